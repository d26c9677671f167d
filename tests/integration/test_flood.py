"""One tenant's flood of ``POST /changes`` is refused (429) before it is acknowledged, and never
costs another tenant a notification: on the memory backend and on Redis."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.integration.mcp_http import McpSession
from tests.support import BrokerProcess, RedisProcess

KEYS = '{"ka": "flood/a", "kb": "quiet/b"}'
TENANT_MAX = 100
#: Changes per flooding request and requests in flight at once: the flood outruns fan-out.
PER_REQUEST = 60
IN_FLIGHT = 8


@pytest.fixture(params=["memory", "redis"])
def bounded_broker(request: pytest.FixtureRequest) -> Iterator[BrokerProcess]:
    env = {"MCP_BROKER_API_KEYS": KEYS, "MCP_BROKER_CHANGELOG_TENANT_MAX": str(TENANT_MAX)}
    if request.param == "redis":
        server: RedisProcess = request.getfixturevalue("redis_server")
        env |= {"MCP_BROKER_REDIS_URL": server.url, "MCP_BROKER_REDIS_PREFIX": f"t{secrets.token_hex(4)}"}
    with BrokerProcess(env=env) as proc:
        yield proc


async def test_a_flooding_tenant_gets_429_and_the_other_tenant_receives_all_ten(bounded_broker: BrokerProcess) -> None:
    async with httpx.AsyncClient(base_url=bounded_broker.url, timeout=10) as http:
        quiet = await McpSession(http, auth="kb").initialize()
        uris = [f"test://quiet/{n}" for n in range(10)]
        await quiet.subscribe(*uris)
        flood_headers = {"Authorization": "Bearer ka"}
        statuses: list[int] = []
        refusals: list[httpx.Response] = []

        async def flood_once(round_: int) -> None:
            # One URI, so one change-log partition: the tenant's backlog is bounded per partition.
            body = [{"uri": "test://flood/one", "meta": {"round": round_, "n": n}} for n in range(PER_REQUEST)]
            response = await http.post("/changes", json=body, headers=flood_headers)
            statuses.append(response.status_code)
            if response.status_code == 429:
                refusals.append(response)

        async def flood() -> None:
            deadline = time.monotonic() + 20
            round_ = 0
            while not refusals and time.monotonic() < deadline:
                await asyncio.gather(*(flood_once(round_ + i) for i in range(IN_FLIGHT)))
                round_ += IN_FLIGHT

        async with quiet.stream() as stream:
            flooding = asyncio.create_task(flood())
            for uri in uris:
                response = await http.post("/changes", json={"uri": uri}, headers={"Authorization": "Bearer kb"})
                assert response.status_code == 202, response.text
                await asyncio.sleep(0)
            await flooding
            received = {event.uri for event in await stream.messages(10)}
        assert received == set(uris)
        assert refusals, f"the flood was never refused: {statuses.count(202)} requests accepted"
        assert set(statuses) <= {202, 429}
        refusal = refusals[0]
        assert refusal.headers["retry-after"].isdigit()
        assert "'flood'" in refusal.json()["detail"] and str(TENANT_MAX) in refusal.json()["detail"]


async def test_more_changes_in_one_request_than_a_tenant_may_have_waiting_is_413(
        bounded_broker: BrokerProcess) -> None:
    async with httpx.AsyncClient(base_url=bounded_broker.url, timeout=10) as http:
        # One URI, so one partition: the bound is per partition (a list spread over partitions may be longer).
        body = [{"uri": "test://x/one", "meta": {"n": n}} for n in range(TENANT_MAX + 1)]
        response = await http.post("/changes", json=body, headers={"Authorization": "Bearer ka"})
        assert response.status_code == 413
        assert str(TENANT_MAX + 1) in response.json()["detail"]
