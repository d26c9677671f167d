"""``UpstreamClient`` against a real SDK server in each era: answers, progress, cancellation, bounds, failures."""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

import httpx
import pytest

from broker.upstreams.client import (
    UpstreamBusy,
    UpstreamClient,
    UpstreamRpcError,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from tests.support import free_port
from tests.upstreams.conftest import CLIENT_INFO, UpstreamProcess, eventually, spec_for


def text_of(result: dict[str, Any]) -> str:
    return str(result["contents"][0]["text"])


async def test_the_era_is_learnt_and_requests_are_answered(upstream: UpstreamProcess, client: UpstreamClient) -> None:
    expected = upstream.era
    assert client.era == expected
    server = await client.probe()
    assert server["serverInfo"]["name"] == "upstream"
    assert server["capabilities"]["resources"]["subscribe"] is True
    key = secrets.token_hex(4)
    result, session = await client.request("tools/call", {"name": "set_note", "arguments": {"id": key, "text": "hi"}})
    assert result["content"][0]["text"] == f"note://{key} set"
    assert (session is None) == (expected == "modern")
    read, _ = await client.request("resources/read", {"uri": f"note://{key}"})
    assert text_of(read) == "hi"
    listed, _ = await client.request("resources/templates/list", {})
    assert listed["resourceTemplates"][0]["uriTemplate"] == "note://{id}"
    prompt, _ = await client.request("prompts/get", {"name": "greet", "arguments": {"name": "Ada"}})
    assert prompt["messages"][0]["content"]["text"] == "Hello, Ada!"
    completed, _ = await client.request("completion/complete", {
        "ref": {"type": "ref/prompt", "name": "greet"}, "argument": {"name": "name", "value": "al"}})
    assert completed["completion"]["values"] == ["Alan", "Alonzo"]


async def test_a_name_that_is_not_plain_ascii_travels_in_the_header_s_base64_form(client: UpstreamClient) -> None:
    """The 2026 server checks ``Mcp-Name`` against the body: a note named in Greek is read all the same."""
    key = "σημείωση " + secrets.token_hex(2)
    await client.request("tools/call", {"name": "set_note", "arguments": {"id": key, "text": "γεια"}})
    read, _ = await client.request("resources/read", {"uri": f"note://{key}"})
    assert text_of(read) == "γεια"


async def test_the_upstream_s_own_error_is_passed_through(client: UpstreamClient) -> None:
    with pytest.raises(UpstreamRpcError) as caught:
        await client.request("resources/read", {"uri": "note://nowhere"})
    assert (caught.value.code, caught.value.data) == (-32002, {"uri": "note://nowhere"})
    assert caught.value.upstream == "notes"
    with pytest.raises(UpstreamRpcError) as unknown:
        await client.request("tools/nothing", {})
    assert unknown.value.code == -32601


async def test_progress_before_the_answer_reaches_on_notification(client: UpstreamClient) -> None:
    seen: list[dict[str, Any]] = []

    async def heard(message: dict[str, Any]) -> None:
        seen.append(message)

    result, _ = await client.request("tools/call", {"name": "slow", "arguments": {"seconds": 0.2},
                                                    "_meta": {"progressToken": "p-1"}}, on_notification=heard)
    assert result["content"][0]["text"] == "slept 0.2"
    assert [(m["method"], m["params"]["progressToken"], m["params"]["progress"]) for m in seen] == \
        [("notifications/progress", "p-1", step) for step in range(1, 11)]


async def test_a_cancelled_request_is_cancelled_at_the_upstream(upstream: UpstreamProcess,
                                                                client: UpstreamClient) -> None:
    """2026-07-28: the closed stream is the cancel; 2025: ``notifications/cancelled`` names the caller's id."""
    request_id = "client-" + secrets.token_hex(4)
    started = asyncio.Event()

    async def heard(message: dict[str, Any]) -> None:
        started.set()

    call = asyncio.create_task(client.request("tools/call", {"name": "slow", "arguments": {"seconds": 30},
                                                             "_meta": {"progressToken": 1}},
                                              request_id=request_id, on_notification=heard))
    async with asyncio.timeout(15):
        await started.wait()
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call

    async def cancelled() -> bool:
        return request_id in [entry["request_id"] for entry in (await upstream.stats())["cancelled"]]

    await eventually(cancelled, "the upstream to see the call cancelled")
    assert client.in_flight == 0


async def test_a_request_past_the_timeout_is_cancelled_and_raises(upstream: UpstreamProcess) -> None:
    client = UpstreamClient(spec_for(upstream.mcp_url, timeout=1.0), client_info=CLIENT_INFO)
    try:
        await client.probe()
        request_id = "late-" + secrets.token_hex(4)
        with pytest.raises(UpstreamTimeout, match="took longer than 1 s"):
            await client.request("tools/call", {"name": "slow", "arguments": {"seconds": 30}}, request_id=request_id)

        async def cancelled() -> bool:
            return request_id in [entry["request_id"] for entry in (await upstream.stats())["cancelled"]]

        await eventually(cancelled, "the upstream to see the late call cancelled")
    finally:
        await client.aclose()


async def test_one_request_past_the_concurrency_bound_is_refused_at_once(upstream: UpstreamProcess) -> None:
    client = UpstreamClient(spec_for(upstream.mcp_url, concurrency=2), client_info=CLIENT_INFO)
    calls: list[asyncio.Task[Any]] = []
    try:
        await client.probe()
        calls = [asyncio.create_task(client.request("tools/call", {"name": "slow", "arguments": {"seconds": 30}}))
                 for _ in range(2)]
        await eventually(lambda: client.in_flight == 2, "two requests in flight")
        with pytest.raises(UpstreamBusy, match="2 requests are in flight"):
            await client.request("resources/read", {"uri": "note://1"})
        calls[0].cancel()
        await asyncio.wait([calls[0]])
        read, _ = await client.request("resources/read", {"uri": "note://1"})  # a place is free again
        assert read["contents"]
    finally:
        for call in calls:
            call.cancel()
        await asyncio.wait(calls)
        await client.aclose()


async def test_an_answer_larger_than_the_bound_is_refused(upstream: UpstreamProcess) -> None:
    key = secrets.token_hex(4)
    await upstream.set_note(key, "x" * 5000)
    client = UpstreamClient(spec_for(upstream.mcp_url), client_info=CLIENT_INFO, max_bytes=4000)
    try:
        with pytest.raises(UpstreamUnavailable, match="larger than 4000 bytes"):
            await client.request("resources/read", {"uri": f"note://{key}"})
        read, _ = await client.request("resources/read", {"uri": "note://1"})
        assert read["contents"]
    finally:
        await client.aclose()


@pytest.mark.parametrize("upstream", ["legacy"], indirect=True)
async def test_a_forgotten_session_is_opened_again(upstream: UpstreamProcess, client: UpstreamClient) -> None:
    _, shared = await client.request("resources/read", {"uri": "note://1"})
    assert shared is not None
    async with httpx.AsyncClient() as http:  # the upstream forgets it (as after an idle timeout)
        gone = await http.delete(upstream.mcp_url, headers={"Mcp-Session-Id": shared.id,
                                                           "MCP-Protocol-Version": shared.version})
        assert gone.status_code == 200
    read, renewed = await client.request("resources/read", {"uri": "note://1"})
    assert read["contents"] and renewed is not None and renewed.id != shared.id
    own = await client.open_session()
    await client.close_session(own)
    _, replaced = await client.request("resources/read", {"uri": "note://1"}, session=own)
    assert replaced is not None and replaced.id not in (own.id, renewed.id)


async def test_an_unreachable_upstream_is_unavailable_until_it_answers() -> None:
    port = free_port()
    client = UpstreamClient(spec_for(f"http://127.0.0.1:{port}/mcp", timeout=5.0), client_info=CLIENT_INFO)
    try:
        with pytest.raises(UpstreamUnavailable, match="cannot reach"):
            await client.request("resources/read", {"uri": "note://1"})
        assert client.era is None
        started = UpstreamProcess(port=port)
        try:
            read, _ = await client.request("resources/read", {"uri": "note://1"})
            assert text_of(read) == "one" and client.era == "modern"
        finally:
            started.stop()
        with pytest.raises(UpstreamUnavailable):
            await client.request("resources/read", {"uri": "note://1"})
    finally:
        await client.aclose()


async def test_the_upstream_hears_only_what_the_broker_says(upstream: UpstreamProcess, client: UpstreamClient) -> None:
    """Every header is the client's own, and 2026-07-28's envelope names the broker, whatever the caller's
    ``_meta`` claimed."""
    marker = secrets.token_hex(4)
    claimed = {"progressToken": marker, "io.modelcontextprotocol/clientCapabilities": {"sampling": {}},
               "io.modelcontextprotocol/clientInfo": {"name": "someone-else", "version": "1"}}
    result, _ = await client.request("tools/call", {"name": "echo_meta", "arguments": {}, "_meta": claimed})
    meta = result["structuredContent"]["meta"]
    assert meta["progress_token"] == marker
    if client.era == "modern":
        assert meta["io.modelcontextprotocol/clientInfo"] == CLIENT_INFO
        assert meta["io.modelcontextprotocol/clientCapabilities"] == {}
    seen = [entry["headers"] for entry in (await upstream.stats())["requests"] if entry["method"] == "POST"]
    allowed = {"host", "accept", "accept-encoding", "connection", "user-agent", "content-type", "content-length",
               "mcp-protocol-version", "mcp-method", "mcp-name", "mcp-session-id"}
    assert seen and all(set(headers) <= allowed for headers in seen), [set(h) - allowed for h in seen]
    assert all(headers["user-agent"] == "mcp-broker" for headers in seen)
