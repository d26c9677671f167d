"""Instructions per delivered frame, counted by ``valgrind --tool=callgrind``: a figure no noisy machine blurs.

    python -m bench.instructions                   # memory and Redis, both workloads
    python -m bench.instructions --backend memory  # one backend; --workload batched: one workload
    python -m bench.instructions --keep /tmp/cg    # keep the callgrind files, for callgrind_annotate
    make bench-instructions                        # both

For Redis, a ``redis-server`` is started outside valgrind, so the first figure is the worker's
side of a frame: the publish script call, the fenced read, the inbox appends, the wake-up
decoding and the SSE event. Redis's own (the scripts, the commands, the replies) is counted in
two more runs, with the worker outside valgrind and ``redis-server`` under it (a slowed
Redis would change how the worker's reads fall, and so its count).

The workloads run in one process over ASGI, with no sockets, each on legacy sessions with an
open GET stream, 10 on each URI:

* ``one``: 100 sessions on 10 URIs; 300 changes through ``POST /changes``, one at a time, each
  delivered to its 10 streams before the next is published, so every fan-out batch holds one
  change and its per-batch costs (the read, the subscribers, the round trips) weigh on 10 frames.
* ``batched``: 1,000 sessions on 100 URIs; 1,000 changes published 50 at a time, each 50 in one
  request to 50 distinct URIs and delivered (500 frames) before the next: fan-out batches of 50
  changes, as on a worker busy with the targeted benchmark point, so per-frame costs dominate
  (one request carries 50 changes, so the publish weighs less than there, where each change is
  a request of its own).

Each runs twice under callgrind, with its first tenth of changes (the warm-up) and with all of
them, and the difference of the two totals, divided by the frames the rest delivered, is the cost
of one frame: its share of a publish request (a tenth in ``one``, a 500th in ``batched``), its
share of fan-out and one SSE event. (A warm-up rather than no change at all: a run that stopped
as soon as its streams had started counted what of the start was still under way, which moved
a Redis run's total by up to 5% on a busy machine; a warmed-up run's total moved by 0.01%.)
The workload runs on uvloop, the loop of a worker: on asyncio's own loop, which is Python, the
turns a round trip takes depend on when its reply comes, and a Redis run with its changes moved
by 0.2% between an idle CPU and a shared one (0.01% on uvloop). The hash seed is fixed, and the
garbage collector is tuned as a worker tunes it once started (``broker.runtime.server.tune_collector``):
with CPython's own thresholds, full collections that a worker does not run fell into the runs as
they pleased. The worker's rounds that run by wall time (the count of live sessions and feeds,
the look for webhook subscriptions; on Redis its lease heartbeat, its look at the partition
layouts, its lag report, an idle read's return) are pushed past the length of a run
(``_wall_timers_off``, ``SESSIONS_COUNT_INTERVAL``): they cost per second, not per frame, and a
run that takes longer under valgrind, on a slower hour, would count more of them.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

FANOUT = 10
#: Per workload: sessions, changes, changes published at once, changes of the warm-up.
WORKLOADS = {"one": (100, 300, 1, 30), "batched": (1000, 1000, 50, 100)}
#: Seconds any one step of the workload may take, at valgrind's speed.
TIMEOUT = 600
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


def _wall_timers_off() -> None:
    """Push the worker's wall-clock rounds on Redis past the length of a run.

    A worker spends on them per second, not per frame: the lease heartbeat and the hold of its
    share (every third and sixth of ``fanout_claim_idle_ms``, set to an hour), the look at the
    partition layouts (``LOOK_INTERVAL``), the lag report (``REPORT_INTERVAL``) and an idle
    read's return (``READ_BLOCK_MS``; at most ``redis_socket_timeout``, set to ten minutes).
    Under valgrind a run lasts minutes, longer on a slower hour, and every round that fell into
    it would be counted as if the frames had cost it.
    """
    import broker.backends.redis.changelog
    import broker.fanout

    broker.backends.redis.changelog.LOOK_INTERVAL = 3600.0
    broker.fanout.REPORT_INTERVAL = 3600.0
    broker.fanout.READ_BLOCK_MS = 3_600_000


async def workload(changes: int, sessions: int = 100, group: int = 1) -> int:
    """Run the workload in this process (on Redis when ``BENCH_REDIS_URL`` is set); the frames delivered.

    ``sessions`` on ``sessions // FANOUT`` URIs; ``changes`` published ``group`` at a time (in one
    request), each group to distinct URIs and delivered before the next."""
    import orjson

    from broker.config import Settings
    from broker.runtime import Broker
    from broker.runtime.app import create_app
    from broker.runtime.server import tune_collector

    redis: dict[str, Any] = {}
    if os.environ.get("BENCH_REDIS_URL"):
        # At valgrind's speed (50-100 times slower) a default timeout can fire where it never
        # would natively; no health-check PING every 15 s of wall time either (it would count).
        redis = {"redis_url": os.environ["BENCH_REDIS_URL"], "redis_socket_timeout": 600.0,
                 "redis_connect_timeout": 60.0, "redis_health_check_interval": 0,
                 "fanout_claim_idle_ms": 3_600_000}
        _wall_timers_off()
    # Rounds of that kind on either backend: the count of the live sessions and feeds (every 5 s of
    # wall time) runs once, at the start; the look for webhook subscriptions (a third of the
    # lease, 1.7 s by default: a store read each time) every 200 s.
    from broker import runtime
    runtime.SESSIONS_COUNT_INTERVAL = 3600.0
    chosen = {"keepalive_interval": 3600, "outage_check_interval": 3600, "credential_check_seconds": 300,
              "webhook_lease_ms": 600_000, **redis}
    # Only what this tree has, so that the file counts an older checkout too.
    broker = Broker(Settings(_env_file=None, **{k: v for k, v in chosen.items() if k in Settings.model_fields}))  # type: ignore[call-arg]
    app = create_app(broker=broker)
    await broker.start()
    tune_collector(broker.settings.gc_thresholds)  # as a worker does once started (broker/runtime/server.py)
    version = [(b"mcp-protocol-version", b"2025-11-25")]
    sids = []
    for i in range(sessions):
        init = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
                "params": {"protocolVersion": "2025-11-25", "capabilities": {},
                           "clientInfo": {"name": "b", "version": "1"}}}
        sent = await _call(app, "POST", "/mcp", orjson.dumps(init), [])
        sid = dict(sent[0]["headers"])[b"mcp-session-id"]
        sids.append(sid)
        subscribe = {"jsonrpc": "2.0", "id": 2, "method": "resources/subscribe", "params": {"uri": f"x:u{i // FANOUT}"}}
        await _call(app, "POST", "/mcp", orjson.dumps(subscribe), [(b"mcp-session-id", sid), *version])
    frames, target, primed = 0, 0, 0
    arrived, started, leave = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def stream(sid: bytes) -> None:
        first = True

        async def receive() -> dict[str, Any]:
            await leave.wait()
            return {"type": "http.disconnect"}

        async def send(message: Any) -> None:
            nonlocal frames, primed, first
            if message["type"] == "http.response.body":
                body = message.get("body", b"")
                if first and body.startswith(b"id: "):  # the priming event: the stream has started
                    first = False
                    primed += 1
                    if primed == sessions:
                        started.set()
                frames += body.count(b"data: {")
                if frames >= target:
                    arrived.set()

        await app(_scope("GET", "/mcp", [(b"mcp-session-id", sid), *version]), receive, send)

    # Every stream has claimed its session and read its inbox before the first change (a fixed
    # pause was too short under valgrind, and streams cut off mid-start are not the workload).
    tasks = [asyncio.create_task(stream(sid)) for sid in sids]
    await asyncio.wait_for(started.wait(), TIMEOUT)
    uris = sessions // FANOUT
    for first in range(0, changes, group):
        ks = range(first, min(first + group, changes))
        target = ks[-1] * FANOUT + FANOUT
        arrived.clear()
        group_changes = [{"uri": f"x:u{k % uris}", "meta": {"k": k}} for k in ks]
        await _call(app, "POST", "/changes", orjson.dumps(group_changes[0] if group == 1 else group_changes), [])
        await asyncio.wait_for(arrived.wait(), TIMEOUT)
    # The clients go away (as over HTTP), rather than their tasks being cancelled.
    leave.set()
    await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), TIMEOUT)
    await broker.stop()
    return frames


def _count(name: str, changes: int, backend: str, keep: str | None = None, counted: str = "worker") -> int:
    """The instructions of one run of the workload: the worker's, or (``counted="redis"``, the
    worker running natively) redis-server's."""
    # Worker and Redis share one CPU: how the worker's reads fall depends on whether Redis answers
    # from another CPU meanwhile, and moved its count by 2-3% from one run to the next.
    pin = ["taskset", "-c", "0"] if shutil.which("taskset") else []

    def counting(command: list[str], out: str) -> list[str]:
        return [*pin, "valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", *command]

    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        env.pop("BENCH_REDIS_URL", None)
        env.pop("MCP_BROKER_REDIS_URL", None)
        redis = None
        if backend == "redis":
            port = _free_port()
            command = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
            command = counting(command, f"{tmp}/redis.out") if counted == "redis" else [*pin, *command]
            with open(f"{tmp}/redis.err", "w") as err:  # valgrind's report, with its total, goes there
                redis = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err)
            env["BENCH_REDIS_URL"] = f"redis://127.0.0.1:{port}/0"
            _wait_redis(port)
        worker = [sys.executable, "-m", "bench.instructions", "--workload", name, "--run", str(changes)]
        worker = counting(worker, f"{tmp}/cg.out") if counted == "worker" else [*pin, *worker]
        redis_stderr = ""
        try:
            out = subprocess.run(worker, env=env, capture_output=True, text=True, check=True)
        finally:
            if redis is not None:
                redis.terminate()  # redis-server exits on SIGTERM, and a callgrind around it writes its total
                try:
                    redis.wait(120)
                except subprocess.TimeoutExpired:
                    redis.kill()
                    redis.wait()
                    raise SystemExit("redis-server did not stop within 120 s of SIGTERM") from None
                with open(f"{tmp}/redis.err") as err:
                    redis_stderr = err.read()
            if keep and counted == "worker":  # for callgrind_annotate (--inclusive=yes): where a frame's work goes
                os.makedirs(keep, exist_ok=True)
                os.replace(f"{tmp}/cg.out", os.path.join(keep, f"callgrind.{name}.{backend}.{changes}.out"))
    stderr = out.stderr if counted == "worker" else redis_stderr
    found = re.search(r"Collected : (\d+)", stderr)
    if found is None:
        raise SystemExit(f"no callgrind total in:\n{stderr[-2000:]}")
    return int(found.group(1))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_redis(port: int) -> None:
    for _ in range(200):
        try:
            with socket.create_connection(("127.0.0.1", port), 0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return
        except OSError:
            time.sleep(0.05)
    raise SystemExit("redis-server did not start")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=[*WORKLOADS, "both"], default="both")
    parser.add_argument("--backend", choices=["memory", "redis", "both"], default="both")
    parser.add_argument("--keep", metavar="DIR", help="keep the callgrind files in DIR")
    parser.add_argument("--run", type=int, help=argparse.SUPPRESS)  # the workload itself, under valgrind
    args = parser.parse_args()
    if args.run is not None:
        sessions, _, group, _ = WORKLOADS[args.workload]
        import uvloop  # the loop a worker runs on (uvicorn's "auto", with uvicorn[standard])

        print("frames", uvloop.run(workload(args.run, sessions, group)), file=sys.stderr)
        return 0
    for name in WORKLOADS if args.workload == "both" else (args.workload,):
        sessions, changes, group, warm = WORKLOADS[name]
        frames = (changes - warm) * FANOUT
        for backend in ("memory", "redis") if args.backend == "both" else (args.backend,):
            base, loaded = _count(name, warm, backend, args.keep), _count(name, changes, backend, args.keep)
            print(f"{name}, {backend} backend: {(loaded - base) / frames:,.0f} instructions per delivered frame "
                  f"({sessions} sessions, {changes} changes {group} at a time after {warm} of warm-up, "
                  f"{frames} frames; totals {base:,} and {loaded:,})", flush=True)
            if backend == "redis":
                base = _count(name, warm, backend, counted="redis")
                loaded = _count(name, changes, backend, counted="redis")
                print(f"{name}, redis-server's own: {(loaded - base) / frames:,.0f} instructions per delivered frame "
                      f"(the same workload, the worker not counted; totals {base:,} and {loaded:,})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
