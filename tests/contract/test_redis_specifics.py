"""What only the Redis backend has to prove: data loss, outages, key layout, Cluster-safe scripts."""

from __future__ import annotations

import asyncio
import re
import secrets
import time
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis
from redis.crc import key_slot

from broker.backends.base import Frame, SessionRecord, Wake
from broker.backends.redis import RedisBackend
from broker.backends.redis.keys import Keys
from broker.backends.redis.scripts import NAMES, source
from broker.changes import Change
from broker.config import Settings
from broker.errors import BackendUnavailable
from tests.contract.conftest import fakeredis_factory
from tests.support import RedisProcess


def settings_for(url: str = "", **overrides: object) -> Settings:
    return Settings(_env_file=None, redis_url=url, redis_prefix=f"t{secrets.token_hex(4)}",  # type: ignore[call-arg]
                    redis_socket_timeout=1.0, redis_connect_timeout=0.5, **overrides)


def record(backend: RedisBackend, tenant: str = "t1") -> SessionRecord:
    return SessionRecord(id=secrets.token_urlsafe(16), tenant=tenant, principal=f"{tenant}/alice",
                         protocol_version="2025-11-25", epoch=backend.sessions.epoch, created_at=time.time())


@pytest.fixture
async def private_redis() -> AsyncIterator[RedisProcess]:
    """A redis-server of this test alone, so it may be flushed, stopped and restarted."""
    with RedisProcess() as server:
        yield server


@pytest.fixture
async def backend(private_redis: RedisProcess) -> AsyncIterator[RedisBackend]:
    impl = RedisBackend(settings_for(private_redis.url))
    await impl.start()
    yield impl
    await impl.close()


async def test_a_redis_that_lost_its_data_gets_a_new_epoch_and_old_cursors_are_gaps(
        backend: RedisBackend, private_redis: RedisProcess) -> None:
    session = record(backend)
    await backend.sessions.create(session)
    await backend.inboxes.append([(session.id, Frame("u:x", b"1"))])
    old = backend.sessions.epoch
    async with Redis.from_url(private_redis.url) as raw:
        await raw.flushall()

    read = await backend.inboxes.read(session.id, old, 1, 10)

    assert read.gap and read.frames == []
    assert read.epoch == backend.sessions.epoch != old
    fresh = record(backend)
    await backend.sessions.create(fresh)
    assert (await backend.sessions.get(fresh.id)) == fresh and fresh.epoch == backend.sessions.epoch


async def test_a_session_lost_with_the_data_is_gone_under_a_new_epoch_and_can_be_restored(
        backend: RedisBackend, private_redis: RedisProcess) -> None:
    session = record(backend)
    await backend.sessions.create(session)
    await backend.subscriptions.add(session.id, "t1", "x:a")
    old = backend.sessions.epoch
    async with Redis.from_url(private_redis.url) as raw:
        await raw.flushall()

    read = await backend.inboxes.read(session.id, old, 0, 10)
    assert read.gone and read.epoch != old

    assert await backend.sessions.restore(session, {"x:a"}) is True
    assert session.epoch == read.epoch == backend.sessions.epoch
    assert await backend.sessions.get(session.id) == session
    assert await backend.subscriptions.subscribers("t1", ["x:a"]) == {"x:a": [session.id]}
    assert await backend.sessions.count() == 1


async def test_a_new_session_notices_the_lost_epoch_itself(backend: RedisBackend, private_redis: RedisProcess) -> None:
    old = backend.sessions.epoch
    async with Redis.from_url(private_redis.url) as raw:
        await raw.flushall()
    session = record(backend)  # still stamped with the old epoch
    await backend.sessions.create(session)
    stored = await backend.sessions.get(session.id)
    assert stored is not None and stored.epoch == session.epoch == backend.sessions.epoch != old


async def test_a_stopped_server_raises_backend_unavailable_quickly_and_service_returns(
        backend: RedisBackend, private_redis: RedisProcess) -> None:
    session = record(backend)
    await backend.sessions.create(session)
    private_redis.stop()

    started = time.monotonic()
    for call in (backend.sessions.get(session.id), backend.changelog.publish(Change("t1", "x:a")), backend.ping(),
                 backend.inboxes.append([(session.id, Frame("u:x", b"1"))])):
        with pytest.raises(BackendUnavailable):
            await call
    assert time.monotonic() - started < 10

    private_redis.start()
    await backend.ping()  # an empty server: a new epoch, and the session is gone
    assert await backend.sessions.get(session.id) is None


