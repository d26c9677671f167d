"""An upstream behind the broker against the same upstream with its clients connected to it directly.

    python -m bench.upstreams                   # 1,000 clients, 20 changes
    python -m bench.upstreams --clients 200 --changes 5

Both sides start their servers here, on loopback: the upstream is ``tests/upstream_server.py`` (the
official Python SDK, serving its notes and 2026-07-28 listens), the broker one ``mcp-broker serve``
on the memory backend with the upstream in ``MCP_BROKER_UPSTREAMS``. ``--clients`` listens watch one
note, through the broker, then directly at the upstream; ``--changes`` times the note is changed at
the upstream (``PUT /notes/<id>``, the upstream notifies its watchers as ``set_note`` does).

Reported: the latency from the change at the upstream to its notification at each client (p50,
p99, max over clients x changes), and what the upstream holds: its open listens and its resident
memory after the clients connected (``VmRSS``), against its resident memory before any did.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench.run import BROKER, Proc, free_port, spawn, wait_http

NOTE = "note://bench"
UPDATED = "notifications/resources/updated"
META = {"io.modelcontextprotocol/protocolVersion": "2026-07-28", "io.modelcontextprotocol/clientCapabilities": {},
        "io.modelcontextprotocol/clientInfo": {"name": "bench", "version": "1"}}


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


class Counter:
    """Notifications heard by all listeners; ``reached`` is set once there are ``target`` of them."""

    def __init__(self) -> None:
        self.count = 0
        self.target = 0
        self.reached = asyncio.Event()

    def one(self) -> None:
        self.count += 1
        if self.count >= self.target:
            self.reached.set()

    def expect(self, target: int) -> None:
        self.count, self.target = 0, target
        self.reached.clear()


class Listener:
    """One 2026-07-28 listen on ``NOTE``, recording when each notification arrived."""

    def __init__(self, http: httpx.AsyncClient, index: int, heard: Counter) -> None:
        self.http = http
        self.index = index
        self.heard = heard
        self.arrivals: list[float] = []
        self.acked = asyncio.Event()
        self.task: asyncio.Task[None] | None = None

    async def run(self) -> None:
        body = {"jsonrpc": "2.0", "id": f"l{self.index}", "method": "subscriptions/listen",
                "params": {"_meta": META, "notifications": {"resourceSubscriptions": [NOTE]}}}
        headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json",
                   "MCP-Protocol-Version": "2026-07-28", "Mcp-Method": "subscriptions/listen"}
        async with self.http.stream("POST", "/mcp", content=orjson.dumps(body), headers=headers) as response:
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                message = orjson.loads(line[5:])
                if message.get("method") == "notifications/subscriptions/acknowledged":
                    self.acked.set()
                elif message.get("method") == UPDATED:
                    self.arrivals.append(time.perf_counter())
                    self.heard.one()


async def measure(url: str, upstream: str, upstream_pid: int, clients: int, changes: int) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=clients + 10, max_keepalive_connections=10)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http, \
            httpx.AsyncClient(base_url=upstream, timeout=10) as side:
        heard = Counter()
        listeners = [Listener(http, i, heard) for i in range(clients)]
        for listener in listeners:
            listener.task = asyncio.create_task(listener.run())
        await asyncio.wait_for(asyncio.gather(*(listener.acked.wait() for listener in listeners)), 120)
        deadline = time.monotonic() + 30
        while NOTE not in (await side.get("/stats")).json()["listening"]:  # the broker's one watch is up
            if time.monotonic() > deadline:
                raise TimeoutError("the upstream was never watched")
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)  # the watch's first look (the gap rule's updated) has reached everyone
        for listener in listeners:
            listener.arrivals.clear()
        latencies: list[float] = []
        for change in range(changes):
            heard.expect(clients)
            sent = time.perf_counter()
            await side.put(f"/notes/{NOTE.removeprefix('note://')}", json={"text": str(change)})
            await asyncio.wait_for(heard.reached.wait(), 30)
            latencies += [listener.arrivals[change] - sent for listener in listeners]
        stats = (await side.get("/stats")).json()
        held = {"listens": stats["listens"], "rss_kib": rss_kib(upstream_pid)}
        for listener in listeners:
            assert listener.task is not None
            listener.task.cancel()
        await asyncio.gather(*(listener.task for listener in listeners if listener.task), return_exceptions=True)
    latencies.sort()
    return {"p50_ms": round(statistics.median(latencies) * 1000, 2),
            "p99_ms": round(latencies[int(len(latencies) * 0.99) - 1] * 1000, 2),
            "max_ms": round(latencies[-1] * 1000, 2), "samples": len(latencies), **held}


def upstream_process(logs: Path) -> tuple[Proc, str]:
    port = free_port()
    proc = spawn([sys.executable, "-m", "tests.upstream_server", "--port", str(port)], logs / "upstream.log")
    wait_http(port, proc)
    return proc, f"http://127.0.0.1:{port}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--changes", type=int, default=20)
    args = parser.parse_args()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(tmp)
        for side in ("broker", "direct"):
            upstream, upstream_url = upstream_process(logs)
            broker = None
            try:
                idle = rss_kib(upstream.popen.pid)
                url = upstream_url
                if side == "broker":
                    port = free_port()
                    config = {"notes": {"url": upstream_url + "/mcp", "prefixes": ["note://"]}}
                    env = {**os.environ, "MCP_BROKER_UPSTREAMS": json.dumps(config),
                           "MCP_BROKER_MAX_LISTENS": str(args.clients + 10)}
                    broker = spawn([BROKER, "--log-level", "warning", "serve", "--port", str(port)],
                                   logs / "broker.log", env)
                    wait_http(port, broker)
                    url = f"http://127.0.0.1:{port}"
                results[side] = {"upstream_rss_kib_idle": idle,
                                 **asyncio.run(measure(url, upstream_url, upstream.popen.pid, args.clients,
                                                       args.changes))}
            finally:
                for proc in (broker, upstream):
                    if proc is not None:
                        proc.stop()
    print(json.dumps({"clients": args.clients, "changes": args.changes, **results}, indent=2))


if __name__ == "__main__":
    main()
