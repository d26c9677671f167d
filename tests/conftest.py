"""Fixtures shared by every tier."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from broker.backends.memory import MemoryBackend
from broker.config import Settings
from tests.support import BrokerProcess, RedisProcess, redis_server_binary
from tests.tiers import mark_items, process_guard


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test is marked by what it needs (``process``, ``redis``): see tests/tiers.py."""
    mark_items(items)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """A test not marked ``process`` that starts one fails, so the markers cannot hide a process."""
    with process_guard(item):
        return (yield)


@pytest.fixture
def settings() -> Settings:
    return Settings(_env_file=None, keepalive_interval=1.0)  # type: ignore[call-arg]


@pytest.fixture
async def memory_backend(settings: Settings) -> AsyncIterator[MemoryBackend]:
    backend = MemoryBackend(settings)
    await backend.start()
    yield backend
    await backend.close()


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisProcess]:
    """One private redis-server for the session; tests isolate themselves with a unique key prefix."""
    if redis_server_binary() is None:
        pytest.fail("redis-server is required (install Debian's redis-server)")
    with RedisProcess() as server:
        yield server


@pytest.fixture
def broker_process() -> Iterator[BrokerProcess]:
    """A broker on the memory backend, in its own process, on a free port."""
    with BrokerProcess() as proc:
        yield proc
