"""The Redis change log partitioned by ordering key, and a switch of partition count, on a real redis-server."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator

import pytest

from broker.backends.redis import RedisBackend
from broker.backends.redis.partitioning import Layout, PartitionMismatch, ordering_key
from broker.changes import Change
from broker.config import Settings
from broker.errors import LimitExceeded, QuotaExceeded
from tests.support import RedisProcess


def settings(redis: RedisProcess, prefix: str, **overrides: object) -> Settings:
    return Settings(_env_file=None, redis_url=redis.url, redis_prefix=prefix, **overrides)  # type: ignore[call-arg]


@pytest.fixture
async def backend(redis_server: RedisProcess) -> AsyncIterator[RedisBackend]:
    impl = RedisBackend(settings(redis_server, f"t{secrets.token_hex(4)}", changelog_tenant_max=5,
                                 max_records_per_tenant=3))
    await impl.start()
    yield impl
    await impl.close()


def test_a_record_and_its_collection_share_a_key_and_other_uris_have_their_own() -> None:
    assert ordering_key("t", "mcpb://t/c/1") == ordering_key("t", "mcpb://t/c") == "t/c"
    assert ordering_key("t", "x:a") != ordering_key("u", "x:a")
    layout = Layout(16, 8)
    assert layout.route("t", "mcpb://t/c/1") == layout.route_collection("t", "c") in layout.numbers
    assert Layout(0, 4, "tenant").route("t", "x:a") == Layout(0, 4, "tenant").route("t", "x:b")


async def test_one_tenants_changes_spread_over_the_partitions(backend: RedisBackend) -> None:
    assert backend.changelog.partitions == 16
    assert len({backend.changelog.partition("t", f"mcpb://t/c{n}/1") for n in range(100)}) == 16


async def test_a_list_over_several_partitions_is_appended_whole_or_not_at_all(backend: RedisBackend) -> None:
    hot = [Change("t", "x:hot", meta={"n": n}) for n in range(5)]
    await backend.changelog.publish_many(hot)  # the tenant's bound in x:hot's partition is reached
    others = [Change("t", f"x:{n}") for n in range(30)]
    spread = {backend.changelog.partition("t", c.uri) for c in others}
    assert len(spread) > 1
    with pytest.raises(QuotaExceeded):
        await backend.changelog.publish_many([*others, Change("t", "x:hot")])
    lengths = [await backend.redis.xlen(backend.keys.log(p)) for p in backend.changelog.partitioning.numbers()]
    assert sum(lengths) == 5


async def test_the_record_quota_counts_every_partition(backend: RedisBackend) -> None:
    collections = ["a", "b", "c", "d"]
    assert len({backend.changelog.partitioning.write.route_collection("t", c) for c in collections}) > 1
    for name in collections[:3]:
        assert await backend.records.write("t", name, "1", b"1", Change("t", f"mcpb://t/{name}/1"))
    with pytest.raises(LimitExceeded):
        await backend.records.write("t", "d", "1", b"1", Change("t", "mcpb://t/d/1"))
    assert await backend.records.collections("t") == ["a", "b", "c"]


async def test_a_switch_keeps_each_uris_order_and_moves_the_records(redis_server: RedisProcess) -> None:
    prefix = f"t{secrets.token_hex(4)}"
    first = RedisBackend(settings(redis_server, prefix))
    stale = RedisBackend(settings(redis_server, prefix))  # a worker that has not seen the switch yet
    await first.start()
    await stale.start()
    try:
        assert await first.records.write("t", "c", "r", b"v0", Change("t", "mcpb://t/c/r"))
        before = [Change("t", "x:a", meta={"n": n}) for n in range(3)]
        await first.changelog.publish_many(before)
        assert (await first.changelog.partitioning.switch(4)).count == 4
        assert await first.changelog.partitioning.move_records() == 1
        after = [Change("t", "x:a", meta={"n": n}) for n in range(3, 6)]
        ids = await stale.changelog.publish_many(after)  # meets the seal, goes to the new layout
        assert all(int(i.partition(":")[0]) >= 16 for i in ids)
        read: list[Change] = []
        for _ in range(40):
            first.changelog._next_look = 0.0  # look at the layouts at every read here
            batch = await first.changelog.read("c1", 100, 50)
            await first.changelog.ack([cid for cid, _ in batch])
            read += [c for _, c in batch if c.uri == "x:a"]
            if len(read) == 6:
                break
        assert [c.meta for c in read] == [{"n": n} for n in range(6)]
        assert first.changelog.partitioning.drain is None
        assert await stale.records.read("t", "c", "r") == b"v0"
        assert not await stale.records.write("t", "c", "r", b"v1", Change("t", "mcpb://t/c/r"))
        mismatched = RedisBackend(settings(redis_server, prefix, changelog_partitions=16))
        try:
            with pytest.raises(PartitionMismatch, match="has 4 partitions"):
                await mismatched.start()
        finally:
            await mismatched.close()
    finally:
        await first.close()
        await stale.close()


async def test_a_drain_that_ends_while_records_move_leaves_them_moving_and_readable(backend: RedisBackend) -> None:
    """Fan-out may find the old partitions empty before the records are moved: the drain waits for
    them (ending it first left record writes refused for good, the last step's compare-and-set lost)."""
    assert await backend.records.write("t", "c", "1", b'{"v": 1}', Change("t", "mcpb://t/c/1"))
    partitioning = backend.changelog.partitioning
    other = backend.changelog.partitioning.__class__(backend.redis, backend.keys, backend.scripts, None)
    await other.start()
    taken = await backend.changelog.read("consumer", 10, 0)  # fan-out has processed the record's change
    await backend.changelog.ack([change_id for change_id, _ in taken])
    await partitioning.switch(4)
    await other.load()
    # Nothing is left to fan out in the old layout, but records still move: it is not dropped.
    assert await other.finish_drain() is False and other.drain is not None
    assert await backend.records.read("t", "c", "1") == b'{"v": 1}'
    assert await partitioning.move_records() == 1
    assert partitioning.moving is False
    await other.load()  # as a fan-out worker looks at the layouts before it tries to end the drain
    assert await other.finish_drain() is True
    await partitioning.load()
    assert partitioning.drain is None and not partitioning.moving
    assert await backend.records.read("t", "c", "1") == b'{"v": 1}'


async def test_layouts_lost_with_the_store_are_put_back_not_made_anew(backend: RedisBackend) -> None:
    partitioning = backend.changelog.partitioning
    await partitioning.switch(4)
    assert await partitioning.move_records() == 0
    assert await partitioning.finish_drain() is True
    numbers = partitioning.write.numbers
    await backend.redis.delete(backend.keys.partitioning)  # as after a restart that lost the data
    await partitioning.load()
    fresh = partitioning.__class__(backend.redis, backend.keys, backend.scripts, None)
    await fresh.start()
    assert fresh.write.numbers == numbers  # the layout a worker started now finds, not a first one


async def test_a_drain_ends_when_what_is_left_in_an_old_partition_was_processed(backend: RedisBackend) -> None:
    """An entry fan-out acknowledged without trimming it (an unreadable one, or a log an older
    version wrote) does not keep the drain from ending: it is trimmed then; one pending does."""
    changelog = backend.changelog
    await changelog.publish(Change("t", "x:left"))
    partition = changelog.partition("t", "x:left")
    key = backend.keys.log(partition)
    taken = await backend.redis.xreadgroup("fanout", "old-version", {key: ">"}, count=10)
    entry_id = taken[0][1][0][0]
    partitioning = changelog.partitioning
    await partitioning.switch(4)
    assert await partitioning.move_records() == 0
    assert await partitioning.finish_drain() is False  # pending: still being fanned out
    await backend.redis.xack(key, "fanout", entry_id)  # acknowledged, not trimmed
    assert await backend.redis.xlen(key) == 1
    assert await partitioning.finish_drain() is True
    assert partitioning.drain is None


async def test_a_list_retried_after_a_seal_appends_each_change_once(backend: RedisBackend) -> None:
    """On Cluster a list goes partition by partition; when one partition meets its seal, only
    what is not appended yet is sent again (the others' changes would land twice, under new ids)."""
    from broker.backends.redis import changelog as module

    changelog = backend.changelog
    changelog.cluster = True  # the Cluster path: one call per partition (each is one slot anyway)
    changes = [Change("t", f"x:{n}") for n in range(20)]
    sealed_once = {changelog.partition("t", changes[0].uri)}
    real = changelog._append_group

    async def append_group(groups: dict[int, list[Change]]) -> list[str]:
        if set(groups) & sealed_once:
            sealed_once.clear()
            raise module._Sealed()
        return await real(groups)

    changelog._append_group = append_group  # type: ignore[method-assign]
    ids = await changelog.publish_many(changes)
    assert len(set(ids)) == len(changes) and all(ids)
    lengths = [await backend.redis.xlen(backend.keys.log(p)) for p in changelog.partitioning.numbers()]
    assert sum(lengths) == len(changes)
