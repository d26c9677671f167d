"""A 2025-03-26 batch is one small request asking for many answers: it is bounded in members and in
answer bytes, and it never keeps the worker from answering anyone else while it runs."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from tests.integration.mcp_http import McpSession
from tests.integration.test_stdio import stdio_process
from tests.support import BrokerProcess

BATCH_VERSION = "2025-03-26"
RECORD = "mcpb://default/big/1"


def reads(count: int, uri: str = RECORD) -> list[dict[str, Any]]:
    return [{"jsonrpc": "2.0", "id": i, "method": "resources/read", "params": {"uri": uri}} for i in range(count)]


@pytest.fixture(scope="module")
def roomy_broker() -> Iterator[BrokerProcess]:
    """An operator raised the member bound to 2,000; the answer bound stays at its default."""
    with BrokerProcess(env={"MCP_BROKER_MAX_BATCH_ITEMS": "2000"}) as proc:
        yield proc


async def test_a_batch_of_two_thousand_members_is_refused_whole_before_any_of_it_runs(
        http: httpx.AsyncClient) -> None:
    mcp = await McpSession(http, BATCH_VERSION).initialize()
    batch = [{"jsonrpc": "2.0", "id": i, "method": "resources/subscribe",
              "params": {"uri": f"https://example.com/{i}"}} for i in range(2000)]
    response = await mcp.post(batch)
    assert response.status_code == 400, response.text[:300]
    body = response.json()
    assert body["error"]["code"] == -32600 and "id" not in body
    assert body["error"]["data"] == {"limit": 100, "items": 2000}
    # A batch within the bound is answered.
    answer = (await mcp.post([{"jsonrpc": "2.0", "id": 1, "method": "ping"}] * 100)).json()
    assert len(answer) == 100 and all(reply["result"] == {} for reply in answer)


async def test_a_thousand_reads_of_a_large_record_are_answered_within_the_response_bound(
        roomy_broker: BrokerProcess) -> None:
    async with httpx.AsyncClient(base_url=roomy_broker.url, timeout=60) as http:
        assert (await http.put("/collections/big/1", json={"text": "x" * 200_000})).status_code in (200, 201)
        mcp = await McpSession(http, BATCH_VERSION).initialize()
        response = await mcp.post(reads(1000))
        assert response.status_code == 200
        assert len(response.content) <= 4_194_304
        answer = response.json()
        # Every member is answered once, in order: a result while the bound allowed, then a
        # precise error for each request left unrun.
        assert [reply["id"] for reply in answer] == list(range(1000))
        results = [reply for reply in answer if "result" in reply]
        refused = answer[len(results):]
        assert 10 < len(results) < 30
        assert all(reply["error"]["code"] == -31001 for reply in refused)
        assert refused[0]["error"]["data"] == {"limit": 4_194_304}
        # The refused reads were not run, and any of them works on its own.
        assert "result" in await mcp.call("resources/read", {"uri": RECORD})


async def test_other_clients_are_answered_while_a_long_batch_runs(roomy_broker: BrokerProcess) -> None:
    """Another client rewrites the record over and over while a 2,000-read batch runs: its writes land
    between the batch's reads, so the batch sees several values. A worker that never yielded
    would run the whole batch before any of them (one value)."""
    async with httpx.AsyncClient(base_url=roomy_broker.url, timeout=30) as http, \
            httpx.AsyncClient(base_url=roomy_broker.url, timeout=30) as other:
        assert (await http.put("/collections/small/1", json={"n": -1})).status_code in (200, 201)
        mcp = await McpSession(http, BATCH_VERSION).initialize()
        batch = asyncio.create_task(mcp.post(reads(2000, "mcpb://default/small/1")))
        writes = 0
        while not batch.done():
            response = await other.put("/collections/small/1", json={"n": writes})
            assert response.status_code == 200
            writes += 1
        answer = (await batch).json()
        assert len(answer) == 2000 and all("result" in reply for reply in answer)
        seen = {orjson.loads(reply["result"]["contents"][0]["text"])["n"] for reply in answer}
        assert len(seen) > 1, f"{writes} writes, none of them landed while the batch ran"


async def test_a_stdio_batch_is_bounded_too() -> None:
    async with stdio_process(MCP_BROKER_DEMO="false", MCP_BROKER_MAX_BATCH_ITEMS="5",
                             MCP_BROKER_MAX_RESPONSE_BYTES="2048") as stdio:
        await stdio.send({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": BATCH_VERSION, "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}})
        assert "result" in await stdio.until(lambda m: m.get("id") == 0)
        await stdio.send([{"jsonrpc": "2.0", "id": i, "method": "ping"} for i in range(6)])
        refused = await stdio.until(lambda m: "error" in m)
        assert refused["error"]["code"] == -32600 and refused["error"]["data"] == {"limit": 5, "items": 6}
        uri = "https://example.com/" + "x" * 500
        await stdio.send([{"jsonrpc": "2.0", "id": i, "method": "resources/read", "params": {"uri": uri}}
                          for i in range(5)])
        assert stdio.proc.stdout is not None
        line = await asyncio.wait_for(stdio.proc.stdout.readline(), 10)
        assert len(line) <= 2049  # the bound, plus the newline
        answer = orjson.loads(line)
        assert [reply["id"] for reply in answer] == list(range(5))
        assert answer[0]["error"]["code"] == -32002  # not found: a reply of its own, within the bound
        assert answer[-1]["error"]["code"] == -31001
