"""What a session's inbox keeps on Redis: its newest frames by count and by age, each frame trimmed
counted, and the session's expiry (``inbox_append.lua``)."""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any

import msgpack
import pytest

from broker.backends.base import Frame, SessionRecord
from broker.backends.redis import RedisBackend
from broker.backends.redis import inboxes as inboxes_module
from broker.config import Settings
from examples.counting_metrics import CountingMetrics
from tests.support import RedisProcess

TRIMMED = "mcp_broker_inbox_trimmed_total"


@pytest.fixture
def server() -> Any:
    with RedisProcess() as process:
        yield process


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """The inboxes' clock, set by the test."""
    now = SimpleNamespace(value=time.time())
    monkeypatch.setattr(inboxes_module, "time", SimpleNamespace(time=lambda: now.value))
    return now


@asynccontextmanager
async def opened(server: Any, metrics: CountingMetrics, **settings: Any) -> AsyncIterator[RedisBackend]:
    s = Settings(_env_file=None, redis_url=server.url, redis_prefix=f"t{secrets.token_hex(4)}", **settings)  # type: ignore[call-arg]
    backend = RedisBackend(s, metrics=metrics)
    await backend.start()
    try:
        yield backend
    finally:
        await backend.close()


async def session(backend: RedisBackend) -> str:
    record = SessionRecord(id=secrets.token_urlsafe(12), tenant="t1", principal="t1/alice",
                           protocol_version="2025-11-25", epoch=backend.sessions.epoch, created_at=time.time())
    await backend.sessions.create(record)
    return record.id


async def stored(backend: RedisBackend, sid: str) -> list[bytes]:
    """The data of the frames the inbox holds."""
    entries = await backend.redis.xrange(backend.keys.session(sid).inbox)
    return [msgpack.unpackb(fields[b"f"])[1] for _, fields in entries]


async def test_frames_past_the_length_bound_are_trimmed_and_each_counted(server: Any) -> None:
    metrics = CountingMetrics()
    async with opened(server, metrics, inbox_maxlen=10) as backend:
        sid = await session(backend)
        for i in range(300):
            await backend.inboxes.append([(sid, Frame("u:x", b"%d" % i))])
        kept = await backend.redis.xlen(backend.keys.session(sid).inbox)
        # Trimmed whole stream nodes at a time (MAXLEN ~), so somewhat more than 10 stay.
        assert 10 <= kept < 300
        assert metrics.get(TRIMMED) == 300 - kept
        read = await backend.inboxes.read(sid, backend.sessions.epoch, 0, 1000)
        assert read.gap and read.head == 300


async def test_frames_older_than_the_retention_go_at_the_next_append_and_each_is_counted(
        server: Any, clock: SimpleNamespace) -> None:
    metrics = CountingMetrics()
    async with opened(server, metrics, inbox_retention=60.0) as backend:
        sid = await session(backend)
        start = clock.value
        for i in range(5):
            await backend.inboxes.append([(sid, Frame("u:x", b"early%d" % i))])
        clock.value = start + 30
        for i in range(3):
            await backend.inboxes.append([(sid, Frame("u:x", b"later%d" % i))])
        assert metrics.get(TRIMMED) == 0
        clock.value = start + 61  # the first five are past the retention now, the next three not yet
        await backend.inboxes.append([(sid, Frame("u:x", b"a"))])
        assert await stored(backend, sid) == [b"later0", b"later1", b"later2", b"a"]
        assert metrics.get(TRIMMED) == 5
        clock.value = start + 91  # now the three are too, and the one appended at 61 is not
        await backend.inboxes.append([(sid, Frame("u:x", b"b"))])
        assert await stored(backend, sid) == [b"a", b"b"]
        assert metrics.get(TRIMMED) == 8
        clock.value = start + 100  # nothing is past the retention: nothing goes
        await backend.inboxes.append([(sid, Frame("u:x", b"c"))])
        assert await stored(backend, sid) == [b"a", b"b", b"c"]
        assert metrics.get(TRIMMED) == 8


async def test_an_inbox_expires_with_its_session_and_a_touch_renews_both(server: Any) -> None:
    async with opened(server, CountingMetrics(), session_ttl=600.0) as backend:
        sid = await session(backend)
        keys = backend.keys.session(sid)
        await backend.inboxes.append([(sid, Frame("u:x", b"1"))])
        await backend.redis.pexpire(keys.meta, 300_000)  # as if the session had idled for 5 minutes
        await backend.redis.pexpire(keys.inbox, 300_000)
        await backend.inboxes.append([(sid, Frame("u:x", b"2"))])
        assert 0 < await backend.redis.pttl(keys.inbox) <= 300_000
        await backend.sessions.touch([sid])
        meta, inbox = await backend.redis.pttl(keys.meta), await backend.redis.pttl(keys.inbox)
        assert 590_000 < inbox <= meta <= 600_000
        await backend.redis.delete(keys.inbox)  # emptied (or evicted): the next append gives it the expiry again
        await backend.inboxes.append([(sid, Frame("u:x", b"3"))])
        assert 590_000 < await backend.redis.pttl(keys.inbox) <= 600_000


async def test_an_inbox_stored_without_t0_is_searched_and_its_aged_frames_go(
        server: Any, clock: SimpleNamespace) -> None:
    """Sessions whose hash has no ``t0`` (an inbox written before it existed) are trimmed by age too."""
    metrics = CountingMetrics()
    async with opened(server, metrics, inbox_retention=60.0) as backend:
        sid = await session(backend)
        start = clock.value
        for i in range(3):
            await backend.inboxes.append([(sid, Frame("u:x", b"old%d" % i))])
        await backend.redis.hdel(backend.keys.session(sid).meta, "t0")
        clock.value = start + 61
        await backend.inboxes.append([(sid, Frame("u:x", b"new"))])
        assert await stored(backend, sid) == [b"new"]
        assert metrics.get(TRIMMED) == 3


async def test_an_append_that_trims_by_length_and_by_age_counts_every_frame_removed(
        server: Any, clock: SimpleNamespace) -> None:
    metrics = CountingMetrics()
    async with opened(server, metrics, inbox_maxlen=10, inbox_retention=60.0) as backend:
        sid = await session(backend)
        start = clock.value
        for i in range(109):
            await backend.inboxes.append([(sid, Frame("u:x", b"%d" % i))])
        assert metrics.get(TRIMMED) == 0  # trimming by length waits for a stream node beyond the bound
        clock.value = start + 61  # all 109 are past the retention, and the next append reaches 110
        await backend.inboxes.append([(sid, Frame("u:x", b"last"))])
        assert await stored(backend, sid) == [b"last"]
        assert metrics.get(TRIMMED) == 109
