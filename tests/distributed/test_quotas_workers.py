"""A tenant's ``publish_per_second`` holds across three workers on one Redis: the token bucket is
shared, so the changes accepted per second by all of them together match the quota within 10%
(counted from the server's own timestamps, the ids of the accepted changes), another tenant is
never refused, and every accepted change is delivered."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from tests.distributed.conftest import Deployment
from tests.integration import modern

RATE = 50
RUN_SECONDS = 6.0
#: Accepted changes are counted in this window of server time, after the first burst and before the end.
SKIP_MS, TAIL_MS = 1500, 500
URIS = [f"test://rate/{n}" for n in range(1000)]


def server_ms(change_id: str) -> int:
    """The Redis stream time of a change id ``<partition>:<ms>-<seq>``."""
    return int(change_id.partition(":")[2].partition("-")[0])


async def test_publish_per_second_holds_across_three_workers_and_nothing_accepted_is_lost() -> None:
    quotas = {"acme": {"publish_per_second": RATE}}
    env = {"MCP_BROKER_API_KEYS": '{"ka": "acme/a", "kb": "other/b"}', "MCP_BROKER_QUOTAS": json.dumps(quotas)}
    with Deployment(env=env) as deploy:
        async with httpx.AsyncClient(base_url=deploy.workers[0].url, timeout=10) as watcher, \
                modern.listen(watcher, URIS, auth="ka") as stream:
            await modern.wait_listens(watcher, 1)
            accepted: list[tuple[str, str]] = []
            statuses: dict[int, int] = {}
            other: list[int] = []
            next_uri = iter(URIS)
            deadline = time.monotonic() + RUN_SECONDS

            async def flood(url: str) -> None:
                async with httpx.AsyncClient(base_url=url, timeout=10) as http:
                    uri = next(next_uri)  # a refused change's URI is published again: one URI, one acceptance
                    while time.monotonic() < deadline:
                        answer = await http.post("/changes", json={"uri": uri}, headers={"Authorization": "Bearer ka"})
                        statuses[answer.status_code] = statuses.get(answer.status_code, 0) + 1
                        if answer.status_code == 202:
                            accepted.append((uri, answer.json()["ids"][0]))
                            uri = next(next_uri)

            async def quiet(url: str) -> None:
                async with httpx.AsyncClient(base_url=url, timeout=10) as http:
                    for n in range(20):
                        answer = await http.post("/changes", json={"uri": f"test://other/{n}"},
                                                 headers={"Authorization": "Bearer kb"})
                        other.append(answer.status_code)
                        await asyncio.sleep(0.1)

            workers = [w.url for w in deploy.workers]
            await asyncio.gather(*(flood(url) for url in workers for _ in range(2)), quiet(workers[1]))

            assert set(statuses) == {202, 429}, statuses
            assert other == [202] * 20, "another tenant is never refused"
            times = sorted(server_ms(change_id) for _, change_id in accepted)
            start, end = times[0] + SKIP_MS, times[-1] - TAIL_MS
            in_window = sum(1 for t in times if start <= t < end)
            measured = in_window / ((end - start) / 1000)
            print(f"accepted {len(accepted)} of {sum(statuses.values())}; {measured:.1f}/s in the window "
                  f"(quota {RATE}/s)")
            assert abs(measured - RATE) <= RATE * 0.10, (measured, statuses)

            # every accepted change reaches the listen (distinct URIs: nothing merges)
            wanted = {uri for uri, _ in accepted}
            seen: set[str] = set()
            async with asyncio.timeout(20):
                while not wanted <= seen:
                    message = await stream.next()
                    assert message is not None, "the listen ended"
                    if message.get("method") == "notifications/resources/updated":
                        seen.add(message["params"]["uri"])
            assert seen == wanted, "a refused change was delivered"
