"""Sentinel failovers under load: no acknowledged change is missed silently, no event id names two changes.

A master, a replica and a Sentinel; two workers behind the round-robin proxy; a legacy session
holding its GET stream and a listen holding its stream, each reconnecting whenever its stream
ends; two publishers POSTing changes all the time. Sentinel fails over again and again
(``SENTINEL FAILOVER``): the old master stays a writable master for seconds, and what the
workers write there meanwhile is lost when it becomes a replica.

What a client must never see: an acknowledged change neither notified nor followed by the
gap rule (a resync, a new listen, a new session), an event id given to two different changes,
an id going backwards within its epoch. With ``MCP_BROKER_REDIS_DURABLE_REPLICAS`` set, a
write is acknowledged only once a replica has it, and no acknowledged record is lost.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.distributed.conftest import Deployment
from tests.distributed.scenario import UPDATED, uris
from tests.distributed.test_sentinel import SERVICE, SentinelSetup, cli, in_sync, master_port, promotable
from tests.integration import modern
from tests.integration.mcp_http import McpSession, SSEStream, StreamEnded
from tests.support import RedisProcess, wait_until

FAILOVERS = 2
WATCHED = uris(8)
#: Streams stay open through a promotion (they end after this long without Redis).
ENV = {"MCP_BROKER_OUTAGE_GRACE": "5"}
#: Durable mode: one replica has every acknowledged write (its wait below the tier's socket timeout of 1 s).
DURABLE = {"MCP_BROKER_REDIS_DURABLE_REPLICAS": "1", "MCP_BROKER_REDIS_DURABLE_TIMEOUT": "0.5"}


@dataclass
class Seen:
    """What one client received: the newest seq notified per URI, when gap rules came, event ids."""

    newest: dict[str, int] = field(default_factory=dict)
    notified: int = 0
    #: When the last gap rule came (a resync, a new listen, a new session): it covers all before it.
    last_gap: float = 0.0
    ids: dict[str, tuple[str, int]] = field(default_factory=dict)
    reused: list[tuple[str, tuple[str, int], tuple[str, int]]] = field(default_factory=list)
    backwards: list[tuple[str, str]] = field(default_factory=list)
    last: dict[str, int] = field(default_factory=dict)  # per epoch, the newest offset

    def gap(self) -> None:
        self.last_gap = time.monotonic()

    def update(self, message: dict[str, Any], event_id: str | None) -> None:
        params = message.get("params", {})
        uri, seq = params.get("uri"), params.get("_meta", {}).get("seq")
        if message.get("method") != UPDATED or uri not in WATCHED:
            return  # a record's list_changed, an update of a record nobody watches
        if seq is None:
            self.gap()  # the gap rule: an update of a watched URI with no change behind it
            return
        self.notified += 1
        self.newest[uri] = max(self.newest.get(uri, -1), seq)
        if event_id:
            known = self.ids.setdefault(event_id, (uri, seq))
            if known != (uri, seq):
                self.reused.append((event_id, known, (uri, seq)))
            epoch, _, offset = event_id.rpartition("-")
            if int(offset) < self.last.get(epoch, 0):
                self.backwards.append((event_id, f"{epoch}-{self.last[epoch]}"))
            self.last[epoch] = max(self.last.get(epoch, 0), int(offset))

    def uncovered(self, acked: dict[tuple[str, int], float]) -> list[tuple[str, int]]:
        """Acknowledged changes neither notified (nor a later change of their URI: level triggers)
        nor followed by a gap rule."""
        return [(uri, seq) for (uri, seq), at in acked.items()
                if self.newest.get(uri, -1) < seq and self.last_gap <= at]


async def hold_legacy(http: httpx.AsyncClient, seen: Seen, stop: asyncio.Event) -> None:
    """A legacy client: its GET stream resumed with Last-Event-ID, a new session after a 404."""
    last: str | None = None
    mcp: McpSession | None = None
    while not stop.is_set():
        try:
            if mcp is None:
                mcp = await McpSession(http).initialize()
                await mcp.subscribe(*WATCHED)
                seen.gap()  # a new session: the client reads everything again
                last = None
            headers = mcp.headers(Accept="text/event-stream")
            headers.pop("Content-Type")
            if last is not None:
                headers["Last-Event-ID"] = last
            async with http.stream("GET", "/mcp", headers=headers) as response:
                if response.status_code == 404:
                    mcp = None
                    continue
                if response.status_code != 200:
                    await asyncio.sleep(0.1)
                    continue
                stream = SSEStream(response)
                while not stop.is_set():
                    event = await stream.next_event(timeout=60)
                    if event.id:
                        last = event.id
                    if event.data:
                        seen.update(event.message, event.id)
        except (StreamEnded, httpx.HTTPError, AssertionError):
            await asyncio.sleep(0.05)


async def hold_listen(http: httpx.AsyncClient, seen: Seen, stop: asyncio.Event) -> None:
    """A 2026 client: a plain listen, listened again (and everything re-read) whenever it ends."""
    body = orjson.dumps(modern.request("subscriptions/listen", {"notifications": {"resourceSubscriptions": WATCHED}}))
    while not stop.is_set():
        try:
            async with http.stream("POST", "/mcp", content=body,
                                   headers=modern.headers("subscriptions/listen")) as response:
                if response.status_code != 200:
                    await asyncio.sleep(0.1)
                    continue
                stream = SSEStream(response)
                while not stop.is_set():
                    event = await stream.next_message(timeout=60)
                    if event.method == "notifications/subscriptions/acknowledged":
                        seen.gap()  # a new listen: the client reads everything again
                    elif event.message is not None and "method" in event.message:
                        seen.update(event.message, None)
        except (StreamEnded, httpx.HTTPError):
            await asyncio.sleep(0.05)


async def publish(http: httpx.AsyncClient, counter: Iterator[int], acked: dict[tuple[str, int], float],
                  records: dict[str, float], stop: asyncio.Event) -> None:
    """Changes of the watched URIs, one a request, and records; each acknowledged one is noted."""
    while not stop.is_set():
        seq = next(counter)
        uri = WATCHED[seq % len(WATCHED)]
        try:
            response = await http.post("/changes", json={"uri": uri, "meta": {"seq": seq}})
            if response.status_code == 202:
                acked[(uri, seq)] = time.monotonic()
            record = await http.put(f"/collections/failover/{seq}", json={"seq": seq})
            if record.status_code in (200, 201):
                records[str(seq)] = time.monotonic()
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.005)


def replica_of(setup: SentinelSetup) -> RedisProcess:
    """The server that is not the master Sentinel names now."""
    current = master_port(setup.sentinel_port)
    return next(r for r in [setup.master, *setup.replicas] if r is not None and r.port != current)


def fail_over(setup: SentinelSetup) -> float:
    """One ``SENTINEL FAILOVER``, once the replica can be promoted; how long until Sentinel named it."""
    replica = replica_of(setup)
    wait_until(lambda: in_sync(replica.port) and promotable(setup.sentinel_port, replica.port), timeout=30,
               what="the replica in sync and known to Sentinel")
    started = time.monotonic()
    assert cli(setup.sentinel_port, "sentinel", "failover", SERVICE).strip() == "OK"
    wait_until(lambda: master_port(setup.sentinel_port) == replica.port, timeout=30, what="the promotion")
    return time.monotonic() - started


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[SentinelSetup]:
    sentinel = SentinelSetup(tmp_path, replicas=1)
    try:
        yield sentinel
    finally:
        sentinel.stop()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("durable", [False, True], ids=["asynchronous", "durable"])
async def test_failovers_lose_nothing_silently_and_never_reuse_an_id(setup: SentinelSetup, durable: bool) -> None:
    assert setup.sentinel is not None
    env = {**ENV, **(DURABLE if durable else {})}
    deploy = Deployment(workers=2, redis_url=setup.sentinel.url, env=env)
    legacy, listen = Seen(), Seen()
    acked: dict[tuple[str, int], float] = {}
    records: dict[str, float] = {}
    stop, quiet = asyncio.Event(), asyncio.Event()
    counter = itertools.count()
    try:
        async with httpx.AsyncClient(base_url=deploy.url, timeout=30) as http:
            holders = [asyncio.ensure_future(hold_legacy(http, legacy, stop)),
                       asyncio.ensure_future(hold_listen(http, listen, stop))]
            publishers = [asyncio.ensure_future(publish(http, counter, acked, records, quiet)) for _ in range(2)]
            promoted = []
            for _ in range(FAILOVERS):
                await asyncio.sleep(1)
                promoted.append(await asyncio.to_thread(fail_over, setup))
            # The last old master demoted and in sync again: what it took meanwhile is gone.
            await asyncio.to_thread(wait_until, lambda: in_sync(replica_of(setup).port), 30, "the old master demoted")
            quiet.set()
            await asyncio.gather(*publishers)
            # A change published last is notified within seconds; then nothing more is owed.
            deadline = time.monotonic() + 20
            while (legacy.uncovered(acked) or listen.uncovered(acked)) and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            stop.set()
            for holder in holders:
                holder.cancel()
            await asyncio.gather(*holders, return_exceptions=True)
            lost_records = [key for key in records
                            if (await http.get(f"/collections/failover/{key}")).status_code != 200]
    finally:
        deploy.close()
    print(f"\n[{'durable' if durable else 'asynchronous'}] {FAILOVERS} failovers (named after "
          f"{', '.join(f'{p:.1f}' for p in promoted)} s); {len(acked)} changes and {len(records)} records "
          f"acknowledged; legacy: {legacy.notified} notified; listen: {listen.notified} notified; "
          f"records lost: {len(lost_records)}")
    assert acked and legacy.notified and listen.notified
    assert legacy.uncovered(acked) == [], "acknowledged, never notified, no gap rule after it (legacy stream)"
    assert listen.uncovered(acked) == [], "acknowledged, never notified, no gap rule after it (listen)"
    assert legacy.reused == [], "an event id given to two different changes"
    assert legacy.backwards == [], "an event id going backwards within its epoch"
    if durable:
        assert lost_records == [], "an acknowledged record lost in a failover"
