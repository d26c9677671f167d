"""``mcp-broker serve --workers N`` on Redis: worker processes share the port and drain on SIGTERM."""

from __future__ import annotations

import signal

import httpx
import psutil
import pytest

from tests.distributed.conftest import WORKER_ENV
from tests.integration.mcp_http import McpSession, publish
from tests.support import BrokerProcess, RedisProcess


@pytest.mark.timeout(60)
async def test_worker_processes_share_one_port_and_end_streams_with_retry_on_sigterm() -> None:
    with RedisProcess() as redis:
        broker = BrokerProcess(env={**WORKER_ENV, "MCP_BROKER_REDIS_URL": redis.url}, args=["--workers", "2"])
        try:
            async with httpx.AsyncClient(base_url=broker.url, timeout=10) as http:
                # Spawned worker processes (the spawn start method also runs a resource tracker).
                workers = [c for c in psutil.Process(broker.proc.pid).children()
                           if "resource_tracker" not in " ".join(c.cmdline())]
                assert len(workers) == 2, workers
                mcp = await McpSession(http).initialize()
                await mcp.subscribe("https://example.com/w")
                async with mcp.stream() as stream:
                    await stream.next_event()
                    await publish(http, "https://example.com/w")
                    assert (await stream.next_message()).uri == "https://example.com/w"
                    broker.proc.send_signal(signal.SIGTERM)
                    events = await stream.until_end(timeout=15)
            assert events and events[-1].retry is not None
            assert broker.proc.wait(20) == 0
            assert not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers)
        finally:
            broker.kill()
