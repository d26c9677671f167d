"""Instructions per delivered frame, counted by ``valgrind --tool=callgrind``: a figure no noisy machine blurs.

    python -m bench.instructions                 # memory backend, 100 sessions, 300 changes
    python -m bench.instructions --changes 500   # more changes, same per-frame figure

The workload runs in one process over ASGI, with no sockets: 100 legacy sessions, 10 on each
of 10 URIs, each with an open GET stream; then ``--changes`` changes through ``POST /changes``,
one at a time, each delivered to its 10 streams before the next is published (so no batch
coalesces and every run does the same work). It runs twice under callgrind, with no change and
with ``--changes``, and the difference of the two totals, divided by the frames delivered, is
the cost of one frame: a tenth of a publish request, fan-out and one SSE event. The hash seed is
fixed; what is left to vary is a few thousand instructions of timer wake-ups per run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import tempfile
from typing import Any

SESSIONS, FANOUT = 100, 10
HEADERS = [(b"host", b"127.0.0.1"), (b"accept", b"application/json, text/event-stream"),
           (b"content-type", b"application/json")]


def _scope(method: str, path: str, headers: list[tuple[bytes, bytes]]) -> dict[str, Any]:
    return {"type": "http", "method": method, "path": path, "headers": HEADERS + headers, "query_string": b"",
            "http_version": "1.1", "scheme": "http", "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1),
            "root_path": ""}


async def _call(app: Any, method: str, path: str, body: bytes, headers: list[tuple[bytes, bytes]]) -> list[Any]:
    sent: list[Any] = []
    first = True

    async def receive() -> dict[str, Any]:
        nonlocal first
        if first:
            first = False
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message: Any) -> None:
        sent.append(message)

    await app(_scope(method, path, headers), receive, send)
    return sent


async def workload(changes: int) -> int:
    """Run the workload in this process; the frames delivered."""
    import orjson

    from broker.app import create_app
    from broker.config import Settings
    from broker.runtime import Broker

    broker = Broker(Settings(_env_file=None, keepalive_interval=3600, outage_check_interval=3600))  # type: ignore[call-arg]
    app = create_app(broker=broker)
    await broker.start()
    version = [(b"mcp-protocol-version", b"2025-11-25")]
    sids = []
    for i in range(SESSIONS):
        init = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
                "params": {"protocolVersion": "2025-11-25", "capabilities": {},
                           "clientInfo": {"name": "b", "version": "1"}}}
        sent = await _call(app, "POST", "/mcp", orjson.dumps(init), [])
        sid = dict(sent[0]["headers"])[b"mcp-session-id"]
        sids.append(sid)
        subscribe = {"jsonrpc": "2.0", "id": 2, "method": "resources/subscribe", "params": {"uri": f"x:u{i // FANOUT}"}}
        await _call(app, "POST", "/mcp", orjson.dumps(subscribe), [(b"mcp-session-id", sid), *version])
    frames, target = 0, 0
    arrived = asyncio.Event()

    async def stream(sid: bytes) -> None:
        async def receive() -> dict[str, Any]:
            await asyncio.sleep(3600)
            return {"type": "http.disconnect"}

        async def send(message: Any) -> None:
            nonlocal frames
            if message["type"] == "http.response.body":
                frames += message.get("body", b"").count(b"data: {")
                if frames >= target:
                    arrived.set()

        await app(_scope("GET", "/mcp", [(b"mcp-session-id", sid), *version]), receive, send)

    tasks = [asyncio.create_task(stream(sid)) for sid in sids]
    await asyncio.sleep(0.2)
    for k in range(changes):
        target = (k + 1) * FANOUT
        arrived.clear()
        change = {"uri": f"x:u{k % (SESSIONS // FANOUT)}", "meta": {"k": k}}
        await _call(app, "POST", "/changes", orjson.dumps(change), [])
        await asyncio.wait_for(arrived.wait(), 60)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await broker.stop()
    return frames


def _count(changes: int) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/cg.out", sys.executable, "-m",
             "bench.instructions", "--run", str(changes)],
            env={**os.environ, "PYTHONHASHSEED": "0"}, capture_output=True, text=True, check=True)
    found = re.search(r"Collected : (\d+)", out.stderr)
    if found is None:
        raise SystemExit(f"no callgrind total in:\n{out.stderr[-2000:]}")
    return int(found.group(1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--changes", type=int, default=300)
    parser.add_argument("--run", type=int, help=argparse.SUPPRESS)  # the workload itself, under valgrind
    args = parser.parse_args()
    if args.run is not None:
        print("frames", asyncio.run(workload(args.run)), file=sys.stderr)
        return 0
    base, loaded = _count(0), _count(args.changes)
    frames = args.changes * FANOUT
    print(f"memory backend: {(loaded - base) / frames:,.0f} instructions per delivered frame "
          f"({args.changes} changes, {frames} frames; totals {base:,} and {loaded:,})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
