"""What durable mode costs a publish: ``MCP_BROKER_REDIS_DURABLE_REPLICAS`` 0 against 1.

``python -m bench.durable [--rounds 2] [--requests 2000] [--seconds 5]`` starts a Redis master
and one replica on loopback, then, alternately, ``mcp-broker serve`` on the master with durable
mode off and on. Each round measures a ``POST /changes`` of one change: its latency, one
request at a time on one keep-alive connection, and the changes a second 16 concurrent
publishers get acknowledged; and the worker's CPU per acknowledged change in both. Prints one
line per run and the medians per mode.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

from bench.fairness import free_port

ROOT = Path(__file__).resolve().parents[1]


def redis(port: int, workdir: Path, *extra: str) -> subprocess.Popen[bytes]:
    workdir.mkdir()
    return subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind", "127.0.0.1",
                             "--save", "", "--appendonly", "no", "--dir", str(workdir), *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def wait_for(check: object, what: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():  # type: ignore[operator]
                return
        except (OSError, httpx.HTTPError):
            pass
        time.sleep(0.05)
    raise TimeoutError(what)


def in_sync(port: int) -> bool:
    out = subprocess.run(["redis-cli", "-p", str(port), "info", "replication"], capture_output=True, text=True).stdout
    return "master_link_status:up" in out


async def run(master: int, durable: int, requests: int, seconds: float) -> dict[str, float]:
    port = free_port()
    env = {**os.environ, "MCP_BROKER_REDIS_URL": f"redis://127.0.0.1:{master}/0",
           "MCP_BROKER_REDIS_PREFIX": f"d{time.monotonic_ns()}", "MCP_BROKER_REDIS_DURABLE_REPLICAS": str(durable)}
    worker = subprocess.Popen([sys.executable, "-m", "broker.cli", "--log-level", "warning", "serve", "--port",
                               str(port)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: httpx.get(url + "/readyz", timeout=1).status_code == 200, "broker start")
        cpu = psutil.Process(worker.pid)
        async with httpx.AsyncClient(base_url=url, timeout=10) as http:
            for n in range(200):  # warm-up
                await http.post("/changes", json={"uri": f"bench://warm/{n}"})
            times = []
            used = cpu.cpu_times()
            for n in range(requests):
                started = time.perf_counter()
                answer = await http.post("/changes", json={"uri": f"bench://one/{n % 100}"})
                times.append(time.perf_counter() - started)
                assert answer.status_code == 202, answer.text
            after = cpu.cpu_times()
            sequential_cpu = (after.user + after.system - used.user - used.system) / requests
            times.sort()
        done = 0

        async def publisher(index: int, until: float) -> None:
            nonlocal done
            async with httpx.AsyncClient(base_url=url, timeout=10) as own:
                while time.monotonic() < until:
                    if (await own.post("/changes", json={"uri": f"bench://many/{index}"})).status_code == 202:
                        done += 1

        used = cpu.cpu_times()
        until = time.monotonic() + seconds
        await asyncio.gather(*(publisher(i, until) for i in range(16)))
        after = cpu.cpu_times()
        return {"p50_ms": times[len(times) // 2] * 1e3, "p99_ms": times[int(len(times) * 0.99)] * 1e3,
                "cpu_us": sequential_cpu * 1e6, "per_s": done / seconds,
                "cpu_us_loaded": (after.user + after.system - used.user - used.system) / max(done, 1) * 1e6}
    finally:
        worker.terminate()
        worker.wait(15)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        master_port, replica_port = free_port(), free_port()
        master = redis(master_port, Path(tmp) / "m", "--repl-diskless-sync-delay", "0")
        replica = redis(replica_port, Path(tmp) / "r", "--replicaof", "127.0.0.1", str(master_port))
        try:
            wait_for(lambda: in_sync(replica_port), "replica in sync")
            results: dict[int, list[dict[str, float]]] = {0: [], 1: []}
            for _ in range(args.rounds):
                for durable in (0, 1):
                    result = await run(master_port, durable, args.requests, args.seconds)
                    results[durable].append(result)
                    print(f"durable={durable}: " + ", ".join(f"{k} {v:.3f}" for k, v in result.items()), flush=True)
            for durable, runs in results.items():
                print(f"median durable={durable}: " + ", ".join(
                    f"{key} {statistics.median(r[key] for r in runs):.3f}" for key in runs[0]))
        finally:
            for server in (replica, master):
                server.kill()
                server.wait(10)


if __name__ == "__main__":
    asyncio.run(main())
