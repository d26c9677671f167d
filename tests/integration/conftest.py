"""The integration tier: real ``mcp-broker serve`` processes on free ports."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from tests.support import BrokerProcess


@pytest.fixture(scope="module")
def broker() -> Iterator[BrokerProcess]:
    """One broker per test file, on the memory backend with default settings."""
    with BrokerProcess() as proc:
        yield proc


@pytest.fixture
async def http(broker: BrokerProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=broker.url, timeout=10) as client:
        yield client
