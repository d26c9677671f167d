"""Fair by default: without ``MCP_BROKER_QUOTAS``, one tenant publishing as fast as a worker
accepts does not hold another tenant's notifications up past a second, and one tenant cannot
fill ``max_sessions`` or ``max_listens`` for another (memory and Redis).

The flood runs in a process of its own (``python -m tests.integration.test_fair_defaults URL
SECONDS``), so its clients do not slow down the quiet tenant's clock readings in this one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import secrets
import statistics
import sys
import time
from collections.abc import Awaitable, Iterator
from pathlib import Path

import httpx
import orjson
import pytest

from tests.integration import modern
from tests.integration.mcp_http import McpSession
from tests.support import BrokerProcess, RedisProcess

ROOT = Path(__file__).resolve().parents[2]
KEYS = '{"kf": "flood/f", "kq": "quiet/q"}'
#: Flooding requests in flight at once, and changes in each (URIs spread over every partition).
FLOOD_LOOPS = 8
PER_REQUEST = 100
#: Seconds the flood runs before the quiet tenant starts measuring, and while it measures.
LEAD = 2.0
MEASURE = 6.0
QUIET_EVERY = 0.05
URI = "test://quiet/clock"


@pytest.fixture(params=["memory", "redis"])
def default_broker(request: pytest.FixtureRequest) -> Iterator[BrokerProcess]:
    with broker(request, {}) as proc:
        yield proc


@pytest.fixture(params=["memory", "redis"])
def small_broker(request: pytest.FixtureRequest) -> Iterator[BrokerProcess]:
    """Global bounds small enough to fill; the tenant share as it is by default."""
    with broker(request, {"MCP_BROKER_MAX_SESSIONS": "10", "MCP_BROKER_MAX_LISTENS": "4"}) as proc:
        yield proc


@contextlib.contextmanager
def broker(request: pytest.FixtureRequest, extra: dict[str, str]) -> Iterator[BrokerProcess]:
    env = {"MCP_BROKER_API_KEYS": KEYS, **extra}
    if request.param == "redis":
        server: RedisProcess = request.getfixturevalue("redis_server")
        env |= {"MCP_BROKER_REDIS_URL": server.url, "MCP_BROKER_REDIS_PREFIX": f"t{secrets.token_hex(4)}"}
    with BrokerProcess(env=env) as proc:
        yield proc


async def flood(url: str, seconds: float) -> dict[int, int]:
    """Publish as fast as the worker answers, for ``seconds``; the count of each status."""
    statuses: dict[int, int] = {}
    serial = iter(range(10**9))

    async def loop(http: httpx.AsyncClient, until: float) -> None:
        while time.monotonic() < until:
            n = next(serial)
            body = [{"uri": f"test://flood/{n}/{i}"} for i in range(PER_REQUEST)]
            answer = await http.post("/changes", json=body, headers={"Authorization": "Bearer kf"})
            statuses[answer.status_code] = statuses.get(answer.status_code, 0) + 1

    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        until = time.monotonic() + seconds
        await asyncio.gather(*(loop(http, until) for _ in range(FLOOD_LOOPS)))
    return statuses


async def test_a_flooding_tenant_does_not_delay_another_tenants_notifications(
        default_broker: BrokerProcess) -> None:
    #: Per notification received: when, and the send time its change carries.
    received: list[tuple[float, float]] = []
    sent: list[float] = []
    async with httpx.AsyncClient(base_url=default_broker.url, timeout=30) as http:
        quiet = await McpSession(http, auth="kq").initialize()
        await quiet.subscribe(URI)
        async with quiet.stream() as stream:

            async def receive() -> None:
                while True:
                    event = await stream.next_message(timeout=60)
                    if event.uri == URI:
                        received.append((time.time(), event.message["params"]["_meta"]["t"]))

            receiver = asyncio.create_task(receive())
            flooder = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "tests.integration.test_fair_defaults", default_broker.url,
                str(LEAD + MEASURE), cwd=ROOT, stdout=asyncio.subprocess.PIPE)
            await asyncio.sleep(LEAD)
            until = time.monotonic() + MEASURE
            while time.monotonic() < until:
                sent.append(time.time())
                response = await http.post("/changes", json={"uri": URI, "meta": {"t": sent[-1]}},
                                           headers={"Authorization": "Bearer kq"})
                assert response.status_code == 202, response.text
                await asyncio.sleep(QUIET_EVERY)
            out, _ = await flooder.communicate()
            statuses = {int(status): count for status, count in json.loads(out).items()}
            deadline = time.monotonic() + 60
            while not (received and received[-1][1] == sent[-1]) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            receiver.cancel()
    # Frames of one URI coalesce (the newest change's meta wins): a change counts as delivered
    # when the first notification of it, or of a newer change, arrives.
    latencies = [min((at for at, t in received if t >= sent_at), default=math.inf) - sent_at for sent_at in sent]
    ordered = sorted(latencies)
    p50 = statistics.median(ordered) * 1000
    p99 = ordered[max(int(len(ordered) * 0.99) - 1, 0)] * 1000
    accepted = statuses.get(202, 0) * PER_REQUEST
    print(f"\nquiet tenant: {len(sent)} changes, {len(received)} notifications, p50 {p50:.0f} ms, p99 {p99:.0f} ms, "
          f"max {ordered[-1] * 1000:.0f} ms; flood: {accepted} changes accepted, statuses {statuses}")
    assert ordered[-1] < math.inf, "a change of the quiet tenant was not notified within a minute"
    assert statuses.get(202, 0) > 0
    assert p99 < 1000, f"the quiet tenant's p99 was {p99:.0f} ms during the flood"


def initialize(http: httpx.AsyncClient, auth: str) -> Awaitable[httpx.Response]:
    return McpSession(http, auth=auth).post({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "tests", "version": "1"}}})


def assert_refused(response: httpx.Response, limit: str, quota: int) -> None:
    assert response.status_code == 429, response.text
    assert response.headers["retry-after"].isdigit()
    error = response.json()["error"]
    assert error["code"] == -31002
    assert error["data"] == {"limit": limit, "tenant": "flood", "quota": quota}, error


async def test_one_tenant_cannot_fill_max_sessions_or_max_listens_for_another(small_broker: BrokerProcess) -> None:
    async with httpx.AsyncClient(base_url=small_broker.url, timeout=10) as http:
        answers = [await initialize(http, "kf") for _ in range(8)]
        assert [answer.status_code for answer in answers] == [200] * 5 + [429] * 3  # half of 10
        assert_refused(answers[-1], "sessions", 5)
        for _ in range(5):
            assert (await initialize(http, "kq")).status_code == 200
        assert (await initialize(http, "kq")).status_code in (429, 503)  # the global bound: all 10 live

        body = modern.request("subscriptions/listen", {"notifications": {"resourceSubscriptions": ["x:y"]}}, 9)
        async with modern.listen(http, ["test://f/1"], auth="kf"), modern.listen(http, ["test://f/2"], auth="kf"):
            refused = await http.post("/mcp", content=orjson.dumps(body),
                                      headers=modern.headers("subscriptions/listen", auth="kf"))
            assert_refused(refused, "listens", 2)  # half of 4
            async with modern.listen(http, ["test://q/1"], auth="kq"), modern.listen(http, ["test://q/2"], auth="kq"):
                pass
        # Places come back as listens end (once the worker has seen each stream close).
        await modern.wait_listens(http, 0)
        async with modern.listen(http, ["test://f/3"], auth="kf"):
            pass


if __name__ == "__main__":
    print(json.dumps(asyncio.run(flood(sys.argv[1], float(sys.argv[2])))))
