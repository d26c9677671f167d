"""Wire-level SSE load generator for mcp-broker and the SDK baseline server.

One asyncio (uvloop) process.  Control requests go over a small pool of
keep-alive HTTP/1.1 connections on asyncio streams; every SSE stream (a legacy
GET stream or a 2026-07-28 ``subscriptions/listen`` POST) is an
``asyncio.Protocol`` that de-chunks, splits frames and parses ``data:`` with
orjson.  Nothing on the hot path goes through the MCP SDK client or httpx.

Publishing is open loop: change *i* is scheduled at ``t0 + i / rate`` and
carries ``meta = {"seq": per-URI sequence, "ts": scheduled perf_counter()}``.
Latency is the frame's arrival time minus its scheduled time (same host, same
monotonic clock).  A notification with ``seq`` n for URI U covers every
published seq <= n of U (the server may coalesce), so per session and URI:

- missing   = published seqs of U above the highest seq received for U;
- duplicate = a (U, seq) received twice by the same session.

Listen frames that carry no ``seq``/``ts`` (the SDK's stock listen handler) are
matched to publishes by URI and arrival order; that is exact only for a server
that never coalesces, and the result says ``listen_meta: false``.

Scenarios (``--scenario``): targeted, broadcast, idle, replay, storm, listen.
Result: one JSON object on stdout (or ``--json-out``), a summary on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import resource
import sys
import time
import zlib
from array import array
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import urlsplit

import orjson
import psutil

perf = time.perf_counter
RUN = os.urandom(3).hex()  # keeps URIs of different runs apart on a long-lived server
LEGACY = "2025-11-25"
MODERN = "2026-07-28"
UPDATED = "notifications/resources/updated"
ACK = "notifications/subscriptions/acknowledged"


def raise_nofile() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


# --------------------------------------------------------------------------- HTTP control plane


class HttpError(Exception):
    pass


class Http:
    """One keep-alive HTTP/1.1 connection (asyncio streams) for control requests."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def _connect(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port, limit=1 << 22)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None

    async def request(
        self, method: str, path: str, headers: dict[str, str] | None = None, body: bytes | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        for attempt in (0, 1):
            if self.writer is None:
                await self._connect()
            try:
                return await self._request(method, path, headers, body)
            except (ConnectionError, asyncio.IncompleteReadError):
                self.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    async def _request(
        self, method: str, path: str, headers: dict[str, str] | None, body: bytes | None
    ) -> tuple[int, dict[str, str], bytes]:
        assert self.reader is not None and self.writer is not None
        lines = [f"{method} {path} HTTP/1.1", f"Host: {self.host}:{self.port}"]
        for k, v in (headers or {}).items():
            lines.append(f"{k}: {v}")
        if body is not None:
            lines.append(f"Content-Length: {len(body)}")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode()
        self.writer.write(head + body if body else head)
        raw = await self.reader.readuntil(b"\r\n\r\n")
        status_line, *hlines = raw[:-4].decode("latin-1").split("\r\n")
        status = int(status_line.split(" ", 2)[1])
        hdrs: dict[str, str] = {}
        for h in hlines:
            k, _, v = h.partition(":")
            hdrs[k.strip().lower()] = v.strip()
        if hdrs.get("transfer-encoding", "").lower() == "chunked":
            parts = []
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    await self.reader.readuntil(b"\r\n")
                    break
                parts.append((await self.reader.readexactly(size + 2))[:-2])
            data = b"".join(parts)
        elif "content-length" in hdrs:
            data = await self.reader.readexactly(int(hdrs["content-length"]))
        elif status in (204, 304) or 100 <= status < 200:
            data = b""
        else:
            data = await self.reader.read()
            self.close()
        if hdrs.get("connection", "").lower() == "close":
            self.close()
        return status, hdrs, data


class Pool:
    def __init__(self, host: str, port: int, size: int) -> None:
        self.q: asyncio.Queue[Http] = asyncio.Queue()
        for _ in range(size):
            self.q.put_nowait(Http(host, port))

    async def request(
        self, method: str, path: str, headers: dict[str, str] | None = None, body: bytes | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        c = await self.q.get()
        try:
            return await c.request(method, path, headers, body)
        except BaseException:
            c.close()
            raise
        finally:
            self.q.put_nowait(c)

    def close(self) -> None:
        while not self.q.empty():
            self.q.get_nowait().close()


class OrderedPool:
    """Connections for publishing where changes of one URI never overtake each other.

    A URI always goes through the same connection, and requests on a connection queue in
    FIFO order: a change reaches the broker after every earlier change of its URI, as a
    producer that writes one resource in order would. (Spread over a pool, two changes of
    one URI 100 ms apart could arrive swapped under load; the broker then rightly notifies
    the later arrival last, and the older sequence number would look like a lost newer one.)
    """

    def __init__(self, host: str, port: int, size: int) -> None:
        self.conns = [Http(host, port) for _ in range(size)]
        self.locks = [asyncio.Lock() for _ in range(size)]

    async def request(self, key: str, method: str, path: str, headers: dict[str, str], body: bytes) -> tuple[
            int, dict[str, str], bytes]:
        i = zlib.crc32(key.encode()) % len(self.conns)
        async with self.locks[i]:
            try:
                return await self.conns[i].request(method, path, headers, body)
            except BaseException:
                self.conns[i].close()
                raise

    def close(self) -> None:
        for conn in self.conns:
            conn.close()


def jsonrpc_body(hdrs: dict[str, str], data: bytes) -> Any:
    """The JSON-RPC message of a POST response (plain JSON, or the last non-empty SSE data)."""
    if hdrs.get("content-type", "").startswith("text/event-stream"):
        msg = None
        for line in data.replace(b"\r\n", b"\n").split(b"\n"):
            if line.startswith(b"data:") and line[5:].strip():
                msg = orjson.loads(line[5:])
        return msg
    return orjson.loads(data) if data else None


# --------------------------------------------------------------------------- SSE streams


class Session:
    """Client-side state of one legacy session or one listen stream."""

    __slots__ = (
        "idx",
        "sid",
        "uris",
        "uriset",
        "maxseq",
        "seen",
        "count",
        "received",
        "dups",
        "stream",
        "last_id",
        "done_t",
    )

    def __init__(self, idx: int, uris: list[str]) -> None:
        self.idx = idx
        self.sid: str | None = None
        self.uris = uris
        self.uriset = frozenset(uris)
        self.maxseq: dict[str, int] = {}
        self.seen: set[tuple[str, int]] = set()
        self.count: dict[str, int] = {}
        self.received = 0
        self.dups = 0
        self.stream: SSEStream | None = None
        self.last_id: bytes | None = None
        self.done_t = 0.0


class Recorder:
    """Collects latencies and per-session coverage; shared by every stream."""

    def __init__(self) -> None:
        self.lat = array("d")
        self.measure = False
        self.delivered = 0
        self.dups = 0
        self.no_meta = 0
        self.foreign = 0  # frames for a URI the session never subscribed to
        self.pub_ts: dict[tuple[str, int], float] = {}  # used only for listen frames without meta
        self.errors: list[str] = []
        self.server_closed = 0  # streams the server ended (legacy ones are resumed, as clients do)

    def on_message(self, sess: Session, msg: dict[str, Any], now: float) -> None:
        if msg.get("method") != UPDATED:
            return
        p = msg["params"]
        uri = p["uri"]
        if uri not in sess.uriset:
            self.foreign += 1
            return
        meta = p.get("_meta") or {}
        seq = meta.get("seq")
        if seq is None:
            self.no_meta += 1
            seq = sess.count[uri] = sess.count.get(uri, 0) + 1
            ts = self.pub_ts.get((uri, seq))
        else:
            ts = meta.get("ts")
        key = (uri, seq)
        if key in sess.seen:
            sess.dups += 1
            self.dups += 1
        else:
            sess.seen.add(key)
        if seq > sess.maxseq.get(uri, 0):
            sess.maxseq[uri] = seq
        sess.received += 1
        self.delivered += 1
        if ts is not None and self.measure:
            self.lat.append(now - ts)


class SSEStream(asyncio.Protocol):
    """One HTTP request whose response is an SSE stream, parsed incrementally."""

    def __init__(self, sess: Session, request: bytes, rec: Recorder) -> None:
        self.sess = sess
        self.request = request
        self.rec = rec
        self.transport: asyncio.Transport | None = None
        loop = asyncio.get_running_loop()
        self.headers_ok: asyncio.Future[int] = loop.create_future()
        self.first_frame: asyncio.Future[None] = loop.create_future()
        self.closed: asyncio.Future[None] = loop.create_future()
        self.hbuf = b""
        self.head_done = False
        self.chunked = False
        self.cbuf = b""
        self.cleft = 0
        self.cskip = 0
        self.sse = b""
        self.status = 0
        self.frames = 0
        self.on_frame: Callable[[SSEStream, dict[str, Any] | None, float], None] | None = None
        self.on_lost: Callable[[SSEStream], None] | None = None
        self.deliberate = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.write(self.request)  # type: ignore[attr-defined]

    def connection_lost(self, exc: Exception | None) -> None:
        for fut in (self.headers_ok, self.first_frame):
            if not fut.done():
                fut.set_exception(ConnectionError(f"stream closed early: {exc}"))
                fut.exception()  # mark retrieved: nobody may be waiting
        if not self.closed.done():
            self.closed.set_result(None)
        if not self.deliberate and self.head_done:
            self.rec.server_closed += 1
            if self.on_lost is not None:
                self.on_lost(self)

    def close(self) -> None:
        self.deliberate = True
        if self.transport is not None:
            self.transport.close()

    def _dechunk(self, data: bytes) -> bytes:
        buf = self.cbuf + data if self.cbuf else data
        out = []
        pos, n = 0, len(buf)
        while pos < n:
            if self.cleft:
                take = min(self.cleft, n - pos)
                out.append(buf[pos : pos + take])
                pos += take
                self.cleft -= take
                if not self.cleft:
                    self.cskip = 2
                continue
            if self.cskip:
                s = min(self.cskip, n - pos)
                pos += s
                self.cskip -= s
                continue
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                break
            size = int(buf[pos:eol].split(b";")[0], 16)
            pos = eol + 2
            if size == 0:
                pos = n
                break
            self.cleft = size
        self.cbuf = buf[pos:]
        return b"".join(out)

    def data_received(self, data: bytes) -> None:
        now = perf()
        if not self.head_done:
            self.hbuf += data
            end = self.hbuf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.hbuf[:end].decode("latin-1").lower()
            data = self.hbuf[end + 4 :]
            self.hbuf = b""
            self.head_done = True
            self.status = int(head.split(" ", 2)[1])
            self.chunked = "transfer-encoding: chunked" in head
            self.headers_ok.set_result(self.status)
            if self.status != 200:
                self.rec.errors.append(f"stream status {self.status}: {head.splitlines()[0]}")
                self.close()
                return
        if self.chunked:
            data = self._dechunk(data)
        if not data:
            return
        sse = self.sse + data if self.sse else data
        if b"\r" in sse:
            sse = sse.replace(b"\r\n", b"\n")
        start = 0
        while True:
            end = sse.find(b"\n\n", start)
            if end < 0:
                break
            self._frame(sse[start:end], now)
            start = end + 2
        self.sse = sse[start:]

    def _frame(self, frame: bytes, now: float) -> None:
        data = None
        for line in frame.split(b"\n"):
            if line.startswith(b"data:"):
                d = line[6:] if line[5:6] == b" " else line[5:]
                data = d if data is None else data + b"\n" + d
            elif line.startswith(b"id:"):
                self.sess.last_id = line[3:].strip()
        self.frames += 1
        msg = orjson.loads(data) if data else None
        if msg is not None:
            self.rec.on_message(self.sess, msg, now)
        if self.on_frame is not None:
            self.on_frame(self, msg, now)
        if not self.first_frame.done():
            self.first_frame.set_result(None)


# --------------------------------------------------------------------------- client


class Client:
    def __init__(self, url: str, setup_concurrency: int = 64) -> None:
        u = urlsplit(url)
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or 80
        self.path = u.path or "/mcp"
        if self.path == "/":
            self.path = "/mcp"
        self.pool = Pool(self.host, self.port, setup_concurrency)
        self.pub_pool = OrderedPool(self.host, self.port, 16)
        self.sem = asyncio.Semaphore(setup_concurrency)
        self.rec = Recorder()
        self.rpc_id = 0
        self.resuming: set[asyncio.Future[None]] = set()

    def _hdrs(self, sid: str | None = None) -> dict[str, str]:
        h = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
        if sid:
            h["Mcp-Session-Id"] = sid
            h["MCP-Protocol-Version"] = LEGACY
        return h

    async def rpc(self, sid: str | None, method: str, params: dict[str, Any] | None, *, notify: bool = False) -> Any:
        msg: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
        if params is not None:
            msg["params"] = params
        if not notify:
            self.rpc_id += 1
            msg["id"] = self.rpc_id
        status, hdrs, data = await self.pool.request("POST", self.path, self._hdrs(sid), orjson.dumps(msg))
        if notify:
            if status not in (200, 202, 204):
                raise HttpError(f"{method}: HTTP {status} {data[:300]!r}")
            return None
        if status != 200:
            raise HttpError(f"{method}: HTTP {status} {data[:300]!r}")
        body = jsonrpc_body(hdrs, data)
        if not isinstance(body, dict) or "result" not in body:
            raise HttpError(f"{method}: unexpected reply {data[:300]!r}")
        if method == "initialize":
            sid_h = hdrs.get("mcp-session-id")
            if not sid_h:
                raise HttpError("initialize: no Mcp-Session-Id header")
            return sid_h
        return body["result"]

    async def open_session(self, sess: Session) -> None:
        async with self.sem:
            sess.sid = await self.rpc(
                None,
                "initialize",
                {"protocolVersion": LEGACY, "capabilities": {}, "clientInfo": {"name": "loadgen", "version": "0"}},
            )
            await self.rpc(sess.sid, "notifications/initialized", None, notify=True)
            for uri in sess.uris:
                await self.rpc(sess.sid, "resources/subscribe", {"uri": uri})

    def get_request(self, sess: Session, last_id: bytes | None = None) -> bytes:
        lines = [
            f"GET {self.path} HTTP/1.1",
            f"Host: {self.host}:{self.port}",
            "Accept: text/event-stream",
            f"Mcp-Session-Id: {sess.sid}",
            f"MCP-Protocol-Version: {LEGACY}",
        ]
        if last_id:
            lines.append("Last-Event-ID: " + last_id.decode())
        return ("\r\n".join(lines) + "\r\n\r\n").encode()

    def listen_request(self, sess: Session) -> bytes:
        body = orjson.dumps(
            {
                "jsonrpc": "2.0",
                "id": f"l{sess.idx}",
                "method": "subscriptions/listen",
                "params": {
                    "_meta": {
                        "io.modelcontextprotocol/protocolVersion": MODERN,
                        "io.modelcontextprotocol/clientCapabilities": {},
                    },
                    "notifications": {"resourceSubscriptions": sess.uris},
                },
            }
        )
        head = "\r\n".join(
            [
                f"POST {self.path} HTTP/1.1",
                f"Host: {self.host}:{self.port}",
                "Accept: application/json, text/event-stream",
                "Content-Type: application/json",
                f"MCP-Protocol-Version: {MODERN}",
                "Mcp-Method: subscriptions/listen",
                f"Content-Length: {len(body)}",
            ]
        )
        return (head + "\r\n\r\n").encode() + body

    async def open_stream(self, sess: Session, request: bytes, *, wait_frame: bool) -> SSEStream:
        loop = asyncio.get_running_loop()
        async with self.sem:
            _, proto = await loop.create_connection(lambda: SSEStream(sess, request, self.rec), self.host, self.port)
            sess.stream = proto
            status = await proto.headers_ok
            if status != 200:
                raise HttpError(f"stream: HTTP {status}")
            if wait_frame:
                await asyncio.wait_for(proto.first_frame, 10)
        return proto

    def resume(self, stream: SSEStream) -> None:
        """A legacy stream the server ended is resumed from its cursor, as MCP clients do."""
        sess = stream.sess

        async def again() -> None:
            try:
                new = await self.open_stream(sess, self.get_request(sess, sess.last_id), wait_frame=False)
                new.on_lost = self.resume
            except (OSError, HttpError) as exc:
                self.rec.errors.append(f"resume of session {sess.idx} failed: {exc!r}")

        task = asyncio.ensure_future(again())
        self.resuming.add(task)
        task.add_done_callback(self.resuming.discard)

    async def open_legacy(self, sessions: list[Session], *, wait_frame: bool = False) -> None:
        async def one(s: Session) -> None:
            await self.open_session(s)
            stream = await self.open_stream(s, self.get_request(s), wait_frame=wait_frame)
            stream.on_lost = self.resume

        await gather_checked([one(s) for s in sessions])

    async def open_listens(self, sessions: list[Session]) -> None:
        async def one(s: Session) -> None:
            s.sid = f"l{s.idx}"
            await self.open_stream(s, self.listen_request(s), wait_frame=True)

        await gather_checked([one(s) for s in sessions])

    async def post_changes(self, changes: list[dict[str, Any]] | dict[str, Any]) -> None:
        key = changes["uri"] if isinstance(changes, dict) else "batch"
        status, _, data = await self.pub_pool.request(
            key, "POST", "/changes", {"Content-Type": "application/json"}, orjson.dumps(changes)
        )
        if status not in (200, 202):
            self.rec.errors.append(f"POST /changes: HTTP {status} {data[:200]!r}")

    def close(self) -> None:
        self.pool.close()
        self.pub_pool.close()


async def gather_checked(coros: Iterable[Any]) -> None:
    results = await asyncio.gather(*coros, return_exceptions=True)
    errs = [r for r in results if isinstance(r, BaseException)]
    if errs:
        raise HttpError(f"{len(errs)} of {len(results)} failed; first: {errs[0]!r}")


#: The shortest pause of a batching publisher between two ticks, in seconds.
BATCH_TICK = 0.002


class Publisher:
    """Open-loop publisher: per-URI sequence numbers, scheduled timestamps.

    With ``batch``, one POST is in flight at a time and carries every change that came due
    while the previous one was out (as a batching publisher would): the time a change waits
    for its POST counts in its latency.
    """

    def __init__(self, client: Client, *, batch: bool = False) -> None:
        self.client = client
        self.batch = batch
        self.seq: dict[str, int] = {}
        self.published = 0
        self.lag_max = 0.0
        self.tasks: set[asyncio.Task[None]] = set()
        self.pending: list[dict[str, Any]] = []
        self.sender: asyncio.Task[None] | None = None

    def change(self, uri: str, ts: float) -> dict[str, Any]:
        seq = self.seq[uri] = self.seq.get(uri, 0) + 1
        self.client.rec.pub_ts[(uri, seq)] = ts
        self.published += 1
        return {"uri": uri, "kind": "updated", "meta": {"seq": seq, "ts": ts}}

    def _send(self, payload: list[dict[str, Any]] | dict[str, Any]) -> None:
        t = asyncio.ensure_future(self.client.post_changes(payload))
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)

    def _queue(self, due: list[dict[str, Any]]) -> None:
        self.pending.extend(due)
        if self.sender is None or self.sender.done():
            self.sender = asyncio.ensure_future(self._send_pending())
            self.tasks.add(self.sender)
            self.sender.add_done_callback(self.tasks.discard)

    async def _send_pending(self) -> None:
        while self.pending:
            payload, self.pending = self.pending, []
            await self.client.post_changes(payload)

    async def run(self, uri_of: Callable[[int], str], rate: float, count: int) -> None:
        t0 = perf() + 0.02
        i = 0
        while i < count:
            now = perf()
            due = []
            while i < count and t0 + i / rate <= now:
                ts = t0 + i / rate
                due.append(self.change(uri_of(i), ts))
                i += 1
            if due:
                self.lag_max = max(self.lag_max, now - due[0]["meta"]["ts"])
                if self.batch:
                    self._queue(due)
                else:
                    for c in due:
                        self._send(c)
            if i < count:
                # A batching publisher wakes once per BATCH_TICK at most: what came due meanwhile
                # goes in one list (the wait counts in the latency, from the scheduled time).
                floor = BATCH_TICK if self.batch else 0.0
                await asyncio.sleep(max(floor, t0 + i / rate - perf()))
        await self.flush()

    async def flush(self) -> None:
        if self.tasks:
            await asyncio.gather(*list(self.tasks), return_exceptions=True)


# --------------------------------------------------------------------------- measurement helpers


class ProcSet:
    """CPU and RSS of the server processes (a pid and all its children)."""

    def __init__(self, pids: list[int]) -> None:
        self.roots = [psutil.Process(p) for p in pids]

    def procs(self) -> list[psutil.Process]:
        out = []
        for r in self.roots:
            try:
                out.append(r)
                out.extend(r.children(recursive=True))
            except psutil.NoSuchProcess:
                pass
        return out

    def cpu(self) -> float:
        t = 0.0
        for p in self.procs():
            try:
                c = p.cpu_times()
                t += c.user + c.system
            except psutil.NoSuchProcess:
                pass
        return t

    def rss(self) -> int:
        t = 0
        for p in self.procs():
            try:
                t += p.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return t

    def count(self) -> int:
        return len(self.procs())


def sockstat_kb() -> float | None:
    try:
        with open("/proc/net/sockstat") as f:
            for line in f:
                if line.startswith("TCP:"):
                    parts = line.split()
                    return int(parts[parts.index("mem") + 1]) * os.sysconf("SC_PAGE_SIZE") / 1024
    except (OSError, ValueError):
        return None
    return None


class Window:
    """CPU of server, aux (redis) and this client over a measured window."""

    def __init__(self, server: ProcSet | None, aux: ProcSet | None) -> None:
        self.server, self.aux = server, aux
        self.me = psutil.Process()

    def start(self) -> None:
        self.t0 = perf()
        self.s0 = self.server.cpu() if self.server else 0.0
        self.a0 = self.aux.cpu() if self.aux else 0.0
        c = self.me.cpu_times()
        self.c0 = c.user + c.system

    def stop(self) -> dict[str, float]:
        wall = perf() - self.t0
        c = self.me.cpu_times()
        out = {
            "wall_s": wall,
            "client_cpu_pct": 100 * (c.user + c.system - self.c0) / wall,
        }
        if self.server:
            out["server_cpu_s"] = self.server.cpu() - self.s0
            out["server_cpu_pct"] = 100 * out["server_cpu_s"] / wall
        if self.aux:
            out["aux_cpu_s"] = self.aux.cpu() - self.a0
            out["aux_cpu_pct"] = 100 * out["aux_cpu_s"] / wall
        return out


class LagProbe:
    """Event-loop lag of the client (a sleep-drift probe)."""

    def __init__(self, period: float = 0.01) -> None:
        self.period = period
        self.max = 0.0
        self.task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            t = perf()
            await asyncio.sleep(self.period)
            self.max = max(self.max, perf() - t - self.period)

    def stop(self) -> float:
        self.task.cancel()
        return self.max


def percentiles(lat: array) -> dict[str, float | None]:
    if not lat:
        return {k: None for k in ("p50_ms", "p90_ms", "p99_ms", "p999_ms", "max_ms", "mean_ms")}
    s = sorted(lat)
    n = len(s)

    def q(p: float) -> float:
        return round(1000 * s[min(n - 1, int(p * n))], 3)

    return {
        "p50_ms": q(0.5),
        "p90_ms": q(0.9),
        "p99_ms": q(0.99),
        "p999_ms": q(0.999),
        "max_ms": round(1000 * s[-1], 3),
        "mean_ms": round(1000 * sum(s) / n, 3),
    }


def coverage(sessions: list[Session], pubmax: dict[str, int]) -> tuple[int, int]:
    """(missing, sessions with a gap): published seqs never covered by a received seq >= them."""
    missing = 0
    bad = 0
    for s in sessions:
        m = 0
        for u in s.uris:
            gap = pubmax.get(u, 0) - s.maxseq.get(u, 0)
            if gap > 0:
                m += gap
        if m:
            bad += 1
            missing += m
    return missing, bad


async def drain(sessions: list[Session], pubmax: dict[str, int], timeout: float) -> tuple[float, bool]:
    t0 = perf()
    pending = list(sessions)
    while True:
        pending = [s for s in pending if any(s.maxseq.get(u, 0) < pubmax.get(u, 0) for u in s.uris)]
        if not pending:
            return perf() - t0, True
        if perf() - t0 > timeout:
            return perf() - t0, False
        await asyncio.sleep(0.02)


# --------------------------------------------------------------------------- scenarios


def targets(n: int, fanout: int, prefix: str) -> tuple[list[Session], list[str]]:
    n_uris = max(1, n // fanout)
    uris = [f"bench://{prefix}{RUN}/{j}" for j in range(n_uris)]
    sessions = [Session(i, [uris[i % n_uris]]) for i in range(n)]
    return sessions, uris


def publish_order(uris: list[str], unwatched: int) -> Callable[[int], str]:
    """The URI of the i-th change: the watched URIs in turn, with ``unwatched`` changes to URIs
    nobody watches after each (ingestion without as many frames to parse)."""
    n_uris = len(uris)
    if not unwatched:
        return lambda i: uris[i % n_uris]
    cold = [f"bench://cold{RUN}/{j}" for j in range(n_uris * unwatched)]
    step = unwatched + 1
    return lambda i: uris[(i // step) % n_uris] if i % step == 0 else cold[i % len(cold)]


async def flow(
    args: argparse.Namespace,
    client: Client,
    sessions: list[Session],
    uris: list[str],
    server: ProcSet | None,
    aux: ProcSet | None,
    *,
    listen: bool,
) -> dict[str, Any]:
    rec = client.rec
    t_setup = perf()
    cpu_setup0 = server.cpu() if server else 0.0
    rss0 = server.rss() if server else 0
    if listen:
        await client.open_listens(sessions)
    else:
        await client.open_legacy(sessions)
    setup_s = perf() - t_setup
    setup_cpu = (server.cpu() - cpu_setup0) if server else 0.0
    rss1 = server.rss() if server else 0
    await asyncio.sleep(args.settle)
    count = int(args.rate * args.duration)
    pub = Publisher(client, batch=args.batch)
    n_uris = len(uris)
    subs_per_uri: dict[str, int] = {}
    for s in sessions:
        for u in s.uris:
            subs_per_uri[u] = subs_per_uri.get(u, 0) + 1
    gc.collect()
    gc.freeze()
    win = Window(server, aux)
    probe = LagProbe()
    rec.measure = True
    win.start()
    await pub.run(publish_order(uris, args.unwatched), args.rate, count)
    pub_wall = perf() - win.t0
    drain_s, complete = await drain(sessions, pub.seq, args.drain_timeout)
    cpu = win.stop()
    rec.measure = False
    lag = probe.stop()
    gc.unfreeze()
    expected = sum(subs_per_uri.get(u, 0) * n for u, n in pub.seq.items())
    missing, bad = coverage(sessions, pub.seq)
    res: dict[str, Any] = {
        "sessions": len(sessions),
        "uris": n_uris,
        "fanout": round(sum(subs_per_uri.values()) / max(1, len(subs_per_uri)), 2),
        "rate": args.rate,
        "duration_s": args.duration,
        "published": pub.published,
        "publish_wall_s": round(pub_wall, 3),
        "publisher_max_lag_ms": round(1000 * pub.lag_max, 2),
        "expected": expected,
        "delivered": rec.delivered,
        "frames_per_s": round(rec.delivered / max(1e-9, cpu["wall_s"]), 1),
        "offered_frames_per_s": round(expected / max(1e-9, args.duration), 1),
        "missing": missing,
        "sessions_with_gaps": bad,
        "duplicates": rec.dups,
        "complete": complete,
        "drain_s": round(drain_s, 3),
        "setup_s": round(setup_s, 3),
        "setup_server_cpu_ms_per_session": round(1000 * setup_cpu / len(sessions), 3) if server else None,
        "server_rss_setup_kb_per_session": round((rss1 - rss0) / 1024 / len(sessions), 2) if server else None,
        "client_loop_lag_max_ms": round(1000 * lag, 2),
        "latency_samples": len(rec.lat),
        "listen_meta": rec.no_meta == 0,
        **percentiles(rec.lat),
        **{k: round(v, 3) for k, v in cpu.items()},
    }
    if server:
        res["server_us_per_frame"] = round(1e6 * cpu["server_cpu_s"] / max(1, rec.delivered), 1)
    return res


async def sc_idle(
    args: argparse.Namespace, client: Client, server: ProcSet | None, aux: ProcSet | None
) -> dict[str, Any]:
    sessions, _ = targets(args.sessions, args.fanout, "i")
    gc.collect()
    rss0 = server.rss() if server else 0
    cpu0 = server.cpu() if server else 0.0
    sock0 = sockstat_kb()
    t0 = perf()
    opened = 0
    err = None
    # open in blocks so a server that stops accepting is reported, not hung on
    block = 1000
    for b in range(0, len(sessions), block):
        try:
            await asyncio.wait_for(client.open_legacy(sessions[b : b + block]), args.drain_timeout)
            opened = b + len(sessions[b : b + block])
        except Exception as e:  # report how far it got
            err = repr(e)[:300]
            opened = sum(
                1
                for s in sessions
                if s.stream is not None and s.stream.headers_ok.done() and not s.stream.closed.done()
            )
            break
    setup_s = perf() - t0
    setup_cpu = (server.cpu() - cpu0) if server else 0.0
    await asyncio.sleep(args.settle)
    rss1 = server.rss() if server else 0
    sock1 = sockstat_kb()
    win = Window(server, aux)
    win.start()
    await asyncio.sleep(args.duration)
    cpu = win.stop()
    alive = sum(1 for s in sessions if s.stream is not None and not s.stream.closed.done())
    n = max(1, opened)
    res: dict[str, Any] = {
        "sessions": args.sessions,
        "opened": opened,
        "alive_after_idle": alive,
        "setup_s": round(setup_s, 3),
        "sessions_per_s": round(opened / max(1e-9, setup_s), 1),
        "setup_server_cpu_ms_per_session": round(1000 * setup_cpu / n, 3) if server else None,
        "server_rss_before_mb": round(rss0 / 2**20, 1) if server else None,
        "server_rss_after_mb": round(rss1 / 2**20, 1) if server else None,
        "server_rss_kb_per_session": round((rss1 - rss0) / 1024 / n, 2) if server else None,
        "kernel_tcp_mem_kb_per_session": round((sock1 - sock0) / n, 2)
        if sock0 is not None and sock1 is not None
        else None,
        "idle_server_cpu_pct": round(cpu.get("server_cpu_pct", 0.0), 2),
        "idle_client_cpu_pct": round(cpu["client_cpu_pct"], 2),
        "server_processes": server.count() if server else None,
        "error": err,
        "missing": 0,
        "duplicates": 0,
    }
    return res


def with_watch(stream: SSEStream, watch: Callable[[SSEStream, dict[str, Any] | None, float], None]) -> SSEStream:
    """Attach the frame hook before the connection exists: frames can arrive before create_connection returns."""
    stream.on_frame = watch
    return stream


async def sc_replay(
    args: argparse.Namespace, client: Client, server: ProcSet | None, aux: ProcSet | None
) -> dict[str, Any]:
    """One session, ``--missed`` URIs; per try: drop the stream, publish one change per URI, reconnect."""
    rec = client.rec
    k = args.missed
    sess = Session(0, [f"bench://rp{RUN}/{j}" for j in range(k)])
    await client.open_legacy([sess])
    pub = Publisher(client, batch=True)
    # one delivered change so Last-Event-ID names a real notification
    await client.post_changes(pub.change(sess.uris[0], perf()))
    await drain([sess], pub.seq, 5)
    times = array("d")
    complete = 0
    tail_ok = 0
    rec.measure = False
    for _ in range(args.tries):
        last = sess.last_id
        sess.stream.close()  # type: ignore[union-attr]
        await sess.stream.closed  # type: ignore[union-attr]
        await asyncio.sleep(args.gap)
        await client.post_changes([pub.change(u, perf()) for u in sess.uris])
        await asyncio.sleep(args.gap)
        target = dict(pub.seq)
        done = asyncio.get_running_loop().create_future()
        t0 = perf()

        def watch(
            stream: SSEStream,
            msg: dict[str, Any] | None,
            now: float,
            done: asyncio.Future[float] = done,
            target: dict[str, int] = target,
        ) -> None:
            if not done.done() and all(sess.maxseq.get(u, 0) >= target[u] for u in sess.uris):
                done.set_result(now)

        _, proto = await asyncio.get_running_loop().create_connection(
            lambda last=last, watch=watch: with_watch(SSEStream(sess, client.get_request(sess, last), rec), watch),
            client.host,
            client.port,
        )
        sess.stream = proto
        try:
            t_done = await asyncio.wait_for(done, args.drain_timeout)
            times.append(t_done - t0)
            complete += 1
        except TimeoutError:
            pass
        # live tail: one more change must arrive on the resumed stream
        await client.post_changes(pub.change(sess.uris[0], perf()))
        _, ok = await drain([sess], pub.seq, 2)
        tail_ok += ok
    missing, _ = coverage([sess], pub.seq)
    return {
        "tries": args.tries,
        "missed_per_try": k,
        "complete": complete,
        "live_tail_ok": tail_ok,
        "missing": missing,
        "duplicates": rec.dups,
        **percentiles(times),
    }


async def sc_storm(
    args: argparse.Namespace, client: Client, server: ProcSet | None, aux: ProcSet | None
) -> dict[str, Any]:
    """``--sessions`` sessions x ``--missed`` URIs each; drop all, publish, reconnect all at once."""
    rec = client.rec
    k = args.missed
    sessions = [Session(i, [f"bench://st{RUN}/{i}/{j}" for j in range(k)]) for i in range(args.sessions)]
    await client.open_legacy(sessions)
    pub = Publisher(client, batch=True)
    first = [pub.change(s.uris[0], perf()) for s in sessions]
    for b in range(0, len(first), 500):
        await client.post_changes(first[b : b + 500])
    await drain(sessions, pub.seq, args.drain_timeout)
    lasts = {s.idx: s.last_id for s in sessions}
    for s in sessions:
        s.stream.close()  # type: ignore[union-attr]
    await asyncio.gather(*(s.stream.closed for s in sessions))  # type: ignore[union-attr]
    await asyncio.sleep(args.gap)
    changes = [pub.change(u, perf()) for s in sessions for u in s.uris]
    for b in range(0, len(changes), 500):
        await client.post_changes(changes[b : b + 500])
    await asyncio.sleep(max(args.gap, 0.5))
    target = dict(pub.seq)
    loop = asyncio.get_running_loop()
    win = Window(server, aux)
    win.start()
    t0 = perf()

    def watch(stream: SSEStream, msg: dict[str, Any] | None, now: float) -> None:
        s = stream.sess
        if not s.done_t and all(s.maxseq.get(u, 0) >= target[u] for u in s.uris):
            s.done_t = now

    async def reconnect(s: Session) -> None:
        _, proto = await loop.create_connection(
            lambda: with_watch(SSEStream(s, client.get_request(s, lasts[s.idx]), rec), watch), client.host, client.port
        )
        s.stream = proto

    results = await asyncio.gather(*(reconnect(s) for s in sessions), return_exceptions=True)
    conn_errors = sum(isinstance(r, BaseException) for r in results)
    drain_s, complete = await drain(sessions, target, args.drain_timeout)
    cpu = win.stop()
    times = array("d", (s.done_t - t0 for s in sessions if s.done_t))
    missing, bad = coverage(sessions, target)
    return {
        "sessions": len(sessions),
        "missed_per_session": k,
        "connect_errors": conn_errors,
        "completed_sessions": len(times),
        "all_done_s": round(drain_s, 3),
        "reconnects_per_s": round(len(times) / max(1e-9, max(times) if times else 0), 1),
        "missing": missing,
        "sessions_with_gaps": bad,
        "duplicates": rec.dups,
        **percentiles(times),
        **{k2: round(v, 3) for k2, v in cpu.items()},
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    import uvloop  # noqa: F401  (the loop is installed by main)

    nofile = raise_nofile()
    client = Client(args.url, args.setup_concurrency)
    server = ProcSet(args.server_pid) if args.server_pid else None
    aux = ProcSet(args.aux_pid) if args.aux_pid else None
    t0 = perf()
    try:
        if args.scenario in ("targeted", "broadcast", "listen"):
            if args.scenario == "broadcast":
                sessions, uris = targets(args.sessions, args.sessions, "b")
            else:
                sessions, uris = targets(args.sessions, args.fanout, "t" if args.scenario == "targeted" else "l")
            res = await flow(args, client, sessions, uris, server, aux, listen=args.scenario == "listen")
        elif args.scenario == "idle":
            res = await sc_idle(args, client, server, aux)
        elif args.scenario == "replay":
            res = await sc_replay(args, client, server, aux)
        elif args.scenario == "storm":
            res = await sc_storm(args, client, server, aux)
        else:
            raise SystemExit(f"unknown scenario {args.scenario}")
    finally:
        client.close()
    res["scenario"] = args.scenario
    res["foreign_frames"] = client.rec.foreign
    res["errors"] = client.rec.errors[:5]
    res["server_closed_streams"] = client.rec.server_closed
    res["error_count"] = len(client.rec.errors)
    res["nofile"] = nofile
    res["total_s"] = round(perf() - t0, 2)
    return res


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="SSE load generator for MCP resource notifications")
    ap.add_argument("--url", default="http://127.0.0.1:8000/mcp")
    ap.add_argument(
        "--scenario", default="targeted", choices=["targeted", "broadcast", "idle", "replay", "storm", "listen"]
    )
    ap.add_argument("--sessions", type=int, default=1000)
    ap.add_argument("--fanout", type=int, default=10, help="sessions per URI (targeted, listen)")
    ap.add_argument("--rate", type=float, default=1000.0, help="changes per second")
    ap.add_argument("--duration", type=float, default=10.0, help="seconds of publishing (idle: seconds measured)")
    ap.add_argument("--batch", action="store_true", help="send the changes due at each tick as one list")
    ap.add_argument("--unwatched", type=int, default=0,
                    help="targeted: changes to unwatched URIs published after each watched one")
    ap.add_argument("--drain-timeout", type=float, default=30.0)
    ap.add_argument("--settle", type=float, default=0.5)
    ap.add_argument("--setup-concurrency", type=int, default=64)
    ap.add_argument("--missed", type=int, default=100, help="replay/storm: missed notifications per session")
    ap.add_argument("--tries", type=int, default=50, help="replay: reconnects")
    ap.add_argument("--gap", type=float, default=0.2, help="replay/storm: pause around the missed publishes")
    ap.add_argument("--server-pid", type=int, action="append", default=[])
    ap.add_argument("--aux-pid", type=int, action="append", default=[], help="e.g. redis-server")
    ap.add_argument("--json-out")
    return ap


def main(argv: list[str] | None = None) -> int:
    import uvloop

    args = build_parser().parse_args(argv)
    res = uvloop.run(main_async(args))
    out = json.dumps(res, indent=None, sort_keys=True)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(out + "\n")
    else:
        print(out)
    keys = [
        "scenario",
        "sessions",
        "delivered",
        "missing",
        "duplicates",
        "p50_ms",
        "p99_ms",
        "max_ms",
        "server_cpu_pct",
        "client_cpu_pct",
        "drain_s",
        "setup_s",
        "server_rss_kb_per_session",
        "errors",
    ]
    print(" ".join(f"{k}={res[k]}" for k in keys if k in res), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
