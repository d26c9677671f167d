"""Per-tenant quotas on a real server process (memory backend and Redis): the tenant at its quota
gets 429 with ``Retry-After`` and a JSON-RPC error naming the limit, the other tenant is unaffected,
and places come back when sessions, streams and listens end."""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import Callable, Iterator

import httpx
import orjson
import pytest

from tests.integration import modern
from tests.integration.mcp_http import McpSession
from tests.support import BrokerProcess, RedisProcess

KEYS = '{"ka": "acme/a", "kb": "other/b"}'
QUOTAS = {"acme": {"sessions": 2, "subscriptions": 2, "streams": 1, "listens": 1, "publish_per_second": 2,
                   "publish_burst": 3}}
TTL = 2.0


@pytest.fixture(scope="module", params=["memory", "redis"])
def quota_broker(request: pytest.FixtureRequest) -> Iterator[BrokerProcess]:
    env = {"MCP_BROKER_API_KEYS": KEYS, "MCP_BROKER_QUOTAS": json.dumps(QUOTAS),
           "MCP_BROKER_SESSION_TTL": str(TTL)}
    if request.param == "redis":
        server: RedisProcess = request.getfixturevalue("redis_server")
        env |= {"MCP_BROKER_REDIS_URL": server.url, "MCP_BROKER_REDIS_PREFIX": f"t{secrets.token_hex(4)}"}
    with BrokerProcess(env=env) as proc:
        yield proc


def assert_quota_refusal(response: httpx.Response, limit: str) -> None:
    assert response.status_code == 429, response.text
    assert response.headers["retry-after"].isdigit()
    error = response.json()["error"]
    assert error["code"] == -31002
    assert error["data"]["limit"] == limit and error["data"]["tenant"] == "acme", error


async def refused_initialize(http: httpx.AsyncClient, auth: str) -> httpx.Response:
    return await McpSession(http, auth=auth).post({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "tests", "version": "1"}}})


async def test_the_third_session_of_a_tenant_limited_to_two_is_429_and_an_ended_one_frees_its_place(
        quota_broker: BrokerProcess) -> None:
    async with httpx.AsyncClient(base_url=quota_broker.url, timeout=10) as http:
        first = await McpSession(http, auth="ka").initialize()
        await McpSession(http, auth="ka").initialize()
        assert_quota_refusal(await refused_initialize(http, "ka"), "sessions")
        for _ in range(3):  # the other tenant is unaffected
            await McpSession(http, auth="kb").initialize()
        ended = await http.delete("/mcp", headers=first.headers())
        assert ended.status_code == 200
        await McpSession(http, auth="ka").initialize()
        assert_quota_refusal(await refused_initialize(http, "ka"), "sessions")
        # Expired sessions free their places too (nothing touches these two for TTL seconds).
        await asyncio.sleep(TTL + 0.8)
        await McpSession(http, auth="ka").initialize()
        await McpSession(http, auth="ka").initialize()


async def until_accepted(http: httpx.AsyncClient, request: Callable[[], httpx.Request], timeout: float = 5.0) -> None:
    """Send until the answer is not a 429 (a place given back reaches the backend a moment after
    its stream ends), closing the stream it opens; fails if it is still refused after ``timeout``
    (a place that was lost would be kept until it lapses, 15 s)."""
    async with asyncio.timeout(timeout):
        while True:
            response = await http.send(request(), stream=True)
            await response.aclose()
            if response.status_code != 429:
                assert response.status_code == 200, response.status_code
                return
            await asyncio.sleep(0.05)


