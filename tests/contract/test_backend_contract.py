"""The guarantees of ``broker.backends.base`` hold for every backend.

Written against the ``backend`` fixture (and ``make_backend`` for other settings) only, so a
new implementation joins by being added to ``BACKENDS``.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from broker.backends.base import CLOSE_ALL, Backend, Frame, SessionRecord, Wake
from broker.changes import Change, ChangeKind
from broker.config import Settings
from broker.errors import LimitExceeded, WriteConflict
from broker.feeds.model import FeedKind, Filter
from tests.contract.conftest import BACKENDS, make_backend, new_session, open_session

TIMEOUT = 5.0


def frame(n: int) -> Frame:
    return Frame(f"u:x:{n}", b'{"n":%d}' % n)


async def eventually(check: Callable[[], Awaitable[bool]], what: str, timeout: float = TIMEOUT) -> None:
    """Wait for a condition that depends on the clock (expiry, idle time), with a deadline."""
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


@pytest.fixture(params=BACKENDS)
async def short_ttl_backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    """A backend whose sessions expire after a quarter of a second without a touch."""
    settings = Settings(_env_file=None, redis_prefix=f"t{secrets.token_hex(4)}",  # type: ignore[call-arg]
                        inbox_maxlen=50, session_ttl=0.25)
    impl = await make_backend(request.param, settings, request)
    await impl.start()
    yield impl
    await impl.close()


@pytest.fixture(params=BACKENDS)
async def short_lease_backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    """A backend whose fan-out consumers lose the change log a fifth of a second after their last read."""
    settings = Settings(_env_file=None, redis_prefix=f"t{secrets.token_hex(4)}",  # type: ignore[call-arg]
                        fanout_claim_idle_ms=200)
    impl = await make_backend(request.param, settings, request)
    await impl.start()
    yield impl
    await impl.close()


# -- sessions ----------------------------------------------------------------------------------


async def test_a_created_session_reads_back_with_every_field(backend: Backend) -> None:
    record = new_session(backend)
    await backend.sessions.create(record)
    assert await backend.sessions.get(record.id) == record
    assert await backend.sessions.get("no-such-session") is None


async def test_updating_a_session_changes_only_the_named_fields(backend: Backend) -> None:
    record = new_session(backend)
    await backend.sessions.create(record)
    await backend.sessions.update(record.id, initialized=True)
    stored = await backend.sessions.get(record.id)
    assert stored is not None and stored.initialized
    assert stored.principal == record.principal and stored.client_info == record.client_info


async def test_a_session_read_is_a_snapshot_not_a_live_view(backend: Backend) -> None:
    record = new_session(backend)
    await backend.sessions.create(record)
    snapshot = await backend.sessions.get(record.id)
    assert snapshot is not None
    snapshot.initialized = True
    stored = await backend.sessions.get(record.id)
    assert stored is not None and not stored.initialized


async def test_a_feed_keeps_its_kind_filter_and_refilter_position(backend: Backend) -> None:
    record = new_session(backend)
    record.kind, record.filter = FeedKind.LISTEN, Filter.of(["x:b", "x:a"], True)
    await backend.sessions.create(record)
    stored = await backend.sessions.get(record.id)
    assert stored is not None and (stored.kind, stored.filter, stored.since) == (record.kind, record.filter, None)

    await backend.sessions.update(record.id, filter=Filter.of(["x:c"]), since=(stored.epoch, 7))

    stored = await backend.sessions.get(record.id)
    assert stored is not None and (stored.filter, stored.since) == (Filter.of(["x:c"]), (stored.epoch, 7))
    plain = new_session(backend)
    await backend.sessions.create(plain)
    stored = await backend.sessions.get(plain.id)
    assert stored is not None and (stored.kind, stored.filter) == (FeedKind.SESSION, None)


async def test_a_feed_lost_with_the_stores_data_is_restored_as_its_kind(backend: Backend) -> None:
    record = new_session(backend)
    record.kind, record.filter, record.since = FeedKind.LISTEN, Filter.of(["x:a"], True), (record.epoch, 3)
    await backend.sessions.create(record)
    await backend.sessions.delete(record.id)

    assert await backend.sessions.restore(record, {"x:a"}) is True

    stored = await backend.sessions.get(record.id)
    assert stored is not None and (stored.kind, stored.filter, stored.since) == (record.kind, record.filter,
                                                                                 record.since)


async def test_only_feeds_of_kind_session_count_as_sessions(backend: Backend) -> None:
    session = new_session(backend)
    await backend.sessions.create(session)
    for kind in (FeedKind.LISTEN, FeedKind.POLL, FeedKind.WEBHOOK):
        record = new_session(backend)
        record.kind, record.filter = kind, Filter.of(["x:a"])
        await backend.sessions.create(record)
    await backend.sessions.touch([session.id])

    assert (await backend.sessions.count(), await backend.sessions.count_sessions()) == (4, 1)

    await backend.sessions.delete(session.id)
    assert (await backend.sessions.count(), await backend.sessions.count_sessions()) == (3, 0)
    assert await backend.sessions.restore(session, set()) is True
    assert await backend.sessions.count_sessions() == 1


async def test_deleting_a_session_removes_its_subscriptions_index_entries_and_inbox(backend: Backend) -> None:
    sid, other = await open_session(backend), await open_session(backend)
    for session in (sid, other):
        await backend.subscriptions.add(session, "t1", "x:a")
    await backend.inboxes.append([(sid, frame(1))])
    assert await backend.sessions.count() == 2

    assert await backend.sessions.delete(sid) is True

    assert await backend.sessions.get(sid) is None
    assert await backend.subscriptions.of_session(sid) == set()
    assert await backend.subscriptions.subscribers("t1", ["x:a"]) == {"x:a": [other]}
    assert sid not in await backend.subscriptions.tenant_sessions("t1")
    assert await backend.inboxes.append([(sid, frame(2)), (other, frame(2))]) == [sid]
    assert await backend.sessions.count() == 1
    assert await backend.sessions.delete(sid) is False


async def test_sessions_are_listed_by_tenant(backend: Backend) -> None:
    a, b = await open_session(backend, "t1"), await open_session(backend, "t1")
    c = await open_session(backend, "t2")
    assert sorted(await backend.subscriptions.tenant_sessions("t1")) == sorted([a, b])
    assert await backend.subscriptions.tenant_sessions("t2") == [c]
    assert await backend.subscriptions.tenant_sessions("t3") == []


async def test_an_idle_session_expires_with_its_subscriptions_and_inbox(short_ttl_backend: Backend) -> None:
    backend = short_ttl_backend
    sid = await open_session(backend)
    await backend.subscriptions.add(sid, "t1", "x:a")

    async def gone() -> bool:
        # Sweep after seeing the record gone: a sweep just before the record expired leaves it be.
        expired = await backend.sessions.get(sid) is None
        await backend.sessions.expire()
        return expired

    await eventually(gone, "the idle session to expire")
    assert await backend.subscriptions.of_session(sid) == set()
    assert await backend.subscriptions.subscribers("t1", ["x:a"]) == {}
    assert await backend.inboxes.append([(sid, frame(1))]) == [sid]


async def test_touching_a_session_keeps_it_alive_while_an_untouched_one_expires(short_ttl_backend: Backend) -> None:
    backend = short_ttl_backend
    kept, idle = await open_session(backend), await open_session(backend)

    async def idle_gone() -> bool:
        await backend.sessions.touch([kept, "no-such-session"])
        await backend.sessions.expire()
        return await backend.sessions.get(idle) is None

    await eventually(idle_gone, "the untouched session to expire")
    assert await backend.sessions.get(kept) is not None


async def test_reading_a_session_with_touch_keeps_it_alive_for_its_principal_only(
        short_ttl_backend: Backend) -> None:
    backend = short_ttl_backend
    kept, foreign = await open_session(backend), await open_session(backend)

    async def foreign_gone() -> bool:
        assert await backend.sessions.get(kept, touch_as="t1/alice") is not None
        await backend.sessions.get(foreign, touch_as="t1/mallory")  # another principal's read: no touch
        await backend.sessions.expire()
        return await backend.sessions.get(foreign) is None

    await eventually(foreign_gone, "the session touched by another principal to expire")
    assert await backend.sessions.get(kept) is not None


# -- subscriptions -------------------------------------------------------------------------------


async def test_subscribing_updates_the_session_and_the_index_and_is_idempotent(backend: Backend) -> None:
    sid = await open_session(backend)
    assert await backend.subscriptions.add(sid, "t1", "x:a") == 1
    assert await backend.subscriptions.add(sid, "t1", "x:a") == 1
    assert await backend.subscriptions.add(sid, "t1", "x:b") == 2
    assert await backend.subscriptions.of_session(sid) == {"x:a", "x:b"}
    assert await backend.subscriptions.subscribers("t1", ["x:a", "x:b", "x:c"]) == {"x:a": [sid], "x:b": [sid]}


async def test_the_subscription_limit_is_checked_in_the_same_step_as_the_add(backend: Backend) -> None:
    sid = await open_session(backend)
    results = await asyncio.gather(*(backend.subscriptions.add(sid, "t1", f"x:{i}", limit=3) for i in range(8)),
                                   return_exceptions=True)
    assert sum(isinstance(r, LimitExceeded) for r in results) == 5
    assert len(await backend.subscriptions.of_session(sid)) == 3
    kept = sorted(await backend.subscriptions.of_session(sid))
    assert await backend.subscriptions.add(sid, "t1", kept[0], limit=3) == 3
    refused = {f"x:{i}" for i in range(8)} - set(kept)
    assert await backend.subscriptions.subscribers("t1", sorted(refused)) == {}  # a refused add leaves no index entry


async def test_unsubscribing_updates_both_and_is_idempotent(backend: Backend) -> None:
    sid = await open_session(backend)
    await backend.subscriptions.add(sid, "t1", "x:a")
    await backend.subscriptions.add(sid, "t1", "x:b")
    await backend.subscriptions.remove(sid, "t1", "x:a")
    await backend.subscriptions.remove(sid, "t1", "x:a")
    await backend.subscriptions.remove(sid, "t1", "x:never")
    assert await backend.subscriptions.of_session(sid) == {"x:b"}
    assert await backend.subscriptions.subscribers("t1", ["x:a"]) == {}


async def test_the_index_is_per_tenant_and_lists_every_subscriber(backend: Backend) -> None:
    a, b = await open_session(backend, "t1"), await open_session(backend, "t1")
    c = await open_session(backend, "t2")
    for sid, tenant in ((a, "t1"), (b, "t1"), (c, "t2")):
        await backend.subscriptions.add(sid, tenant, "x:a")
    found = await backend.subscriptions.subscribers("t1", ["x:a"])
    assert sorted(found["x:a"]) == sorted([a, b])
    assert await backend.subscriptions.subscribers("t2", ["x:a"]) == {"x:a": [c]}


# -- inboxes -------------------------------------------------------------------------------------


async def test_inbox_offsets_increase_and_reads_return_what_follows_the_cursor(backend: Backend) -> None:
    sid = await open_session(backend)
    empty = await backend.inboxes.read(sid, backend.sessions.epoch, 0, 10)
    assert (empty.frames, empty.gap, empty.head) == ([], False, 0)

    assert await backend.inboxes.append([(sid, frame(n)) for n in range(1, 6)]) == []
    read = await backend.inboxes.read(sid, backend.sessions.epoch, 0, 100)
    offsets = [off for off, _ in read.frames]
    assert offsets == sorted(set(offsets)) and len(offsets) == 5
    assert [f for _, f in read.frames] == [frame(n) for n in range(1, 6)]
    assert not read.gap and read.head == offsets[-1] and read.epoch == backend.sessions.epoch

    after_second = await backend.inboxes.read(sid, backend.sessions.epoch, offsets[1], 100)
    assert after_second.frames == read.frames[2:]
    limited = await backend.inboxes.read(sid, backend.sessions.epoch, offsets[0], 2)
    assert limited.frames == read.frames[1:3]
    at_head = await backend.inboxes.read(sid, backend.sessions.epoch, read.head, 100)
    assert (at_head.frames, at_head.gap) == ([], False)


async def test_inboxes_of_different_sessions_are_independent(backend: Backend) -> None:
    a, b = await open_session(backend), await open_session(backend)
    await backend.inboxes.append([(a, frame(1)), (b, frame(2)), (a, frame(3))])
    assert [f for _, f in (await backend.inboxes.read(a, backend.sessions.epoch, 0, 10)).frames] == [frame(1), frame(3)]
    assert [f for _, f in (await backend.inboxes.read(b, backend.sessions.epoch, 0, 10)).frames] == [frame(2)]


async def test_a_cursor_from_another_epoch_is_a_gap(backend: Backend) -> None:
    sid = await open_session(backend)
    await backend.inboxes.append([(sid, frame(1))])
    read = await backend.inboxes.read(sid, "0ther3poch", 0, 10)
    assert read.gap and read.frames == []
    assert read.epoch == backend.sessions.epoch and read.head >= 1


async def test_a_cursor_beyond_the_newest_frame_is_a_gap(backend: Backend) -> None:
    sid = await open_session(backend)
    await backend.inboxes.append([(sid, frame(1))])
    head = (await backend.inboxes.read(sid, backend.sessions.epoch, 0, 10)).head
    read = await backend.inboxes.read(sid, backend.sessions.epoch, head + 5, 10)
    assert read.gap and read.frames == [] and read.head == head


async def test_a_cursor_older_than_what_is_retained_is_a_gap_and_the_rest_is_kept(backend: Backend) -> None:
    """The fixture keeps 50 frames per inbox."""
    sid = await open_session(backend)
    await backend.inboxes.append([(sid, frame(n)) for n in range(1, 11)])
    first_ten = [off for off, _ in (await backend.inboxes.read(sid, backend.sessions.epoch, 0, 100)).frames]
    await backend.inboxes.append([(sid, frame(n)) for n in range(11, 61)])  # pushes frames 1-10 out

    trimmed = await backend.inboxes.read(sid, backend.sessions.epoch, first_ten[8], 100)  # frame 10 is lost
    assert trimmed.gap and trimmed.frames == []
    assert (await backend.inboxes.read(sid, backend.sessions.epoch, 0, 100)).gap

    kept = await backend.inboxes.read(sid, backend.sessions.epoch, first_ten[9], 100)  # frame 11 onwards is kept
    assert not kept.gap
    assert [f for _, f in kept.frames] == [frame(n) for n in range(11, 61)]
    assert trimmed.head == kept.head == kept.frames[-1][0]

    resumed = await backend.inboxes.read(sid, backend.sessions.epoch, trimmed.head, 100)
    assert (resumed.frames, resumed.gap) == ([], False)


# -- wake-ups ------------------------------------------------------------------------------------


async def next_wake(queue: asyncio.Queue[Wake]) -> Wake:
    return await asyncio.wait_for(queue.get(), TIMEOUT)


async def test_a_watcher_is_woken_with_the_offset_of_each_new_frame(backend: Backend) -> None:
    sid = await open_session(backend)
    wakes: asyncio.Queue[Wake] = asyncio.Queue()
    unwatch = await backend.inboxes.watch(sid, wakes.put_nowait)
    await backend.inboxes.append([(sid, frame(1))])
    wake = await next_wake(wakes)
    head = (await backend.inboxes.read(sid, backend.sessions.epoch, 0, 0)).head
    assert (wake.kind, wake.offset) == ("frames", head)
    assert wake.frame in (None, frame(1))
    await unwatch()


async def test_a_watch_taken_before_reading_never_misses_a_frame(backend: Backend) -> None:
    """The replay -> live handoff: every frame after the watch is in the read or in a wake-up."""
    sid = await open_session(backend)
    await backend.inboxes.append([(sid, frame(n)) for n in range(1, 4)])
    woken: set[int] = set()
    changed = asyncio.Event()

    def on_wake(wake: Wake) -> None:
        if wake.kind == "frames":
            woken.add(wake.offset)
            changed.set()

    unwatch = await backend.inboxes.watch(sid, on_wake)
    await backend.inboxes.append([(sid, frame(4))])  # between the watch and the read
    read = await backend.inboxes.read(sid, backend.sessions.epoch, 0, 100)
    await backend.inboxes.append([(sid, frame(5)), (sid, frame(6))])  # after the read
    head = (await backend.inboxes.read(sid, backend.sessions.epoch, 0, 0)).head
    seen = {off for off, _ in read.frames}
    while max(seen | woken) < head:
        changed.clear()
        await asyncio.wait_for(changed.wait(), TIMEOUT)
    everything = {off for off, _ in (await backend.inboxes.read(sid, backend.sessions.epoch, 0, 100)).frames}
    assert seen | woken == everything
    assert {head - 1, head} <= woken
    await unwatch()


async def test_an_ended_watch_is_no_longer_woken(backend: Backend) -> None:
    sid = await open_session(backend)
    stopped: asyncio.Queue[Wake] = asyncio.Queue()
    still: asyncio.Queue[Wake] = asyncio.Queue()
    unwatch = await backend.inboxes.watch(sid, stopped.put_nowait)
    unwatch_still = await backend.inboxes.watch(sid, still.put_nowait)
    await unwatch()
    await backend.inboxes.append([(sid, frame(1))])
    await next_wake(still)
    assert stopped.empty()
    await unwatch_still()


async def test_claiming_the_stream_tells_the_previous_holder_to_close(backend: Backend) -> None:
    sid = await open_session(backend)
    first = await backend.inboxes.claim_stream(sid)
    assert first.had_stream is False
    wakes: asyncio.Queue[Wake] = asyncio.Queue()
    unwatch = await backend.inboxes.watch(sid, wakes.put_nowait)
    second = await backend.inboxes.claim_stream(sid)
    assert second.had_stream is True and second.generation > first.generation
    wake = await next_wake(wakes)
    assert (wake.kind, wake.generation) == ("takeover", second.generation)
    await unwatch()


async def test_starting_a_stream_loads_claims_and_reads_in_one_step(backend: Backend) -> None:
    sid = await open_session(backend)
    record = await backend.sessions.get(sid)
    assert record is not None
    await backend.subscriptions.add(sid, "t1", "x:a")
    await backend.inboxes.append([(sid, frame(n)) for n in range(1, 4)])
    earlier = await backend.inboxes.claim_stream(sid)
    wakes: asyncio.Queue[Wake] = asyncio.Queue()
    unwatch = await backend.inboxes.watch(sid, wakes.put_nowait)
    start = await backend.inboxes.start_stream(sid, record.epoch, 1, 10)
    assert start.subscriptions == {"x:a"}
    assert start.claim.had_stream and start.claim.generation > earlier.generation
    assert (await next_wake(wakes)).generation == start.claim.generation
    assert (start.read.gap, start.read.head) == (False, 3)
    assert start.read.frames == [(2, frame(2)), (3, frame(3))]
    await unwatch()


async def test_claim_generations_grow_even_after_the_session_is_restored(backend: Backend) -> None:
    sid = await open_session(backend)
    before = await backend.inboxes.claim_stream(sid)
    record = await backend.sessions.get(sid)
    assert record is not None
    await backend.sessions.delete(sid)
    assert await backend.sessions.restore(record, set())
    after = await backend.inboxes.claim_stream(sid)
    assert after.had_stream is False and after.generation > before.generation


async def test_claiming_the_stream_of_a_deleted_session_closes_every_stream(backend: Backend) -> None:
    sid = await open_session(backend)
    wakes: asyncio.Queue[Wake] = asyncio.Queue()
    unwatch = await backend.inboxes.watch(sid, wakes.put_nowait)
    await backend.inboxes.claim_stream(sid)
    await backend.sessions.delete(sid)
    await backend.inboxes.claim_stream(sid)
    await next_wake(wakes)
    assert (await next_wake(wakes)).generation == CLOSE_ALL
    await unwatch()


async def test_subscribing_and_unsubscribing_wake_the_watcher_with_the_uri_in_order(backend: Backend) -> None:
    sid = await open_session(backend)
    wakes: asyncio.Queue[Wake] = asyncio.Queue()
    unwatch = await backend.inboxes.watch(sid, wakes.put_nowait)
    await backend.subscriptions.add(sid, "t1", "x:a")
    await backend.subscriptions.add(sid, "t1", "x:b")
    await backend.subscriptions.remove(sid, "t1", "x:a")
    got = [await next_wake(wakes) for _ in range(3)]
    assert [(w.kind, w.uri) for w in got] == [("subscribe", "x:a"), ("subscribe", "x:b"), ("unsubscribe", "x:a")]
    await unwatch()


async def test_reading_the_inbox_of_a_vanished_session_reports_it_gone_under_the_current_epoch(
        backend: Backend) -> None:
    sid = await open_session(backend)
    await backend.sessions.delete(sid)
    read = await backend.inboxes.read(sid, backend.sessions.epoch, 0, 10)
    assert read.gap and read.gone and read.frames == []
    assert read.epoch == backend.sessions.epoch
    live = await open_session(backend)
    assert not (await backend.inboxes.read(live, backend.sessions.epoch, 0, 10)).gone


async def test_a_lost_session_is_restored_with_its_subscriptions_and_an_empty_inbox(backend: Backend) -> None:
    record = new_session(backend)
    await backend.sessions.create(record)
    for uri in ("x:a", "x:b"):
        await backend.subscriptions.add(record.id, "t1", uri)
    await backend.inboxes.append([(record.id, frame(1)), (record.id, frame(2))])
    await backend.sessions.delete(record.id)  # what a store that lost its data looks like to a stream
    record.epoch = "stale"

    assert await backend.sessions.restore(record, {"x:a", "x:b"}) is True

    assert record.epoch == backend.sessions.epoch
    stored = await backend.sessions.get(record.id)
    assert stored == record
    assert await backend.subscriptions.of_session(record.id) == {"x:a", "x:b"}
    assert await backend.subscriptions.subscribers("t1", ["x:a", "x:b"]) == {"x:a": [record.id], "x:b": [record.id]}
    assert record.id in await backend.subscriptions.tenant_sessions("t1")
    read = await backend.inboxes.read(record.id, record.epoch, 0, 10)
    assert (read.gap, read.head, read.frames) == (False, 0, [])
    assert await backend.inboxes.append([(record.id, frame(3))]) == []
    assert [off for off, _ in (await backend.inboxes.read(record.id, record.epoch, 0, 10)).frames] == [1]


async def test_restoring_a_live_session_changes_nothing(backend: Backend) -> None:
    record = new_session(backend)
    await backend.sessions.create(record)
    await backend.subscriptions.add(record.id, "t1", "x:a")
    await backend.inboxes.append([(record.id, frame(1))])
    impostor = SessionRecord(**{**{f: getattr(record, f) for f in record.__slots__}, "principal": "t1/mallory"})

    assert await backend.sessions.restore(impostor, {"x:b"}) is False

    assert await backend.sessions.get(record.id) == record
    assert await backend.subscriptions.of_session(record.id) == {"x:a"}
    assert await backend.subscriptions.subscribers("t1", ["x:b"]) == {}
    assert (await backend.inboxes.read(record.id, record.epoch, 0, 10)).head == 1


# -- change log ----------------------------------------------------------------------------------


async def test_a_published_change_is_read_back_intact(backend: Backend) -> None:
    change = Change("t1", "x:a", ChangeKind.CREATED, {"etag": "v2"})
    change_id = await backend.changelog.publish(change)
    assert isinstance(change_id, str) and change_id
    assert await backend.changelog.read("c1", 10, 100) == [(change_id, change)]


async def test_the_overview_names_each_partitions_holder_and_what_waits_there(backend: Backend) -> None:
    before = await backend.changelog.overview()
    assert len(before) == backend.changelog.partitions
    assert all(holder is None and entries == 0 for holder, entries, _ in before.values())
    for n in range(3):
        await backend.changelog.publish(Change("t1", f"x:{n}"))
    waiting = await backend.changelog.overview()
    assert sum(entries for _, entries, _ in waiting.values()) == 3
    read = await backend.changelog.read("c1", 100, 100)
    held = await backend.changelog.overview()
    assert {holder for holder, _, _ in held.values()} == {"c1"}  # every partition, this consumer alone
    lag = await backend.changelog.lag("c1")  # the same figures (the ages read a moment apart)
    assert {p: entries for p, (_, entries, _) in held.items() if entries} == {p: n for p, (n, _) in lag.items() if n}
    await backend.changelog.ack([cid for cid, _ in read])
    assert sum(entries for _, entries, _ in (await backend.changelog.overview()).values()) == 0
    await backend.changelog.release("c1")
    assert all(holder is None for holder, _, _ in (await backend.changelog.overview()).values())


async def test_one_consumer_reads_the_log_at_a_time_so_changes_keep_their_order(backend: Backend) -> None:
    changes = [Change("t1", f"x:{n % 2}", meta={"n": n}) for n in range(10)]
    ids = [await backend.changelog.publish(change) for change in changes]
    first = await backend.changelog.read("c1", 4, 100)
    # c1 holds the log for fanout_claim_idle_ms (5 s here) after each read: c2 reading now
    # would fan out changes 5..10 beside c1's 1..4, and a URI's frames could cross.
    assert await backend.changelog.read("c2", 100, 50) == []
    await backend.changelog.ack([cid for cid, _ in first])
    second = await backend.changelog.read("c1", 100, 100)
    # Each URI's changes in the order they were published (the order the log keeps is per URI).
    for uri in ("x:0", "x:1"):
        assert [pair for pair in first + second if pair[1].uri == uri] == [
            pair for pair in zip(ids, changes, strict=True) if pair[1].uri == uri]
    await backend.changelog.ack([cid for cid, _ in second])
    assert await backend.changelog.read("c1", 100, 50) == []


async def test_what_a_consumer_did_not_acknowledge_is_handed_out_again_before_anything_newer(
        backend: Backend) -> None:
    changes = [Change("t1", "x:a", meta={"n": n}) for n in range(5)]  # one URI: one order
    ids = [await backend.changelog.publish(change) for change in changes]
    first = await backend.changelog.read("c1", 3, 100)
    await backend.changelog.ack([first[0][0]])  # the batch failed after its first change
    again = await backend.changelog.read("c1", 100, 100)
    assert again == list(zip(ids[1:3], changes[1:3], strict=True))
    await backend.changelog.ack([cid for cid, _ in again])
    assert await backend.changelog.read("c1", 100, 100) == list(zip(ids[3:], changes[3:], strict=True))


async def test_a_consumer_that_takes_over_first_finishes_what_the_last_one_left(
        short_lease_backend: Backend) -> None:
    backend = short_lease_backend
    changes = [Change("t1", "x:a", meta={"n": n}) for n in range(6)]  # one URI: one order
    ids = [await backend.changelog.publish(change) for change in changes]
    taken = await backend.changelog.read("dead", 2, 100)
    assert [cid for cid, _ in taken] == ids[:2]
    await backend.changelog.ack([ids[0]])  # it finished one of its two, then died
    read: list[tuple[str, Change]] = []

    async def taken_over() -> bool:
        batch = await backend.changelog.read("alive", 100, 50)
        await backend.changelog.ack([cid for cid, _ in batch])
        read.extend(batch)
        return len(read) >= 5

    await eventually(taken_over, "the lease of the dead consumer to lapse")
    assert read == list(zip(ids[1:], changes[1:], strict=True))


async def test_a_consumer_that_stops_hands_the_log_over_at_once(backend: Backend) -> None:
    changes = [Change("t1", "x:a", meta={"n": n}) for n in range(4)]  # one URI: one order
    ids = [await backend.changelog.publish(change) for change in changes]
    taken = await backend.changelog.read("stopping", 2, 100)
    await backend.changelog.ack([taken[0][0]])  # it was cancelled halfway through its batch
    assert await backend.changelog.read("next", 100, 50) == []
    await backend.changelog.release("stopping")
    await backend.changelog.release("someone-else")  # releasing what one does not hold changes nothing
    # Without waiting out the lease (5 s here): the unfinished change first, then the rest.
    read: list[tuple[str, Change]] = []
    for _ in range(2):
        batch = await backend.changelog.read("next", 100, 100)
        await backend.changelog.ack([cid for cid, _ in batch])
        read += batch
    assert read == list(zip(ids[1:], changes[1:], strict=True))


async def test_changes_published_together_are_read_in_the_order_given_per_uri(backend: Backend) -> None:
    changes = [Change(f"t{n % 3}", "x:a", meta={"n": n}) for n in range(30)]
    ids = await backend.changelog.publish_many(changes)
    assert len(set(ids)) == 30
    read = await backend.changelog.read("c1", 100, 100)
    assert sorted(read, key=lambda item: ids.index(item[0])) == list(zip(ids, changes, strict=True))
    for tenant in ("t0", "t1", "t2"):
        assert [c for _, c in read if c.tenant == tenant] == [c for c in changes if c.tenant == tenant]


async def test_a_blocked_read_returns_as_soon_as_a_change_is_published(backend: Backend) -> None:
    reader = asyncio.create_task(backend.changelog.read("c1", 10, 10_000))
    await asyncio.sleep(0)  # let the read block before publishing
    change_id = await backend.changelog.publish(Change("t1", "x:a"))
    assert await asyncio.wait_for(reader, TIMEOUT) == [(change_id, Change("t1", "x:a"))]


async def test_an_unacknowledged_change_goes_to_another_consumer_once_the_holder_lapses(
        short_lease_backend: Backend) -> None:
    backend = short_lease_backend
    change_id = await backend.changelog.publish(Change("t1", "x:a"))
    taken = await backend.changelog.read("dead", 10, 100)
    assert [cid for cid, _ in taken] == [change_id]
    claimed: list[tuple[str, Change]] = []

    async def taken_over() -> bool:
        claimed.extend(await backend.changelog.read("alive", 10, 20))
        return bool(claimed)

    await eventually(taken_over, "the dead holder's pending change to reach another consumer")
    assert claimed == [(change_id, Change("t1", "x:a"))]
    await backend.changelog.ack([change_id])
    assert await backend.changelog.read("alive", 10, 20) == []


async def test_an_acknowledged_change_is_never_handed_out_again(backend: Backend) -> None:
    await backend.changelog.publish(Change("t1", "x:a"))
    taken = await backend.changelog.read("c1", 10, 100)
    await backend.changelog.ack([cid for cid, _ in taken])
    await backend.changelog.release("c1")
    assert await backend.changelog.read("c2", 10, 20) == []


# -- broadcast -----------------------------------------------------------------------------------


async def test_broadcast_changes_reach_every_handler_until_it_is_removed(backend: Backend) -> None:
    first: asyncio.Queue[Change] = asyncio.Queue()
    second: asyncio.Queue[Change] = asyncio.Queue()
    remove_first = await backend.broadcast.subscribe(first.put_nowait)
    remove_second = await backend.broadcast.subscribe(second.put_nowait)
    changes = [Change("t1", "x:a"), Change("t2", "x:b", ChangeKind.DELETED)]
    await backend.broadcast.publish([("0:1-0", changes[0]), ("0:2-0", changes[1])])
    for queue in (first, second):
        assert [await asyncio.wait_for(queue.get(), TIMEOUT) for _ in changes] == changes

    await remove_first()
    await backend.broadcast.publish([("0:3-0", Change("t1", "x:c"))])
    assert await asyncio.wait_for(second.get(), TIMEOUT) == Change("t1", "x:c")
    assert first.empty()
    await remove_second()


async def test_a_handler_that_fails_on_one_change_costs_no_other_change_or_handler(backend: Backend) -> None:
    seen: asyncio.Queue[Change] = asyncio.Queue()
    failing_saw: list[str] = []

    def failing(change: Change) -> None:
        failing_saw.append(change.uri)
        if change.uri == "x:bad":
            raise TypeError("cannot encode")

    remove_failing = await backend.broadcast.subscribe(failing)
    remove_seen = await backend.broadcast.subscribe(seen.put_nowait)
    await backend.broadcast.publish([("0:1-0", Change("t", "x:bad")), ("0:2-0", Change("t", "x:good"))])
    assert [(await asyncio.wait_for(seen.get(), TIMEOUT)).uri for _ in range(2)] == ["x:bad", "x:good"]
    assert failing_saw == ["x:bad", "x:good"]
    await remove_failing()
    await remove_seen()


async def test_a_redone_broadcast_reaches_the_handlers_once(backend: Backend) -> None:
    # Fan-out redoes a batch whose broadcast went out (its acknowledgement was lost), and a
    # lapsed holder's batch may arrive after its successor's: neither reaches a listen again.
    seen: asyncio.Queue[Change] = asyncio.Queue()
    remove = await backend.broadcast.subscribe(seen.put_nowait)
    first = [("0:10-0", Change("t", "x:a")), ("0:10-1", Change("t", "x:b"))]
    await backend.broadcast.publish(first)
    await backend.broadcast.publish([*first, ("0:11-0", Change("t", "x:c"))])  # the redo, with one new change
    await backend.broadcast.publish([("0:9-0", Change("t", "x:old")), ("1:5-0", Change("t", "x:other-partition"))])
    await backend.broadcast.publish([("", Change("t", "x:no-id"))])  # an id of another form always passes
    expected = ["x:a", "x:b", "x:c", "x:other-partition", "x:no-id"]
    assert [(await asyncio.wait_for(seen.get(), TIMEOUT)).uri for _ in expected] == expected
    await backend.broadcast.publish([("0:12-0", Change("t", "x:last"))])
    assert (await asyncio.wait_for(seen.get(), TIMEOUT)).uri == "x:last"  # nothing else came between
    await remove()


# -- leases --------------------------------------------------------------------------------------


async def test_a_lease_is_held_by_one_owner_until_it_is_released(backend: Backend) -> None:
    name = f"lease-{secrets.token_hex(4)}"
    assert await backend.leases.hold(name, "a", 60_000) is True
    assert await backend.leases.hold(name, "a", 60_000) is True  # its holder renews it
    assert await backend.leases.hold(name, "b", 60_000) is False
    assert await backend.leases.hold(f"{name}-other", "b", 60_000) is True  # each name is its own lease
    await backend.leases.release(name, "b")  # releasing what one does not hold changes nothing
    assert await backend.leases.hold(name, "b", 60_000) is False
    await backend.leases.release(name, "a")
    assert await backend.leases.hold(name, "b", 60_000) is True  # without waiting out the ttl
    assert await backend.leases.hold(name, "a", 60_000) is False


async def test_a_leases_holder_can_be_asked_for(backend: Backend) -> None:
    name = f"lease-{secrets.token_hex(4)}"
    assert await backend.leases.holder(name) is None
    assert await backend.leases.hold(name, "a", 60_000) is True
    assert await backend.leases.holder(name) == "a"
    await backend.leases.release(name, "a")
    assert await backend.leases.holder(name) is None


async def test_a_lease_its_owner_stops_renewing_lapses_after_its_ttl(backend: Backend) -> None:
    name = f"lease-{secrets.token_hex(4)}"
    assert await backend.leases.hold(name, "a", 200) is True
    assert await backend.leases.hold(name, "b", 200) is False

    async def lapsed() -> bool:
        return await backend.leases.hold(name, "b", 60_000)

    await eventually(lapsed, "the unrenewed lease to lapse")
    assert await backend.leases.hold(name, "a", 60_000) is False  # the old owner lost it to the next


async def test_a_renewed_lease_lasts_its_ttl_from_the_renewal(backend: Backend) -> None:
    name = f"lease-{secrets.token_hex(4)}"
    assert await backend.leases.hold(name, "a", 60_000) is True
    assert await backend.leases.hold(name, "a", 200) is True  # a renewal sets the ttl anew, a shorter one too

    async def lapsed() -> bool:
        return await backend.leases.hold(name, "b", 60_000)

    await eventually(lapsed, "the renewed lease's shorter ttl to pass")


# -- records -------------------------------------------------------------------------------------


async def test_writing_a_record_stores_it_and_publishes_its_change(backend: Backend) -> None:
    updated = Change("t1", "mcpb://t1/P/1", ChangeKind.UPDATED, {"v": 1})
    assert await backend.records.write("t1", "P", "1", b'{"v":1}', updated) is True
    assert await backend.records.write("t1", "P", "1", b'{"v":2}', updated) is False
    assert await backend.records.read("t1", "P", "1") == b'{"v":2}'
    assert await backend.records.read("t2", "P", "1") is None
    # The store knows which write created the record, so it publishes that one as "created".
    created = Change("t1", "mcpb://t1/P/1", ChangeKind.CREATED, {"v": 1})
    assert [change for _, change in await backend.changelog.read("c1", 10, 100)] == [created, updated]


async def test_a_conditional_write_happens_only_over_the_expected_value(backend: Backend) -> None:
    change = Change("t1", "mcpb://t1/P/1")
    with pytest.raises(WriteConflict):
        await backend.records.write("t1", "P", "1", b"1", change, expect=b"0")  # nothing to compare with
    await backend.records.write("t1", "P", "1", b"1", change)
    with pytest.raises(WriteConflict):
        await backend.records.write("t1", "P", "1", b"2", change, expect=b"0")
    assert await backend.records.write("t1", "P", "1", b"2", change, expect=b"1") is False
    assert await backend.records.read("t1", "P", "1") == b"2"
    assert len(await backend.changelog.read("c1", 10, 100)) == 2  # refused writes publish nothing


async def test_deleting_a_record_publishes_only_when_it_existed(backend: Backend) -> None:
    await backend.records.write("t1", "P", "1", b"{}", Change("t1", "mcpb://t1/P/1", ChangeKind.CREATED))
    deleted = Change("t1", "mcpb://t1/P/1", ChangeKind.DELETED)
    assert await backend.records.delete("t1", "P", "1", deleted) is True
    assert await backend.records.delete("t1", "P", "1", deleted) is False
    assert await backend.records.read("t1", "P", "1") is None
    assert [change.kind for _, change in await backend.changelog.read("c1", 10, 100)] == [
        ChangeKind.CREATED, ChangeKind.DELETED]


async def test_records_list_in_order_and_page_after_an_id(backend: Backend) -> None:
    for rid in ["b", "a", "d", "c"]:
        await backend.records.write("t1", "P", rid, b"{}", Change("t1", f"mcpb://t1/P/{rid}"))
    await backend.records.write("t1", "Q", "z", b"{}", Change("t1", "mcpb://t1/Q/z"))
    await backend.records.write("t2", "R", "y", b"{}", Change("t2", "mcpb://t2/R/y"))
    assert await backend.records.ids("t1", "P", "", 100) == ["a", "b", "c", "d"]
    assert await backend.records.ids("t1", "P", "a", 2) == ["b", "c"]
    assert await backend.records.ids("t1", "P", "d", 10) == []
    assert await backend.records.ids("t1", "none", "", 10) == []
    assert await backend.records.collections("t1") == ["P", "Q"]
    assert await backend.records.collections("t2") == ["R"]


async def test_a_collection_whose_last_record_is_deleted_is_no_longer_listed(backend: Backend) -> None:
    await backend.records.write("t1", "P", "1", b"{}", Change("t1", "mcpb://t1/P/1"))
    await backend.records.delete("t1", "P", "1", Change("t1", "mcpb://t1/P/1", ChangeKind.DELETED))
    assert await backend.records.collections("t1") == []
    assert await backend.records.ids("t1", "P", "", 10) == []
