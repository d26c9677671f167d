"""``examples/notes.py``, resources declared by decorated functions, run as its README says: as a program of its
own (``python examples/notes.py``) and under ``mcp-broker serve`` (``MCP_BROKER_PROVIDERS``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest
from mcp import types
from mcp.client.client import Client

from tests.sdk_inbox import Inbox
from tests.support import ROOT, BrokerProcess, free_port, wait_until

pytestmark = pytest.mark.filterwarnings("ignore::mcp.shared.exceptions.MCPDeprecationWarning")


@pytest.fixture
def notes_app() -> Iterator[str]:
    """``python examples/notes.py`` on a free port; its URL."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, str(ROOT / "examples" / "notes.py")], cwd=ROOT,
                            env={**os.environ, "PORT": str(port)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_until(lambda: httpx.get(url + "/broker/readyz", timeout=1).status_code == 200, what="notes example")
        yield url
    finally:
        proc.kill()
        proc.wait(10)


async def test_the_example_lists_reads_and_notifies_a_subscriber_of_a_note_it_writes(notes_app: str) -> None:
    inbox = Inbox()
    async with Client(notes_app + "/broker/mcp", mode="legacy", message_handler=inbox.handler) as client:
        templates = await client.list_resource_templates()
        assert "notes://{id}" in [t.uri_template for t in templates.resource_templates]
        assert "notes://index" in [str(r.uri) for r in (await client.list_resources()).resources]
        await client.subscribe_resource("notes://1")
        async with httpx.AsyncClient(base_url=notes_app) as http:
            assert (await http.put("/notes/1", json={"text": "buy milk"})).status_code == 200
        await inbox.wait_for(types.ResourceUpdatedNotification, "notes://1")
        read = await client.read_resource("notes://1", cache_mode="bypass")
        assert read.contents[0].text == "buy milk"  # type: ignore[union-attr]
        index = await client.read_resource("notes://index", cache_mode="bypass")
        assert json.loads(index.contents[0].text) == {"notes": ["1"]}  # type: ignore[union-attr]


async def test_the_same_resources_answer_under_mcp_broker_serve() -> None:
    with BrokerProcess(env={"MCP_BROKER_PROVIDERS": '["examples.notes:resources"]'}) as broker:
        async with Client(broker.mcp_url, mode="legacy") as client:
            read = await client.read_resource("notes://1", cache_mode="bypass")
            assert read.contents[0].text == "Welcome to your notes."  # type: ignore[union-attr]
            with pytest.raises(Exception, match="Resource not found"):
                await client.read_resource("notes://2", cache_mode="bypass")
