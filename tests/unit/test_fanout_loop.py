"""The fan-out loop: it ends when cancelled, and a batch that failed goes before anything newer."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import pytest

from broker.backends.base import ChangeLog, Frame, Inboxes, SessionRecord
from broker.backends.memory import MemoryBackend
from broker.changes import Change
from broker.config import Settings
from broker.errors import BackendUnavailable
from broker.fanout import Fanout


def settings() -> Settings:
    return Settings(_env_file=None)  # type: ignore[call-arg]


class Wrapped:
    """A store of the memory backend with some of its methods replaced: the rest go to the real one."""

    def __init__(self, real: object) -> None:
        self.real = real

    def __getattr__(self, name: str) -> object:
        return getattr(self.real, name)


class CancelBecomesTimeout(Wrapped):
    """A change-log read that turns its cancellation into an outage, as a Redis client's own timeout can."""

    def __init__(self, real: ChangeLog) -> None:
        super().__init__(real)
        self.reading = asyncio.Event()

    async def read(self, consumer: str, count: int, block_ms: int) -> list[tuple[str, Change]]:
        self.reading.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            raise BackendUnavailable("timeout reading from redis") from None
        return []


async def test_a_cancelled_fanout_ends_even_when_the_cancellation_surfaces_as_an_outage() -> None:
    backend = MemoryBackend(settings())
    backend.changelog = changelog = CancelBecomesTimeout(backend.changelog)  # type: ignore[assignment]
    task = asyncio.create_task(Fanout(settings(), backend).run())
    await asyncio.wait_for(changelog.reading.wait(), 5)
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=5)
    assert task in done and task.cancelled()


class FailsOnce(Wrapped):
    """Appending to inboxes fails once, as Redis going away for a moment does."""

    def __init__(self, real: Inboxes) -> None:
        super().__init__(real)
        self.inboxes = real
        self.failed = False
        self.appended: list[bytes] = []
        self.all_in = asyncio.Event()

    async def append(self, batch: Sequence[tuple[str, Frame]]) -> list[str]:
        if not self.failed:
            self.failed = True
            raise BackendUnavailable("redis went away")
        self.appended += [frame.data for _, frame in batch]
        if len(self.appended) >= 3:
            self.all_in.set()
        return await self.inboxes.append(batch)


async def test_a_batch_that_failed_is_fanned_out_again_before_anything_newer() -> None:
    s = settings().model_copy(update={"fanout_batch": 1})
    backend = MemoryBackend(s)
    backend.inboxes = inboxes = FailsOnce(backend.inboxes)  # type: ignore[assignment]
    await backend.start()
    record = SessionRecord(id="s1", tenant="t", principal="t/anon", protocol_version="2025-11-25",
                           epoch=backend.sessions.epoch, created_at=time.time())
    await backend.sessions.create(record)
    await backend.subscriptions.add(record.id, "t", "x:a")
    for n in range(3):
        await backend.changelog.publish(Change("t", "x:a", meta={"n": n}))
    task = asyncio.create_task(Fanout(s, backend).run())
    try:
        await asyncio.wait_for(inboxes.all_in.wait(), 5)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert [n for data in inboxes.appended for n in range(3) if f'"n":{n}'.encode() in data] == [0, 1, 2]
    await backend.close()


class AppendsSlowly(MemoryBackend):
    """An append that takes until ``go`` is set: a stop can arrive while it is under way."""

    def __init__(self, s: Settings) -> None:
        super().__init__(s)
        self.appending = asyncio.Event()
        self.go = asyncio.Event()
        self.broadcasts = 0
        inboxes, broadcast, outer = self.inboxes, self.broadcast, self

        class SlowInboxes(Wrapped):
            async def append(self, batch: Sequence[tuple[str, Frame]]) -> list[str]:
                outer.appending.set()
                await outer.go.wait()
                return await inboxes.append(batch)

        class CountedBroadcast(Wrapped):
            async def publish(self, changes: Sequence[tuple[str, Change]]) -> None:
                outer.broadcasts += 1
                await broadcast.publish(changes)

        self.inboxes = SlowInboxes(inboxes)  # type: ignore[assignment]
        self.broadcast = CountedBroadcast(broadcast)  # type: ignore[assignment]


async def started_mid_append(backend: AppendsSlowly, s: Settings) -> asyncio.Task[None]:
    await backend.start()
    record = SessionRecord(id="s1", tenant="t", principal="t/anon", protocol_version="2025-11-25",
                           epoch=backend.sessions.epoch, created_at=time.time())
    await backend.sessions.create(record)
    await backend.subscriptions.add(record.id, "t", "x:a")
    await backend.changelog.publish(Change("t", "x:a"))
    task = asyncio.create_task(Fanout(s, backend).run())
    await asyncio.wait_for(backend.appending.wait(), 5)
    return task


async def test_a_stopping_fanout_finishes_the_batch_in_hand_before_it_gives_up_its_lease() -> None:
    """Cut short after its append, the batch would be redone by the next holder: listens would hear it twice."""
    s = settings()
    backend = AppendsSlowly(s)
    task = await started_mid_append(backend, s)
    task.cancel()  # the worker is stopping (SIGTERM)
    task.cancel()  # and a shutdown cancels again while it waits
    backend.go.set()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)
    assert len((await backend.inboxes.read("s1", backend.sessions.epoch, 0, 10)).frames) == 1
    assert backend.broadcasts == 1
    assert await backend.changelog.read("next-holder", 10, 0) == []  # acknowledged: nothing to redo
    await backend.close()


async def test_a_batch_that_cannot_finish_holds_a_stop_up_no_longer_than_the_stop_timeout() -> None:
    s = settings().model_copy(update={"fanout_stop_timeout": 0.1})
    backend = AppendsSlowly(s)
    task = await started_mid_append(backend, s)  # and the append never ends
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=5)
    assert task in done and task.cancelled()
    assert [change.uri for _, change in await backend.changelog.read("next-holder", 10, 0)] == ["x:a"]  # redone there
    await backend.close()
