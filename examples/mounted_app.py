"""A FastAPI app of its own with mcp-broker mounted at /broker: its tickets are MCP resources.

    uvicorn examples.mounted_app:app --port 8000     # MCP on http://127.0.0.1:8000/broker/mcp
    curl -X POST localhost:8000/tickets/1 -H 'content-type: application/json' -d '{"status": "closed"}'
"""

import json
from typing import Any

from fastapi import FastAPI

from broker.auth import Principal
from broker.errors import NotFound
from broker.mount import mount_broker

TICKETS: dict[str, dict[str, Any]] = {"1": {"title": "printer on fire", "status": "open"}}


class Tickets:
    """``tickets://<id>``, read from the dict above, for every caller."""

    def owns(self, uri: str) -> bool:
        return uri.startswith("tickets://")

    def can_watch(self, principal: Principal, uri: str) -> bool:
        return True

    async def list_page(self, principal: Principal, state: str | None, limit: int) -> tuple[list[Any], str | None]:
        return [{"uri": f"tickets://{i}", "name": t["title"]} for i, t in TICKETS.items()], None

    async def read(self, principal: Principal, uri: str) -> list[dict[str, Any]]:
        if (ticket := TICKETS.get(uri.removeprefix("tickets://"))) is None:
            raise NotFound(uri)
        return [{"uri": uri, "mimeType": "application/json", "text": json.dumps(ticket)}]

    def templates(self, principal: Principal) -> list[dict[str, Any]]:
        return [{"uriTemplate": "tickets://{id}", "name": "ticket"}]


app = FastAPI()
broker = mount_broker(app, "/broker").broker  # /broker/mcp, started and stopped with this app
broker.register(Tickets())


@app.post("/tickets/{ticket_id}")
async def change_ticket(ticket_id: str, changes: dict[str, Any]) -> dict[str, Any]:
    TICKETS.setdefault(ticket_id, {"title": "", "status": "open"}).update(changes)
    await broker.publish(f"tickets://{ticket_id}")  # subscribers get notifications/resources/updated
    return TICKETS[ticket_id]
