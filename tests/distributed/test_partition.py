"""A worker cut off from Redis by a real network partition: what it answered 503 never lands later.

The partition is made with a network namespace and a veth pair. Redis listens on loopback (for
the healthy worker) and on an address of its own on the host end of the pair; the namespace
routes that single address over the pair, so a ``blackhole`` route there cuts the worker in the
namespace off from Redis while its TCP connections stay up and the test still reaches its HTTP
port. A blackholed segment is not lost for good: TCP keeps it in the send queue and retransmits
it once the route is back, seconds later.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import secrets
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest

from tests.distributed.conftest import WORKER_ENV
from tests.integration.mcp_http import McpSession, SSEStream
from tests.support import BrokerProcess, RedisProcess, free_port, wait_until

#: Retransmission backoff doubles from about 0.2 s: a segment queued during a cut of a few
#: seconds goes out again within about 7 s of the heal, well inside this bound.
SETTLE_TIMEOUT = 30.0


def ip(*args: str, netns: str | None = None) -> str:
    command = ["ip", *(["netns", "exec", netns, "ip"] if netns else []), *args]
    return subprocess.run(command, check=True, capture_output=True, text=True, timeout=10).stdout


@dataclass
class Partition:
    """A namespace whose only way to Redis (``redis_address``) can be cut and healed."""

    netns: str
    host_address: str  # the host end of the pair
    worker_address: str  # the namespace end: the cut worker listens here
    redis_address: str  # a /32 of its own on the host end, routed through the pair

    @property
    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.netns]

    def cut(self) -> None:
        ip("route", "replace", "blackhole", f"{self.redis_address}/32", netns=self.netns)

    def heal(self) -> None:
        ip("route", "replace", f"{self.redis_address}/32", "via", self.host_address, netns=self.netns)

    def unsent(self) -> list[str]:
        """The namespace's TCP sockets to Redis that still hold bytes Redis has not acknowledged."""
        out = subprocess.run([*self.prefix, "ss", "-tnH", "state", "all", "dst", self.redis_address],
                             check=True, capture_output=True, text=True, timeout=10).stdout
        return [line for line in out.splitlines() if len(fields := line.split()) >= 3 and fields[2] != "0"]


def _free_block() -> ipaddress.IPv4Network:
    """A /29 of 10.213.0.0/16 that no interface of the host uses (the /30 link and the Redis /32)."""
    used = ip("-4", "-o", "addr", "show")
    while True:
        block = ipaddress.IPv4Network(f"10.213.{secrets.randbelow(256)}.{8 * secrets.randbelow(32)}/29")
        if not any(str(address) in used for address in block):
            return block


@pytest.fixture
def partition() -> Iterator[Partition]:
    tag = secrets.token_hex(3)
    netns, outside, inside = f"mcpb-{tag}", f"mcpb{tag}h", f"mcpb{tag}n"
    try:
        ip("netns", "add", netns)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"a network partition needs `ip netns` (root): {getattr(exc, 'stderr', exc)}")
    try:
        hosts = list(_free_block().hosts())  # .1 .2: the link (a /30); .5: Redis (a /32)
        host_address, worker_address, redis_address = str(hosts[0]), str(hosts[1]), str(hosts[4])
        ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        ip("link", "set", inside, "netns", netns)
        ip("addr", "add", f"{host_address}/30", "dev", outside)
        ip("addr", "add", f"{redis_address}/32", "dev", outside)
        ip("link", "set", outside, "up")
        ip("addr", "add", f"{worker_address}/30", "dev", inside, netns=netns)
        ip("link", "set", inside, "up", netns=netns)
        ip("link", "set", "lo", "up", netns=netns)
        partition = Partition(netns, host_address, worker_address, redis_address)
        partition.heal()
        yield partition
    finally:
        subprocess.run(["ip", "netns", "delete", netns], capture_output=True, timeout=10)  # takes the pair along
        subprocess.run(["ip", "link", "delete", outside], capture_output=True, timeout=10)  # in case it did not


async def seqs_until(stream: SSEStream, uri: str, last: int) -> list[int]:
    """The ``_meta.seq`` of every notification of ``uri`` read until ``last`` arrives."""
    seen: list[int] = []
    while not seen or seen[-1] != last:
        event = await stream.next_message()
        if event.uri == uri:
            seen.append(event.message["params"]["_meta"]["seq"])
    return seen


