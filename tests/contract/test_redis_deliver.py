"""A fan-out batch's effects on one Redis server (``RedisBackend.deliver``): who hears of a frame, and how."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from broker.backends.base import Frame, SessionRecord, Wake
from broker.backends.redis import RedisBackend
from broker.backends.redis.keys import FANOUT_GROUP
from broker.changes import Change
from broker.config import Settings
from tests.support import RedisProcess


@pytest.fixture
async def workers() -> AsyncIterator[tuple[RedisBackend, RedisBackend, Redis]]:
    """Two workers of one deployment on a redis-server of this test alone, and a raw client of it."""
    with RedisProcess() as server:
        s = Settings(_env_file=None, redis_url=server.url, redis_prefix=f"t{secrets.token_hex(4)}",  # type: ignore[call-arg]
                     redis_socket_timeout=2.0)
        a, b = RedisBackend(s), RedisBackend(s)
        try:
            await a.start()
            await b.start()
            async with Redis.from_url(server.url) as raw:
                yield a, b, raw
        finally:
            await a.close()
            await b.close()


async def watched(backend: RedisBackend) -> tuple[str, asyncio.Queue[Wake]]:
    record = SessionRecord(id=secrets.token_urlsafe(12), tenant="t1", principal="t1/alice",
                           protocol_version="2025-11-25", epoch=backend.sessions.epoch, created_at=time.time())
    await backend.sessions.create(record)
    wakes: asyncio.Queue[Wake] = asyncio.Queue()
    await backend.inboxes.watch(record.id, wakes.put_nowait)
    return record.id, wakes


async def test_a_stream_of_the_fanning_out_worker_gets_its_frame_in_memory_and_another_workers_by_its_channel(
        workers: tuple[RedisBackend, RedisBackend, Redis]) -> None:
    a, b, raw = workers
    here, here_wakes = await watched(a)
    there, there_wakes = await watched(b)
    channels = [a.keys.node_wake(a.watchers.node), b.keys.node_wake(b.watchers.node)]
    listener = raw.pubsub()
    for channel in channels:
        await listener.execute_command("SSUBSCRIBE", channel)
    for _ in channels:  # both confirmed before anything is published
        assert (await listener.parse_response(block=True, timeout=5))[0] == b"ssubscribe"

    mine, theirs = Frame("u:x:a", b"for-a", change="0:1-0"), Frame("u:x:b", b"for-b", change="0:1-0")
    assert await a.deliver([(here, mine), (there, theirs)], [("0:1-0", Change("t1", "x:a"))], []) == []

    # In memory: the wake-up was handed over before deliver returned, frame and offset with it.
    got = here_wakes.get_nowait()
    assert (got.kind, got.offset, got.frame) == ("frames", 1, mine)
    got = await asyncio.wait_for(there_wakes.get(), 5)
    assert (got.kind, got.offset, got.frame) == ("frames", 1, theirs)
    # Redis carried one node wake-up: to b. A marker published on a's channel afterwards is the
    # first message there, so nothing went to a's channel before it.
    await raw.execute_command("SPUBLISH", channels[0], b"marker")
    seen: list[tuple[bytes, bytes]] = []
    while not seen or seen[-1] != (channels[0].encode(), b"marker"):
        message = await listener.parse_response(block=True, timeout=5)
        seen.append((message[1], message[2]))
    assert [channel for channel, _ in seen] == [channels[1].encode(), channels[0].encode()]
    await listener.aclose()


async def test_a_redone_batch_adds_nothing_and_its_stream_rereads_rather_than_hears_a_frame_twice(
        workers: tuple[RedisBackend, RedisBackend, Redis]) -> None:
    a, _, _ = workers
    sid, wakes = await watched(a)
    first = Frame("u:x:a", b"1", change="0:5-0")
    await a.deliver([(sid, first)], [], [])
    assert wakes.get_nowait().offset == 1
    await a.deliver([(sid, first)], [], [])  # the same change again: its acknowledgement was lost
    got = wakes.get_nowait()
    assert (got.offset, got.frame) == (1, None) and wakes.empty()  # read the inbox up to 1: nothing new
    newer = Frame("u:x:a", b"2", change="0:6-0")
    await a.deliver([(sid, first), (sid, newer)], [], [])  # a redo that picked up one more change
    got = wakes.get_nowait()
    assert (got.offset, got.frame) == (2, newer) and wakes.empty()
    read = await a.inboxes.read(sid, a.sessions.epoch, 0, 10)
    assert [frame for _, frame in read.frames] == [first, newer]


async def test_a_batch_whose_append_fails_stays_unacknowledged_and_its_redo_wakes_what_the_failure_hid(
        workers: tuple[RedisBackend, RedisBackend, Redis]) -> None:
    a, _, raw = workers
    change_id = await a.changelog.publish(Change("t1", "x:a"))
    assert await a.changelog.read("c1", 10, 0) != []
    partition = int(change_id.partition(":")[0])
    good, wakes = await watched(a)
    bad, _ = await watched(a)
    await raw.set(a.keys.session(bad).inbox, b"not a stream")  # its append fails, after good's ran
    frame = Frame("u:x:a", b"1", change=change_id)
    with pytest.raises(ResponseError):
        await a.deliver([(good, frame), (bad, frame)], [(change_id, Change("t1", "x:a"))], [change_id])
    assert wakes.empty()  # appended but never announced
    assert (await raw.xpending(a.keys.log(partition), FANOUT_GROUP))["pending"] == 1

    await raw.delete(a.keys.session(bad).inbox)
    await a.deliver([(good, frame), (bad, frame)], [(change_id, Change("t1", "x:a"))], [change_id])
    got = wakes.get_nowait()
    assert (got.offset, got.frame) == (1, None)  # the stream reads its inbox and finds the frame
    assert [f for _, f in (await a.inboxes.read(good, a.sessions.epoch, 0, 10)).frames] == [frame]
    assert (await raw.xpending(a.keys.log(partition), FANOUT_GROUP))["pending"] == 0


async def test_a_partly_redone_batch_announces_only_its_new_frames_to_another_workers_stream(
        workers: tuple[RedisBackend, RedisBackend, Redis]) -> None:
    a, b, _ = workers
    sid, wakes = await watched(b)
    repeat = Frame("u:x:r", b"r", change="1:3-0")
    await a.deliver([(sid, repeat)], [], [])
    got = await asyncio.wait_for(wakes.get(), 5)
    assert (got.offset, got.frame) == (1, repeat)
    # Redone with a change of another partition on either side of it: the repeat, in the middle,
    # is skipped, and b's stream hears the two new frames at the offsets they were given.
    before, after = Frame("u:x:b", b"before", change="0:6-0"), Frame("u:x:c", b"after", change="0:7-0")
    await a.deliver([(sid, before), (sid, repeat), (sid, after)], [], [])
    heard = [await asyncio.wait_for(wakes.get(), 5) for _ in range(2)]
    assert [(got.offset, got.frame) for got in heard] == [(2, before), (3, after)]
    last = Frame("u:x:d", b"last", change="0:8-0")
    await a.deliver([(sid, last)], [], [])
    got = await asyncio.wait_for(wakes.get(), 5)
    assert (got.offset, got.frame) == (4, last)  # nothing else was announced in between
    assert [f for _, f in (await b.inboxes.read(sid, b.sessions.epoch, 0, 10)).frames] == [repeat, before, after, last]
