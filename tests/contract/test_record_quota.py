"""The tenant's record quota, on every backend: counted in the step that writes, so it cannot drift."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator

import pytest

from broker.backends.base import Backend
from broker.changes import Change
from broker.config import Settings
from broker.errors import LimitExceeded, WriteConflict
from tests.contract.conftest import BACKENDS, make_backend


@pytest.fixture(params=BACKENDS)
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    settings = Settings(_env_file=None, redis_prefix=f"t{secrets.token_hex(4)}",  # type: ignore[call-arg]
                        max_records_per_tenant=2, max_record_bytes_per_tenant=20)
    impl = await make_backend(request.param, settings, request)
    await impl.start()
    yield impl
    await impl.close()


async def write(backend: Backend, tenant: str, rid: str, data: bytes, expect: bytes | None = None) -> bool:
    return await backend.records.write(tenant, "c", rid, data, Change(tenant, f"mcpb://{tenant}/c/{rid}"), expect)


async def test_a_new_record_past_the_count_is_refused_and_nothing_is_written(backend: Backend) -> None:
    assert await write(backend, "t1", "1", b"1")
    assert await write(backend, "t1", "2", b"2")
    with pytest.raises(LimitExceeded, match="at most 2 records"):
        await write(backend, "t1", "3", b"3")
    assert await backend.records.read("t1", "c", "3") is None
    assert await backend.records.ids("t1", "c", "", 10) == ["1", "2"]
    assert not await write(backend, "t1", "2", b"22")  # replacing is no new record
    assert await write(backend, "t2", "1", b"1")  # another tenant has its own quota
    assert await backend.records.delete("t1", "c", "1", Change("t1", "mcpb://t1/c/1"))
    assert await write(backend, "t1", "3", b"3")


async def test_bytes_past_the_quota_are_refused_but_a_write_that_shrinks_passes(backend: Backend) -> None:
    assert await write(backend, "t1", "1", b"x" * 15)
    with pytest.raises(LimitExceeded, match="at most 20 bytes"):
        await write(backend, "t1", "2", b"y" * 6)
    with pytest.raises(LimitExceeded, match="at most 20 bytes"):
        await write(backend, "t1", "1", b"x" * 21, expect=b"x" * 15)
    assert await backend.records.read("t1", "c", "1") == b"x" * 15
    assert not await write(backend, "t1", "1", b"x" * 10, expect=b"x" * 15)
    assert await write(backend, "t1", "2", b"y" * 10)
    with pytest.raises(WriteConflict):  # a conflict is still a conflict, quota or not
        await write(backend, "t1", "2", b"z", expect=b"not it")
    assert await backend.records.delete("t1", "c", "2", Change("t1", "mcpb://t1/c/2"))
    assert await write(backend, "t1", "3", b"z" * 10)
