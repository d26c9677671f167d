"""``GET /metrics`` across workers: three ``serve`` processes on one Redis (each scraped, the sums
exact), and ``serve --workers 2`` (one port, every scrape covering both processes).

Counters move by known amounts: N changes published through the round-robin proxy, each
delivered to every stream before the next is published, so nothing coalesces.
"""

from __future__ import annotations

from contextlib import AsyncExitStack

import httpx
import psutil
import pytest

from tests.distributed.conftest import WORKER_ENV, Deployment
from tests.integration.mcp_http import McpSession, publish
from tests.integration.test_metrics import Samples, open_streams, scrape, value, wait_for
from tests.support import BrokerProcess, RedisProcess


def total(scrapes: list[Samples], name: str, **labels: str) -> float:
    return sum(value(samples, name, **labels) for samples in scrapes)


@pytest.mark.timeout(90)
async def test_three_workers_on_one_redis_count_the_deployments_traffic_between_them(
        deployment: Deployment) -> None:
    changes, streams, uri = 4, 3, "https://example.com/metrics-workers"
    urls = [worker.url for worker in deployment.workers]
    before = [scrape(url) for url in urls]
    async with httpx.AsyncClient(base_url=deployment.url, timeout=10) as http, AsyncExitStack() as stack:
        opened = await open_streams(http, stack, uri, streams)
        for _ in range(changes):
            await publish(http, uri)
            for stream in opened:
                assert (await stream.next_message()).uri == uri
        after = [scrape(url) for url in urls]
        # The proxy sends each request to the next worker: the streams are spread, their sum is exact.
        assert total(after, "mcp_broker_streams_open", era="legacy") == streams
        # Every worker counts the deployment's sessions (the store's count), each for itself.
        await wait_for(lambda: all(value(scrape(url), "mcp_broker_sessions_open") >= streams for url in urls),
                       "every worker's periodic session count")
        # Sixteen partitions (the default), shared out: each is held by exactly one worker.
        await wait_for(lambda: sum(value(scrape(url), "mcp_broker_fanout_leases_held") for url in urls) == 16,
                       "the lease reports")

    def grew(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    assert grew("mcp_broker_changes_published_total", source="http") == changes
    assert grew("mcp_broker_fanout_changes_total") == changes  # each change fanned out once, by one worker
    assert grew("mcp_broker_fanout_frames_total") == changes * streams
    assert grew("mcp_broker_notifications_sent_total", era="legacy", kind="updated") == changes * streams
    assert grew("mcp_broker_http_answers_total", route="changes", status="202") == changes
    assert grew("mcp_broker_tenant_publishes_total", tenant="other") == changes
    # Acknowledged changes are trimmed from the Redis log (all of them, once fan-out caught up).
    assert grew("mcp_broker_changelog_trimmed_total") >= changes - 1


@pytest.mark.timeout(90)
async def test_serve_workers_2_answers_every_scrape_for_both_processes() -> None:
    changes, uri = 3, "https://example.com/metrics-two"
    with RedisProcess() as redis:
        broker = BrokerProcess(env={**WORKER_ENV, "MCP_BROKER_REDIS_URL": redis.url}, args=["--workers", "2"])
        try:
            workers = [c for c in psutil.Process(broker.proc.pid).children()
                       if "resource_tracker" not in " ".join(c.cmdline())]
            assert len(workers) == 2, workers
            async with httpx.AsyncClient(base_url=broker.url, timeout=10) as http:
                mcp = await McpSession(http).initialize()
                await mcp.subscribe(uri)
                async with mcp.stream() as stream:
                    await stream.next_event()
                    for _ in range(changes):
                        await publish(http, uri)
                        assert (await stream.next_message()).uri == uri
                    # Each scrape is a new connection, answered by either process; every one of them
                    # shows both processes' counts merged, the same figures whichever answered.
                    scrapes = [scrape(broker.url) for _ in range(8)]
            for samples in scrapes:
                assert value(samples, "mcp_broker_changes_published_total", source="http") == changes
                assert value(samples, "mcp_broker_fanout_changes_total") == changes
                assert value(samples, "mcp_broker_notifications_sent_total", era="legacy", kind="updated") == changes
                assert value(samples, "mcp_broker_http_answers_total", route="changes", status="202") == changes
                assert value(samples, "mcp_broker_streams_open", era="legacy") == 1  # livesum over both
                # Each worker's process and runtime figures, told apart by its pid, whichever answered.
                for pid in (worker.pid for worker in workers):
                    assert value(samples, "process_resident_memory_bytes", pid=str(pid)) > 10_000_000
                    assert value(samples, "process_open_fds", pid=str(pid)) > 0
                    assert value(samples, "python_gc_collections_total", generation="0", pid=str(pid)) > 0
                # Requests are timed on both, the counts summed.
                assert value(samples, "mcp_server_operation_duration_seconds_count",
                             mcp_method_name="resources/subscribe") == 1
            # The answers to the scrapes themselves are counted too, by whichever process answered:
            # the last scrape sees the seven before it.
            assert value(scrapes[-1], "mcp_broker_http_answers_total", route="metrics", status="200") == 7
        finally:
            broker.kill()
