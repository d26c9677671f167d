"""The GET stream: replay after ``Last-Event-ID``, the gap rule, take-over, principals and shutdown."""

from __future__ import annotations

import asyncio
import secrets
import signal
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from tests.integration.mcp_http import McpSession, SSEStream, publish
from tests.support import BrokerProcess

UPDATED = "notifications/resources/updated"
LIST_CHANGED = "notifications/resources/list_changed"


def uris(count: int) -> list[str]:
    tag = secrets.token_hex(3)
    return [f"https://example.com/{tag}/{n}" for n in range(count)]


async def session(http: httpx.AsyncClient, *subscriptions: str, version: str = "2025-11-25") -> McpSession:
    mcp = await McpSession(http, version).initialize()
    await mcp.subscribe(*subscriptions)
    return mcp


async def cursor_of(stream: SSEStream) -> str:
    """The priming event's id: where this stream starts."""
    priming = await stream.next_event()
    assert priming.id and not priming.data
    return priming.id


async def test_a_resumed_stream_receives_exactly_the_missed_notifications(http: httpx.AsyncClient) -> None:
    seen, missed, later = uris(2), uris(3), uris(1)
    mcp = await session(http, *seen, *missed, *later)
    async with mcp.stream() as stream:
        await publish(http, *seen)
        received = await stream.messages(2)
        assert [e.uri for e in received] == seen
    last_id = received[-1].id
    assert last_id is not None

    await publish(http, *missed)  # nobody is listening: the inbox keeps them
    async with mcp.stream(last_event_id=last_id) as stream:
        replayed = await stream.messages(3)
        await publish(http, *later)
        live = await stream.next_message()
    assert [e.uri for e in replayed] == missed
    assert live.uri == later[0]
    ids = [e.id for e in [*received, *replayed, live]]
    assert len(set(ids)) == len(ids)


async def test_a_stream_resumed_from_its_newest_id_gets_nothing_old(http: httpx.AsyncClient) -> None:
    first, marker = uris(1), uris(1)
    mcp = await session(http, *first, *marker)
    async with mcp.stream() as stream:
        await publish(http, *first)
        last = await stream.next_message()
    async with mcp.stream(last_event_id=last.id) as stream:
        await publish(http, *marker)
        assert (await stream.next_message()).uri == marker[0]


async def test_a_cursor_from_another_epoch_gets_every_subscribed_uri_and_list_changed(
        http: httpx.AsyncClient) -> None:
    watched = uris(3)
    mcp = await session(http, *watched)
    async with mcp.stream() as stream:
        await publish(http, *watched)
        await stream.messages(3)  # the inbox now holds three frames that must not be replayed
    async with mcp.stream(last_event_id="0ther3poch-42") as stream:
        resync = await stream.messages(4)
        assert sorted(e.uri for e in resync if e.method == UPDATED) == sorted(watched)
        assert [e.method for e in resync].count(LIST_CHANGED) == 1
        marker = uris(1)
        await mcp.subscribe(*marker)
        await publish(http, *marker)
        assert (await stream.next_message()).uri == marker[0]  # and then it carries on live


async def test_a_cursor_beyond_the_newest_frame_gets_every_subscribed_uri(http: httpx.AsyncClient) -> None:
    watched = uris(2)
    mcp = await session(http, *watched)
    async with mcp.stream() as stream:
        epoch = (await cursor_of(stream)).rpartition("-")[0]
    async with mcp.stream(last_event_id=f"{epoch}-999999") as stream:
        resync = await stream.messages(3)
        assert sorted(e.uri for e in resync if e.method == UPDATED) == sorted(watched)
        assert resync[-1].id is not None  # the client has a cursor once the resync is through


@pytest.mark.parametrize("value", ["garbage", "12", "abc-", "abc-x", "a b-1", "abc-1.5"])
async def test_a_malformed_last_event_id_is_refused_with_400(http: httpx.AsyncClient, value: str) -> None:
    mcp = await session(http)
    response = await http.get("/mcp", headers={**mcp.headers(Accept="text/event-stream"), "Last-Event-ID": value})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == -32600


async def test_a_second_get_takes_over_and_the_first_one_ends(http: httpx.AsyncClient) -> None:
    watched = uris(1)
    mcp = await session(http, *watched)
    async with mcp.stream() as first:
        await cursor_of(first)
        async with mcp.stream() as second:
            await cursor_of(second)
            assert [e for e in await first.until_end() if e.data] == []
            await publish(http, *watched)
            assert (await second.next_message()).uri == watched[0]


