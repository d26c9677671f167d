"""The change log's bounds as Redis keeps them: counts in the partition's slot, trimming by the reader."""

from __future__ import annotations

import secrets

from redis.crc import key_slot

from broker.backends.redis import RedisBackend
from broker.backends.redis.keys import FANOUT_GROUP, Keys
from broker.changes import Change
from broker.config import Settings
from tests.contract.conftest import fakeredis_factory


def bounded(**overrides: object) -> RedisBackend:
    settings = Settings(_env_file=None, redis_prefix=f"t{secrets.token_hex(4)}",  # type: ignore[call-arg]
                        **{"changelog_tenant_max": 20, "changelog_maxlen": 60, "changelog_partitions": 1, **overrides})
    return RedisBackend(settings, client_factory=fakeredis_factory())


def test_the_tenant_counts_live_in_the_slot_of_their_partition() -> None:
    keys = Keys("mcpb")
    assert key_slot(keys.backlog(3).encode()) == key_slot(keys.log(3).encode())


async def test_a_log_full_of_processed_entries_an_older_version_left_is_trimmed_not_refused() -> None:
    backend = bounded()
    await backend.start()
    try:
        log = backend.keys.log(0)
        for _ in range(80):  # as an older version wrote them: no tenant field, trimmed by length only
            await backend.redis.xadd(log, {"c": b"old"})
        reply = await backend.redis.xreadgroup(FANOUT_GROUP, "old-worker", {log: ">"}, count=100)
        await backend.redis.xack(log, FANOUT_GROUP, *[entry_id for entry_id, _ in reply[0][1]])
        ids = [await backend.changelog.publish(Change("a", f"x:{n}")) for n in range(20)]
        assert len(ids) == 20
        assert await backend.redis.xlen(log) == 20
    finally:
        await backend.close()


async def test_acknowledging_trims_the_log_and_counts_the_tenant_out() -> None:
    backend = bounded()
    await backend.start()
    try:
        for n in range(10):
            await backend.changelog.publish(Change("a", f"x:{n}"))
        batch = await backend.changelog.read("c1", 4, 0)
        await backend.changelog.ack([cid for cid, _ in batch])
        assert await backend.redis.xlen(backend.keys.log(0)) == 6
        assert await backend.redis.hget(backend.keys.backlog(0), "a") == b"6"
        rest = await backend.changelog.read("c1", 100, 0)
        await backend.changelog.ack([cid for cid, _ in rest])
        await backend.changelog.ack([cid for cid, _ in rest])  # twice: counted out once
        assert await backend.redis.xlen(backend.keys.log(0)) == 0
        assert not await backend.redis.exists(backend.keys.backlog(0))
    finally:
        await backend.close()


async def test_a_tenant_count_that_drifted_above_the_log_is_cut_to_it_not_refused() -> None:
    # A worker that predates the counts acknowledges with a plain XACK and counts nothing out
    # (a rolling upgrade): the tenant's count only grows, though fan-out keeps up.
    backend = bounded()
    await backend.start()
    try:
        for n in range(5):
            await backend.changelog.publish(Change("a", f"x:{n}"))
        log = backend.keys.log(0)
        reply = await backend.redis.xreadgroup(FANOUT_GROUP, "old-worker", {log: ">"}, count=100)
        await backend.redis.xack(log, FANOUT_GROUP, *[entry_id for entry_id, _ in reply[0][1]])
        await backend.redis.xtrim(log, maxlen=0)
        await backend.redis.hset(backend.keys.backlog(0), "a", 20)  # as if 20 were still waiting
        assert await backend.changelog.publish(Change("a", "x:after"))
        assert await backend.redis.hget(backend.keys.backlog(0), "a") == b"1"
        await backend.records.write("a", "c", "r1", b"{}", Change("a", "mcpb://a/c/r1"))
    finally:
        await backend.close()


async def test_a_read_that_arrives_after_its_lease_lapsed_takes_nothing_from_the_new_holder() -> None:
    # A consumer renewed its lease, then its read reached Redis late (an event-loop stall, a
    # network that held the command back) after another consumer took the partition over. Had
    # the read taken changes, they would sit pending to a consumer the new holder never sweeps.
    backend = bounded(fanout_claim_idle_ms=60_000)
    await backend.start()
    try:
        ids = [await backend.changelog.publish(Change("a", f"x:{n}")) for n in range(5)]
        log = backend.changelog
        await backend.redis.set(backend.keys.lease(0), "new-holder", px=60_000)
        assert await log._reader._readgroup("late-reader", [0], 10, None) == []
        taken = await backend.changelog.read("new-holder", 10, 0)
        assert [change_id for change_id, _ in taken] == ids
    finally:
        await backend.close()


async def test_a_consumer_that_stops_with_nothing_pending_leaves_the_group() -> None:
    # Consumer names are new with every process: without this the group keeps one per restart.
    backend = bounded()
    await backend.start()
    try:
        log = backend.keys.log(0)
        await backend.changelog.publish(Change("a", "x:1"))
        taken = await backend.changelog.read("finished", 10, 0)
        await backend.changelog.ack([cid for cid, _ in taken])
        await backend.changelog.release("finished")
        await backend.changelog.publish(Change("a", "x:2"))
        await backend.changelog.read("cut-short", 10, 0)  # read, never acknowledged
        await backend.changelog.release("cut-short")
        names = {consumer["name"] for consumer in await backend.redis.xinfo_consumers(log, FANOUT_GROUP)}
        assert names == {b"cut-short"}  # its pending change is not stranded
    finally:
        await backend.close()