async def test_watchers_are_woken_to_reread_after_the_pubsub_connection_drops(
        backend: RedisBackend, private_redis: RedisProcess) -> None:
    session = record(backend)
    await backend.sessions.create(session)
    wakes: asyncio.Queue[Wake] = asyncio.Queue()
    unwatch = await backend.inboxes.watch(session.id, wakes.put_nowait)
    async with Redis.from_url(private_redis.url) as raw:
        await raw.execute_command("CLIENT", "KILL", "TYPE", "pubsub")

    resync = await asyncio.wait_for(wakes.get(), 10)
    assert (resync.kind, resync.frame) == ("frames", None)
    await backend.inboxes.append([(session.id, Frame("u:x", b"1"))])  # the channel is subscribed again
    live = await asyncio.wait_for(wakes.get(), 10)
    assert (live.offset, live.frame) == (1, Frame("u:x", b"1"))
    await unwatch()


async def test_watchers_are_woken_to_reread_when_the_pubsub_connection_drops_between_two_reads(
        backend: RedisBackend) -> None:
    # A connection dropped while the reader is not waiting on it (Sentinel's failover check drops
    # the connection to the old master whenever it finds a new one) was reconnected by redis-py
    # on the next read, its channels resubscribed, without a word: streams never re-read what
    # was published meanwhile.
    session = record(backend)
    await backend.sessions.create(session)
    wakes: asyncio.Queue[Wake] = asyncio.Queue()
    bus = backend.bus

    def drop_on_first_frame(wake: Wake) -> None:
        wakes.put_nowait(wake)
        if wake.frame is not None and wake.offset == 1:
            bus._pubsub.connection._close()  # the reader is handling this message: between reads

    unwatch = await backend.inboxes.watch(session.id, drop_on_first_frame)
    await backend.inboxes.append([(session.id, Frame("u:x", b"1"))])
    first = await asyncio.wait_for(wakes.get(), 10)
    assert (first.offset, first.frame) == (1, Frame("u:x", b"1"))
    resync = await asyncio.wait_for(wakes.get(), 10)
    assert (resync.kind, resync.frame) == ("frames", None)
    await unwatch()


async def test_every_key_carries_the_prefix() -> None:
    settings = settings_for(inbox_maxlen=5)
    factory = fakeredis_factory()
    backend = RedisBackend(settings, client_factory=factory)
    await backend.start()
    try:
        session = record(backend)
        await backend.sessions.create(session)
        await backend.subscriptions.add(session.id, "t1", "x:a")
        await backend.inboxes.append([(session.id, Frame("u:x:a", b"1"))])
        await backend.sessions.touch([session.id])
        await backend.records.write("t1", "P", "1", b"{}", Change("t1", "mcpb://t1/P/1"))
        await backend.changelog.publish(Change("t2", "x:b"))
        await backend.changelog.read("c1", 10, 0)
        keys = [key.decode() async for key in backend.redis.scan_iter()]
    finally:
        await backend.close()
    assert len(keys) >= 10
    assert all(key.startswith(settings.redis_prefix + ":") for key in keys), keys


def test_the_keys_of_one_session_and_of_one_tenants_records_share_a_cluster_slot() -> None:
    keys = Keys("mcpb")
    session = keys.session("abc")
    assert len({key_slot(k.encode()) for k in (session.meta, session.subs, session.inbox, session.wake)}) == 1
    records = [keys.records(3, "acme", "P"), keys.record_ids(3, "acme", "P"), keys.collections(3, "acme"), keys.log(3)]
    assert len({key_slot(k.encode()) for k in records}) == 1


@pytest.mark.parametrize("name", NAMES)
def test_scripts_touch_only_the_keys_they_declare(name: str) -> None:
    """Every ``redis.call`` names its key (or channel) as ``KEYS[n]``: legal in Redis Cluster."""
    calls = re.findall(r"redis\.call\(([^,)]+)(?:,\s*([^,)]+))?", source(name))
    assert calls, name
    for command, first in calls:
        if command == "'TIME'" and not first:
            continue  # takes no key
        if command == "'XREADGROUP'":  # its keys follow STREAMS
            assert re.search(r"redis\.call\('XREADGROUP'[^)]*'STREAMS',\s*KEYS\[[^\]]+\],\s*'>'\)", source(name)), name
            continue
        assert first.strip().startswith("KEYS["), f"{name}: redis.call({command}, {first}, ...)"
    multi_key = re.findall(r"redis\.call\('DEL',([^)]*)\)", source(name))
    for args in multi_key:
        assert all(arg.strip().startswith("KEYS[") for arg in args.split(",")), name


