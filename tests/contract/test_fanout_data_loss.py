"""A fan-out batch read before the store lost its data adds nothing to a session made after the loss.

Fan-out reads a batch, looks its subscribers up and appends in later calls; when Redis is emptied
(a restart without data, a FLUSHALL) in between, those calls land on the emptied store. A feed made
there meanwhile (a stream restoring its session, a poll or webhook subscription answering
``truncated``) already stands for every change before it, so the old batch's frames must not follow
in its inbox, after the truncation that stands for them.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

from broker.backends.base import Backend
from broker.changes import Change
from broker.config import Settings
from broker.fanout import Fanout
from broker.notifications import update_frame
from tests.contract.conftest import open_session


async def test_a_batch_read_before_the_store_was_emptied_adds_nothing_to_a_session_made_after(
        backend: Backend) -> None:
    if not hasattr(backend, "redis"):
        pytest.skip("the memory backend never loses its data")
    fanout = Fanout(Settings(_env_file=None), backend, "c1")  # type: ignore[call-arg]
    before = await open_session(backend)
    await backend.subscriptions.add(before, "t1", "polled/a")
    await backend.changelog.publish(Change("t1", "polled/a"))
    read_under = backend.sessions.epoch
    batch = await backend.changelog.read("c1", 10, 100)
    assert len(batch) == 1

    await backend.redis.flushall()  # type: ignore[attr-defined]
    after = await open_session(backend)
    await backend.subscriptions.add(after, "t1", "polled/a")
    await fanout.process(batch, read_under)

    read = await backend.inboxes.read(after, backend.sessions.epoch, 0, 10)
    assert (read.gap, read.frames) == (False, []), "a change from before the loss follows the feed made after it"

    # A change published after the loss reaches the new session, even from a worker that read
    # it before it noticed the loss (its epoch still the old one).
    change = Change("t1", "polled/a", meta={"n": 2})
    await fanout.process([(await backend.changelog.publish(change), change)], read_under)
    read = await backend.inboxes.read(after, backend.sessions.epoch, 0, 10)
    assert [frame.data for _, frame in read.frames] == [update_frame("polled/a", {"n": 2}).data]


class LosesItsDataAfterTheFirstRead:
    """The change log, whose store is emptied right after the first read that found changes, and a
    subscriber to ``uri`` made there at once (as a poll answered ``truncated`` makes one)."""

    def __init__(self, backend: Backend, uri: str) -> None:
        self.backend, self.uri = backend, uri
        self.real = backend.changelog
        self.made: str | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)

    async def read(self, consumer: str, count: int, block_ms: int) -> list[tuple[str, Change]]:
        batch = await self.real.read(consumer, count, block_ms)
        if batch and self.made is None:
            await self.backend.redis.flushall()  # type: ignore[attr-defined]
            self.made = await open_session(self.backend)
            await self.backend.subscriptions.add(self.made, "t1", self.uri)
        return batch


async def test_the_fanout_loop_appends_a_batch_under_the_epoch_it_knew_before_reading_it(backend: Backend) -> None:
    if not hasattr(backend, "redis"):
        pytest.skip("the memory backend never loses its data")
    fanout = Fanout(Settings(_env_file=None), backend, "c1")  # type: ignore[call-arg]
    fanout.changelog = log = LosesItsDataAfterTheFirstRead(backend, "polled/a")  # type: ignore[assignment]
    await backend.changelog.publish(Change("t1", "polled/a"))
    task = asyncio.create_task(fanout.run())
    try:
        async with asyncio.timeout(10):
            while not fanout.processed:
                await asyncio.sleep(0.01)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert log.made is not None
    read = await backend.inboxes.read(log.made, backend.sessions.epoch, 0, 10)
    assert (read.gap, read.frames) == (False, [])
