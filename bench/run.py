"""Run benchmark scenarios against servers this script starts itself, and write bench/README.md.

    python -m bench.run --smoke                       # CI: 100 sessions, 1,000 changes, memory + Redis
    python -m bench.run --full                        # every server x every point x 3 repeats
    python -m bench.run --servers sdk,broker-memory --points targeted-1k,replay-100 --repeats 1
    python -m bench.run --servers broker-redis-1 --points targeted-10k --redis-cpu 1

Servers: ``broker-memory``, ``broker-redis-1``, ``broker-redis-2`` (``--workers 2``),
``sdk`` (bench/sdk_server.py on the official SDK).  Each point of each repeat gets
a fresh server (and a fresh ``redis-server --save "" --appendonly no`` on a free
port).  With one server process the server and Redis are pinned to CPU 0 (Redis to
another CPU with ``--redis-cpu``, so that the worker has CPU 0 to itself); the load
generator always runs pinned to CPU 1.  Raw results go to bench/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
PY = sys.executable
BROKER = str(Path(PY).parent / "mcp-broker")
HAVE_TASKSET = shutil.which("taskset") is not None and (os.cpu_count() or 1) >= 2

SERVERS = ["broker-memory", "broker-redis-1", "broker-redis-2", "sdk"]

# name -> loadgen arguments
POINTS: dict[str, list[str]] = {
    "targeted-1k": "--scenario targeted --sessions 1000 --fanout 10 --rate 1000 --duration 10".split(),
    "targeted-10k": "--scenario targeted --sessions 10000 --fanout 10 --rate 1000 --duration 10".split(),
    "targeted-1k-200": "--scenario targeted --sessions 1000 --fanout 10 --rate 200 --duration 10".split(),
    "broadcast-1k-2": "--scenario broadcast --sessions 1000 --rate 2 --duration 10".split(),
    "broadcast-1k-20": "--scenario broadcast --sessions 1000 --rate 20 --duration 10".split(),
    "idle-10k": "--scenario idle --sessions 10000 --duration 10".split(),
    "idle-15k": "--scenario idle --sessions 15000 --duration 10".split(),
    "replay-100": "--scenario replay --tries 50 --missed 100".split(),
    "storm-1k": "--scenario storm --sessions 1000 --missed 10".split(),
    "ingest-5k": ("--scenario targeted --sessions 1000 --fanout 1 --rate 5000 --unwatched 4 --duration 10"
                  " --batch").split(),
    "listen-1k": "--scenario listen --sessions 1000 --fanout 10 --rate 1000 --duration 10".split(),
    "listen-1k-100": "--scenario listen --sessions 1000 --fanout 10 --rate 100 --duration 10".split(),
}

TITLES = {
    "targeted-1k": "(a) targeted: 1,000 legacy sessions, 100 URIs x 10 sessions, 1,000 changes/s (10k frames/s)",
    "targeted-10k": "(a) targeted: 10,000 legacy sessions, 1,000 URIs x 10 sessions, 1,000 changes/s (10k frames/s)",
    "targeted-1k-200": "(a) targeted, light: 1,000 legacy sessions, 10 per URI, 200 changes/s (2k frames/s)",
    "ingest-5k": "(f) ingestion: 5,000 changes/s over 5,000 URIs, 1 in 5 watched (1,000 URIs x 1 session, 1k frames/s)",
    "broadcast-1k-2": "(b) broadcast: 1,000 legacy sessions on one URI, 2 changes/s (2k frames/s)",
    "broadcast-1k-20": "(b) broadcast: 1,000 legacy sessions on one URI, 20 changes/s (20k frames/s)",
    "idle-10k": "(c) idle: 10,000 legacy sessions with an open GET stream (1 subscription each)",
    "idle-15k": "(c) idle: 15,000 legacy sessions with an open GET stream (1 subscription each)",
    "replay-100": "(d) one reconnect with 100 missed notifications (100 URIs, one change each), 50 tries",
    "storm-1k": "(d) storm: 1,000 simultaneous reconnects, 10 missed each",
    "listen-1k": "(e) 2026-07-28 listens, targeted: 1,000 streams, 10 per URI, 1,000 changes/s",
    "listen-1k-100": "(e) 2026-07-28 listens, targeted, light: 1,000 streams, 10 per URI, 100 changes/s",
}

FLOW_COLS = [
    ("delivered", "delivered"),
    ("missing", "missing"),
    ("duplicates", "dups"),
    ("p50_ms", "p50 ms"),
    ("p90_ms", "p90 ms"),
    ("p99_ms", "p99 ms"),
    ("p999_ms", "p99.9 ms"),
    ("max_ms", "max ms"),
    ("frames_per_s", "frames/s"),
    ("server_cpu_pct", "server CPU %"),
    ("server_us_per_frame", "server µs/frame"),
    ("aux_cpu_pct", "redis CPU %"),
    ("client_cpu_pct", "client CPU %"),
    ("publish_wall_s", "publish s"),
    ("drain_s", "drain s"),
    ("setup_s", "setup s"),
]
COLS: dict[str, list[tuple[str, str]]] = {
    "targeted": FLOW_COLS,
    "broadcast": FLOW_COLS,
    "listen": FLOW_COLS,
    "idle": [
        ("opened", "opened"),
        ("alive_after_idle", "alive"),
        ("setup_s", "setup s"),
        ("sessions_per_s", "sessions/s"),
        ("setup_server_cpu_ms_per_session", "server CPU ms/session"),
        ("server_rss_before_mb", "RSS before MB"),
        ("server_rss_after_mb", "RSS after MB"),
        ("server_rss_kb_per_session", "RSS KB/session"),
        ("kernel_tcp_mem_kb_per_session", "kernel TCP KB/session"),
        ("idle_server_cpu_pct", "idle server CPU %"),
    ],
    "replay": [
        ("complete", "complete"),
        ("p50_ms", "p50 ms"),
        ("p99_ms", "p99 ms"),
        ("max_ms", "max ms"),
        ("missing", "missing"),
        ("duplicates", "dups"),
        ("foreign_frames", "foreign frames"),
        ("live_tail_ok", "live tail ok"),
    ],
    "storm": [
        ("completed_sessions", "completed"),
        ("p50_ms", "p50 ms"),
        ("p99_ms", "p99 ms"),
        ("max_ms", "max ms"),
        ("all_done_s", "all done s"),
        ("missing", "missing"),
        ("duplicates", "dups"),
        ("foreign_frames", "foreign frames"),
        ("server_cpu_pct", "server CPU %"),
        ("client_cpu_pct", "client CPU %"),
    ],
}
# figures where a ratio to the SDK is shown (broker / SDK)
RATIO = {
    "p50_ms",
    "p99_ms",
    "server_us_per_frame",
    "server_rss_kb_per_session",
    "sessions_per_s",
    "setup_server_cpu_ms_per_session",
    "all_done_s",
    "frames_per_s",
}


def raise_nofile() -> None:
    """Every open stream is a descriptor in the server: 15,000 idle streams need more than the usual
    soft limit of 1,024. The servers this script starts inherit the raised limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pin(cmd: list[str], cpu: str | None) -> list[str]:
    return ["taskset", "-c", cpu, *cmd] if cpu is not None and HAVE_TASKSET else cmd


