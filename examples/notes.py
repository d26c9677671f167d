"""MCP resources in a few lines of Python: notes, per tenant, declared by decorated functions.

    python examples/notes.py                      # MCP on http://127.0.0.1:8000/broker/mcp
    curl -X PUT localhost:8000/notes/1 -H 'content-type: application/json' -d '{"text": "buy milk"}'

``notes://{id}`` is a template (``resources/templates/list``), ``notes://index`` a resource
(``resources/list``). A client subscribed to ``notes://1`` is notified when the note is written.
The same set runs under ``mcp-broker serve`` with ``MCP_BROKER_PROVIDERS='["examples.notes:resources"]'``.
"""

from __future__ import annotations

import os
from typing import Any

from fastapi import FastAPI, HTTPException

from broker.resources import ResourceSet

resources = ResourceSet()
#: Each tenant's notes, by id. A real application keeps them in its database.
NOTES: dict[str, dict[str, str]] = {"default": {"1": "Welcome to your notes."}}


@resources.resource("notes://{id}", mime_type="text/markdown")
def note(id: str, tenant: str) -> str | None:
    """One note of the caller's tenant."""
    return NOTES.get(tenant, {}).get(id)  # None: "Resource not found"


@resources.resource("notes://index")
async def index(tenant: str) -> dict[str, Any]:
    """The ids of the caller's notes."""
    return {"notes": sorted(NOTES.get(tenant, {}))}


app = FastAPI()


@app.put("/notes/{note_id}")
async def write_note(note_id: str, body: dict[str, Any]) -> dict[str, str]:
    if not isinstance(body.get("text"), str):
        raise HTTPException(422, "give the note's text as {\"text\": ...}")
    NOTES.setdefault("default", {})[note_id] = body["text"]
    await resources.publish(f"notes://{note_id}")  # every subscriber, on every worker, is notified
    await resources.publish("notes://index")
    return {"uri": f"notes://{note_id}"}


if __name__ == "__main__":
    import uvicorn

    from broker.mount import mount_broker

    mount_broker(app, "/broker", resources=resources)
    uvicorn.run(app, host="127.0.0.1", port=int(os.environ.get("PORT", "8000")))
