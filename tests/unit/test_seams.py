"""The three seams, each filled by one file of ``examples/`` and one line of wiring, as docs/ARCHITECTURE.md shows.

In process, on the memory backend: two ``Broker`` objects sharing one backend stand for two
workers of one deployment.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import orjson
import pytest

from broker.auth import Principal
from broker.backends.memory import MemoryBackend
from broker.config import Settings
from broker.errors import BackendUnavailable
from broker.feeds.model import FeedKind
from broker.methods import Call
from broker.protocol import jsonrpc as rpc
from broker.publisher import Publisher
from broker.runtime import Broker
from broker.runtime.app import create_app
from examples.counting_metrics import CountingMetrics
from examples.signed_tokens import SignedTokens
from examples.ticker_source import Ticker

TIMEOUT = 5.0


def settings(**overrides: Any) -> Settings:
    return Settings(_env_file=None, source_lease_ms=200, **overrides)  # type: ignore[call-arg]


async def eventually(check: Callable[[], bool | Awaitable[bool]], what: str) -> None:
    try:
        async with asyncio.timeout(TIMEOUT):
            while True:
                result = check()
                if result if isinstance(result, bool) else await result:
                    return
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"waited {TIMEOUT}s in vain for {what}") from None


# -- Authenticator ----------------------------------------------------------------------------
@pytest.fixture
async def signed() -> AsyncIterator[tuple[httpx.AsyncClient, SignedTokens, Broker]]:
    tokens = SignedTokens(b"secret")
    broker = Broker(settings(), authenticator=tokens)
    await broker.start()
    transport = httpx.ASGITransport(app=create_app(broker=broker))
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        yield client, tokens, broker
    await broker.stop()


INITIALIZE = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
              "params": {"protocolVersion": "2025-11-25", "capabilities": {},
                         "clientInfo": {"name": "t", "version": "1"}}}
MCP_HEADERS = {"accept": "application/json, text/event-stream", "content-type": "application/json"}


async def test_a_custom_authenticator_guards_every_front_door_with_its_own_challenge(
        signed: tuple[httpx.AsyncClient, SignedTokens, Broker]) -> None:
    client, _, _ = signed
    forged = {"authorization": "Bearer acme.alice.0000"}
    for answer in (await client.post("/mcp", json=INITIALIZE, headers=MCP_HEADERS),
                   await client.post("/changes", json={"uri": "x:a"}),
                   await client.get("/collections"),
                   await client.post("/changes", json={"uri": "x:a"}, headers=forged)):
        assert answer.status_code == 401
        assert answer.headers["www-authenticate"].startswith('Bearer realm="platform"')
    assert (await client.get("/healthz")).status_code == 200  # a probe needs no token


async def test_the_principal_an_authenticator_returns_is_the_tenant_of_what_it_does(
        signed: tuple[httpx.AsyncClient, SignedTokens, Broker]) -> None:
    client, tokens, broker = signed
    acme = {"authorization": "Bearer " + tokens.sign("acme", "alice")}
    put = await client.put("/collections/products/1", json={"price": 3}, headers=acme)
    assert put.status_code == 201 and put.json()["uri"] == "mcpb://acme/products/1"
    # Another tenant's record URI is out of reach: a 403, not a change in acme's stream.
    assert (await client.post("/changes", json={"uri": "mcpb://other/products/1"}, headers=acme)).status_code == 403
    answer = await client.post("/mcp", json=INITIALIZE, headers={**MCP_HEADERS, **acme})
    assert answer.status_code == 200
    session = await broker.feeds.load(answer.headers["mcp-session-id"], Principal("acme", "alice"), FeedKind.SESSION)
    assert session.tenant == "acme"


# -- ChangeSource -------------------------------------------------------------------------------
class Counted(Ticker):
    """The example ticker, counting how many of it run at once across the brokers."""

    running: list[int] = [0, 0]  # now, most at once

    async def run(self, publisher: Publisher) -> None:
        Counted.running[0] += 1
        Counted.running[1] = max(Counted.running)
        try:
            await super().run(publisher)
        finally:
            Counted.running[0] -= 1


async def test_an_exclusive_source_runs_on_one_worker_and_moves_when_that_worker_stops() -> None:
    Counted.running[:] = [0, 0]
    s = settings()
    backend = MemoryBackend(s)
    first, second = Broker(s, backend), Broker(s, backend)
    tickers = [Counted("x:feed", tenant="acme", every=0.01), Counted("x:feed", tenant="acme", every=0.01)]
    for broker, ticker in zip((first, second), tickers, strict=True):
        broker.add_source(ticker)
        await broker.start()
    try:
        await eventually(lambda: sum(t.ticks for t in tickers) >= 5, "the source to tick")
        holder = 0 if tickers[0].ticks else 1
        assert tickers[1 - holder].ticks == 0
        before = tickers[1 - holder].ticks
        await (first, second)[holder].stop()
        await eventually(lambda: tickers[1 - holder].ticks > before, "the other worker to take the source over")
        assert Counted.running[1] == 1  # never two at once
    finally:
        for broker in (first, second):
            if broker.started:
                await broker.stop()


class Flaky:
    """A source whose first run fails at once: it is started again; a run that returns is not."""

    name = "flaky"
    exclusive = False

    def __init__(self) -> None:
        self.runs = 0

    async def run(self, publisher: Publisher) -> None:
        self.runs += 1
        if self.runs == 1:
            raise BackendUnavailable("not yet")
        await publisher.publish("x:done", tenant="acme", source=self.name)


async def test_a_source_that_fails_is_started_again_and_one_that_returns_is_done() -> None:
    broker = Broker(settings(embedded_fanout=False))  # the change stays in the log for the test to read
    source = Flaky()
    broker.add_source(source)
    await broker.start()
    try:
        runner = next(t for t in asyncio.all_tasks() if t.get_name() == "source-runner-flaky")
        await asyncio.wait_for(runner, TIMEOUT)  # it ends once the source returned: no third run
        assert source.runs == 2
        changes = await broker.backend.changelog.read("reader", 10, 100)
        assert [c.uri for _, c in changes] == ["x:done"]
    finally:
        await broker.stop()


# -- Metrics ------------------------------------------------------------------------------------
class Lines:
    """A ``Writer`` that keeps what it is given."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.arrived = asyncio.Event()

    async def send(self, message: bytes, event_id: str | None = None) -> None:
        self.sent.append(message)
        self.arrived.set()

    async def send_many(self, items: list[tuple[bytes, str | None]]) -> None:
        for message, event_id in items:
            await self.send(message, event_id)

    async def comment(self) -> None:
        return None

    async def retry(self) -> None:
        return None

    async def prime(self, event_id: str) -> None:
        return None