async def test_subscriptions_streams_and_listens_over_quota_are_429_and_come_back(
        quota_broker: BrokerProcess) -> None:
    await asyncio.sleep(TTL + 0.8)  # the sessions of the test before have expired
    async with httpx.AsyncClient(base_url=quota_broker.url, timeout=10) as http:
        acme = await McpSession(http, auth="ka").initialize()
        await acme.subscribe("test://a/1", "test://a/2")
        third = await acme.post({"jsonrpc": "2.0", "id": 9, "method": "resources/subscribe",
                                 "params": {"uri": "test://a/3"}})
        assert_quota_refusal(third, "subscriptions")
        other = await McpSession(http, auth="kb").initialize()
        await other.subscribe("test://b/1", "test://b/2", "test://b/3")

        # streams: one open GET stream; a second session's is refused, the other tenant's are not
        second = await McpSession(http, auth="ka").initialize()
        async with acme.stream():
            refused = await http.get("/mcp", headers={**second.headers(Accept="text/event-stream")})
            assert_quota_refusal(refused, "streams")
            async with acme.stream():  # a takeover of the same session holds the same place
                pass
            async with other.stream(), (await McpSession(http, auth="kb").initialize()).stream():
                pass
        # The place goes back once the stream has ended (in the background: a moment later).
        await until_accepted(http, lambda: http.build_request("GET", "/mcp",
                                                              headers=second.headers(Accept="text/event-stream")))

        # listens: one open listen; the second is refused until the first one ends
        async with modern.listen(http, ["test://a/1"], auth="ka"):
            body = modern.request("subscriptions/listen", {"notifications": {"resourceSubscriptions": ["x:y"]}}, 2)
            again = await http.post("/mcp", content=orjson.dumps(body),
                                    headers=modern.headers("subscriptions/listen", auth="ka"))
            assert_quota_refusal(again, "listens")
            async with modern.listen(http, ["test://b/1"], auth="kb"), modern.listen(http, ["test://b/2"], auth="kb"):
                pass
        body = modern.request("subscriptions/listen", {"notifications": {"resourceSubscriptions": ["test://a/1"]}}, 3)
        await until_accepted(http, lambda: http.build_request(
            "POST", "/mcp", content=orjson.dumps(body), headers=modern.headers("subscriptions/listen", auth="ka")))


async def test_a_plain_listen_is_held_to_the_subscriptions_quota_as_a_resumable_one_is(
        quota_broker: BrokerProcess) -> None:
    async with httpx.AsyncClient(base_url=quota_broker.url, timeout=10) as http:
        spec = {"resourceSubscriptions": ["test://a/1", "test://a/2", "test://a/3"]}
        body = modern.request("subscriptions/listen", {"notifications": spec}, 4)
        refused = await http.send(http.build_request("POST", "/mcp", content=orjson.dumps(body), headers=modern.headers(
            "subscriptions/listen", auth="ka")), stream=True)  # before the check, a stream that never ended
        if refused.status_code != 429:
            await refused.aclose()
        assert refused.status_code == 429, "the listen was opened"
        await refused.aread()
        assert_quota_refusal(refused, "subscriptions")
        async with modern.listen(http, ["test://b/1", "test://b/2", "test://b/3"], auth="kb"):
            pass  # the other tenant has no such quota


async def test_publishing_past_the_rate_is_429_and_every_accepted_change_is_delivered(
        quota_broker: BrokerProcess) -> None:
    await asyncio.sleep(TTL + 0.8)  # the sessions of the tests before have expired
    async with httpx.AsyncClient(base_url=quota_broker.url, timeout=10) as http:
        watcher = await McpSession(http, auth="ka").initialize()
        await watcher.subscribe("test://rate/x")
        async with watcher.stream() as stream:
            accepted: list[int] = []
            refusals: list[httpx.Response] = []
            for n in range(8):  # a burst of 3, then 2 a second: most of these are refused
                answer = await http.post("/changes", json={"uri": "test://rate/x", "meta": {"n": n}},
                                         headers={"Authorization": "Bearer ka"})
                if answer.status_code == 202:
                    accepted.append(n)
                else:
                    refusals.append(answer)
            assert 3 <= len(accepted) < 8 and refusals
            assert {r.status_code for r in refusals} == {429}
            assert refusals[0].headers["retry-after"].isdigit() and "publish_per_second" in refusals[0].json()["detail"]
            record = await http.put("/collections/c/r", json={"v": 1}, headers={"Authorization": "Bearer ka"})
            assert record.status_code == 429 and record.headers["retry-after"].isdigit()
            too_many = await http.post("/changes", json=[{"uri": "test://rate/x"}] * 4,
                                       headers={"Authorization": "Bearer ka"})
            assert too_many.status_code == 413, too_many.text
            # the other tenant publishes freely meanwhile
            for _ in range(10):
                assert (await http.post("/changes", json={"uri": "test://b/x"},
                                        headers={"Authorization": "Bearer kb"})).status_code == 202
            # the accepted changes are delivered, in order, up to the last one (repeats of one URI
            # may be merged into the newest: a level trigger); no refused one is
            seen: list[int] = []
            while not seen or seen[-1] != accepted[-1]:
                event = await stream.next_message(timeout=5)
                seen.append(event.message["params"]["_meta"]["n"])
            assert set(seen) <= set(accepted) and seen == sorted(seen)
