"""Faults that make fan-out redo a batch add no notification twice to an inbox, and lose none.

Every change carries a ``_meta.seq`` of its own, and sessions subscribed to every URI hold, in
their inboxes, read straight from Redis (so nothing a stream would coalesce hides a repeat),
each URI's frames in increasing seq, none twice, ending with its newest change. Changes of one
URI in one fan-out batch coalesce into the newest: a partition holds a share of the URIs, so a
batch may meet one URI more than once. Run with ``-s`` to see the numbers.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator

import httpx
import orjson
import pytest
from redis import Redis

from broker.backends.redis.codec import decode_entry
from tests.distributed.conftest import WORKER_ENV
from tests.distributed.scenario import uris
from tests.integration.mcp_http import McpSession
from tests.support import BrokerProcess, RedisProcess, wait_until

#: Sessions subscribed to every URI, the URIs, and the rounds of each test.
SESSIONS = 12
URIS = 300
ROUNDS = 3
#: Batches of a few dozen changes: each append is large next to the reads around it. Changes
#: cycle through the URIs, so no batch holds one URI twice (nothing coalesces); the inboxes
#: keep every frame of a test.
#: One change-log partition: these faults are about one holder and the standby that takes over
#: from it (with several, live workers share the partitions; tests/distributed/test_scale_out.py).
ENV = {**WORKER_ENV, "MCP_BROKER_FANOUT_BATCH": "32", "MCP_BROKER_INBOX_MAXLEN": "30000",
       "MCP_BROKER_CHANGELOG_PARTITIONS": "1"}
LEASE = "mcpb:{c:0}:lease"


async def subscribed_session(http: httpx.AsyncClient, targets: list[str]) -> str:
    """A 2025-03-26 session (it may batch) subscribed to every target, 100 per request."""
    mcp = await McpSession(http, version="2025-03-26").initialize()
    for start in range(0, len(targets), 100):
        body = [{"jsonrpc": "2.0", "id": n, "method": "resources/subscribe", "params": {"uri": uri}}
                for n, uri in enumerate(targets[start:start + 100], start)]
        response = await mcp.post(body)
        assert response.status_code == 200 and all("result" in reply for reply in response.json()), response.text
    assert mcp.id is not None
    return mcp.id


def inbox_key(sid: str) -> str:
    return f"mcpb:{{s:{sid}}}:inbox"


async def fanout_begins(raw: Redis, watcher: str, before: int) -> None:
    """Wait until fan-out has appended to ``watcher``'s inbox past ``before`` frames."""
    await asyncio.to_thread(wait_until, lambda: raw.xlen(inbox_key(watcher)) > before, 10, "fan-out to begin")


def inbox_seqs(raw: Redis, sid: str) -> list[tuple[str, int]]:
    """The (URI, seq) of every frame in the session's inbox, in inbox order."""
    found: list[tuple[str, int]] = []
    for _, fields in raw.xrange(inbox_key(sid)):
        params = orjson.loads(decode_entry(fields).data)["params"]
        found.append((params["uri"], params["_meta"]["seq"]))
    return found


