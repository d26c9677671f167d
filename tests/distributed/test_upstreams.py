"""One watch of an upstream for the whole deployment (docs/UPSTREAMS.md, "One watch for the deployment").

Three workers on a real Redis behind the round-robin proxy, in front of an upstream built with the
official SDK (``tests/upstream_server.py``). A thousand clients of both eras subscribe to one of its
notes, on every worker: the upstream sees one watch; a tool call through the broker changes the
note and every client hears of it and reads the new text. Killing the worker that holds the watch
moves it to another; killing and restarting the upstream loses nobody the next change.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from tests.distributed.conftest import Deployment
from tests.integration import modern
from tests.integration.mcp_http import McpSession, SSEStream
from tests.integration.test_upstreams import UpstreamProcess
from tests.support import wait_until

UPDATED = "notifications/resources/updated"
#: A short lease, so that a dead holder's watch moves within seconds (the default is 5 s).
ENV = {"MCP_BROKER_SOURCE_LEASE_MS": "1500"}


def upstreams_env(upstream: UpstreamProcess) -> dict[str, str]:
    config = {"notes": {"url": upstream.url + "/mcp", "watch_grace": 2}}
    return {**ENV, "MCP_BROKER_UPSTREAMS": json.dumps(config)}


@pytest.fixture
def upstream() -> Iterator[UpstreamProcess]:
    process = UpstreamProcess()
    try:
        yield process
    finally:
        process.stop()


def holders(deployment: Deployment) -> list[int]:
    """The workers that run the upstream's watch now, by their own console."""
    found = []
    for index, worker in enumerate(deployment.workers):
        if worker.proc.poll() is not None:
            continue
        rows = httpx.get(worker.url + "/console/state.json", timeout=5).json()["upstreams"]
        if rows and rows[0]["watching"] is not None:
            found.append(index)
    return found


async def text(http: httpx.AsyncClient, uri: str) -> str:
    response = await modern.call(http, "resources/read", {"uri": uri}, name=uri)
    return str(response.json()["result"]["contents"][0]["text"])


async def until_text(next_update: Any, read: Any, uri: str, wanted: str) -> None:
    """Take this client's notifications until one is followed by a read of the new text."""
    while True:
        message = await next_update()
        assert message is not None, "the stream ended"
        assert message["method"] == UPDATED and message["params"]["uri"] == uri, message
        if await read() == wanted:
            return


class Listener:
    """A 2026-07-28 listen on one worker."""

    def __init__(self, stack: contextlib.AsyncExitStack, http: httpx.AsyncClient) -> None:
        self.stack = stack
        self.http = http
        self.stream: modern.ListenStream | None = None

    async def open(self, uri: str) -> Listener:
        self.stream = await self.stack.enter_async_context(modern.listen(self.http, [uri]))
        ack = await self.stream.next(timeout=30)
        assert ack is not None and ack["method"] == "notifications/subscriptions/acknowledged"
        return self

    async def next_update(self) -> dict[str, Any] | None:
        assert self.stream is not None
        return await self.stream.next(timeout=30)


class Subscriber:
    """A 2025 session through the proxy: every request on the next worker."""

    def __init__(self, stack: contextlib.AsyncExitStack, http: httpx.AsyncClient) -> None:
        self.stack = stack
        self.session = McpSession(http)
        self.stream: SSEStream | None = None

    async def open(self, uri: str) -> Subscriber:
        await self.session.initialize()
        await self.session.subscribe(uri)
        self.stream = await self.stack.enter_async_context(self.session.stream())
        return self

    async def next_update(self) -> dict[str, Any] | None:
        assert self.stream is not None
        message: dict[str, Any] = (await self.stream.next_message(timeout=30)).message
        return message


@pytest.fixture
async def clients() -> AsyncIterator[contextlib.AsyncExitStack]:
    async with contextlib.AsyncExitStack() as stack:
        yield stack


async def gather_bounded(coros: list[Any], at_once: int = 50) -> list[Any]:
    gate = asyncio.Semaphore(at_once)

    async def one(coro: Any) -> Any:
        async with gate:
            return await coro

    return await asyncio.gather(*(one(coro) for coro in coros))


