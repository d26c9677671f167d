"""A change source runs on exactly one worker of a deployment, and moves when that worker dies.

Three workers on one Redis watch one directory (``MCP_BROKER_FILE_ROOTS``); the watcher is an
exclusive source, so one of them runs it under the lease ``source:files``, as
``mcp_broker_sources_running{source="files"}`` on each worker's ``/metrics`` tells. The test
kills that worker with ``kill -9``, changes a file while no worker watches, and expects the
change notified once another worker has taken the source over; then one more change is
notified exactly once (two runners would publish it twice).
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.distributed.conftest import Deployment
from tests.integration.mcp_http import McpSession, SSEStream
from tests.integration.test_metrics import scrape, value, wait_for

LEASE_MS = 1000


def runners(deployment: Deployment) -> list[int]:
    """The index of every live worker that runs the file watcher now."""
    running = []
    for i, worker in enumerate(deployment.workers):
        if worker.proc.poll() is None and value(scrape(worker.url), "mcp_broker_sources_running", source="files"):
            running.append(i)
    return running


async def next_update(stream: SSEStream, timeout: float) -> str | None:
    """The URI of the next ``updated`` (list changes, which a takeover's rescan may add, are skipped)."""
    while True:
        event = await stream.next_message(timeout=timeout)
        if event.method == "notifications/resources/updated":
            return event.uri


@pytest.mark.timeout(120)
async def test_the_watcher_runs_once_moves_when_its_worker_is_killed_and_misses_nothing(tmp_path: Path) -> None:
    root = tmp_path / "files"
    root.mkdir()
    watched, marker = root / "watched.txt", root / "marker.txt"  # the marker is made at the end only
    watched.write_text("v1")
    env = {"MCP_BROKER_FILE_ROOTS": json.dumps({"default": str(root)}), "MCP_BROKER_SOURCE_LEASE_MS": str(LEASE_MS)}
    deployment = Deployment(env=env)
    try:
        await wait_for(lambda: len(runners(deployment)) == 1, "one worker to run the watcher", timeout=15)
        holder = runners(deployment)[0]
        other = deployment.workers[(holder + 1) % 3]
        uri, marker_uri = f"file://{watched}", f"file://{marker}"
        # The session's stream on a worker that will live: it must not end with the holder.
        async with httpx.AsyncClient(base_url=other.url, timeout=10) as http:
            mcp = await McpSession(http).initialize()
            await mcp.subscribe(uri, marker_uri)
            async with mcp.stream() as stream:
                await stream.next_event()  # the priming event: the stream is open
                watched.write_text("v2")
                assert await next_update(stream, 5) == uri
                deployment.workers[holder].kill()
                watched.write_text("v3")  # while nobody watches
                await wait_for(lambda: len(runners(deployment)) == 1, "another worker to take the watcher over",
                               timeout=15)
                # The new runner's rescan notifies the change made meanwhile.
                assert await next_update(stream, 15) == uri
                read = await mcp.result("resources/read", {"uri": uri})
                assert read["contents"][0]["text"] == "v3"
                # One more change, notified; then a new file: a second runner would have notified the
                # change again in between.
                watched.write_text("v4")
                assert await next_update(stream, 10) == uri
                marker.write_text("m")
                between: list[str | None] = []
                while marker_uri not in between:
                    between.append(await next_update(stream, 10))
                assert between == [marker_uri] and len(runners(deployment)) == 1, between
    finally:
        deployment.close()
