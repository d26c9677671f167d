"""The client tier: ``broker_client`` against real servers, mcp-broker and the official SDK server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.client.targets import SdkProcess, Target
from tests.support import BrokerProcess, RedisProcess, redis_server_binary


@pytest.fixture(scope="module")
def broker() -> Iterator[BrokerProcess]:
    with BrokerProcess() as proc:
        yield proc


@pytest.fixture(scope="module")
def sdk() -> Iterator[SdkProcess]:
    proc = SdkProcess()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def redis() -> Iterator[RedisProcess]:
    if redis_server_binary() is None:
        pytest.fail("redis-server is required (install Debian's redis-server)")
    with RedisProcess() as proc:
        yield proc


@pytest.fixture
def http_target(request: pytest.FixtureRequest) -> Target:
    """``broker`` or ``sdk`` (the parameter), over Streamable HTTP."""
    if request.param == "broker":
        proc: BrokerProcess | SdkProcess = request.getfixturevalue("broker")
        return Target("broker", proc.mcp_url, proc.url, broker=True)
    proc = request.getfixturevalue("sdk")
    return Target("sdk", proc.mcp_url, proc.url, broker=False)
