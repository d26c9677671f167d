"""A listen never misses a change silently when its worker's pub/sub connection to Redis is re-made.

Listens get changes through the broadcast channel, which has no replay: whatever is published
while a worker's pub/sub connection is down never reaches that worker. Legacy sessions re-read
their inboxes after the reconnect; a listen has no inbox, so it gets the gap rule instead (an
``updated`` for every URI it watches), or ends so that its client listens again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import orjson
import pytest

from tests.distributed.conftest import WORKER_ENV
from tests.distributed.relay import Relay
from tests.distributed.scenario import UPDATED, uris
from tests.integration import modern
from tests.integration.mcp_http import McpSession, SSEStream, StreamEnded
from tests.support import BrokerProcess, RedisProcess

#: Streams must outlive the outage: the outage grace is much longer than it.
ENV = {**WORKER_ENV, "MCP_BROKER_OUTAGE_GRACE": "20"}


@asynccontextmanager
async def cut_off_worker(data: str, tmp_path: Path) -> AsyncIterator[tuple[BrokerProcess, BrokerProcess, RedisProcess,
                                                                         Relay]]:
    """Worker A reaches Redis through a relay the test cuts; worker B, directly, fans out every change."""
    extra = ["--appendonly", "yes", "--appendfsync", "always"] if data == "kept" else []
    with RedisProcess(extra=extra, workdir=tmp_path) as redis:
        async with Relay(redis.port) as relay:
            # Started in threads: the relay that worker A needs runs in this event loop.
            a = await asyncio.to_thread(BrokerProcess, env={**ENV, "MCP_BROKER_REDIS_URL": relay.url,
                                                            "MCP_BROKER_EMBEDDED_FANOUT": "false"})
            try:
                with await asyncio.to_thread(BrokerProcess, env={**ENV, "MCP_BROKER_REDIS_URL": redis.url}) as b:
                    yield a, b, redis, relay
            finally:
                a.kill()


@asynccontextmanager
async def listen_stream(http: httpx.AsyncClient, watched: list[str]) -> AsyncIterator[SSEStream]:
    body = modern.request("subscriptions/listen", {"notifications": {"resourceSubscriptions": watched}}, "gap")
    async with http.stream("POST", "/mcp", content=orjson.dumps(body),
                           headers=modern.headers("subscriptions/listen")) as response:
        assert response.status_code == 200, (await response.aread()).decode()
        yield SSEStream(response)


async def publish_until_acknowledged(http: httpx.AsyncClient, uri: str, seq: int) -> None:
    async with asyncio.timeout(20):
        while (response := await http.post("/changes", json={"uri": uri, "meta": {"seq": seq}})).status_code != 202:
            assert response.status_code == 503, response.text


@pytest.mark.timeout(90)
@pytest.mark.parametrize("outage", ["restart keeping data", "restart empty", "reset connections"])
async def test_a_listen_learns_of_every_change_its_worker_could_not_hear(outage: str, tmp_path: Path) -> None:
    """Redis restarts (or only worker A's connections reset); A is cut off a little longer than the
    others, as its reconnect backoff may make it, while 30 changes are published through B."""
    watched = uris(30)
    data = "lost" if outage == "restart empty" else "kept"
    async with (cut_off_worker(data, tmp_path) as (worker_a, worker_b, redis, relay),
                httpx.AsyncClient(base_url=worker_a.url, timeout=30) as a,
                httpx.AsyncClient(base_url=worker_b.url, timeout=30) as b):
        legacy = await McpSession(a).initialize()
        await legacy.subscribe(*watched)
        async with legacy.stream() as session_stream, listen_stream(a, watched) as listen:
            await session_stream.next_event()  # priming: claimed and reading
            assert (await listen.next_message()).method == "notifications/subscriptions/acknowledged"

            relay.cut()
            if outage != "reset connections":
                redis.stop()
                redis.start()  # same port; with its append-only file, or empty
            for seq, uri in enumerate(watched):
                await publish_until_acknowledged(b, uri, seq)
            relay.heal()
            healed = time.monotonic()

            # Legacy sessions re-read their inboxes after the reconnect and get every change; after
            # a restart (a new replication id: the session takes a new epoch) or restored after an
            # empty one, they get the gap rule instead. Either way every URI is announced.
            seen_by_session: set[str] = set()
            async with asyncio.timeout(20):
                while seen_by_session != set(watched):
                    event = await session_stream.next_message()
                    if event.method == UPDATED and (outage != "reset connections"
                                                    or "seq" in event.message["params"].get("_meta", {})):
                        seen_by_session.add(event.uri or "")

            # The listen hears of every URI (the change itself, or a resync), or ends with retry:.
            seen_by_listen: set[str] = set()
            ended_with_retry = False
            try:
                async with asyncio.timeout(20):
                    while seen_by_listen != set(watched):
                        event = await listen.next_event(timeout=20)
                        if event.retry is not None and event.data is None:
                            ended_with_retry = True
                        elif event.method == UPDATED:
                            seen_by_listen.add(event.uri or "")
            except StreamEnded:
                assert ended_with_retry, "the listen ended without retry:"
            except TimeoutError:
                missed = sorted(set(watched) - seen_by_listen)
                pytest.fail(f"the listen stayed open and missed {len(missed)} of 30 changes: {missed[:3]}")
    print(f"\n[{outage}] the legacy session heard of all 30; the listen "
          f"{'ended with retry:' if ended_with_retry else 'heard of all 30'} "
          f"{time.monotonic() - healed:.2f}s after worker A could reach Redis again")
