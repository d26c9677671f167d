"""The distributed tier: a real redis-server, three ``mcp-broker serve`` workers, and a round-robin proxy.

Every request through ``Deployment.url`` goes to the next worker (``tests/distributed/proxy.py``),
so one MCP session is served by all of them. Tests that break things (kill a worker, restart
or stop Redis) get a deployment of their own; the others share one per module.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.support import ROOT, BrokerProcess, RedisProcess, free_port, redis_server_binary, wait_until

#: Settings every worker of the tier runs with: fast claims of a dead consumer's changes,
#: short Redis timeouts (an outage is seen within a second), and a short outage grace.
WORKER_ENV = {
    "MCP_BROKER_FANOUT_CLAIM_IDLE_MS": "300",
    "MCP_BROKER_REDIS_SOCKET_TIMEOUT": "1",
    "MCP_BROKER_REDIS_CONNECT_TIMEOUT": "0.5",
    "MCP_BROKER_OUTAGE_GRACE": "1",
    "MCP_BROKER_KEEPALIVE_INTERVAL": "0.5",
}


class ProxyProcess:
    def __init__(self, upstreams: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.distributed.proxy", "--port", str(self.port), *upstreams],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_until(lambda: httpx.get(self.url + "/__proxy/log", timeout=1).status_code == 200, what="proxy start")
        except TimeoutError:
            self.stop()
            raise

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


class Deployment:
    """Redis, ``workers`` brokers on it, and the proxy in front of them."""

    def __init__(self, workers: int = 3, redis_url: str | None = None, env: dict[str, str] | None = None) -> None:
        self.redis = RedisProcess() if redis_url is None else None
        self.redis_url = redis_url or (self.redis.url if self.redis else "")
        self.env = {**WORKER_ENV, "MCP_BROKER_REDIS_URL": self.redis_url, **(env or {})}
        self.workers: list[BrokerProcess] = []
        self.proxy: ProxyProcess | None = None
        try:
            with ThreadPoolExecutor(workers) as pool:
                starting = [pool.submit(BrokerProcess, env=self.env) for _ in range(workers)]
            # Keep every worker that did start, so close() stops it even if another one failed.
            self.workers = [f.result() for f in starting if f.exception() is None]
            for future in starting:
                if future.exception() is not None:
                    raise future.exception()  # type: ignore[misc]
            self.proxy = ProxyProcess([w.url for w in self.workers])
        except BaseException:
            self.close()
            raise

    @property
    def url(self) -> str:
        assert self.proxy is not None
        return self.proxy.url

    def log(self) -> list[dict[str, Any]]:
        """Which worker served each request so far, in order."""
        entries: list[dict[str, Any]] = httpx.get(self.url + "/__proxy/log", timeout=5).json()
        return entries

    def kill9(self, index: int) -> None:
        proc = self.workers[index].proc
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)

    def __enter__(self) -> Deployment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.proxy is not None:
            self.proxy.stop()
        for worker in self.workers:
            worker.kill()
        if self.redis is not None:
            self.redis.stop()


@pytest.fixture(scope="session", autouse=True)
def _needs_redis() -> None:
    if redis_server_binary() is None:
        pytest.fail("redis-server is required (install Debian's redis-server)")


@pytest.fixture(scope="module")
def deployment() -> Iterator[Deployment]:
    """One deployment shared by the tests of a module that break nothing."""
    with Deployment() as deploy:
        yield deploy


@pytest.fixture
def own_deployment() -> Iterator[Deployment]:
    """A deployment of this test alone: it may kill workers and stop Redis."""
    with Deployment() as deploy:
        yield deploy


@pytest.fixture
def own_deployment_large_inbox() -> Iterator[Deployment]:
    """Inboxes long enough that a client who missed a burst of 1,000 never meets a gap."""
    with Deployment(env={"MCP_BROKER_INBOX_MAXLEN": "5000"}) as deploy:
        yield deploy


@pytest.fixture
def own_deployment_small_inbox() -> Iterator[Deployment]:
    with Deployment(env={"MCP_BROKER_INBOX_MAXLEN": "500"}) as deploy:
        yield deploy


@pytest.fixture
def own_deployment_slow_grace() -> Iterator[Deployment]:
    """Streams outlive a short Redis restart (the outage grace is longer than the restart)."""
    with Deployment(env={"MCP_BROKER_OUTAGE_GRACE": "10"}) as deploy:
        yield deploy


@pytest.fixture
async def http(deployment: Deployment) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=deployment.url, timeout=10) as client:
        yield client
