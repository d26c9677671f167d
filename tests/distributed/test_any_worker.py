"""Any worker serves any request of any session: three workers behind a round-robin proxy, one Redis."""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import httpx
import pytest
from mcp import types
from mcp.client.client import Client

from tests.distributed.conftest import Deployment
from tests.distributed.scenario import any_worker_scenario, served, steer, uris
from tests.integration.mcp_http import McpSession, SSEStream, StreamEnded, publish
from tests.integration.modern import listen, put_record
from tests.sdk_inbox import Inbox

# resources/subscribe is deprecated by 2026-07-28 only; the legacy era is what is under test.
pytestmark = pytest.mark.filterwarnings("ignore::mcp.shared.exceptions.MCPDeprecationWarning")



@asynccontextmanager
async def sdk_client(deployment: Deployment) -> AsyncIterator[tuple[Client, Inbox]]:
    inbox = Inbox()
    async with Client(deployment.url + "/mcp", mode="legacy", message_handler=inbox.handler) as client:
        yield client, inbox


async def test_the_sdk_client_is_served_by_every_worker_and_notified_of_changes_made_through_others(
        deployment: Deployment, http: httpx.AsyncClient) -> None:
    name = "c" + secrets.token_hex(4)
    uri = f"mcpb://default/{name}/42"
    assert (await http.put(f"/collections/{name}/42", json={"price": 1})).status_code == 201
    start = len(deployment.log())
    async with sdk_client(deployment) as (client, inbox):
        await client.subscribe_resource(uri)
        for price in (2, 3):
            assert (await http.put(f"/collections/{name}/42", json={"price": price})).status_code == 200
        await inbox.wait_for(types.ResourceUpdatedNotification, uri)
        # Reads agree whichever worker answers them.
        values = [json.loads((await client.read_resource(uri, cache_mode="bypass")).contents[0].text)  # type: ignore[union-attr]
                  for _ in range(3)]
    assert values == [{"price": 3}] * 3
    log = deployment.log()[start:]
    session = next(e["session"] for e in log if e["session"])
    mine = [e for e in log if e["session"] == session or (e["method"] == "POST" and not e["session"]
                                                          and e["path"] == "/mcp")]
    assert len({e["upstream"] for e in mine}) == 3, mine
    get = next(e["upstream"] for e in mine if e["method"] == "GET")
    assert get != mine[0]["upstream"], "initialize and the GET stream on different workers"


async def test_a_session_resumes_on_another_worker_with_exactly_what_it_missed(
        deployment: Deployment, http: httpx.AsyncClient) -> None:
    await any_worker_scenario(http, deployment.log)


async def test_a_second_get_on_another_worker_takes_over_the_first(
        deployment: Deployment, http: httpx.AsyncClient) -> None:
    first_uri, second_uri = uris(2)
    mcp = await McpSession(http).initialize()
    await mcp.subscribe(first_uri, second_uri)
    async with mcp.stream() as first:
        await first.next_event()
        await publish(http, first_uri)
        assert (await first.next_message()).uri == first_uri
        assert mcp.id is not None
        await steer(http, set(served(deployment.log(), mcp.id, "GET")))
        async with mcp.stream() as second:
            await second.next_event()
            with pytest.raises(StreamEnded):
                await first.next_message()  # ended by the takeover, across workers
            await publish(http, second_uri)
            assert (await second.next_message()).uri == second_uri
    gets = served(deployment.log(), mcp.id, "GET")
    assert len(gets) == 2 and gets[0] != gets[1]


async def test_of_two_streams_opened_at_once_on_two_workers_exactly_one_stays(
        deployment: Deployment, http: httpx.AsyncClient) -> None:
    (uri,) = uris(1)
    mcp = await McpSession(http).initialize()
    await mcp.subscribe(uri)
    async with AsyncExitStack() as stack:
        streams = await asyncio.gather(*(stack.enter_async_context(mcp.stream()) for _ in range(2)))
        # Primed, or ended at once when the other claim was newer: either way, both have claimed.
        primed = await asyncio.gather(*(stream.next_event() for stream in streams), return_exceptions=True)
        await publish(http, uri)

        async def outcome(stream: SSEStream, start: object) -> str:
            if isinstance(start, BaseException):
                return type(start).__name__
            try:
                return type(await stream.next_message()).__name__
            except (StreamEnded, TimeoutError) as exc:
                return type(exc).__name__

        outcomes = await asyncio.gather(*(outcome(s, p) for s, p in zip(streams, primed, strict=True)))
    assert sorted(outcomes) == ["Event", "StreamEnded"]
    assert mcp.id is not None
    assert len(set(served(deployment.log(), mcp.id, "GET"))) == 2


async def test_a_modern_listen_receives_changes_published_through_other_workers(
        deployment: Deployment, http: httpx.AsyncClient) -> None:
    name = "c" + secrets.token_hex(4)
    uri = await put_record(http, name, "a", {"v": 0})
    async with listen(http, [uri]) as stream:
        ack = await stream.next()
        assert ack is not None and ack["method"] == "notifications/subscriptions/acknowledged"
        listen_worker = deployment.log()[-1]["upstream"]
        writers: set[int] = set()
        for v in (1, 2, 3):  # three writes: at least two through workers other than the listen's
            response = await http.put(f"/collections/{name}/a", json={"v": v})
            writers.add(int(response.headers["x-upstream"]))
            message = await stream.next()
            assert message is not None and message["params"]["uri"] == uri
    assert writers - {listen_worker}


@pytest.mark.timeout(60)
async def test_the_notifications_of_a_uri_arrive_in_the_order_of_its_changes(
        deployment: Deployment, http: httpx.AsyncClient) -> None:
    """Every worker fans out, and each takes its batches from the one change log: the frames of a
    URI must still leave in the order its changes were published, on the legacy stream and on a
    listen. A client that kept the newest notification of a URI would otherwise keep an old one."""
    writers, per_writer, posts, size = 4, 3, 10, 100
    targets = uris(writers * per_writer)
    last = {uri: -1 for uri in targets}

    async def write(k: int) -> None:
        mine = targets[k * per_writer:(k + 1) * per_writer]
        for post in range(posts):
            body = []
            for i in range(size):
                seq = post * size + i
                uri = mine[seq % per_writer]
                body.append({"uri": uri, "meta": {"seq": seq}})
                last[uri] = seq
            assert (await http.post("/changes", json=body)).status_code == 202

    def in_order(seen: dict[str, list[int]]) -> None:
        for uri, seqs in seen.items():
            assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs), f"{uri}: {seqs}"

    mcp = await McpSession(http).initialize()
    await mcp.subscribe(*targets)
    legacy: dict[str, list[int]] = {uri: [] for uri in targets}
    modern: dict[str, list[int]] = {uri: [] for uri in targets}
    async with mcp.stream() as stream, listen(http, targets) as listening:
        await stream.next_event()
        assert (await listening.next())["method"] == "notifications/subscriptions/acknowledged"  # type: ignore[index]
        await asyncio.gather(*(write(k) for k in range(writers)))
        async with asyncio.timeout(30):
            while any(not seqs or seqs[-1] != last[uri] for uri, seqs in legacy.items()):
                params = (await stream.next_message()).message["params"]
                legacy[params["uri"]].append(params["_meta"]["seq"])
            while any(not seqs or seqs[-1] != last[uri] for uri, seqs in modern.items()):
                message = await listening.next()
                assert message is not None
                modern[message["params"]["uri"]].append(message["params"]["_meta"]["seq"])
    in_order(legacy)
    in_order(modern)
