"""An open GET stream keeps its session alive past ``MCP_BROKER_SESSION_TTL``; a session without one expires.

The worker restarts the idle clocks of its open sessions a slot at a time (``Hub._touch``),
many sessions to a script call: every one of them must still be touched within its TTL.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import AsyncExitStack

import httpx

from tests.distributed.conftest import Deployment
from tests.integration.mcp_http import McpSession, SSEStream, publish

TTL = 3.0
#: More sessions than one touch script call carries, so the slots and the calls both split them.
STREAMED = 150


async def test_open_streams_keep_their_sessions_alive_and_the_others_expire() -> None:
    env = {"MCP_BROKER_SESSION_TTL": str(TTL), "MCP_BROKER_KEEPALIVE_INTERVAL": "15"}
    with Deployment(1, env=env) as deploy:
        async with AsyncExitStack() as stack:
            http = await stack.enter_async_context(httpx.AsyncClient(
                base_url=deploy.url, timeout=30, limits=httpx.Limits(max_connections=STREAMED + 10)))
            idle = await McpSession(http).initialize()
            idle_touched = time.monotonic()  # its last request: a request restarts a session's idle clock
            sessions: list[McpSession] = []
            streams: list[SSEStream] = []
            for n in range(STREAMED):
                session = await McpSession(http).initialize()
                await session.subscribe(f"x:kept/{n}")
                stream = await stack.enter_async_context(session.stream())
                await stream.next_event()  # primed: the stream holds the session
                sessions.append(session)
                streams.append(stream)
            opened = time.monotonic()
            # The session without a stream runs out of time (its expiry is Redis's), asked once, well
            # past its TTL: asked before, it would be kept alive by the asking.
            await asyncio.sleep(max(0.0, idle_touched + 2 * TTL - time.monotonic()))
            ping = {"jsonrpc": "2.0", "id": 1, "method": "ping"}
            assert (await idle.post(ping)).status_code == 404, "a session with no stream outlived its TTL"
            # ... while those with one outlive three of their TTLs, and still get their changes.
            await asyncio.sleep(max(0.0, opened + 3 * TTL - time.monotonic()))
            for session in sessions:
                assert (await session.post(ping)).status_code == 200
            await publish(http, *(f"x:kept/{n}" for n in range(STREAMED)))
            for n, stream in enumerate(streams):
                event = await stream.next_message()
                assert event.uri == f"x:kept/{n}"