async def test_a_thousand_clients_one_watch_and_everyone_hears_a_tool_call(
        upstream: UpstreamProcess, clients: contextlib.AsyncExitStack) -> None:
    uri = "note://crowd"
    httpx.put(upstream.url + "/notes/crowd", json={"text": "before"}, timeout=5)
    with Deployment(env=upstreams_env(upstream)) as deployment:
        limits = httpx.Limits(max_connections=2000, max_keepalive_connections=200)
        workers = [await clients.enter_async_context(httpx.AsyncClient(base_url=w.url, timeout=60, limits=limits))
                   for w in deployment.workers]
        proxied = await clients.enter_async_context(httpx.AsyncClient(base_url=deployment.url, timeout=60,
                                                                      limits=limits))
        streams = await clients.enter_async_context(contextlib.AsyncExitStack())
        listeners = await gather_bounded([Listener(streams, workers[i % 3]).open(uri) for i in range(800)])
        subscribers = await gather_bounded([Subscriber(streams, proxied).open(uri) for _ in range(200)])
        async with asyncio.timeout(30):
            while uri not in (stats := upstream.stats())["listening"]:
                await asyncio.sleep(0.1)
        assert stats["listens"] == 1 and stats["get_streams"] == 0 and not stats["watchers"], stats
        assert len(holders(deployment)) == 1

        called = await modern.call(proxied, "tools/call", {"name": "set_note",
                                                           "arguments": {"id": "crowd", "text": "after"}},
                                   name="set_note")
        assert called.json()["result"]["isError"] is False
        await gather_bounded([until_text(client.next_update, lambda: text(proxied, uri), uri, "after")
                              for client in [*listeners, *subscribers]])
        stats = upstream.stats()
        assert stats["listens"] == 1 and stats["get_streams"] == 0, stats  # still the one watch

        # Everyone leaves (the sessions end): the watch closes after its grace, and the upstream's stream with it.
        await streams.aclose()
        await gather_bounded([proxied.delete("/mcp", headers=client.session.headers()) for client in subscribers])
        async with asyncio.timeout(30):
            while upstream.stats()["listens"]:
                await asyncio.sleep(0.2)


async def test_the_watch_moves_when_its_holder_dies_and_outlives_an_upstream_restart(
        upstream: UpstreamProcess, clients: contextlib.AsyncExitStack) -> None:
    uri = "note://moving"
    with Deployment(env=upstreams_env(upstream)) as deployment:
        workers = [await clients.enter_async_context(httpx.AsyncClient(base_url=w.url, timeout=60))
                   for w in deployment.workers]
        listeners = [await Listener(clients, workers[i % 3]).open(uri) for i in range(6)]
        wait_until(lambda: uri in upstream.stats()["listening"], what="the watch")
        [holder] = holders(deployment)
        deployment.kill9(holder)
        survivors = [listener for i, listener in enumerate(listeners) if i % 3 != holder]
        alive = workers[(holder + 1) % 3]
        # Another worker takes the lease once it lapses, and a new watch at the upstream.
        wait_until(lambda: len(holders(deployment)) == 1 and upstream.stats()["listens"] == 1, timeout=30,
                   what="the watch taken over")
        httpx.put(upstream.url + "/notes/moving", json={"text": "after the move"}, timeout=5)
        await asyncio.gather(*(until_text(listener.next_update, lambda: text(alive, uri), uri, "after the move")
                               for listener in survivors))

        # The upstream dies and comes back on its port: its notes are new, and the next change reaches all.
        port = upstream.port
        upstream.stop()
        restarted = UpstreamProcess.on_port(port)
        try:
            wait_until(lambda: uri in restarted.stats()["listening"], timeout=30, what="the watch back")
            httpx.put(restarted.url + "/notes/moving", json={"text": "after the restart"}, timeout=5)
            await asyncio.gather(*(until_text(listener.next_update, lambda: text(alive, uri), uri,
                                              "after the restart") for listener in survivors))
        finally:
            restarted.stop()