@pytest.fixture
def workers(partition: Partition) -> Iterator[tuple[BrokerProcess, BrokerProcess]]:
    """One Redis; a healthy worker on loopback, and one in the namespace that ``partition`` cuts off."""
    with RedisProcess(extra=["--bind", "127.0.0.1", partition.redis_address, "--protected-mode", "no"]) as redis:
        port = free_port()  # the namespace has ports of its own: any will do
        cut_off_env = {**WORKER_ENV, "MCP_BROKER_REDIS_URL": f"redis://{partition.redis_address}:{redis.port}/0",
                       "MCP_BROKER_REDIS_SOCKET_TIMEOUT": "2",  # time enough to see its writes queued
                       "MCP_BROKER_ALLOWED_HOSTS": json.dumps([f"{partition.worker_address}:{port}"])}
        with ThreadPoolExecutor(2) as pool:
            starting = [pool.submit(BrokerProcess, env={**WORKER_ENV, "MCP_BROKER_REDIS_URL": redis.url}),
                        pool.submit(BrokerProcess, env=cut_off_env, port=port, host=partition.worker_address,
                                    prefix=partition.prefix)]
        try:
            healthy, cut_off = (f.result() for f in starting)
            yield healthy, cut_off
        finally:
            for future in starting:
                if future.exception() is None:
                    future.result().kill()


@pytest.mark.timeout(90)
async def test_writes_answered_503_during_a_partition_never_land_after_later_acknowledged_writes(
        partition: Partition, workers: tuple[BrokerProcess, BrokerProcess]) -> None:
    healthy, cut_off = workers
    record = f"/collections/c{secrets.token_hex(4)}/1"
    uri = f"https://example.com/{secrets.token_hex(3)}/doc"
    async with (httpx.AsyncClient(base_url=healthy.url, timeout=30) as good,
                httpx.AsyncClient(base_url=cut_off.url, timeout=30) as bad):
        mcp = await McpSession(good).initialize()
        await mcp.subscribe(uri)
        async with mcp.stream() as stream:
            await stream.next_event()  # priming: the stream is claimed and reading
            assert (await good.put(record, json={"v": 1})).status_code == 201
            assert (await good.post("/changes", json={"uri": uri, "meta": {"seq": 1}})).status_code == 202
            # Several connections of the cut-off worker's pool up and idle, as under load.
            warm = await asyncio.gather(*(bad.get(record) for _ in range(8)))
            assert {r.status_code for r in warm} == {200}

            partition.cut()
            put, post, _ = await asyncio.gather(
                bad.put(record, json={"v": 2}),
                bad.post("/changes", json={"uri": uri, "meta": {"seq": 2}}),
                # The two writes did leave the worker: they wait in its kernel's send queues.
                asyncio.to_thread(wait_until, lambda: len(partition.unsent()) >= 2, 10,
                                  "the cut-off worker's writes to be queued for Redis"))
            assert (put.status_code, post.status_code) == (503, 503)
            assert (await good.put(record, json={"v": 3})).status_code == 200
            assert (await good.post("/changes", json={"uri": uri, "meta": {"seq": 3}})).status_code == 202
            queued = partition.unsent()
            partition.heal()
            healed = time.monotonic()

            # Nothing of the cut-off worker is left for TCP to deliver: every socket it has to
            # Redis has had all its bytes acknowledged (or is gone).
            await asyncio.to_thread(wait_until, lambda: not partition.unsent(), SETTLE_TIMEOUT,
                                    "the cut-off worker's connections to hold no unsent bytes")
            settled = time.monotonic() - healed
            # A URI's notifications leave in the order of its changes: once seq 4 is read,
            # whatever reached the change log before it has been delivered too.
            assert (await good.post("/changes", json={"uri": uri, "meta": {"seq": 4}})).status_code == 202
            seen = await seqs_until(stream, uri, 4)
        value = (await good.get(record)).json()
    print(f"\n[partition] queued at the heal: {len(queued)} socket(s) with unsent bytes; settled "
          f"{settled:.1f}s after the heal; record {value}; notifications of the URI: seq {seen}")
    assert value == {"v": 3}, "a PUT answered 503 landed over a later acknowledged PUT"
    assert 2 not in seen[seen.index(3):], "a change answered 503 was notified after a later acknowledged one"
