"""mcp-broker mounted into a FastAPI app of its own (``examples/mounted_app.py``) under a plain uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
from fastapi import FastAPI
from mcp import types
from mcp.client.client import Client

from broker.config import Settings
from broker.mount import mount_broker
from broker.runtime.app import create_app
from tests.sdk_inbox import Inbox
from tests.support import ROOT, free_port, wait_until

pytestmark = pytest.mark.filterwarnings("ignore::mcp.shared.exceptions.MCPDeprecationWarning")

INITIALIZE = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
              "params": {"protocolVersion": "2025-11-25", "capabilities": {},
                         "clientInfo": {"name": "t", "version": "1"}}}
MCP_HEADERS = {"accept": "application/json, text/event-stream", "content-type": "application/json"}


class HostApp:
    """``uvicorn examples.mounted_app:app`` (the host's own server, not ``mcp-broker serve``) on a free port."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "examples.mounted_app:app", "--port",
                                      str(self.port), "--log-level", "warning"], cwd=ROOT,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            wait_until(lambda: httpx.get(self.url + "/broker/readyz", timeout=1).status_code == 200, what="host app")
        except TimeoutError:
            self.kill()
            raise

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def host() -> Iterator[HostApp]:
    app = HostApp()
    yield app
    app.kill()


async def test_a_subscriber_of_a_ticket_is_notified_when_the_host_app_changes_it(host: HostApp) -> None:
    inbox = Inbox()
    async with Client(host.url + "/broker/mcp", mode="legacy", message_handler=inbox.handler) as client:
        await client.subscribe_resource("tickets://1")
        async with httpx.AsyncClient(base_url=host.url) as http:
            assert (await http.post("/tickets/1", json={"status": "closed"})).status_code == 200
        await inbox.wait_for(types.ResourceUpdatedNotification, "tickets://1")
        read = await client.read_resource("tickets://1", cache_mode="bypass")
        assert json.loads(read.contents[0].text)["status"] == "closed"  # type: ignore[union-attr]


async def test_the_broker_routes_answer_under_the_prefix(host: HostApp) -> None:
    async with httpx.AsyncClient(base_url=host.url + "/broker") as http:
        for path in ("/healthz", "/livez", "/readyz", "/collections"):
            assert (await http.get(path)).status_code == 200, path
        assert (await http.post("/changes", json={"uri": "tickets://1"})).status_code == 202
        assert (await http.put("/collections/c/1", json={"a": 1})).status_code == 201
        assert (await http.post("/mcp", json=INITIALIZE, headers=MCP_HEADERS)).status_code == 200


def test_sigterm_ends_an_open_stream_with_retry_and_the_host_process_exits(host: HostApp) -> None:
    with httpx.Client(base_url=host.url, timeout=10) as http:
        answer = http.post("/broker/mcp", json=INITIALIZE, headers=MCP_HEADERS)
        session = answer.headers["mcp-session-id"]
        headers = {"accept": "text/event-stream", "mcp-session-id": session, "mcp-protocol-version": "2025-11-25"}
        with http.stream("GET", "/broker/mcp", headers=headers) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("id:")  # the stream is open
            host.proc.send_signal(signal.SIGTERM)
            began = time.monotonic()
            rest = list(lines)  # ends when the server ends the stream
        assert any(line.startswith("retry:") for line in rest), rest
    assert host.proc.wait(5) in (0, -signal.SIGTERM)  # uvicorn ends by re-raising the signal
    assert time.monotonic() - began < 5


async def test_a_broker_whose_lifespan_never_ran_answers_503_and_says_why_once(
        caplog: pytest.LogCaptureFixture) -> None:
    app = FastAPI()
    app.mount("/b", create_app(Settings(metrics=False)))  # mounted by hand: nothing starts it
    transport = httpx.ASGITransport(app=app)
    with caplog.at_level(logging.ERROR, logger="broker.runtime.app"):
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            mcp = await http.post("/b/mcp", json=INITIALIZE, headers=MCP_HEADERS)
            health = await http.get("/b/healthz")
    assert mcp.status_code == health.status_code == 503
    assert "not started" in mcp.json()["error"]["message"] and "not started" in health.json()["detail"]
    assert len([r for r in caplog.records if "not started" in r.getMessage()]) == 1


async def test_mount_broker_starts_the_broker_with_the_host_lifespan_and_keeps_the_host_own() -> None:
    events: list[str] = []

    @contextlib.asynccontextmanager
    async def own(app: FastAPI):  # type: ignore[no-untyped-def]
        events.append("host up")
        yield
        events.append("host down")

    app = FastAPI(lifespan=own)
    broker = mount_broker(app, "/b", settings=Settings(metrics=False)).broker
    async with app.router.lifespan_context(app):
        assert broker.started and events == ["host up"]
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
            assert (await http.get("/b/readyz")).status_code == 200
            assert (await http.post("/b/mcp", json=INITIALIZE, headers=MCP_HEADERS)).status_code == 200
        await asyncio.sleep(0)
    assert not broker.started and events == ["host up", "host down"]