async def test_a_watch_cancelled_while_subscribing_leaves_no_subscription_behind(
        backend: RedisBackend, private_redis: RedisProcess) -> None:
    session, other = record(backend), record(backend)
    await backend.sessions.create(session)
    await backend.sessions.create(other)
    watching = asyncio.create_task(backend.inboxes.watch(session.id, lambda wake: None))
    await asyncio.sleep(0)  # one step: the watch is now waiting for its subscription
    watching.cancel()
    with pytest.raises(asyncio.CancelledError):
        await watching
    # Subscriptions are confirmed in order on the one pub/sub connection: once a later one is,
    # the cancelled one has landed too.
    unwatch = await backend.inboxes.watch(other.id, lambda wake: None)
    channel = backend.keys.session(session.id).wake
    async with Redis.from_url(private_redis.url) as raw:
        async def subscribers() -> int:
            return int((await raw.execute_command("PUBSUB", "SHARDNUMSUB", channel))[1])

        async with asyncio.timeout(10):
            while await subscribers():
                await asyncio.sleep(0.01)
    assert not backend.watchers.watches(session.id)
    await unwatch()


async def test_sharded_pubsub_is_used_where_the_server_has_it(backend: RedisBackend) -> None:
    assert backend.bus.sharded and backend.bus.publish_command == "SPUBLISH"  # redis-server >= 7


async def test_with_several_partitions_fan_out_spreads_over_the_live_consumers() -> None:
    backend = RedisBackend(settings_for(changelog_partitions=4), client_factory=fakeredis_factory())
    await backend.start()
    try:
        held = backend.changelog.leases.share_of  # which partitions each consumer holds after its read

        def later(*consumers: str) -> None:
            """As once a sixth of a lease has passed: their next read takes their share again."""
            for consumer in consumers:
                held(consumer).lapse()

        await backend.changelog.read("a", 10, 0)
        assert len(held("a").held) == 4  # alone: every partition
        await backend.changelog.read("b", 10, 0)  # b joins: nothing is free yet
        await backend.changelog.read("a", 10, 0)
        assert len(held("a").held) == 4  # held a moment ago: not asked again at every read
        later("a", "b")
        await backend.changelog.read("a", 10, 0)  # a sees two consumers and gives half up
        await backend.changelog.read("b", 10, 0)
        assert len(held("a").held) == len(held("b").held) == 2
        assert set(held("a").held).isdisjoint(held("b").held)
        # Each change is read by the holder of its URI's partition, and by nobody else.
        uris = [f"x:{n}" for n in range(40)]
        for uri in uris:
            await backend.changelog.publish(Change("t1", uri))
        read = {name: [c.uri for _, c in await backend.changelog.read(name, 100, 0)] for name in ("a", "b")}
        assert sorted(read["a"] + read["b"]) == sorted(uris)
        assert all(backend.changelog.partition("t1", u) in held("a").held for u in read["a"])
        await backend.changelog.release("b")  # b stops: a takes everything back at its next hold
        later("a")
        await backend.changelog.read("a", 10, 0)
        assert len(held("a").held) == 4
    finally:
        await backend.close()


async def test_a_consumer_that_retakes_a_partition_finishes_what_the_holder_in_between_left() -> None:
    backend = RedisBackend(settings_for(changelog_partitions=1), client_factory=fakeredis_factory())
    await backend.start()
    try:
        changes = [Change("t1", f"x:{n}") for n in range(4)]
        ids = [await backend.changelog.publish(change) for change in changes]
        first = await backend.changelog.read("a", 1, 0)
        await backend.changelog.ack([cid for cid, _ in first])
        backend.changelog.leases.share_of("a").stop_heartbeat()
        await backend.redis.delete(backend.keys.lease(0))  # a's lease lapsed without a noticing
        cut_short = await backend.changelog.read("b", 1, 0)  # b takes over, reads one and stops
        assert [cid for cid, _ in cut_short] == ids[1:2]
        await backend.changelog.release("b")
        read: list[tuple[str, Change]] = []
        for _ in range(2):
            batch = await backend.changelog.read("a", 10, 0)
            await backend.changelog.ack([cid for cid, _ in batch])
            read += batch
        assert read == list(zip(ids[1:], changes[1:], strict=True))
    finally:
        await backend.close()
