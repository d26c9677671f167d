"""Runtime API keys across three real workers on one real Redis: revoked everywhere, bound everywhere.

A key revoked with ``mcp-broker keys revoke`` ends, on every worker, the legacy GET streams
(with ``retry:``) and the listens (with their ``complete`` result) that were opened with it,
within a few seconds, and each worker refuses it with 401. A session is its principal's on
every worker: another principal gets 404 for its id, while the same subject with a refreshed
key carries on with it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack

import httpx
import pytest

from tests.distributed.conftest import Deployment
from tests.distributed.scenario import UPDATED, uris
from tests.integration import modern
from tests.integration.mcp_http import McpSession, SSEStream, publish
from tests.keys_support import create_key, revoke_key

TENANT = "acme"
#: Each worker checks the keys behind its open streams every second (5 by default).
ENV = {"MCP_BROKER_AUTH": "keys", "MCP_BROKER_CREDENTIAL_CHECK_SECONDS": "1"}


@pytest.fixture(scope="module")
def keyed() -> Iterator[Deployment]:
    with Deployment(env=ENV) as deploy:
        yield deploy


@pytest.fixture
def cli_env(keyed: Deployment) -> dict[str, str]:
    return {"MCP_BROKER_REDIS_URL": keyed.redis_url, "MCP_BROKER_AUTH": "keys"}


@pytest.fixture
async def clients(keyed: Deployment) -> AsyncIterator[list[httpx.AsyncClient]]:
    """One client per worker, each talking to that worker alone."""
    async with AsyncExitStack() as stack:
        yield [await stack.enter_async_context(httpx.AsyncClient(base_url=w.url, timeout=10)) for w in keyed.workers]


async def ended_at(stream: SSEStream) -> tuple[float, list[object]]:
    """When the server closed ``stream`` (monotonic), and the events it sent before."""
    events = await stream.until_end(timeout=20)
    return time.monotonic(), [e.retry for e in events]


async def listen_ended_at(listening: modern.ListenStream) -> tuple[float, object]:
    last = None
    while (message := await listening.next(timeout=20)) is not None:
        last = message
    return time.monotonic(), last


async def test_a_revoked_key_ends_its_streams_and_listens_on_every_worker(
        cli_env: dict[str, str], clients: list[httpx.AsyncClient]) -> None:
    made = create_key(cli_env, TENANT, "alice")
    watched = uris(1)
    async with AsyncExitStack() as stack:
        streams: list[SSEStream] = []
        listens: list[modern.ListenStream] = []
        for http in clients:
            session = await McpSession(http, auth=made.key).initialize()
            await session.subscribe(*watched)
            stream = await stack.enter_async_context(session.stream())
            await stream.next_event()  # priming: open and reading
            streams.append(stream)
            listening = await stack.enter_async_context(modern.listen(http, watched, auth=made.key))
            assert (await listening.next())["method"] == "notifications/subscriptions/acknowledged"  # type: ignore[index]
            listens.append(listening)
        await publish(clients[0], *watched, auth=made.key)  # every stream and listen is live
        for stream in streams:
            assert (await stream.next_message()).uri == watched[0]
        for listening in listens:
            assert (await listening.next())["method"] == UPDATED  # type: ignore[index]
        revoked = time.monotonic()  # timed from before the command, which takes a moment to start
        revoke_key(cli_env, made.id)
        legacy = await asyncio.gather(*(ended_at(s) for s in streams))
        modern_ends = await asyncio.gather(*(listen_ended_at(listening) for listening in listens))
    latencies = [at - revoked for at, _ in [*legacy, *modern_ends]]
    print(f"streams and listens ended {min(latencies):.2f}-{max(latencies):.2f}s after `keys revoke` began")
    assert max(latencies) < 8  # a check every second on each worker, plus the lookups
    for _, retries in legacy:
        assert retries and retries[-1] is not None  # ended with retry:
    for _, final in modern_ends:
        assert isinstance(final, dict) and final["result"]["resultType"] == "complete"
    for http in clients:
        refused = await http.get("/collections", headers={"Authorization": f"Bearer {made.key}"})
        assert refused.status_code == 401, refused.text


async def test_a_session_is_its_principals_on_every_worker_and_survives_a_refreshed_key(
        cli_env: dict[str, str], clients: list[httpx.AsyncClient]) -> None:
    first = create_key(cli_env, TENANT, "dora")
    stranger = create_key(cli_env, TENANT, "eve")
    refreshed = create_key(cli_env, TENANT, "dora")  # the same subject, a new credential
    (before, missed) = uris(2)
    owner = await McpSession(clients[0], auth=first.key).initialize()
    await owner.subscribe(before, missed)
    assert owner.id is not None
    # Another principal, on another worker, finds no such session, whatever it asks.
    thief = McpSession(clients[1], auth=stranger.key)
    thief.id = owner.id
    ping = await thief.post({"jsonrpc": "2.0", "id": 1, "method": "ping"})
    assert ping.status_code == 404
    stream_headers = thief.headers(Accept="text/event-stream")
    assert (await clients[1].get("/mcp", headers=stream_headers)).status_code == 404
    assert (await clients[2].get("/mcp", headers={**stream_headers, "Last-Event-ID": "abcd-1"})).status_code == 404
    assert (await clients[1].delete("/mcp", headers=thief.headers())).status_code == 404
    # The owner, on a third worker, streams with its first key; then the first key goes.
    async with owner.stream() as stream:
        await stream.next_event()
        await publish(clients[1], before, auth=first.key)
        seen = await stream.next_message()
        assert seen.uri == before
    revoke_key(cli_env, first.id)
    await publish(clients[2], missed, auth=refreshed.key)
    # The refreshed key resumes the same session, on every worker, from where it left off.
    for http in clients:
        again = McpSession(http, auth=refreshed.key)
        again.id = owner.id
        assert (await again.call("resources/list"))["result"] is not None
    resumed = McpSession(clients[2], auth=refreshed.key)
    resumed.id = owner.id
    async with resumed.stream(last_event_id=seen.id) as stream:
        assert (await stream.next_message()).uri == missed