async def test_a_metrics_binding_sees_publishes_fanout_streams_and_notifications() -> None:
    metrics = CountingMetrics()
    broker = Broker(settings(), metrics=metrics)
    await broker.start()
    try:
        principal = Principal("default", "anonymous")
        _, session = await broker.dispatcher.initialize(principal, rpc.parse_message(INITIALIZE))
        subscribe = {"jsonrpc": "2.0", "id": 2, "method": "resources/subscribe", "params": {"uri": "x:a"}}
        await broker.dispatcher.legacy(Call(principal, False, session), rpc.parse_message(subscribe))
        stream, writer = broker.dispatcher.legacy_stream(session, None), Lines()
        task = asyncio.create_task(stream.run(writer))
        await eventually(lambda: metrics.get("mcp_broker_streams_open", era="legacy") == 1, "the stream to open")
        await broker.publish("x:a", meta={"v": 1})
        await asyncio.wait_for(writer.arrived.wait(), TIMEOUT)
        assert orjson.loads(writer.sent[-1])["params"] == {"uri": "x:a", "_meta": {"v": 1}}
        assert metrics.get("mcp_broker_changes_published_total", source="python") == 1
        assert metrics.get("mcp_broker_fanout_changes_total") == 1
        assert metrics.get("mcp_broker_notifications_sent_total", era="legacy", kind="updated") == 1
        stream.disconnect()
        await asyncio.wait_for(task, TIMEOUT)
        assert metrics.get("mcp_broker_streams_open", era="legacy") == 0
        assert metrics.get("mcp_broker_streams_ended_total", era="legacy", reason="disconnect") == 1
    finally:
        await broker.stop()
