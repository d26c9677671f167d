"""The any-worker scenario on a Redis Cluster of three masters that the test starts itself."""

from __future__ import annotations

import contextlib
import secrets
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from redis import Redis

from broker.backends.redis import RedisBackend
from broker.changes import Change
from broker.config import Settings
from tests.distributed.conftest import Deployment
from tests.distributed.scenario import any_worker_scenario
from tests.distributed.test_wake_size import STREAMS, every_stream_receives, pubsub_client_ids, watching_streams
from tests.support import BrokerProcess, RedisProcess, free_port, wait_until


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


async def test_changes_published_together_keep_each_uris_order_across_cluster_nodes(
        cluster: list[RedisProcess]) -> None:
    settings = Settings(_env_file=None, redis_url=f"redis+cluster://127.0.0.1:{cluster[0].port}",  # type: ignore[call-arg]
                        redis_prefix=f"t{secrets.token_hex(4)}", changelog_partitions=6)
    backend = RedisBackend(settings)
    await backend.start()
    try:
        tenants = [f"t{n}" for n in range(6)]
        assert len({backend.changelog.partition(t, "x:a") for t in tenants}) > 1  # several partitions, nodes
        changes = [Change(tenants[n % 6], "x:a", meta={"n": n}) for n in range(60)]
        ids = await backend.changelog.publish_many(changes)
        read: list[Change] = []
        while len(read) < 60:
            batch = await backend.changelog.read("c1", 100, 1000)
            assert batch, "every published change is read"
            read += [change for _, change in batch]
        assert len(set(ids)) == 60
        for tenant in tenants:
            assert [c for c in read if c.tenant == tenant] == [c for c in changes if c.tenant == tenant]
    finally:
        await backend.close()


async def test_a_large_change_watched_by_many_streams_keeps_the_pubsub_connection_on_a_cluster(
        cluster: list[RedisProcess]) -> None:
    # On a Cluster each session's wake-up is published by the append script itself, one message
    # per session: 45 streams of one worker watching a URI whose change carries 20 kB used to
    # queue 45 x 20 kB for that worker's pub/sub connections, past the nodes' (scaled down) limit.
    limit = "pubsub 128kb 64kb 0"
    saved = []
    for node in cluster:
        with Redis(port=node.port) as raw:
            saved.append(raw.config_get("client-output-buffer-limit")["client-output-buffer-limit"])
            raw.config_set("client-output-buffer-limit", limit)
    url = f"redis+cluster://127.0.0.1:{cluster[0].port}"
    try:
        with BrokerProcess(env={"MCP_BROKER_REDIS_URL": url, "MCP_BROKER_REDIS_PREFIX": f"t{secrets.token_hex(4)}",
                                "MCP_BROKER_MAX_META_BYTES": "65536",  # an operator allowing large meta
                                "MCP_BROKER_WAKE_FRAME_MAX_BYTES": "8192"}) as worker:
            limits = httpx.Limits(max_connections=STREAMS + 10)
            async with httpx.AsyncClient(base_url=worker.url, timeout=20, limits=limits) as http, \
                    contextlib.AsyncExitStack() as stack:
                streams = await watching_streams(http, stack)
                before = set().union(*[await pubsub_client_ids(f"redis://127.0.0.1:{n.port}") for n in cluster])
                await every_stream_receives(http, streams, 20_000)
                after = set().union(*[await pubsub_client_ids(f"redis://127.0.0.1:{n.port}") for n in cluster])
                assert after == before, "a worker's pub/sub connection was dropped and re-made"
    finally:
        for node, value in zip(cluster, saved, strict=True):
            with Redis(port=node.port) as raw:
                raw.config_set("client-output-buffer-limit", value)
