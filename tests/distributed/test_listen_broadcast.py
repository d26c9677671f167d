"""A Redis worker receives the listen broadcast only while it has listens open.

Every fan-out batch of every worker is broadcast to the workers that have listens; one without
any is not subscribed, so it receives and decodes none of them. A listen's ack comes once the
worker is subscribed, so a change published after the ack reaches it, whether the worker had
other listens or none; the channel is given up about a keep-alive interval after the last
listen closed, and a listen that cannot be subscribed is refused with nothing kept.
"""

from __future__ import annotations

import asyncio

import httpx
import orjson
import pytest
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from tests.distributed.conftest import WORKER_ENV
from tests.integration import modern
from tests.support import BrokerProcess, RedisProcess

CHANNEL = "mcpb:bcast"


async def receivers(redis: Redis) -> int:
    """The connections subscribed to the broadcast channel (sharded or not, as the server has it)."""
    counts = list(await redis.pubsub_numsub(CHANNEL))
    try:
        counts += await redis.pubsub_shardnumsub(CHANNEL)
    except ResponseError:  # before Redis 7: no sharded pub/sub, the broker uses plain channels
        pass
    return sum(int(count) for _, count in counts)


async def metric(http: httpx.AsyncClient, name: str) -> float:
    """The sum of the worker's samples of ``name`` (labels included)."""
    return sum(float(line.split()[-1]) for line in (await http.get("/metrics")).text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


async def fanned_out(http: httpx.AsyncClient) -> float:
    return await metric(http, "mcp_broker_fanout_changes_total")


async def until_receivers(redis: Redis, expected: int) -> None:
    async with asyncio.timeout(15):
        while await receivers(redis) != expected:
            await asyncio.sleep(0.05)


async def acknowledged_then_notified(http: httpx.AsyncClient, redis: Redis, uri: str, seq: int,
                                     gap_rule: bool = False) -> None:
    """A listen's ack, then the change published after it. ``gap_rule``: the worker's pub/sub
    connection is new, so an ``updated`` without the change's ``meta`` may come first."""
    async with modern.listen(http, [uri], f"listen-{seq}") as stream:
        ack = await stream.next()
        assert ack is not None and ack["method"] == "notifications/subscriptions/acknowledged", ack
        assert await receivers(redis) == 1  # subscribed by the time the ack is read
        response = await http.post("/changes", json={"uri": uri, "meta": {"seq": seq}})
        assert response.status_code == 202, response.text
        while True:
            note = await stream.next()
            assert note is not None and note["method"] == "notifications/resources/updated", note
            assert note["params"]["uri"] == uri
            if "seq" in note["params"]["_meta"] or not gap_rule:
                break
        assert note["params"]["_meta"]["seq"] == seq


@pytest.mark.timeout(90)
async def test_a_worker_receives_the_broadcast_only_while_it_has_listens() -> None:
    with RedisProcess() as server, BrokerProcess(env={**WORKER_ENV, "MCP_BROKER_REDIS_URL": server.url}) as worker:
        redis = Redis.from_url(server.url)
        uri = "mcpb://default/listened/a"
        try:
            async with httpx.AsyncClient(base_url=worker.url, timeout=10) as http:
                for seq in range(3):  # fanned out with no listen open: nothing receives the broadcast
                    assert (await http.post("/changes", json={"uri": uri, "meta": {"seq": seq}})).status_code == 202
                async with asyncio.timeout(15):
                    while await fanned_out(http) < 3:
                        await asyncio.sleep(0.05)
                assert await receivers(redis) == 0

                await acknowledged_then_notified(http, redis, uri, 10)
                await modern.wait_listens(http, 0)
                await until_receivers(redis, 0)  # given up once no listen is left

                await acknowledged_then_notified(http, redis, uri, 20)  # and subscribed again for the next
                await until_receivers(redis, 0)

                ended = await metric(http, "mcp_broker_streams_ended_total")
                server.stop()  # no Redis: a listen cannot be subscribed, and is refused
                refused = await http.post("/mcp", content=orjson.dumps(modern.request(
                    "subscriptions/listen", {"notifications": {"resourceSubscriptions": [uri]}}, "down")),
                    headers=modern.headers("subscriptions/listen"))
                assert refused.status_code == 503, refused.text
                assert await metric(http, "mcp_broker_streams_ended_total") == ended  # never registered
                server.start()
                await redis.aclose()
                redis = Redis.from_url(server.url)  # the test's own connection died with the server
                async with asyncio.timeout(30):
                    while (health := await http.get("/healthz")).status_code != 200:
                        await asyncio.sleep(0.1)
                assert health.json()["listens"] == 0  # the refused listen was not kept
                await acknowledged_then_notified(http, redis, uri, 30, gap_rule=True)
        finally:
            await redis.aclose()