@dataclass
class Proc:
    popen: subprocess.Popen[bytes]
    log: Path

    def stop(self) -> None:
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGTERM)
            except ProcessLookupError:
                return
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait(5)


def spawn(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> Proc:
    f = open(log, "wb")
    p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
    return Proc(p, log)


def wait_http(port: int, proc: Proc, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"server exited: {proc.log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"server not ready on {port}: {proc.log.read_text()[-2000:]}")


def wait_redis(port: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), 0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith(b"+PONG"):
                    return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("redis-server did not start")


@dataclass
class Server:
    name: str
    tmp: Path
    port: int = 0
    procs: list[Proc] = field(default_factory=list)
    pid: int = 0
    aux_pid: int | None = None
    #: The CPU redis-server is pinned to when it is not the server's (``--redis-cpu``).
    redis_cpu: str | None = None

    def start(self) -> None:
        self.port = free_port()
        workers = 2 if self.name == "broker-redis-2" else 1
        cpu = "0" if workers == 1 else None
        env = dict(os.environ)
        if self.name.startswith("broker-redis"):
            rport = free_port()
            rp = spawn(
                pin(
                    ["redis-server", "--port", str(rport), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                    self.redis_cpu or cpu,
                ),
                self.tmp / f"redis-{rport}.log",
            )
            self.procs.append(rp)
            wait_redis(rport)
            self.aux_pid = rp.popen.pid
            env["MCP_BROKER_REDIS_URL"] = f"redis://127.0.0.1:{rport}/0"
        else:
            env.pop("MCP_BROKER_REDIS_URL", None)
        if self.name == "sdk":
            cmd = [PY, str(BENCH / "sdk_server.py"), "--port", str(self.port)]
        else:
            cmd = [BROKER, "serve", "--host", "127.0.0.1", "--port", str(self.port)]
            if workers > 1:
                cmd += ["--workers", str(workers)]
        p = spawn(pin(cmd, cpu), self.tmp / f"{self.name}-{self.port}.log", env)
        self.procs.append(p)
        self.pid = p.popen.pid
        wait_http(self.port, p)

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.stop()
        self.procs.clear()


def run_loadgen(server: Server, args: list[str], timeout: float) -> dict[str, Any]:
    out = server.tmp / f"lg-{time.monotonic_ns()}.json"
    cmd = [
        PY,
        str(BENCH / "loadgen.py"),
        "--url",
        f"http://127.0.0.1:{server.port}/mcp",
        "--server-pid",
        str(server.pid),
        "--json-out",
        str(out),
        *args,
    ]
    if server.aux_pid:
        cmd += ["--aux-pid", str(server.aux_pid)]
    r = subprocess.run(pin(cmd, "1"), cwd=ROOT, timeout=timeout, capture_output=True, text=True)
    if r.returncode != 0 or not out.exists():
        return {"failed": True, "stderr": r.stderr[-1500:]}
    res: dict[str, Any] = json.loads(out.read_text())
    return res


def run_point(name: str, point: str, tmp: Path, extra: list[str], timeout: float,
              redis_cpu: str | None = None) -> dict[str, Any]:
    srv = Server(name, tmp, redis_cpu=redis_cpu)
    try:
        srv.start()
        return run_loadgen(srv, POINTS[point] + extra, timeout)
    except Exception as e:  # one failed point must not end the whole run
        return {"failed": True, "stderr": repr(e)[:1500]}
    finally:
        srv.stop()


# --------------------------------------------------------------------------- report


def med(values: list[Any]) -> tuple[float | None, float | None, float | None]:
    v = [x for x in values if isinstance(x, (int, float)) and not isinstance(x, bool)]
    if not v:
        return None, None, None
    return statistics.median(v), min(v), max(v)


def fmt(x: float | None) -> str:
    if x is None:
        return "-"
    if x == int(x) and abs(x) >= 1:
        return str(int(x))
    a = abs(x)
    return f"{x:.3g}" if a < 100 else f"{x:.0f}"


def cell(values: list[Any]) -> str:
    m, lo, hi = med(values)
    if m is None:
        return "-"
    if len(values) > 1 and lo != hi:
        return f"{fmt(m)} ({fmt(lo)}–{fmt(hi)})"
    return fmt(m)


def machine() -> dict[str, str]:
    def ver(mod: str) -> str:
        try:
            from importlib.metadata import version

            return version(mod)
        except Exception:
            return "?"

    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        redis = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.split()[2]
    except Exception:
        redis = "?"
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    except Exception:
        commit = "?"
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "cpu": f"{cpu}, {os.cpu_count()} CPUs, {mem:.0f} GiB",
        "kernel": platform.release(),
        "python": platform.python_version(),
        "versions": ", ".join(f"{m} {ver(m)}" for m in ("mcp", "uvicorn", "uvloop", "httptools", "redis", "orjson")),
        "redis-server": redis,
        "commit": commit,
    }


def write_readme(results: dict[str, dict[str, list[dict[str, Any]]]], meta: dict[str, Any]) -> str:
    m = meta["machine"]
    lines = [
        "# Benchmarks",
        "",
        "`bench/loadgen.py` is a wire-level load generator (asyncio + uvloop, raw sockets, its own",
        "HTTP/1.1 and SSE parsing; no SDK client, no httpx on the hot path). `bench/sdk_server.py` is a",
        "baseline on the official MCP Python SDK with the same `POST /changes` API. `bench/run.py` starts",
        "each server itself, runs the load generator and writes this file.",
        "",
        "```",
        "python -m bench.run --smoke      # CI: 100 sessions, 1,000 changes, memory and Redis; fails on loss",
        "python -m bench.run --full       # all servers, all points, 3 repeats (long)",
        "python -m bench.run --servers sdk,broker-memory --points targeted-1k --repeats 3",
        "python -m bench.run --servers broker-redis-1 --points targeted-10k --redis-cpu 1   # a core per worker",
        "python bench/loadgen.py --help   # one scenario against a running server",
        "python -m bench.fairness [--redis URL] [--seconds 10] [--flood-rate 500]   # tenant fairness",
        "```",
        "",
        summary_block(),
        "## Method",
        "",
        "- Latency: scheduled publish time (`time.perf_counter()` in `meta.ts`) to the moment the SSE",
        "  frame is parsed by the client; open-loop publisher (one `POST /changes` per change unless",
        "  `--batch`), so a stalled publisher cannot hide latency.",
        "- Missing: a published (URI, seq) that no notification with seq' >= seq covered, per session;",
        "  duplicates: a (URI, seq) a session received twice. Frames for a URI the session never",
        "  subscribed to are counted as foreign and ignored.",
        "- CPU: psutil `cpu_times` of the server process tree (and of redis-server, reported separately)",
        "  over the publishing + drain window. A run whose client CPU is above ~70% is not valid.",
        "- RSS per session: server-tree RSS after setup minus before, divided by sessions (no gc is",
        "  forced inside the server).",
        "- Each point runs against a fresh server; "
        + (
            "server and Redis pinned to CPU 0, load generator to CPU 1 (2-worker runs: server unpinned)."
            if HAVE_TASKSET
            else "no CPU pinning available."
        ),
        '- Median of the repeats, spread (min–max) in brackets. "x SDK" = broker figure / SDK figure:',
        "  below 1 is better for latency, CPU and memory, above 1 for throughput.",
        "- The broker's listen frames carry the change's `seq`/`ts`; the SDK's do not (see below), so its",
        "  listen frames are matched to publishes by URI and arrival order.",
        "",
        "## Machine",
        "",
        *[f"- {k}: {v}" for k, v in m.items()],
        f"- repeats: {meta.get('note') or meta['repeats']}; run at {meta['when']}",
        "",
    ]
    for point, by_server in results.items():
        scen = POINTS[point][1]
        cols = COLS[scen]
        lines += [f"### {TITLES.get(point, point)}", ""]
        lines.append("| server | n | " + " | ".join(c[1] for c in cols) + " |")
        lines.append("|---|---|" + "---|" * len(cols))
        sdk_runs = [r for r in by_server.get("sdk", []) if not r.get("failed")]
        for name, runs in by_server.items():
            ok = [r for r in runs if not r.get("failed")]
            row = [name, f"{len(ok)}/{len(runs)}"]
            for key, _ in cols:
                c = cell([r.get(key) for r in ok])
                if key in RATIO and name != "sdk" and sdk_runs:
                    a, b = med([r.get(key) for r in ok])[0], med([r.get(key) for r in sdk_runs])[0]
                    if a is not None and b:
                        c += f" ({a / b:.2g}x SDK)"
                row.append(c)
            lines.append("| " + " | ".join(row) + " |")
        fails = [(n, r) for n, rs in by_server.items() for r in rs if r.get("failed")]
        errs = [(n, r["errors"]) for n, rs in by_server.items() for r in rs if r.get("errors")]
        valid = [
            (n, r.get("client_cpu_pct"))
            for n, rs in by_server.items()
            for r in rs
            if (r.get("client_cpu_pct") or 0) > 70
        ]
        for n, r in fails[:3]:
            lines.append(f"\n{n}: run failed: `{r.get('stderr', '')[-300:].strip()}`")
        for n, e in errs[:3]:
            lines.append(f"\n{n}: errors: `{str(e)[:300]}`")
        for n, c in valid[:3]:
            lines.append(f"\n{n}: client CPU {c:.0f}% > 70%: that run is not valid")
        lines.append("")
    return "\n".join(lines) + "\n"


def summary_block() -> str:
    """The summary against the targets (``bench/SUMMARY.md``): written from the tables below, by
    hand, so it survives the tables being measured again."""
    p = BENCH / "SUMMARY.md"
    return p.read_text() if p.exists() else ""


def notes_block() -> str:
    p = BENCH / "NOTES.md"
    return p.read_text() if p.exists() else ""


# --------------------------------------------------------------------------- modes


def smoke(tmp: Path) -> int:
    checks = [
        (
            "targeted",
            [
                "--scenario",
                "targeted",
                "--sessions",
                "100",
                "--fanout",
                "10",
                "--rate",
                "500",
                "--duration",
                "2",
                "--drain-timeout",
                "10",
            ],
        ),
        ("replay", ["--scenario", "replay", "--tries", "3", "--missed", "10", "--drain-timeout", "5"]),
    ]
    bad = 0
    for name in ("broker-memory", "broker-redis-1"):
        srv = Server(name, tmp)
        try:
            srv.start()
            for label, args in checks:
                r = run_loadgen(srv, args, 60)
                ok = (
                    not r.get("failed")
                    and r.get("missing") == 0
                    and r.get("duplicates") == 0
                    and not r.get("error_count")
                    and (r.get("complete") in (True, 3))
                )
                if label == "targeted":
                    ok = ok and r.get("delivered", 0) >= 1000 and r.get("published") == 1000
                print(
                    f"{name:15} {label:9} {'ok  ' if ok else 'FAIL'} "
                    + " ".join(
                        f"{k}={r.get(k)}"
                        for k in (
                            "published",
                            "delivered",
                            "missing",
                            "duplicates",
                            "p50_ms",
                            "p99_ms",
                            "complete",
                            "errors",
                            "stderr",
                        )
                        if k in r
                    ),
                    flush=True,
                )
                bad += not ok
        except Exception as e:
            print(f"{name:15} FAIL {e!r}"[:2000], flush=True)
            bad += 1
        finally:
            srv.stop()
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--servers", default=",".join(SERVERS))
    ap.add_argument("--points", default=",".join(POINTS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--drain-timeout", type=float, default=20)
    ap.add_argument("--timeout", type=float, default=900, help="per load-generator run")
    ap.add_argument("--readme", default=str(BENCH / "README.md"))
    ap.add_argument("--merge", help="also include the results of an earlier bench/results/*.json")
    ap.add_argument("--redis-cpu", help="pin redis-server to this CPU rather than the server's (1: the load "
                    "generator's, so that one worker has CPU 0 to itself)")
    args = ap.parse_args()
    raise_nofile()
    tmp = Path(tempfile.mkdtemp(prefix="bench-"))
    if args.smoke:
        t0 = time.monotonic()
        rc = smoke(tmp)
        print(f"smoke {'passed' if rc == 0 else 'FAILED'} in {time.monotonic() - t0:.1f} s")
        return rc
    servers = [s for s in args.servers.split(",") if s]
    points = [p for p in args.points.split(",") if p]
    for p in points:
        if p not in POINTS:
            raise SystemExit(f"unknown point {p}; known: {', '.join(POINTS)}")
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    if args.merge:
        results = json.loads(Path(args.merge).read_text())["results"]
    t0 = time.monotonic()
    extra = ["--drain-timeout", str(args.drain_timeout)]
    for rep in range(args.repeats):
        for point in points:
            for name in servers:
                print(f"[{rep + 1}/{args.repeats}] {point} on {name} ...", end=" ", flush=True)
                r = run_point(name, point, tmp, extra, args.timeout, args.redis_cpu)
                by_server = results.setdefault(point, {})
                if rep == 0:
                    by_server[name] = []  # a fresh run replaces merged results for this pair
                by_server[name].append(r)
                print(
                    "failed: " + r.get("stderr", "")[-300:]
                    if r.get("failed")
                    else " ".join(
                        f"{k}={r.get(k)}"
                        for k in (
                            "missing",
                            "p50_ms",
                            "p99_ms",
                            "server_cpu_pct",
                            "client_cpu_pct",
                            "server_rss_kb_per_session",
                            "all_done_s",
                        )
                        if r.get(k) is not None
                    ),
                    flush=True,
                )
    meta = {
        "machine": machine(),
        "repeats": args.repeats,
        "when": time.strftime("%Y-%m-%d %H:%M"),
        "took_min": (time.monotonic() - t0) / 60,
    }
    if args.redis_cpu:
        meta["note"] = f"{args.repeats}; redis-server pinned to CPU {args.redis_cpu} (--redis-cpu)"
    out_dir = BENCH / "results"
    out_dir.mkdir(exist_ok=True)
    raw = out_dir / f"{time.strftime('%Y%m%d-%H%M%S')}.json"
    raw.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    text = write_readme(results, meta) + notes_block()
    Path(args.readme).write_text(text)
    print(f"wrote {args.readme} and {raw}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
