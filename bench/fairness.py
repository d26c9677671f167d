"""Fairness between tenants: one tenant's notification latency before and during another's flood.

``python -m bench.fairness [--redis URL] [--seconds 10]`` starts ``mcp-broker serve`` with two
API keys (tenants ``quiet`` and ``flood``) and ``MCP_BROKER_QUOTAS`` giving ``flood`` a quota of
sessions and publishes a second. The quiet tenant holds 50 legacy sessions with a GET stream
each, all subscribed to one URI, and publishes one change of it every 50 ms; each change
carries its send time in ``meta``, and every frame received is timed against it (client clock,
one process). Phase one measures that alone; phase two adds the flood: the flooding tenant
publishes as fast as 8 concurrent loops can (most answered 429 by its quota) and keeps opening
sessions past its quota. Prints the quiet tenant's p50/p99 in each phase and their ratio
(target: p99 during / before <= 2).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

ROOT = Path(__file__).resolve().parents[1]
KEYS = {"kq": "quiet/q", "kf": "flood/f"}
FLOOD_QUOTAS = {"sessions": 200, "publish_per_second": 500}
ACCEPT = "application/json, text/event-stream"
QUIET_SESSIONS = 50
QUIET_EVERY = 0.05
URI = "test://quiet/clock"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def initialize(http: httpx.AsyncClient, key: str) -> str | None:
    body = {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "bench", "version": "1"}}}
    answer = await http.post("/mcp", json=body, headers={"Accept": ACCEPT, "Authorization": f"Bearer {key}"})
    return answer.headers.get("mcp-session-id") if answer.status_code == 200 else None


async def quiet_session(http: httpx.AsyncClient, latencies: list[tuple[float, float]], ready: asyncio.Event,
                        count: list[int]) -> None:
    sid = await initialize(http, "kq")
    assert sid is not None
    headers = {"Accept": ACCEPT, "Authorization": "Bearer kq", "Mcp-Session-Id": sid,
               "MCP-Protocol-Version": "2025-11-25"}
    await http.post("/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "resources/subscribe", "params": {"uri": URI}},
                    headers=headers)
    async with http.stream("GET", "/mcp", headers={**headers, "Accept": "text/event-stream"}) as response:
        count[0] += 1
        if count[0] == QUIET_SESSIONS:
            ready.set()
        async for line in response.aiter_lines():
            if line.startswith("data:") and '"_meta"' in line:
                sent = orjson.loads(line[5:])["params"]["_meta"]["t"]
                now = time.time()
                latencies.append((now, now - sent))


async def quiet_publisher(http: httpx.AsyncClient, until: float) -> None:
    while time.time() < until:
        await http.post("/changes", json={"uri": URI, "meta": {"t": time.time()}},
                        headers={"Authorization": "Bearer kq"})
        await asyncio.sleep(QUIET_EVERY)


async def flood(http: httpx.AsyncClient, until: float, statuses: dict[int, int]) -> None:
    n = 0
    while time.time() < until:
        n += 1
        body = [{"uri": f"test://flood/{n}/{i}"} for i in range(10)] if n % 2 else {"uri": f"test://flood/{n}"}
        answer = await http.post("/changes", json=body, headers={"Authorization": "Bearer kf"})
        statuses[answer.status_code] = statuses.get(answer.status_code, 0) + 1
        if n % 5 == 0:
            await initialize(http, "kf")  # sessions past the quota get 429


async def flood_all(url: str, seconds: float) -> dict[int, int]:
    statuses: dict[int, int] = {}
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        until = time.time() + seconds
        await asyncio.gather(*(flood(http, until, statuses) for _ in range(8)))
    return statuses


def summary(values: list[float]) -> tuple[float, float]:
    ordered = sorted(values)
    return statistics.median(ordered) * 1000, ordered[int(len(ordered) * 0.99) - 1] * 1000


async def run(url: str, seconds: float) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=200)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as http:
        latencies: list[tuple[float, float]] = []
        ready, count = asyncio.Event(), [0]
        readers = [asyncio.create_task(quiet_session(http, latencies, ready, count)) for _ in range(QUIET_SESSIONS)]
        await asyncio.wait_for(ready.wait(), 30)
        await asyncio.sleep(0.5)
        start = time.time()
        await quiet_publisher(http, start + seconds)
        middle = time.time()
        # The flood runs in a process of its own, so it does not slow down this one's clock readings.
        flooder = await asyncio.create_subprocess_exec(sys.executable, "-m", "bench.fairness", "--flood", url,
                                                       "--seconds", str(seconds), cwd=ROOT,
                                                       stdout=asyncio.subprocess.PIPE)
        await quiet_publisher(http, middle + seconds)
        out, _ = await flooder.communicate()
        statuses = json.loads(out)
        await asyncio.sleep(1.0)
        for reader in readers:
            reader.cancel()
        before = [lat for at, lat in latencies if start <= at < middle]
        during = [lat for at, lat in latencies if at >= middle]
        (p50b, p99b), (p50d, p99d) = summary(before), summary(during)
        return {"before_ms": {"p50": round(p50b, 2), "p99": round(p99b, 2), "frames": len(before)},
                "during_ms": {"p50": round(p50d, 2), "p99": round(p99d, 2), "frames": len(during)},
                "p99_ratio": round(p99d / p99b, 2), "flood_statuses": statuses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis", default="", help="a Redis URL (default: the memory backend)")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each phase")
    parser.add_argument("--flood-rate", type=int, default=FLOOD_QUOTAS["publish_per_second"],
                        help="the flooding tenant's publish_per_second quota")
    parser.add_argument("--flood", default="", help=argparse.SUPPRESS)  # the flooding process, at this URL
    args = parser.parse_args()
    if args.flood:
        print(json.dumps(asyncio.run(flood_all(args.flood, args.seconds))))
        return
    port = free_port()
    env = {**os.environ, "MCP_BROKER_API_KEYS": json.dumps(KEYS), "MCP_BROKER_QUOTAS": json.dumps(
               {"flood": {**FLOOD_QUOTAS, "publish_per_second": args.flood_rate}}),
           "MCP_BROKER_REDIS_URL": args.redis, "MCP_BROKER_REDIS_PREFIX": f"fair{port}", "MCP_BROKER_METRICS": "false"}
    binary = Path(sys.executable).parent / "mcp-broker"
    proc = subprocess.Popen([str(binary), "--log-level", "warning", "serve", "--port", str(port)], env=env, cwd=ROOT,
                            stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(200):
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                    break
            time.sleep(0.05)
        print(json.dumps({"backend": "redis" if args.redis else "memory", **asyncio.run(run(url, args.seconds))}))
    finally:
        proc.terminate()
        proc.wait(15)


if __name__ == "__main__":
    main()
