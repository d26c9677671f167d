"""A watch through a round-robin proxy in front of mcp-broker workers on one Redis, while they fail.

The worker holding the watcher's stream is killed with ``kill -9`` or stopped with SIGTERM, or
Redis restarts empty (every session is gone); each time the watcher's content must end equal
to the server's, and no error may reach the caller.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator

import httpx
import pytest

from broker_client import Backoff
from tests.client.targets import Target, watching
from tests.distributed.conftest import Deployment
from tests.support import redis_server_binary

ERAS = ["legacy", "modern"]
BACKOFF = Backoff(initial=0.05, maximum=0.5, retries=20)


@pytest.fixture
def deployment() -> Iterator[Deployment]:
    if redis_server_binary() is None:
        pytest.fail("redis-server is required (install Debian's redis-server)")
    with Deployment(workers=2) as deploy:
        yield deploy


async def holder(deployment: Deployment, era: str) -> int:
    """The worker that holds the watcher's stream (asked of each worker directly)."""
    key = "streams" if era == "legacy" else "listens"
    async with asyncio.timeout(10):
        while True:
            for index, worker in enumerate(deployment.workers):
                if worker.proc.poll() is None and httpx.get(worker.url + "/healthz", timeout=2).json()[key]:
                    return index
            await asyncio.sleep(0.05)


def through(deployment: Deployment) -> Target:
    return Target("broker", deployment.url + "/mcp", deployment.url, broker=True)


@pytest.mark.parametrize("era", ERAS)
async def test_kill_9_of_the_worker_holding_the_stream(deployment: Deployment, era: str) -> None:
    target = through(deployment)
    uri = target.uri("k9")
    await target.write("k9", 0)
    async with watching(target.watch, [uri], era=era, backoff=BACKOFF) as seen:
        await seen.content(uri, target.text(0))
        await target.write("k9", 1)
        await seen.content(uri, target.text(1))
        deployment.kill9(await holder(deployment, era))
        await target.write("k9", 2)
        await seen.content(uri, target.text(2))
        await seen.until(lambda: seen.kinds()[-1] in ("resumed", "resynced"), "the watch to reconnect")
        await target.write("k9", 3)  # and it is live again, on the other worker
        await seen.content(uri, target.text(3))
    assert seen.error is None
    assert "resumed" in seen.kinds()  # a listen too: mcp-broker offers the resumable-listen extension


@pytest.mark.parametrize("era", ERAS)
async def test_redis_restarted_empty_under_a_live_stream(deployment: Deployment, era: str) -> None:
    """The worker holding the stream restores what it serves; the watch re-reads on the gap rule."""
    assert deployment.redis is not None
    target = through(deployment)
    uri = target.uri("empty")
    await target.write("empty", 0)
    async with watching(target.watch, [uri], era=era, backoff=BACKOFF) as seen:
        await seen.content(uri, target.text(0))
        deployment.redis.stop()
        deployment.redis.start()  # same port, nothing in it: the record is gone too
        await seen.until(lambda: seen.latest[uri] is None, "the re-read that finds the record gone")
        await target.write("empty", 7)
        await seen.content(uri, target.text(7))
    assert seen.error is None


@pytest.mark.parametrize("era", ERAS)
async def test_redis_restarted_empty_with_its_holder_dead_means_a_new_session(deployment: Deployment,
                                                                               era: str) -> None:
    """Nobody is left to restore the session: 404, then initialize, subscribe and read again (legacy);
    a new listen and a re-read (2026-07-28, where there is no session to lose)."""
    assert deployment.redis is not None
    target = through(deployment)
    uri = target.uri("gone")
    await target.write("gone", 0)
    async with watching(target.watch, [uri], era=era, backoff=BACKOFF) as seen:
        await seen.content(uri, target.text(0))
        deployment.kill9(await holder(deployment, era))
        deployment.redis.stop()
        deployment.redis.start()
        await target.write("gone", 7)
        await seen.content(uri, target.text(7))
    assert seen.error is None
    assert ("reinitialized" if era == "legacy" else "resynced") in seen.kinds(), seen.kinds()  # the id is not known


@pytest.mark.parametrize("era", ERAS)
async def test_sigterm_of_the_worker_holding_the_stream_is_a_clean_end(deployment: Deployment, era: str) -> None:
    """A draining worker ends its streams (a listen with ``complete``); the watch carries on elsewhere."""
    target = through(deployment)
    uri = target.uri("term")
    await target.write("term", 0)
    async with watching(target.watch, [uri], era=era, backoff=BACKOFF) as seen:
        await seen.content(uri, target.text(0))
        index = await holder(deployment, era)
        deployment.workers[index].proc.send_signal(signal.SIGTERM)
        if era == "modern":
            await seen.until(lambda: "completed" in seen.kinds(), "the listen's complete")
        await asyncio.to_thread(deployment.workers[index].proc.wait, 20)
        await target.write("term", 1)
        await seen.content(uri, target.text(1))
    assert seen.error is None
    assert "gave_up" not in seen.kinds()
