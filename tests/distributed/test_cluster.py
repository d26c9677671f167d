"""The any-worker scenario on a Redis Cluster of three masters that the test starts itself."""

from __future__ import annotations

import secrets
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from broker.backends.redis import RedisBackend
from broker.changes import Change
from broker.config import Settings
from tests.distributed.conftest import Deployment
from tests.distributed.scenario import any_worker_scenario
from tests.support import RedisProcess, free_port, wait_until


def cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is valid and free too."""
    while True:
        port = free_port()
        if port + 10000 <= 65535:
            try:
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", port + 10000))
                return port
            except OSError:
                continue


def cluster_ok(port: int) -> bool:
    info = subprocess.run(["redis-cli", "-p", str(port), "cluster", "info"], capture_output=True, text=True,
                          timeout=5).stdout
    return "cluster_state:ok" in info


@pytest.fixture(scope="module")
def cluster() -> Iterator[list[RedisProcess]]:
    with tempfile.TemporaryDirectory() as tmp:
        nodes: list[RedisProcess] = []
        try:
            for n in range(3):
                workdir = Path(tmp) / str(n)
                workdir.mkdir()
                nodes.append(RedisProcess(port=cluster_port(), workdir=workdir, extra=[
                    "--cluster-enabled", "yes", "--cluster-config-file", str(workdir / "nodes.conf")]))
            subprocess.run(["redis-cli", "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in nodes),
                            "--cluster-replicas", "0", "--cluster-yes"],
                           check=True, capture_output=True, timeout=30)
            for node in nodes:
                wait_until(lambda node=node: cluster_ok(node.port), what="cluster_state:ok")  # type: ignore[misc]
            yield nodes
        finally:
            for node in nodes:
                node.stop()


async def test_any_worker_serves_any_request_on_a_redis_cluster(cluster: list[RedisProcess]) -> None:
    deploy = Deployment(redis_url=f"redis+cluster://127.0.0.1:{cluster[0].port}")
    try:
        async with httpx.AsyncClient(base_url=deploy.url, timeout=10) as http:
            await any_worker_scenario(http, deploy.log)
    finally:
        deploy.close()


async def test_changes_published_together_keep_each_tenants_order_across_cluster_nodes(
        cluster: list[RedisProcess]) -> None:
    settings = Settings(_env_file=None, redis_url=f"redis+cluster://127.0.0.1:{cluster[0].port}",  # type: ignore[call-arg]
                        redis_prefix=f"t{secrets.token_hex(4)}", changelog_partitions=6)
    backend = RedisBackend(settings)
    await backend.start()
    try:
        tenants = [f"t{n}" for n in range(6)]
        assert len({backend.changelog.partition(t) for t in tenants}) > 1  # several partitions, several nodes
        changes = [Change(tenants[n % 6], f"x:{n}", meta={"n": n}) for n in range(60)]
        ids = await backend.publish_many(changes)
        read: list[Change] = []
        while len(read) < 60:
            batch = await backend.read_changes("c1", 100, 1000)
            assert batch, "every published change is read"
            read += [change for _, change in batch]
        assert len(set(ids)) == 60
        for tenant in tenants:
            assert [c for c in read if c.tenant == tenant] == [c for c in changes if c.tenant == tenant]
    finally:
        await backend.close()
