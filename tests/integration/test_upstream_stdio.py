"""A stdio upstream behind a real broker process: ``"command"`` in ``MCP_BROKER_UPSTREAMS`` starts the SDK
server (``tests/upstream_server.py --stdio``) as the worker's child, and clients of both eras use it
through the broker as they use an HTTP upstream: a tool called, a note read, a note subscribed to (a
2025 ``resources/subscribe``, a 2026-07-28 listen) heard changing after a ``set_note`` that went
through the broker; its progress reaching the caller, and a call slower than the upstream's
``timeout`` cancelled in the process. The server's side doors (``/stats``) stay on a loopback port of its own.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import orjson
import psutil
import pytest

from tests.integration import modern
from tests.integration.mcp_http import McpSession, SSEStream
from tests.integration.test_upstreams import result, text_of
from tests.support import ROOT, BrokerProcess, free_port, wait_until

KEY = "k-acme"
OPERATOR = "k-ops"  # a key of an operators' tenant: it reads the console
UPDATED = "notifications/resources/updated"


class Side:
    """The stdio server's side doors."""

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = httpx.get(self.url + "/stats", timeout=5).json()
        return stats

    def watchers(self, uri: str) -> int:
        """The sessions watching ``uri`` at the server now (on stdio, its one session)."""
        return int(self.stats()["watchers"].get(uri, 0))


@pytest.fixture(scope="module")
def side() -> Side:
    return Side(free_port())


@pytest.fixture(scope="module")
def broker(side: Side) -> Iterator[BrokerProcess]:
    command = ["env", f"PYTHONPATH={ROOT}", sys.executable, "-m", "tests.upstream_server", "--stdio",
               "--port", side.url.rsplit(":", 1)[1]]
    config = {"notes": {"command": command, "tenants": ["acme"], "timeout": 3}}  # its prefixes learnt: note://
    env = {"MCP_BROKER_UPSTREAMS": json.dumps(config),
           "MCP_BROKER_API_KEYS": json.dumps({KEY: "acme/alice", OPERATOR: "ops/olga"}),
           "MCP_BROKER_CONSOLE_TENANTS": json.dumps(["ops"])}
    with BrokerProcess(env=env) as proc:
        # The worker starts the process at its start, and learns the upstream's prefixes from it (the start
        # waits for that a few seconds at most).
        wait_until(lambda: upstream_state(proc) == "ready", what="the broker to have probed the upstream")
        wait_until(lambda: side.stats()["pid"] > 0, what="the stdio server's side doors")
        yield proc


def upstream_state(broker: BrokerProcess) -> str:
    """The upstream's state as the broker's console shows it (``mcp-broker upstreams --url``)."""
    state = httpx.get(broker.url + "/console/state.json", headers={"Authorization": f"Bearer {OPERATOR}"},
                      timeout=5)
    rows = {row["name"]: row for row in state.json().get("upstreams", [])}
    return str(rows["notes"]["state"]) if "notes" in rows else "absent"


@pytest.fixture
async def http(broker: BrokerProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=broker.url, timeout=15) as client:
        yield client


async def modern_result(http: httpx.AsyncClient, method: str, params: dict[str, Any] | None = None,
                        name: str | None = None) -> dict[str, Any]:
    return await result(http, KEY, method, params, name)


def set_note(key: str, text: str) -> dict[str, Any]:
    return {"name": "set_note", "arguments": {"id": key, "text": text}}


async def watched(side: Side, uri: str) -> None:
    """Until the broker's one watch has subscribed to ``uri`` at the server."""
    async with asyncio.timeout(15):
        while side.watchers(uri) == 0:
            await asyncio.sleep(0.05)


async def updated_legacy(stream: SSEStream, uri: str) -> None:
    event = await stream.next_message(timeout=15)
    assert event.method == UPDATED and event.uri == uri, event.message


async def updated_modern(stream: modern.ListenStream, uri: str) -> None:
    note = await stream.next(timeout=15)
    assert note is not None and note["method"] == UPDATED and note["params"]["uri"] == uri, note


# Each test changes a note the server was started with: a new note would also change the resource list,
# and the `list_changed` that follows would reach the 2025 sessions of whichever test runs then.


