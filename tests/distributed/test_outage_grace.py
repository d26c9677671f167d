"""``MCP_BROKER_OUTAGE_GRACE`` means what it says, whatever the keep-alive interval and the Redis timeouts.

The workers run with the default keep-alive interval (15 s) and socket timeout (5 s) and a grace
of 2 s. Redis is frozen (SIGSTOP: no errors, no replies, the hardest outage to notice): every
legacy stream and listen ends with ``retry:`` within grace + 2 s of the freeze, so clients move
to a healthy worker; a freeze well under the grace leaves every stream open and working.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager

import httpx
import orjson
import pytest

from tests.distributed.conftest import Deployment
from tests.distributed.scenario import uris
from tests.integration import modern
from tests.integration.mcp_http import Event, McpSession, SSEStream, StreamEnded, publish

GRACE = 2.0
#: The defaults of every timer but the grace.
ENV = {
    "MCP_BROKER_OUTAGE_GRACE": str(GRACE),
    "MCP_BROKER_KEEPALIVE_INTERVAL": "15",
    "MCP_BROKER_REDIS_SOCKET_TIMEOUT": "5",
    "MCP_BROKER_REDIS_CONNECT_TIMEOUT": "2",
}


@pytest.fixture
def deploy() -> Iterator[Deployment]:
    with Deployment(2, env=ENV) as deployment:
        yield deployment


@asynccontextmanager
async def open_streams(deploy: Deployment, watched: list[str]) -> AsyncIterator[dict[str, SSEStream]]:
    """A legacy GET stream and a listen on each worker, all started (primed, acknowledged)."""
    async with AsyncExitStack() as stack:
        streams: dict[str, SSEStream] = {}
        for n, worker in enumerate(deploy.workers):
            http = await stack.enter_async_context(httpx.AsyncClient(base_url=worker.url, timeout=30))
            session = await McpSession(http).initialize()
            await session.subscribe(*watched)
            legacy = await stack.enter_async_context(session.stream())
            await legacy.next_event()
            body = modern.request("subscriptions/listen", {"notifications": {"resourceSubscriptions": watched}}, n)
            response = await stack.enter_async_context(
                http.stream("POST", "/mcp", content=orjson.dumps(body), headers=modern.headers("subscriptions/listen")))
            assert response.status_code == 200
            listen = SSEStream(response)
            assert (await listen.next_message()).method == "notifications/subscriptions/acknowledged"
            streams[f"legacy stream on worker {n}"] = legacy
            streams[f"listen on worker {n}"] = listen
        yield streams


@asynccontextmanager
async def frozen_redis(deploy: Deployment) -> AsyncIterator[float]:
    """Redis frozen (SIGSTOP) while the block runs; yields the monotonic time of the freeze."""
    assert deploy.redis is not None and deploy.redis.proc is not None
    pid = deploy.redis.proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        yield time.monotonic()
    finally:
        os.kill(pid, signal.SIGCONT)


async def ending(stream: SSEStream, deadline: float) -> tuple[float, bool]:
    """When the stream ended (monotonic) and whether its last event was ``retry:``; fails at ``deadline``."""
    last_retry = False
    try:
        async with asyncio.timeout_at(asyncio.get_running_loop().time() + deadline - time.monotonic()):
            while True:
                event = await stream.next_event(timeout=60)
                last_retry = event.retry is not None and event.data is None
    except StreamEnded:
        return time.monotonic(), last_retry


@pytest.mark.timeout(60)
async def test_every_stream_ends_with_retry_within_the_grace_of_a_frozen_redis(deploy: Deployment) -> None:
    watched = uris(2)
    async with open_streams(deploy, watched) as streams:
        async with frozen_redis(deploy) as frozen:
            bound = frozen + GRACE + 2
            results = await asyncio.gather(*(ending(s, bound) for s in streams.values()), return_exceptions=True)
    late = [name for name, result in zip(streams, results, strict=True) if isinstance(result, TimeoutError)]
    assert not late, f"still open {GRACE + 2:.0f}s into the outage: {late}"
    for name, result in zip(streams, results, strict=True):
        assert not isinstance(result, BaseException), (name, result)
        assert result[1], f"{name} ended without retry:"
    after = sorted(result[0] - frozen for result in results if not isinstance(result, BaseException))
    print(f"\n[redis frozen, grace {GRACE:.0f}s, keep-alive 15s] {len(after)} streams ended with retry: "
          f"{after[0]:.2f}s to {after[-1]:.2f}s after the freeze")


async def read_all(stream: SSEStream, into: asyncio.Queue[Event | None]) -> None:
    """Every event of the stream, then None when it ends (a read that is cancelled spoils the stream)."""
    try:
        while True:
            await into.put(await stream.next_event(timeout=60))
    except StreamEnded:
        await into.put(None)


@pytest.mark.timeout(60)
async def test_a_freeze_well_under_the_grace_leaves_every_stream_open(deploy: Deployment) -> None:
    watched = uris(2)
    async with open_streams(deploy, watched) as streams:
        events: dict[str, asyncio.Queue[Event | None]] = {name: asyncio.Queue() for name in streams}
        readers = [asyncio.ensure_future(read_all(stream, events[name])) for name, stream in streams.items()]
        try:
            async with frozen_redis(deploy) as frozen:
                await asyncio.sleep(GRACE / 4)  # how long the blip lasts
            # Nothing ends, not even once a grace (and then some) has passed since the blip began.
            window = frozen + GRACE + 2
            for name, queue in events.items():
                with contextlib.suppress(TimeoutError):
                    event = await asyncio.wait_for(queue.get(), max(0.01, window - time.monotonic()))
                    pytest.fail(f"{name} {'ended' if event is None else f'sent {event}'} after the blip")
            # And each of them still delivers.
            async with httpx.AsyncClient(base_url=deploy.workers[1].url, timeout=30) as http:
                await publish(http, watched[0])
            for name, queue in events.items():
                event = await asyncio.wait_for(queue.get(), 10)
                assert event is not None and event.uri == watched[0], (name, event)
        finally:
            for reader in readers:
                reader.cancel()