async def test_a_session_with_no_stream_yet_keeps_what_was_published_before_the_first_get(
        http: httpx.AsyncClient) -> None:
    early = uris(2)
    mcp = await session(http, *early)
    await publish(http, *early)
    async with mcp.stream() as stream:
        assert [e.uri for e in await stream.messages(2)] == early


async def test_2025_11_25_streams_start_with_a_priming_event_and_send_keep_alives(http: httpx.AsyncClient) -> None:
    mcp = await session(http)
    async with mcp.stream() as stream:
        assert stream.response.headers["x-accel-buffering"] == "no"
        priming = await stream.next_event()
        assert priming.id and priming.data == "" and priming.retry
        await stream.keepalive(timeout=5)  # the broker under test sends one every second


async def test_older_clients_get_no_priming_event(http: httpx.AsyncClient) -> None:
    watched = uris(1)
    mcp = await session(http, *watched, version="2025-06-18")
    async with mcp.stream() as stream:
        await publish(http, *watched)
        event = await stream.next_event()
        assert event.uri == watched[0] and event.id


# -- an inbox of five frames -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_inbox_broker() -> Iterator[BrokerProcess]:
    with BrokerProcess(env={"MCP_BROKER_INBOX_MAXLEN": "5"}) as proc:
        yield proc


@pytest.fixture
async def small_http(small_inbox_broker: BrokerProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=small_inbox_broker.url, timeout=10) as client:
        yield client


async def test_a_cursor_older_than_the_inbox_gets_every_subscribed_uri_and_list_changed(
        small_http: httpx.AsyncClient) -> None:
    watched = uris(7)
    mcp = await session(small_http, *watched)
    witness = await session(small_http, watched[-1])
    async with mcp.stream() as stream:
        cursor = await cursor_of(stream)
    async with witness.stream() as witness_stream:
        await publish(small_http, *watched)  # seven frames for an inbox of five
        assert (await witness_stream.next_message()).uri == watched[-1]  # so fan-out has filled the inbox

    async with mcp.stream(last_event_id=cursor) as stream:
        resync = await stream.messages(len(watched) + 1)
        assert sorted(e.uri for e in resync if e.method == UPDATED) == sorted(watched)
        assert [e.method for e in resync].count(LIST_CHANGED) == 1
        marker = uris(1)
        await mcp.subscribe(*marker)
        await publish(small_http, *marker)
        assert (await stream.next_message()).uri == marker[0]


# -- principals ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed_broker() -> Iterator[BrokerProcess]:
    with BrokerProcess(env={"MCP_BROKER_API_KEYS": '{"k1":"t1/alice","k2":"t1/bob"}'}) as proc:
        yield proc


async def test_another_principal_presenting_a_session_id_gets_404(keyed_broker: BrokerProcess) -> None:
    async with httpx.AsyncClient(base_url=keyed_broker.url, timeout=10) as http:
        alice = await McpSession(http, auth="k1").initialize()
        assert await alice.result("ping") == {}
        bob = McpSession(http, auth="k2")
        bob.id = alice.id
        assert (await bob.post({"jsonrpc": "2.0", "id": 1, "method": "ping"})).status_code == 404
        get_headers = bob.headers(Accept="text/event-stream")
        assert (await http.get("/mcp", headers=get_headers)).status_code == 404
        assert (await http.delete("/mcp", headers=bob.headers())).status_code == 404
        assert await alice.result("ping") == {}  # bob's attempts did not end alice's session


async def test_a_caller_without_a_valid_key_gets_401(keyed_broker: BrokerProcess) -> None:
    async with httpx.AsyncClient(base_url=keyed_broker.url, timeout=10) as http:
        for auth in (None, "wrong"):
            response = await McpSession(http, auth=auth).post({"jsonrpc": "2.0", "id": 0, "method": "initialize",
                                                               "params": {"protocolVersion": "2025-11-25"}})
            assert response.status_code == 401
            assert response.headers["www-authenticate"].startswith("Bearer")


# -- shutdown --------------------------------------------------------------------------------------


async def test_sigterm_ends_an_open_stream_with_retry_and_the_process_exits() -> None:
    with BrokerProcess() as proc:
        async with httpx.AsyncClient(base_url=proc.url, timeout=10) as http:
            mcp = await session(http)
            async with mcp.stream() as stream:
                await cursor_of(stream)
                exit_code = asyncio.get_running_loop().run_in_executor(None, proc.terminate)
                tail = await stream.until_end()
        assert any(e.retry for e in tail)
        # uvicorn re-raises the signal once it has shut down gracefully, so the status says SIGTERM.
        assert await asyncio.wait_for(exit_code, 15) in (0, -signal.SIGTERM)
        assert proc.proc.stderr is not None
        assert b"Traceback" not in proc.proc.stderr.read()