def test_the_server_is_a_child_of_the_broker(broker: BrokerProcess, side: Side) -> None:
    server = psutil.Process(side.stats()["pid"])
    assert broker.proc.pid in {parent.pid for parent in server.parents()}


async def test_a_2025_client_calls_reads_and_hears_a_stdio_upstream(http: httpx.AsyncClient, side: Side) -> None:
    uri = "note://1"
    session = await McpSession(http, auth=KEY).initialize()
    tools = await session.result("tools/list")
    assert {tool["name"] for tool in tools["tools"]} == {"set_note", "slow", "echo_meta"}
    called = await session.result("tools/call", set_note("1", "first"))
    assert called["isError"] is False and called["content"][0]["text"] == "note://1 set"
    assert text_of(await session.result("resources/read", {"uri": uri})) == "first"

    await session.subscribe(uri)
    async with session.stream() as stream:
        # The watch taking the note on says `updated` by the gap rule: the subscriber came before it.
        await watched(side, uri)
        await updated_legacy(stream, uri)
        assert text_of(await session.result("resources/read", {"uri": uri})) == "first"
        # Then the server's own notification, on its stdout, after a change made through the broker.
        await session.result("tools/call", set_note("1", "second"))
        await updated_legacy(stream, uri)
        assert text_of(await session.result("resources/read", {"uri": uri})) == "second"
    assert side.stats()["notes"]["1"] == "second"


async def test_a_2026_client_calls_reads_and_hears_a_stdio_upstream(http: httpx.AsyncClient, side: Side) -> None:
    uri = "note://2"
    called = await modern_result(http, "tools/call", set_note("2", "first"), name="set_note")
    assert called["isError"] is False
    assert text_of(await modern_result(http, "resources/read", {"uri": uri}, name=uri)) == "first"

    async with modern.listen(http, [uri], auth=KEY) as stream:
        ack = await stream.next()
        assert ack is not None and ack["method"] == "notifications/subscriptions/acknowledged"
        await watched(side, uri)
        await updated_modern(stream, uri)  # the gap rule's, as the watch took the note on
        assert text_of(await modern_result(http, "resources/read", {"uri": uri}, name=uri)) == "first"
        await modern_result(http, "tools/call", set_note("2", "second"), name="set_note")
        await updated_modern(stream, uri)
        assert text_of(await modern_result(http, "resources/read", {"uri": uri}, name=uri)) == "second"
    assert side.stats()["notes"]["2"] == "second"


async def test_progress_of_a_call_to_a_stdio_upstream_reaches_its_caller(http: httpx.AsyncClient) -> None:
    body = modern.request("tools/call", {"name": "slow", "arguments": {"seconds": 0.5}})
    body["params"]["_meta"]["progressToken"] = "p-1"
    async with http.stream("POST", "/mcp", content=orjson.dumps(body),
                           headers=modern.headers("tools/call", "slow", auth=KEY)) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        stream = modern.ListenStream(response)
        progress = []
        while (message := await stream.next()) is not None and "method" in message:
            assert message["method"] == "notifications/progress" and message["params"]["progressToken"] == "p-1"
            progress.append(message["params"]["progress"])
        assert message is not None and message["result"]["isError"] is False
    assert progress == sorted(progress) and len(progress) == 10


async def test_a_call_slower_than_the_timeout_is_a_504_and_is_cancelled_in_the_process(
        http: httpx.AsyncClient, side: Side) -> None:
    response = await modern.call(http, "tools/call", {"name": "slow", "arguments": {"seconds": 30}}, name="slow",
                                 auth=KEY)
    assert response.status_code == 504, response.text
    error = response.json()["error"]
    assert error["code"] == -31005 and error["data"]["upstream"] == "notes"
    async with asyncio.timeout(10):
        while not side.stats()["cancelled"]:
            await asyncio.sleep(0.05)
    # The process is still the one the broker talks to: the next call is answered by it.
    called = await modern_result(http, "tools/call", set_note("1", "after"), name="set_note")
    assert called["isError"] is False and side.stats()["notes"]["1"] == "after"
