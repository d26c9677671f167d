"""The change log's bounds: one tenant's flood is refused before it is acknowledged, and never
evicts another tenant's changes; only what fan-out processed is ever trimmed."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator

import pytest

from broker.backends.base import Backend
from broker.changes import Change
from broker.config import Settings
from broker.errors import BrokerError, LogFull, QuotaExceeded
from tests.contract.conftest import BACKENDS, make_backend

TENANT_MAX = 20
LOG_MAX = 60


@pytest.fixture(params=BACKENDS)
async def bounded(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    settings = Settings(_env_file=None, redis_prefix=f"t{secrets.token_hex(4)}",  # type: ignore[call-arg]
                        changelog_tenant_max=TENANT_MAX, changelog_maxlen=LOG_MAX,
                        changelog_partitions=1)  # the bounds are per partition: one log here
    impl = await make_backend(request.param, settings, request)
    await impl.start()
    yield impl
    await impl.close()


async def fan_out(backend: Backend) -> list[Change]:
    """What a fan-out consumer reads and acknowledges until the log is drained."""
    read: list[Change] = []
    while batch := await backend.changelog.read("c1", 7, 50):
        await backend.changelog.ack([cid for cid, _ in batch])
        read += [change for _, change in batch]
    return read


async def test_a_flooding_tenant_is_refused_and_the_other_tenants_changes_all_arrive(bounded: Backend) -> None:
    backend = bounded
    mine = [Change("b", f"x:b{n}") for n in range(10)]
    for change in mine[:5]:
        await backend.changelog.publish(change)
    refused = 0
    for n in range(10 * LOG_MAX):  # far more than the log holds
        try:
            await backend.changelog.publish(Change("a", f"x:a{n}"))
        except BrokerError:
            refused += 1
    for change in mine[5:]:
        await backend.changelog.publish(change)
    read = await fan_out(backend)
    assert [change for change in read if change.tenant == "b"] == mine
    assert refused == 10 * LOG_MAX - TENANT_MAX
    assert len([change for change in read if change.tenant == "a"]) == TENANT_MAX


async def test_the_refusal_says_whose_bound_and_how_full(bounded: Backend) -> None:
    for n in range(TENANT_MAX):
        await bounded.changelog.publish(Change("a", f"x:{n}"))
    with pytest.raises(QuotaExceeded) as refused:
        await bounded.changelog.publish(Change("a", "x:more"))
    assert (refused.value.tenant, refused.value.limit, refused.value.pending, refused.value.asked) == (
        "a", TENANT_MAX, TENANT_MAX, 1)
    assert "'a'" in str(refused.value) and str(TENANT_MAX) in str(refused.value)


async def test_a_tenant_may_publish_again_once_fan_out_has_processed_its_changes(bounded: Backend) -> None:
    for round_ in range(3):
        for n in range(TENANT_MAX):
            await bounded.changelog.publish(Change("a", f"x:{round_}-{n}"))
        with pytest.raises(QuotaExceeded):
            await bounded.changelog.publish(Change("a", "x:more"))
        assert len(await fan_out(bounded)) == TENANT_MAX


async def test_a_full_log_refuses_every_tenant_and_takes_changes_again_once_processed(bounded: Backend) -> None:
    tenants = [f"t{n}" for n in range(LOG_MAX // TENANT_MAX)]
    for tenant in tenants:
        for n in range(TENANT_MAX):
            await bounded.changelog.publish(Change(tenant, f"x:{n}"))
    with pytest.raises(LogFull) as refused:
        await bounded.changelog.publish(Change("newcomer", "x:1"))
    assert refused.value.limit == LOG_MAX
    assert len(await fan_out(bounded)) == LOG_MAX
    # What fan-out processed was trimmed: the log takes a full load again.
    for n in range(LOG_MAX):
        await bounded.changelog.publish(Change(f"u{n % 3}", f"x:{n}"))
    assert len(await fan_out(bounded)) == LOG_MAX


async def test_while_fan_out_is_stuck_on_a_change_nothing_after_it_is_trimmed_either(bounded: Backend) -> None:
    first = Change("b", "x:first")
    first_id = await bounded.changelog.publish(first)
    assert await bounded.changelog.read("c1", 1, 50) == [(first_id, first)]  # its batch fails: not acknowledged
    later = [Change(f"t{n % 3}", f"x:{n}") for n in range(LOG_MAX - 1)]
    for change in later:
        await bounded.changelog.publish(change)
    with pytest.raises(LogFull):
        await bounded.changelog.publish(Change("t4", "x:one-too-many"))
    assert await bounded.changelog.read("c1", 100, 50) == [(first_id, first)]  # handed out again, first
    await bounded.changelog.ack([first_id])
    assert await fan_out(bounded) == later


async def test_a_list_is_appended_whole_or_not_at_all(bounded: Backend) -> None:
    for n in range(TENANT_MAX - 3):
        await bounded.changelog.publish(Change("a", f"x:{n}"))
    with pytest.raises(QuotaExceeded) as refused:
        await bounded.changelog.publish_many([Change("a", f"x:more{n}") for n in range(5)])
    assert (refused.value.pending, refused.value.asked) == (TENANT_MAX - 3, 5)
    ids = await bounded.changelog.publish_many([Change("a", f"x:last{n}") for n in range(3)])
    assert len(ids) == 3
    assert len(await fan_out(bounded)) == TENANT_MAX


async def test_a_refused_record_write_stores_nothing(bounded: Backend) -> None:
    for n in range(TENANT_MAX):
        await bounded.changelog.publish(Change("a", f"x:{n}"))
    with pytest.raises(QuotaExceeded):
        await bounded.records.write("a", "P", "1", b"{}", Change("a", "mcpb://a/P/1"))
    assert await bounded.records.read("a", "P", "1") is None
    await fan_out(bounded)
    assert await bounded.records.write("a", "P", "1", b"{}", Change("a", "mcpb://a/P/1")) is True
    for n in range(TENANT_MAX - 1):
        await bounded.changelog.publish(Change("a", f"x:{n}"))
    with pytest.raises(QuotaExceeded):
        await bounded.records.delete("a", "P", "1", Change("a", "mcpb://a/P/1"))
    assert await bounded.records.read("a", "P", "1") == b"{}"
