"""Failures of a worker or of Redis, each bounded in time: what clients see, measured and printed.

Run with ``-s`` to see the numbers (duplicates, time to recover, RSS).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections import Counter
from typing import Any

import httpx
import psutil
import pytest
from redis import Redis

from tests.distributed.conftest import WORKER_ENV, Deployment
from tests.distributed.scenario import LIST_CHANGED, UPDATED, served, steer, uris
from tests.integration.mcp_http import McpSession, SSEStream, StreamEnded, publish
from tests.support import BrokerProcess, RedisProcess, wait_until


class Coverage:
    """Per URI, the highest ``_meta.seq`` notified; duplicates are (uri, seq) pairs seen twice."""

    def __init__(self) -> None:
        self.best: dict[str, int] = {}
        self.seen: Counter[tuple[str, int]] = Counter()
        self.without_seq: list[str] = []
        self.last_id: str | None = None

    def add(self, message: dict[str, Any], event_id: str | None) -> None:
        if event_id:
            self.last_id = event_id
        if message.get("method") != UPDATED:
            self.without_seq.append(str(message.get("method")))
            return
        params = message["params"]
        seq = params.get("_meta", {}).get("seq")
        if seq is None:
            self.without_seq.append(params["uri"])
            return
        self.seen[(params["uri"], seq)] += 1
        self.best[params["uri"]] = max(self.best.get(params["uri"], -1), seq)

    def missing(self, wanted: dict[str, int]) -> dict[str, int]:
        return {uri: seq for uri, seq in wanted.items() if self.best.get(uri, -1) < seq}

    def duplicates(self) -> list[tuple[str, int]]:
        return [key for key, n in self.seen.items() if n > 1]


async def read_into(stream: SSEStream, coverage: Coverage, done: asyncio.Event) -> None:
    """Read the stream until it ends (the caller bounds it); every message goes to ``coverage``."""
    while not done.is_set():
        event = await stream.next_message(timeout=60)
        coverage.add(event.message, event.id)


async def publish_seq(http: httpx.AsyncClient, changes: list[tuple[str, int]], pad: str = "") -> None:
    """POST /changes until acknowledged (202): a request lost with a dying worker is sent again."""
    body = [{"uri": uri, "meta": {"seq": seq, **({"pad": pad} if pad else {})}} for uri, seq in changes]
    async with asyncio.timeout(30):
        while (response := await http.post("/changes", json=body)).status_code != 202:
            assert response.status_code in (502, 503), response.text


def pending_changes(redis_url: str) -> int:
    with Redis.from_url(redis_url) as raw:
        return sum(int(raw.xpending(key, "fanout")["pending"]) for key in raw.scan_iter("mcpb:{c:*}:log"))


@pytest.mark.timeout(90)
async def test_a_killed_stream_worker_loses_no_change_and_the_client_resumes_elsewhere(
        own_deployment_large_inbox: Deployment) -> None:
    deploy = own_deployment_large_inbox
    targets = uris(50)
    wanted: dict[str, int] = {}
    coverage = Coverage()
    async with httpx.AsyncClient(base_url=deploy.url, timeout=30) as http:
        mcp = await McpSession(http).initialize()
        assert mcp.id is not None
        await mcp.subscribe(*targets)
        done = asyncio.Event()
        async with mcp.stream() as stream:
            await stream.next_event()
            holder = served(deploy.log(), mcp.id, "GET")[-1]
            reader = asyncio.ensure_future(read_into(stream, coverage, done))
            seq = 0
            for batch in range(20):  # 1,000 changes, 50 per request; the stream's worker dies halfway
                changes = [(targets[(seq + i) % 50], seq + i) for i in range(50)]
                seq += 50
                await publish_seq(http, changes)
                wanted.update(dict(changes))
                if batch == 9:
                    deploy.kill9(holder)
                    killed_at = time.monotonic()
                    pending_at_kill = pending_changes(deploy.redis_url)
            with pytest.raises(StreamEnded):
                await asyncio.wait_for(reader, 30)
        before_kill = len(coverage.seen)
        assert coverage.last_id is not None
        await steer(http, {holder})
        async with mcp.stream(last_event_id=coverage.last_id) as stream:
            resumed_on = served(deploy.log(), mcp.id, "GET")[-1]
            first_event = None
            async with asyncio.timeout(30):
                while coverage.missing(wanted):
                    event = await stream.next_message()
                    first_event = first_event or time.monotonic()
                    coverage.add(event.message, event.id)
    recovered = (first_event or time.monotonic()) - killed_at
    print(f"\n[kill -9 stream worker] 1000 changes over 50 URIs; notifications before kill {before_kill}, "
          f"total {sum(coverage.seen.values())}; duplicates {len(coverage.duplicates())}: "
          f"{sorted(coverage.duplicates())[:20]}; changes pending in the group at the kill {pending_at_kill}; "
          f"first replayed notification {recovered:.2f}s after the kill; resumed on worker {resumed_on}")
    assert resumed_on != holder
    assert coverage.missing(wanted) == {}
    assert coverage.without_seq == [], "no gap: the inbox kept everything the client missed"


@pytest.mark.timeout(60)
async def test_changes_pending_on_a_killed_fanout_worker_are_claimed_and_delivered(own_deployment: Deployment) -> None:
    """Fan-out runs only on worker 0; it is killed mid-burst and the others claim what it left pending."""
    deploy = own_deployment
    targets = uris(50)
    wanted: dict[str, int] = {}
    coverage = Coverage()
    async with httpx.AsyncClient(base_url=deploy.url, timeout=30) as http:
        mcp = await McpSession(http).initialize()
        await mcp.subscribe(*targets)
        assert mcp.id is not None
        # Workers 1 and 2 stop consuming until worker 0 dies: SIGSTOP freezes them, so worker 0's
        # consumer takes every change of the first half and still holds some when it is killed.
        for worker in (1, 2):
            os.kill(deploy.workers[worker].proc.pid, signal.SIGSTOP)
        try:
            async with httpx.AsyncClient(base_url=deploy.workers[0].url, timeout=30) as direct:
                for seq in range(0, 500, 50):  # straight to worker 0: the frozen ones cannot answer
                    changes = [(targets[(seq + i) % 50], seq + i) for i in range(50)]
                    await publish_seq(direct, changes)
                    wanted.update(dict(changes))
        finally:
            deploy.kill9(0)
            pending_at_kill = pending_changes(deploy.redis_url)
            for worker in (1, 2):
                os.kill(deploy.workers[worker].proc.pid, signal.SIGCONT)
        for seq in range(500, 1000, 50):
            changes = [(targets[(seq + i) % 50], seq + i) for i in range(50)]
            await publish_seq(http, changes)
            wanted.update(dict(changes))
        started = time.monotonic()
        async with mcp.stream(last_event_id=None) as stream:
            try:
                async with asyncio.timeout(30):
                    while coverage.missing(wanted):
                        event = await stream.next_message()
                        coverage.add(event.message, event.id)
            except TimeoutError:
                pytest.fail(f"not delivered: {coverage.missing(wanted)}; pending now "
                            f"{pending_changes(deploy.redis_url)}; resyncs {coverage.without_seq[:5]}")
    print(f"\n[kill -9 fan-out worker] pending changes in the group at the kill {pending_at_kill}; "
          f"all 1000 covered {time.monotonic() - started:.2f}s after the stream opened; "
          f"duplicates {len(coverage.duplicates())}")
    assert coverage.missing(wanted) == {}


@pytest.mark.timeout(60)
async def test_redis_restarted_empty_resynchronises_every_open_stream_and_keeps_its_session(
        own_deployment_slow_grace: Deployment) -> None:
    deploy = own_deployment_slow_grace
    assert deploy.redis is not None
    async with httpx.AsyncClient(base_url=deploy.url, timeout=30) as http:
        sessions = []
        for _ in range(3):
            mcp = await McpSession(http).initialize()
            watched = uris(3)
            await mcp.subscribe(*watched)
            sessions.append((mcp, watched))
        idle = await McpSession(http).initialize()  # no stream open: nobody can restore it
        async with (sessions[0][0].stream() as s0, sessions[1][0].stream() as s1, sessions[2][0].stream() as s2):
            streams = [s0, s1, s2]
            for stream in streams:
                await stream.next_event()
            assert len({served(deploy.log(), mcp.id or "", "GET")[-1] for mcp, _ in sessions}) == 3
            deploy.redis.stop()
            stopped = time.monotonic()
            deploy.redis.start()  # same port, no data
            resynced: list[float] = []
            for stream, (_, watched) in zip(streams, sessions, strict=True):
                events = await stream.messages(len(watched) + 1, timeout=20)
                resynced.append(time.monotonic() - stopped)
                assert sorted(e.uri or "" for e in events if e.method == UPDATED) == sorted(watched)
                assert [e.method for e in events].count(LIST_CHANGED) == 1
            # The restored sessions keep working: a new change reaches each of them.
            for _, watched in sessions:
                await publish(http, watched[0])
            for stream, (_, watched) in zip(streams, sessions, strict=True):
                assert (await stream.next_message()).uri == watched[0]
        for mcp, _ in sessions:
            assert "result" in await mcp.call("resources/list")
        assert (await idle.post({"jsonrpc": "2.0", "id": 9, "method": "resources/list"})).status_code == 404
    print(f"\n[redis restarted empty] resync notifications {', '.join(f'{t:.2f}s' for t in resynced)} "
          "after the stop; sessions restored; a session without an open stream gets 404")


@pytest.mark.timeout(60)
async def test_a_redis_outage_answers_503_quickly_ends_streams_with_retry_and_heals_itself(
        own_deployment: Deployment) -> None:
    deploy = own_deployment
    assert deploy.redis is not None and deploy.redis.proc is not None
    watched = uris(2)
    async with httpx.AsyncClient(base_url=deploy.url, timeout=30) as http:
        mcp = await McpSession(http).initialize()
        await mcp.subscribe(*watched)
        async with mcp.stream() as stream:
            cursor = (await stream.next_event()).id
            os.kill(deploy.redis.proc.pid, signal.SIGSTOP)  # a hung Redis: no errors, no replies
            stopped = time.monotonic()
            try:
                latencies = []
                statuses = []
                for request in (lambda: mcp.post({"jsonrpc": "2.0", "id": 5, "method": "resources/subscribe",
                                                  "params": {"uri": watched[0]}}),
                                lambda: http.post("/changes", json={"uri": watched[0]}),
                                lambda: mcp.initialize()):
                    began = time.monotonic()
                    try:
                        response = await request()
                        statuses.append((response.status_code, response.json()))
                    except AssertionError:
                        statuses.append((503, None))  # initialize asserts 200; a 503 is what we want
                    latencies.append(time.monotonic() - began)
                events = await stream.until_end(timeout=15)
                ended = time.monotonic() - stopped
            finally:
                os.kill(deploy.redis.proc.pid, signal.SIGCONT)
        resumed = time.monotonic()
        assert [status for status, _ in statuses] == [503, 503, 503]
        body = statuses[0][1]
        assert body["jsonrpc"] == "2.0" and body["error"]["code"] < 0
        # Nothing hangs: a Redis call gives up after two attempts of 1s (socket timeout, one retry);
        # allow a request two such calls (measured: one, ~2.1s, directly; up to ~4.3s via the proxy).
        assert max(latencies) < 5.0, latencies
        assert events and events[-1].retry is not None and events[-1].data is None
        # Service returns by itself: the same session resumes from its cursor on any worker.
        async with asyncio.timeout(15):
            while (await http.get("/healthz")).status_code != 200:
                await asyncio.sleep(0.05)
        await publish(http, watched[1])
        async with mcp.stream(last_event_id=cursor) as stream:
            # A 503 means "not acknowledged", not "not applied": the change sent during the hang
            # may have reached Redis after all, and then it is delivered too.
            first = await stream.next_message()
            if first.uri == watched[0]:
                first = await stream.next_message()
            assert first.uri == watched[1]
        healed = time.monotonic() - resumed
    print(f"\n[redis hung {resumed - stopped:.1f}s] request latencies {', '.join(f'{t:.2f}s' for t in latencies)} "
          f"(all 503); stream ended with retry: {ended:.2f}s after the stop; "
          f"service back {healed:.2f}s after Redis")


@pytest.mark.timeout(90)
async def test_a_client_that_never_reads_does_not_grow_its_worker(own_deployment_small_inbox: Deployment) -> None:
    deploy = own_deployment_small_inbox
    targets = uris(100)
    pad = "x" * 200
    async with httpx.AsyncClient(base_url=deploy.url, timeout=30) as http:
        mcp = await McpSession(http).initialize()
        await mcp.subscribe(*targets)
        watcher = await McpSession(http).initialize()  # a normal reader: tells when fan-out is done
        await watcher.subscribe(targets[-1])
        assert mcp.id is not None
        worker = deploy.workers[0]
        process = psutil.Process(worker.proc.pid)
        reader, writer = await asyncio.open_connection("127.0.0.1", worker.port)
        try:
            writer.write((f"GET /mcp HTTP/1.1\r\nHost: x\r\nAccept: text/event-stream\r\n"
                          f"Mcp-Session-Id: {mcp.id}\r\nMCP-Protocol-Version: 2025-11-25\r\n\r\n").encode())
            await writer.drain()
            async with watcher.stream() as watching:
                await watching.next_event()
                baseline = process.memory_info().rss
                peak = baseline
                total = 10_000
                for seq in range(0, total, 500):
                    await publish_seq(http, [(targets[(seq + i) % 100], seq + i) for i in range(500)], pad)
                    peak = max(peak, process.memory_info().rss)
                # Fan-out has processed the last change once the watcher hears of it (a URI's
                # notifications leave in publish order, so nothing of it is still to come).
                async with asyncio.timeout(60):
                    while True:
                        event = await watching.next_message()
                        if event.message["params"].get("_meta", {}).get("seq") == total - 1:
                            break
                        peak = max(peak, process.memory_info().rss)
            peak = max(peak, process.memory_info().rss)
            with Redis.from_url(deploy.redis_url) as raw:
                inbox_len = raw.xlen(f"mcpb:{{s:{mcp.id}}}:inbox")
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
    growth = (peak - baseline) / 2**20
    print(f"\n[slow client] {total} changes of ~250 bytes to a stream nobody reads: worker RSS "
          f"{baseline / 2**20:.1f} MB -> peak {peak / 2**20:.1f} MB (+{growth:.1f} MB); inbox length {inbox_len} "
          f"(maxlen 500)")
    assert growth < 40, f"the worker grew by {growth:.1f} MB"
    assert inbox_len <= 500 + 200  # MAXLEN ~ trims whole stream nodes




@pytest.mark.timeout(60)
async def test_a_worker_stopped_with_sigterm_hands_fanout_over_at_once() -> None:
    """The lease of a stopping worker is given up, not left to lapse: with a 30 s lease, a change
    published right after the holder stopped is still delivered within seconds."""
    env = {**WORKER_ENV, "MCP_BROKER_FANOUT_CLAIM_IDLE_MS": "30000"}
    with RedisProcess() as redis:
        env["MCP_BROKER_REDIS_URL"] = redis.url
        first = BrokerProcess(env=env)
        try:
            with Redis.from_url(redis.url) as raw:
                wait_until(lambda: raw.get("mcpb:{c:0}:lease") is not None, what="the first worker's lease")
                holder = raw.get("mcpb:{c:0}:lease")
            with BrokerProcess(env=env) as second:
                async with httpx.AsyncClient(base_url=second.url, timeout=10) as http:
                    mcp = await McpSession(http).initialize()
                    await mcp.subscribe("https://example.com/handover")
                    async with mcp.stream() as stream:
                        await stream.next_event()
                        # uvicorn re-raises the signal once it has shut down gracefully.
                        assert first.terminate() in (0, -signal.SIGTERM)
                        with Redis.from_url(redis.url) as raw:
                            assert raw.get("mcpb:{c:0}:lease") != holder
                        await publish(http, "https://example.com/handover")
                        assert (await stream.next_message(timeout=10)).uri == "https://example.com/handover"
        finally:
            first.kill()
