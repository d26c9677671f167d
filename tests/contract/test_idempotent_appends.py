"""Inbox appends are idempotent per change: a redone fan-out batch adds nothing twice (every backend)."""

from __future__ import annotations

import asyncio

from broker.backends.base import Backend, Frame, Wake
from broker.changes import Change
from tests.contract.conftest import open_session

TIMEOUT = 5.0


def update(uri: str, change: str = "") -> Frame:
    return Frame("u:" + uri, b'{"uri":"%s"}' % uri.encode(), change)


async def inbox(backend: Backend, sid: str) -> list[tuple[int, Frame]]:
    return (await backend.inboxes.read(sid, backend.sessions.epoch, 0, 100)).frames


async def test_appending_the_frames_of_a_change_twice_leaves_them_once(backend: Backend) -> None:
    sid = await open_session(backend)
    first, second = await backend.changelog.publish_many([Change("t1", "x:a"), Change("t1", "x:b")])
    # A record's change notifies the record and its collection: one change, two frames, both land.
    batch = [(sid, update("x:a", first)), (sid, update("x:coll", first)), (sid, update("x:b", second))]
    assert await backend.inboxes.append(batch) == []
    assert await backend.inboxes.append(batch) == []  # the batch was redone: its ack was lost
    assert [(off, f.key) for off, f in await inbox(backend, sid)] == [(1, "u:x:a"), (2, "u:x:coll"), (3, "u:x:b")]


async def test_a_frame_of_an_older_change_after_a_newer_one_is_skipped(backend: Backend) -> None:
    sid = await open_session(backend)
    older, newer, newest = await backend.changelog.publish_many([Change("t1", "x:a") for _ in range(3)])
    await backend.inboxes.append([(sid, update("x:newer", newer))])
    await backend.inboxes.append([(sid, update("x:older", older))])  # a lapsed holder's late frame
    await backend.inboxes.append([(sid, update("x:newest", newest))])
    # A skipped frame takes no offset.
    assert [(off, f.key) for off, f in await inbox(backend, sid)] == [(1, "u:x:newer"), (2, "u:x:newest")]


async def test_change_ids_compare_as_numbers_per_partition(backend: Backend) -> None:
    """Stream ids are ``<ms>-<seq>``: 9 comes before 10, and a seq beyond a double's precision still counts."""
    sid = await open_session(backend)
    big = 2**53
    for change in ("0:9-0", "0:10-0", "0:9-5", f"0:10-{big + 1}", f"0:10-{big}", f"0:10-{big + 2}",
                   "1:3-0", "1:2-0"):  # partition 1 has its own order
        await backend.inboxes.append([(sid, update(change, change))])
    assert [f.key for _, f in await inbox(backend, sid)] == [
        "u:0:9-0", "u:0:10-0", f"u:0:10-{big + 1}", f"u:0:10-{big + 2}", "u:1:3-0"]


async def test_frames_no_change_is_behind_are_always_appended(backend: Backend) -> None:
    sid = await open_session(backend)
    await backend.inboxes.append([(sid, update("x:a", "0:5-0"))])
    await backend.inboxes.append([(sid, update("x:a")), (sid, update("x:a"))])
    assert len(await inbox(backend, sid)) == 3


async def test_only_what_was_appended_wakes_the_watcher_at_its_own_offset(backend: Backend) -> None:
    sid = await open_session(backend)
    wakes: asyncio.Queue[Wake] = asyncio.Queue()
    unwatch = await backend.inboxes.watch(sid, wakes.put_nowait)
    try:
        await backend.inboxes.append([(sid, update("x:a", "0:2-0"))])
        # a redo of 0:2 with the next batch's 0:3 behind it: only 0:3 is new
        await backend.inboxes.append([(sid, update("x:a", "0:2-0")), (sid, update("x:b", "0:3-0"))])
        seen = [await asyncio.wait_for(wakes.get(), TIMEOUT) for _ in range(2)]
        assert [w.offset for w in seen] == [1, 2]
        assert seen[1].frame is None or seen[1].frame.key == "u:x:b"
        await backend.inboxes.append([(sid, update("x:c", "0:4-0"))])
        assert (await asyncio.wait_for(wakes.get(), TIMEOUT)).offset == 3  # nothing else was announced
    finally:
        await unwatch()
    assert [f.key for _, f in await inbox(backend, sid)] == ["u:x:a", "u:x:b", "u:x:c"]
