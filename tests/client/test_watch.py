"""A watch against one server: it reads after subscribing, follows every change, survives cut streams.

Every scenario runs against mcp-broker and against the official SDK server, in both eras.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from broker_client import Backoff, GaveUp, NotSupported, Watcher
from broker_client.stdio import StdioChannel
from tests.client.targets import Target, stdio_target, watching
from tests.distributed.relay import Relay
from tests.support import ROOT, BrokerProcess, free_port, wait_until

HTTP_TARGETS = [pytest.param(("broker", era), id=f"broker-{era}") for era in ("legacy", "modern")] + [
    pytest.param(("sdk", era), id=f"sdk-{era}") for era in ("legacy", "modern")]
ERA = {"legacy": "2025-11-25", "modern": "2026-07-28"}


@pytest.fixture(params=HTTP_TARGETS)
def case(request: pytest.FixtureRequest) -> tuple[Target, str]:
    kind, era = request.param
    proc = request.getfixturevalue(kind)
    return Target(kind, proc.mcp_url, proc.url, broker=kind == "broker"), era


# The broker's stdio target runs on a redis-server: marked here, where the choice is made at run time.
@pytest.fixture(params=[pytest.param("broker", marks=pytest.mark.redis), "sdk"])
def stdio(request: pytest.FixtureRequest) -> Iterator[Target]:
    redis = request.getfixturevalue("redis") if request.param == "broker" else None
    yield from stdio_target(request.param, redis)


async def test_the_watch_follows_every_change(case: tuple[Target, str]) -> None:
    target, era = case
    uris = [target.uri("a"), target.uri("b")]
    await target.write("a", 0)
    await target.write("b", 0)
    async with watching(target.watch, uris, era=era) as seen:
        for uri in uris:
            await seen.content(uri, target.text(0))
        assert seen.statuses[0].kind == "connected" and seen.statuses[0].era == ERA[era]
        for value in range(1, 6):
            await target.write("a", value)
            await seen.content(uris[0], target.text(value))  # each one seen before the next is written
        await target.write("b", 9)
        await seen.content(uris[1], target.text(9))
    assert [u.uri for u in seen.updates if u.initial] == sorted(uris)
    texts = [u.text for u in seen.updates if u.uri == uris[0]]
    assert texts == [target.text(v) for v in range(6)]  # no re-read that found nothing new is reported


async def test_a_change_between_subscribe_and_first_read_is_never_missed(case: tuple[Target, str]) -> None:
    """The test writes at the one moment a careless client loses a change: subscribed, not yet read."""
    target, era = case
    uri = target.uri("race")
    await target.write("race", 1)

    async def change_now() -> None:
        await target.write("race", 2)

    async with watching(target.watch, [uri], era=era, on_subscribed=change_now) as seen:
        await seen.content(uri, target.text(2))
    # The first read came after the subscription was confirmed, and so after the change.
    assert seen.updates[0].initial and seen.updates[0].text == target.text(2)


async def test_cut_streams_are_resumed_or_resynced(case: tuple[Target, str]) -> None:
    """Every connection to the server is reset while it changes; the watch ends on the server's content."""
    target, era = case
    uri = target.uri("cut")
    await target.write("cut", 0)
    port = int(target.base.rsplit(":", 1)[1])
    async with Relay(port) as relay, \
            watching(f"http://127.0.0.1:{relay.port}/mcp", [uri], era=era,
                     backoff=Backoff(initial=0.05, maximum=0.5)) as seen:
        await seen.content(uri, target.text(0))
        for value in (1, 3, 5):
            await target.write("cut", value)  # heard live: the stream has an event id to resume from
            await seen.content(uri, target.text(value))
            relay.cut()
            await target.write("cut", value + 1)  # written while the watcher cannot reach the server
            relay.heal()
            await seen.content(uri, target.text(value + 1))
    # A legacy session resumes its GET stream from the last event id (the server replays); so
    # does a listen where the server offers the resumable-listen extension (mcp-broker). Plain
    # 2026-07-28 has no replay, so each new listen re-reads.
    kinds = seen.kinds()
    expected = "resynced" if era == "modern" and not target.broker else "resumed"
    assert kinds.count(expected) == 3, [(s.kind, s.detail) for s in seen.statuses]
    assert "reinitialized" not in kinds


async def test_the_watch_over_stdio_follows_changes_and_outlives_its_process(stdio: Target) -> None:
    """The watcher starts the server itself; when that process dies, it starts another and re-reads."""
    for era in ("legacy", "modern"):
        uri = stdio.uri(era)
        async with watching(stdio.watch, [uri], era=era, backoff=Backoff(initial=0.05)) as seen:
            await seen.until(lambda: bool(seen.statuses), "the stdio server to answer")
            await stdio.write(era, 1)  # the SDK's side door opens with the process
            await seen.content(uri, stdio.text(1))
            await stdio.write(era, 2)
            await seen.content(uri, stdio.text(2))
            assert seen.watcher is not None and isinstance(seen.watcher.channel, StdioChannel)
            seen.watcher.channel.proc.kill()
            await seen.until(lambda: "reinitialized" in seen.kinds(), "a new server process")
            await stdio.write(era, 3)
            await seen.content(uri, stdio.text(3))
        assert seen.statuses[0].era == ERA[era]


async def test_a_server_without_subscribe_is_refused() -> None:
    """No ``resources.subscribe`` capability: no update would ever come, so the watch refuses to start."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tests.client.sdk_target", "--port", str(port), "--no-subscribe"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200)
        for era in ("legacy", "modern", "auto"):
            async with Watcher(f"http://127.0.0.1:{port}/mcp", era=era) as watcher:
                with pytest.raises(NotSupported, match="resources.subscribe"):
                    await anext(aiter(watcher.watch(["test://x"])))
    finally:
        proc.kill()
        proc.wait(10)


async def test_teardown_unsubscribes_and_ends_the_session(broker: BrokerProcess) -> None:
    target = Target("broker", broker.mcp_url, broker.url, broker=True)
    await target.write("bye", 0)
    async with httpx.AsyncClient(base_url=broker.url) as http:
        for era in ("legacy", "modern"):
            async with watching(target.watch, [target.uri("bye")], era=era) as seen:
                await seen.content(target.uri("bye"), target.text(0))
                health = (await http.get("/healthz")).json()
                assert health["streams" if era == "legacy" else "listens"] == 1
            async with asyncio.timeout(10):
                while (health := (await http.get("/healthz")).json())["streams"] + health["listens"]:
                    await asyncio.sleep(0.02)


@pytest.mark.parametrize("era", ["legacy", "modern"])
async def test_a_server_that_stays_away_ends_the_watch_with_gave_up(era: str) -> None:
    with BrokerProcess() as proc:
        target = Target("broker", proc.mcp_url, proc.url, broker=True)
        await target.write("gone", 0)
        async with watching(target.watch, [target.uri("gone")], era=era,
                            backoff=Backoff(initial=0.01, maximum=0.05, retries=3)) as seen:
            await seen.content(target.uri("gone"), target.text(0))
            proc.kill()
            await seen.until(lambda: seen.error is not None, "the watch to give up")
    assert isinstance(seen.error, GaveUp)
    assert seen.kinds()[-1] == "gave_up" and seen.kinds().count("retrying") == 3
