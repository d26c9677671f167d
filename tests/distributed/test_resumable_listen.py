"""A resumable listen across workers: cut, resumed on another worker, and its worker killed mid-burst.

Three workers on one Redis behind the round-robin proxy. Each change carries its sequence in
``meta``; a URI's newest notification carries the newest sequence (notifications are coalesced
per URI, newest kept), so "nothing missed" is checkable exactly: for every URI, the last
sequence the client saw equals the last one acknowledged to the publisher.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import httpx
import pytest

from tests.distributed.conftest import Deployment
from tests.distributed.scenario import steer, uris
from tests.distributed.test_faults import publish_seq
from tests.integration.test_stdio import stdio_process
from tests.resumable import ACK, EVENT_ID, LAST_EVENT_ID, UPDATED, Events, listen_body, open_listen
from tests.support import BrokerProcess, RedisProcess


class Seen:
    """The newest sequence each URI was notified with, and the id to resume from."""

    def __init__(self) -> None:
        self.newest: dict[str, int] = {}

    def add(self, message: dict[str, Any] | None) -> None:
        if message is None or message.get("method") != UPDATED:
            return
        params = message["params"]
        seq = params.get("_meta", {}).get("seq")
        if isinstance(seq, int):
            self.newest[params["uri"]] = max(seq, self.newest.get(params["uri"], -1))

    def missing(self, wanted: dict[str, int]) -> dict[str, int]:
        return {uri: seq for uri, seq in wanted.items() if self.newest.get(uri, -1) < seq}


async def read_into(events: Events, seen: Seen) -> None:
    """Record every notification until the stream ends (or is cut)."""
    try:
        while (event := await events.next(timeout=60)) is not None:
            seen.add(event.message)
    except (TimeoutError, httpx.HTTPError):
        pass


async def listen_worker(deploy: Deployment) -> int:
    log = deploy.log()
    return [e["upstream"] for e in log if e["method"] == "POST" and e["path"] == "/mcp"][-1]


async def test_a_cut_listen_resumes_on_another_worker_with_every_missed_uri(deployment: Deployment) -> None:
    targets = uris(30)
    seen = Seen()
    async with httpx.AsyncClient(base_url=deployment.url, timeout=30) as http:
        async with open_listen(http, targets) as events:
            first = await listen_worker(deployment)
            await publish_seq(http, [(targets[0], 0)])
            while seen.missing({targets[0]: 0}):
                seen.add((await events.notification()).message)
            last = events.last_id
        # Cut: published meanwhile through the other workers, waiting in the listen's inbox.
        wanted = {uri: n for n, uri in enumerate(targets)}
        for n in range(0, 30, 10):
            await publish_seq(http, [(targets[i], i) for i in range(n, n + 10)])
        await steer(http, {first})
        async with open_listen(http, targets, last_id=last) as events:
            assert await listen_worker(deployment) != first
            async with asyncio.timeout(20):
                while seen.missing(wanted):
                    seen.add((await events.notification()).message)
            # Then live, on the new worker's stream.
            await publish_seq(http, [(targets[0], 100)])
            async with asyncio.timeout(20):
                while seen.missing({targets[0]: 100}):
                    seen.add((await events.notification()).message)


@pytest.mark.timeout(120)
async def test_killing_the_worker_holding_a_resumable_listen_mid_burst_misses_nothing(
        own_deployment_large_inbox: Deployment) -> None:
    deploy = own_deployment_large_inbox
    targets = uris(50)
    wanted: dict[str, int] = {}
    seen = Seen()
    async with httpx.AsyncClient(base_url=deploy.url, timeout=30) as http:
        async with open_listen(http, targets) as events:
            holder = await listen_worker(deploy)
            reader = asyncio.ensure_future(read_into(events, seen))
            seq = 0
            for batch in range(20):  # 1,000 changes, 50 per request; the listen's worker dies halfway
                changes = [(targets[(seq + i) % 50], seq + i) for i in range(50)]
                seq += 50
                await publish_seq(http, changes)
                wanted.update(dict(changes))
                if batch == 9:
                    deploy.kill9(holder)
            await asyncio.wait_for(reader, 30)  # the cut reaches the client
            last = events.last_id
        assert last is not None
        assert seen.missing(wanted), "the kill came before the listen had everything (else nothing was tested)"
        await steer(http, {holder})
        async with open_listen(http, targets, last_id=last) as events:
            assert await listen_worker(deploy) != holder
            async with asyncio.timeout(30):
                while seen.missing(wanted):
                    seen.add((await events.notification()).message)


async def test_a_stdio_child_resumes_the_listen_of_another_with_the_id_in_meta() -> None:
    with RedisProcess() as redis:
        env = {"MCP_BROKER_REDIS_URL": redis.url, "MCP_BROKER_REDIS_PREFIX": f"rs{os.getpid()}"}
        targets = uris(5)
        with BrokerProcess(env=env) as broker:
            async with httpx.AsyncClient(base_url=broker.url, timeout=30) as http:
                async with stdio_process(MCP_BROKER_DEMO="false", **env) as child:
                    await child.send(listen_body(targets, 1))
                    ack = await child.until(lambda m: m.get("method") == ACK)
                    assert EVENT_ID in ack["params"]["_meta"]  # a position from the start
                    await publish_seq(http, [(targets[0], 0)])
                    update = await child.until(lambda m: m.get("method") == UPDATED)
                    last = update["params"]["_meta"][EVENT_ID]
                    child.proc.kill()  # the child dies; the listen's state stays in Redis
                await publish_seq(http, [(targets[n], n) for n in range(1, 5)])
                async with stdio_process(MCP_BROKER_DEMO="false", **env) as child:
                    body = listen_body(targets, 7)
                    body["params"]["_meta"][LAST_EVENT_ID] = last
                    await child.send(body)
                    seen = Seen()
                    async with asyncio.timeout(20):
                        while seen.missing({targets[n]: n for n in range(1, 5)}):
                            message = await child.next()
                            assert message is not None, "stdout closed"
                            seen.add(message)
                    assert targets[0] not in seen.newest, "what the first child received is not sent again"