def newest(pairs: set[tuple[str, int]] | list[tuple[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for uri, seq in pairs:
        out[uri] = max(seq, out.get(uri, -1))
    return out


def pending(raw: Redis) -> int:
    return sum(int(raw.xpending(key, "fanout")["pending"]) for key in raw.scan_iter("mcpb:{c:*}:log"))


def settled(raw: Redis, sids: list[str], wanted: set[tuple[str, int]]) -> bool:
    """Every change fanned out and acknowledged: nothing is left to redo, every URI's newest change is in."""
    if pending(raw):
        return False
    last = newest(wanted)
    return all(newest(inbox_seqs(raw, sid)) == last for sid in sids)


def repeats_and_missing(raw: Redis, sids: list[str], wanted: set[tuple[str, int]]) -> tuple[int, int]:
    """Frames that repeat or go back on an earlier one of their URI, and URIs whose newest change is missing.

    Changes of one URI that fan-out handled in one batch coalesce into the newest (a level
    trigger): so a change may have no frame of its own, but its URI's newest one is there, once,
    after every older one.
    """
    repeats = missing = 0
    last = newest(wanted)
    for sid in sids:
        seen: dict[str, int] = {}
        for uri, seq in inbox_seqs(raw, sid):
            if seq <= seen.get(uri, -1):
                repeats += 1
            seen[uri] = max(seq, seen.get(uri, -1))
        missing += sum(1 for uri, seq in last.items() if seen.get(uri) != seq)
    return repeats, missing


async def publish_round(http: httpx.AsyncClient, targets: list[str], first_seq: int,
                        count: int) -> set[tuple[str, int]]:
    """``count`` changes through the targets in turn, seqs from ``first_seq``; the (URI, seq) pairs."""
    changes = [(targets[n % len(targets)], first_seq + n) for n in range(count)]
    for start in range(0, len(changes), 50):
        body = [{"uri": uri, "meta": {"seq": seq}} for uri, seq in changes[start:start + 50]]
        response = await http.post("/changes", json=body)
        assert response.status_code == 202, response.text
    return set(changes)


async def publish_while_held(http: httpx.AsyncClient, raw: Redis, targets: list[str], first_seq: int, watcher: str,
                             stop: asyncio.Event) -> set[tuple[str, int]]:
    """Publish until ``stop`` or until the fan-out lease changes hands (2,000 changes at most),
    keeping fan-out a few batches behind: it is always at work, never far behind. The (URI, seq) pairs."""
    published: set[tuple[str, int]] = set()
    seq = first_seq
    inbox = inbox_key(watcher)
    start = raw.xlen(inbox)
    holder = raw.get(LEASE)
    while not stop.is_set() and raw.get(LEASE) == holder and len(published) < 2000:
        if len(published) - (raw.xlen(inbox) - start) < 100:
            published |= await publish_round(http, targets, seq, 50)
            seq += 50
        else:
            await asyncio.sleep(0.002)
    return published


@pytest.fixture
def workers() -> Iterator[list[BrokerProcess]]:
    """Worker processes a test starts; all are killed at the end."""
    started: list[BrokerProcess] = []
    yield started
    for worker in started:
        worker.kill()


@pytest.mark.timeout(120)
async def test_a_fanout_holder_stopped_with_sigterm_mid_flow_adds_each_change_once(
        workers: list[BrokerProcess]) -> None:
    """Three times, the worker fanning out is stopped gracefully while changes flow (it has a
    backlog), and a standby takes over; the clients' worker does no fan-out of its own."""
    targets = uris(URIS)
    wanted: set[tuple[str, int]] = set()
    with RedisProcess() as redis, Redis.from_url(redis.url) as raw:
        env = {**ENV, "MCP_BROKER_REDIS_URL": redis.url}
        workers.append(BrokerProcess(env=env))
        wait_until(lambda: raw.get(LEASE) is not None, what="the first worker's lease")
        front = BrokerProcess(env={**env, "MCP_BROKER_EMBEDDED_FANOUT": "false"})
        workers.append(front)
        holder = workers[0]
        async with httpx.AsyncClient(base_url=front.url, timeout=30) as http:
            sids = list(await asyncio.gather(*(subscribed_session(http, targets) for _ in range(SESSIONS))))
            for round_ in range(ROUNDS):
                successor = await asyncio.to_thread(BrokerProcess, env=env)  # stands by
                workers.append(successor)
                before = raw.xlen(inbox_key(sids[-1]))
                stop = asyncio.Event()
                publishing = asyncio.ensure_future(
                    publish_while_held(http, raw, targets, round_ * 100_000, sids[-1], stop))
                await fanout_begins(raw, sids[-1], before)
                try:
                    # uvicorn re-raises the signal once it has shut down gracefully.
                    assert await asyncio.to_thread(holder.terminate) in (0, -signal.SIGTERM)
                finally:
                    stop.set()
                    wanted |= await publishing
                holder = successor
            began = time.monotonic()
            await asyncio.to_thread(wait_until, lambda: settled(raw, sids, wanted), 60, "every change fanned out")
        repeats, missing = repeats_and_missing(raw, sids, wanted)
    print(f"\n[SIGTERM of the fan-out holder x{ROUNDS}] {len(wanted)} changes to {SESSIONS} sessions; "
          f"settled {time.monotonic() - began:.2f}s after the last stop; repeated frames {repeats}, missing {missing}")
    assert (repeats, missing) == (0, 0)


@pytest.mark.timeout(120)
async def test_redis_frozen_past_the_socket_timeout_while_fanout_appends_adds_each_change_once(
        workers: list[BrokerProcess]) -> None:
    """Three times, Redis is stopped (SIGSTOP) while fan-out works through a backlog, until a worker
    has given up on it, then resumed: what a worker gave up on still runs, and is redone as well."""
    targets = uris(URIS)
    wanted: set[tuple[str, int]] = set()
    with RedisProcess() as redis, Redis.from_url(redis.url) as raw:
        assert redis.proc is not None
        env = {**ENV, "MCP_BROKER_REDIS_URL": redis.url}
        workers.extend(await asyncio.gather(*(asyncio.to_thread(BrokerProcess, env=env) for _ in range(2))))
        async with httpx.AsyncClient(base_url=workers[0].url, timeout=30) as http:
            sids = list(await asyncio.gather(*(subscribed_session(http, targets) for _ in range(SESSIONS))))
            frozen = []
            for round_ in range(ROUNDS):
                before = raw.xlen(inbox_key(sids[-1]))
                wanted |= await publish_round(http, targets, round_ * URIS, URIS)
                await fanout_begins(raw, sids[-1], before)  # and freeze at once: it is mid-backlog
                os.kill(redis.proc.pid, signal.SIGSTOP)
                stopped = time.monotonic()
                try:
                    # A Redis call gives up after the socket timeout (1 s here): the health check
                    # of a worker failing says fan-out's calls gave up too.
                    await asyncio.to_thread(
                        wait_until, lambda: httpx.get(workers[1].url + "/healthz", timeout=5).status_code == 503,
                        15, "a worker to give up on Redis")
                finally:
                    os.kill(redis.proc.pid, signal.SIGCONT)
                frozen.append(time.monotonic() - stopped)
            await asyncio.to_thread(wait_until, lambda: settled(raw, sids, wanted), 60, "every change fanned out")
        repeats, missing = repeats_and_missing(raw, sids, wanted)
    print(f"\n[Redis frozen x{ROUNDS}: {', '.join(f'{t:.1f}s' for t in frozen)}] {len(wanted)} changes to "
          f"{SESSIONS} sessions; repeated frames {repeats}, missing {missing}")
    assert (repeats, missing) == (0, 0)
