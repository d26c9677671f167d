"""The ``Quotas`` store and the sessions quota, on every backend: places held by leases, buckets of tokens."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator

import pytest

from broker.backends.base import Backend
from broker.config import Settings
from broker.errors import OverQuota
from tests.contract.conftest import BACKENDS, make_backend, new_session

TTL = 0.4


async def test_places_are_counted_per_tenant_and_kind_and_come_back_when_released(backend: Backend) -> None:
    quotas = backend.quotas
    assert await quotas.acquire("t1", "streams", "a", 2, 10_000)
    assert await quotas.acquire("t1", "streams", "b", 2, 10_000)
    assert not await quotas.acquire("t1", "streams", "c", 2, 10_000)
    assert await quotas.acquire("t1", "streams", "a", 2, 10_000), "a holder renews its own place at the limit"
    assert await quotas.acquire("t2", "streams", "c", 2, 10_000), "another tenant is unaffected"
    assert await quotas.acquire("t1", "listens", "c", 2, 10_000), "another kind is unaffected"
    await quotas.release("t1", "streams", "a")
    assert await quotas.acquire("t1", "streams", "c", 2, 10_000)


async def test_a_place_nobody_renews_lapses_and_a_renewed_one_stays(backend: Backend) -> None:
    quotas = backend.quotas
    assert await quotas.acquire("t1", "listens", "dead", 2, 300)
    assert await quotas.acquire("t1", "listens", "alive", 2, 300)
    for _ in range(3):
        await asyncio.sleep(0.15)
        await quotas.refresh([("t1", "listens", "alive")], 300)
    assert await quotas.acquire("t1", "listens", "new", 2, 300), "the unrenewed place lapsed"
    assert not await quotas.acquire("t1", "listens", "third", 2, 300), "the renewed one still counts"


async def test_a_bucket_gives_its_burst_then_its_rate_and_refuses_without_taking(backend: Backend) -> None:
    quotas = backend.quotas
    assert await quotas.take("t1", 5, 10, 5) == 0
    wait = await quotas.take("t1", 1, 10, 5)
    assert 0 < wait <= 0.11
    assert await quotas.take("t2", 5, 10, 5) == 0, "another tenant has a bucket of its own"
    await asyncio.sleep(0.25)
    assert await quotas.take("t1", 2, 10, 5) == 0, "refilled at the rate"
    assert await quotas.take("t1", 3, 10, 5) > 0, "the refusal took nothing, the take before took two"


async def test_a_tenants_buckets_of_each_kind_are_apart_and_a_rate_may_be_below_one(backend: Backend) -> None:
    quotas = backend.quotas
    assert await quotas.take("t1", 2, 2 / 60, 2, kind="verify") == 0
    assert 29 < await quotas.take("t1", 1, 2 / 60, 2, kind="verify") <= 30, "one token every 30 s"
    assert await quotas.take("t1", 5, 10, 5) == 0, "the publish bucket is another"


async def test_the_sessions_quota_counts_live_sessions_and_frees_ended_and_expired_ones(backend: Backend) -> None:
    sessions = backend.sessions
    first, second = new_session(backend, "t1"), new_session(backend, "t1")
    await sessions.create(first, 2)
    await sessions.create(second, 2)
    with pytest.raises(OverQuota) as refused:
        await sessions.create(new_session(backend, "t1"), 2)
    assert (refused.value.limit, refused.value.tenant, refused.value.quota) == ("sessions", "t1", 2)
    await sessions.create(new_session(backend, "t2"), 2)  # another tenant
    await sessions.delete(first.id)
    await sessions.create(new_session(backend, "t1"), 2)
    with pytest.raises(OverQuota):
        await sessions.create(new_session(backend, "t1"), 2)


@pytest.fixture(params=BACKENDS)
async def short_lived(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    """A backend whose sessions live 0.4 s without a touch."""
    settings = Settings(_env_file=None, redis_prefix=f"t{secrets.token_hex(4)}",  # type: ignore[call-arg]
                        session_ttl=TTL, session_index_grace=0.5)
    impl = await make_backend(request.param, settings, request)
    await impl.start()
    yield impl
    await impl.close()


async def test_an_expired_session_leaves_the_count_and_a_touched_one_stays(short_lived: Backend) -> None:
    sessions = short_lived.sessions
    idle, busy = new_session(short_lived, "t1"), new_session(short_lived, "t1")
    await sessions.create(idle, 2)
    await sessions.create(busy, 2)
    deadline = time.monotonic() + TTL * 1.5
    while time.monotonic() < deadline:  # the idle one expires, nothing sweeps it
        await sessions.touch([busy.id])
        await asyncio.sleep(TTL / 8)
    await sessions.create(new_session(short_lived, "t1"), 2)
    with pytest.raises(OverQuota):
        await sessions.create(new_session(short_lived, "t1"), 2)
