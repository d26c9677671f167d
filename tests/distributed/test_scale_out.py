"""Scale-out on real Redis: one tenant's fan-out shared by three workers, and a partition switch under load.

Each worker's share is measured, not assumed: the frames each fanned out (its
``mcp_broker_fanout_frames_total``, scraped from the worker itself).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import httpx
import pytest

from tests.distributed.conftest import Deployment
from tests.integration.mcp_http import McpSession
from tests.integration.test_metrics import scrape, value
from tests.support import ROOT

COLLECTIONS = 300


async def frames_by_worker(deployment: Deployment) -> list[float]:
    return [value(await asyncio.to_thread(scrape, worker.url), "mcp_broker_fanout_frames_total")
            for worker in deployment.workers]


async def shares_taken(deployment: Deployment, partitions: int = 16) -> None:
    """Wait until every worker holds a share of the partitions and all of them are held."""
    async with asyncio.timeout(30):
        while True:
            held = [value(await asyncio.to_thread(scrape, worker.url), "mcp_broker_fanout_leases_held")
                    for worker in deployment.workers]
            if all(held) and sum(held) == partitions:
                return
            await asyncio.sleep(0.1)


@pytest.mark.timeout(120)
async def test_three_workers_share_one_tenants_fan_out(deployment: Deployment, http: httpx.AsyncClient) -> None:
    """A single tenant publishing to 300 collections: each worker fans out 23-43% of the frames."""
    targets = [f"mcpb://default/c{n}" for n in range(COLLECTIONS)]
    mcp = await McpSession(http).initialize()
    await mcp.subscribe(*targets)
    before = await frames_by_worker(deployment)
    rounds = 5
    async with mcp.stream() as stream:
        await stream.next_event()
        await shares_taken(deployment)
        for k in range(rounds):
            body = [{"uri": uri, "meta": {"k": k}} for uri in targets]
            assert (await http.post("/changes", json=body)).status_code == 202
            await asyncio.sleep(0.2)
        seen: set[tuple[str, int]] = set()
        async with asyncio.timeout(60):
            while len(seen) < rounds * COLLECTIONS:
                params = (await stream.next_message()).message["params"]
                seen.add((params["uri"], params["_meta"]["k"]))
    after = await frames_by_worker(deployment)
    shares = [b - a for a, b in zip(before, after, strict=True)]
    total = sum(shares)
    assert total >= rounds * COLLECTIONS
    fractions = [share / total for share in shares]
    print(f"\n[scale-out] frames fanned out per worker: {shares} ({', '.join(f'{f:.1%}' for f in fractions)})")
    assert all(0.23 <= f <= 0.43 for f in fractions), fractions


def partitions(deployment: Deployment, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **deployment.env}
    env.pop("MCP_BROKER_CHANGELOG_PARTITIONS", None)
    return subprocess.run([sys.executable, "-m", "broker.cli", "partitions", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.timeout(120)
async def test_changing_the_partition_count_while_changes_flow_loses_and_reorders_nothing(
        own_deployment: Deployment) -> None:
    deployment = own_deployment
    targets = [f"https://example.com/switch/{n}" for n in range(20)]
    collection = "mcpb://default/switched"
    async with httpx.AsyncClient(base_url=deployment.url, timeout=10) as http:
        assert (await http.put("/collections/switched/r1", json={"v": 0})).status_code == 201
        mcp = await McpSession(http).initialize()
        await mcp.subscribe(*targets, collection)
        last = {uri: -1 for uri in targets}
        stop = asyncio.Event()

        async def publish() -> None:
            seq = 0
            while not stop.is_set():
                body = []
                for uri in targets:
                    body.append({"uri": uri, "meta": {"seq": seq}})
                    last[uri] = seq
                    seq += 1
                response = await http.post("/changes", json=body)
                assert response.status_code == 202, response.text
                await asyncio.sleep(0.01)

        async with mcp.stream() as stream:
            await stream.next_event()
            publisher = asyncio.create_task(publish())
            await asyncio.sleep(1.0)
            for count in (5, 16):  # down, and back up to the default
                done = await asyncio.to_thread(partitions, deployment, "set", str(count), "--wait", "30")
                assert done.returncode == 0, done.stderr
                assert done.stdout.startswith(f"{count} partitions"), done.stdout
                await asyncio.sleep(1.0)
            stop.set()
            await publisher
            # The record moved with its collection: still readable, and writable again.
            assert (await http.get("/collections/switched/r1")).json() == {"v": 0}
            assert (await http.put("/collections/switched/r1", json={"v": 1})).status_code == 200
            seen: dict[str, list[int]] = {uri: [] for uri in targets}
            async with asyncio.timeout(30):
                while any(not seqs or seqs[-1] != last[uri] for uri, seqs in seen.items()):
                    params = (await stream.next_message()).message.get("params", {})
                    if params.get("uri") in seen:
                        seen[params["uri"]].append(params["_meta"]["seq"])
    for uri, seqs in seen.items():
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs), f"{uri}: {seqs}"
        # Nothing lost: with coalescing a frame may stand for several changes, never skip the last.
        assert seqs[-1] == last[uri]
    shown = partitions(deployment)
    assert shown.returncode == 0 and shown.stdout.startswith("16 partitions") and "draining" not in shown.stdout


async def test_a_worker_set_to_another_partition_count_than_the_deployment_does_not_start(
        deployment: Deployment) -> None:
    """Misrouted changes otherwise: one line saying both counts and what to do, exit code 2."""
    env = {**os.environ, **deployment.env, "MCP_BROKER_CHANGELOG_PARTITIONS": "4"}
    done = await asyncio.to_thread(subprocess.run, [sys.executable, "-m", "broker.cli", "serve", "--port", "0"],
                                   cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert "MCP_BROKER_CHANGELOG_PARTITIONS=4" in lines[0] and "has 16 partitions" in lines[0], lines
