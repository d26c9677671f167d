"""One large change watched by many streams of one worker never knocks the worker's pub/sub
connection off: its wake-ups go in bounded messages, a frame too large for one goes without it."""

from __future__ import annotations

import asyncio
import contextlib
import secrets

import httpx
import redis.asyncio as aioredis

from tests.integration.mcp_http import McpSession, SSEStream
from tests.support import BrokerProcess, RedisProcess

STREAMS = 45
URI = "test://watched/big"


async def pubsub_client_ids(url: str) -> set[str]:
    async with aioredis.Redis.from_url(url) as raw:
        clients = await raw.client_list()
    return {client["id"] for client in clients if "P" in client["flags"]}


async def watching_streams(http: httpx.AsyncClient, stack: contextlib.AsyncExitStack) -> list[SSEStream]:
    """STREAMS legacy sessions subscribed to URI, each with its GET stream open and watching."""
    streams: list[SSEStream] = []
    for _ in range(STREAMS):
        session = await McpSession(http).initialize()
        await session.subscribe(URI)
        stream = await stack.enter_async_context(session.stream())
        await stream.next_event()  # the priming event: the stream is watching
        streams.append(stream)
    return streams


async def every_stream_receives(http: httpx.AsyncClient, streams: list[SSEStream], size: int) -> None:
    """Publish a change of URI whose ``meta`` is ``size`` bytes; every stream gets it, ``meta`` and all."""
    meta = {"blob": "x" * size}
    response = await http.post("/changes", json={"uri": URI, "meta": meta})
    assert response.status_code == 202, response.text
    events = await asyncio.gather(*(stream.next_message(timeout=20) for stream in streams))
    assert all(event.uri == URI and event.message["params"]["_meta"]["blob"] == meta["blob"] for event in events)


async def test_a_large_change_watched_by_many_streams_keeps_the_pubsub_connection() -> None:
    # Redis drops a subscriber whose pending output passes this hard limit (32 MB by default):
    # scaled down here with the frames, so the test stays small.
    with RedisProcess(extra=["--client-output-buffer-limit", "pubsub 512kb 256kb 0"]) as server, \
         BrokerProcess(env={"MCP_BROKER_REDIS_URL": server.url, "MCP_BROKER_REDIS_PREFIX": f"t{secrets.token_hex(4)}",
                            "MCP_BROKER_MAX_META_BYTES": "65536",  # an operator allowing large meta
                            "MCP_BROKER_WAKE_FRAME_MAX_BYTES": "8192",
                            "MCP_BROKER_WAKE_MESSAGE_MAX_BYTES": "65536"}) as worker:
        limits = httpx.Limits(max_connections=STREAMS + 10)
        async with httpx.AsyncClient(base_url=worker.url, timeout=20, limits=limits) as http, \
                contextlib.AsyncExitStack() as stack:
            streams = await watching_streams(http, stack)
            before = await pubsub_client_ids(server.url)
            # 45 x 20 kB in one message passed the limit; 45 x 5 kB carried in several messages did not.
            for size in (20_000, 5_000):
                await every_stream_receives(http, streams, size)
            assert await pubsub_client_ids(server.url) == before
        worker.terminate()
        assert worker.proc.stderr is not None
        log = worker.proc.stderr.read().decode()
        assert "pub/sub lost" not in log, log
