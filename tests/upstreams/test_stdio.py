"""A ``command`` upstream: the SDK server on stdio, started by the client itself (one process), and watched.

The client starts the process out of the tier walk's sight: every test here is marked ``process``
by hand. The server's side doors (``/stats``, ``PUT /notes``) stay on a loopback port.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import sys
from collections.abc import AsyncIterator
from typing import Any

import httpx
import psutil
import pytest

from broker.upstreams.client import UpstreamClient, UpstreamUnavailable
from broker.upstreams.spec import UpstreamSpec
from broker.upstreams.watch import UpstreamWatch
from tests.support import ROOT, free_port
from tests.upstreams.conftest import CLIENT_INFO, eventually
from tests.upstreams.test_watch import Recorder, notes

pytestmark = pytest.mark.process


class Side:
    """The side doors of the stdio server, on their own port."""

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}"

    async def stats(self) -> dict[str, Any]:
        async with httpx.AsyncClient(base_url=self.url, timeout=5) as http:
            found: dict[str, Any] = (await http.get("/stats")).json()
            return found

    async def set_note(self, key: str, text: str) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=5) as http:
            assert (await http.put(f"/notes/{key}", json={"text": text})).status_code == 204

    async def kill(self) -> None:
        """SIGKILL the server's process, and wait until it is gone (not even a zombie)."""
        pid = (await self.stats())["pid"]
        os.kill(pid, signal.SIGKILL)

        def gone() -> bool:
            try:
                return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return True

        await eventually(gone, "the process to exit")


@pytest.fixture
async def stdio() -> AsyncIterator[tuple[UpstreamClient, Side]]:
    port = free_port()
    command = ("env", f"PYTHONPATH={ROOT}", sys.executable, "-m", "tests.upstream_server", "--stdio",
               "--port", str(port))
    client = UpstreamClient(UpstreamSpec(name="notes", command=command, timeout=15.0), client_info=CLIENT_INFO)
    try:
        yield client, Side(port)
    finally:
        await client.aclose()


async def side_up(side: Side) -> None:
    async def answers() -> bool:
        try:
            await side.stats()
        except httpx.HTTPError:
            return False
        return True

    await eventually(answers, "the side doors")


async def test_a_stdio_upstream_answers_in_the_2025_era(stdio: tuple[UpstreamClient, Side]) -> None:
    client, _ = stdio
    server = await client.probe()
    assert client.era == "legacy" and server["serverInfo"]["name"] == "upstream"
    key = secrets.token_hex(3)
    _, session = await client.request("tools/call", {"name": "set_note", "arguments": {"id": key, "text": "hi"}})
    read, same = await client.request("resources/read", {"uri": f"note://{key}"}, request_id=7)
    assert read["contents"][0]["text"] == "hi" and session == same and session is not None
    assert await client.open_session() == session  # the process is the one session
    seen: list[dict[str, Any]] = []

    async def heard(message: dict[str, Any]) -> None:
        seen.append(message)

    await client.request("tools/call", {"name": "slow", "arguments": {"seconds": 0.1}, "_meta": {"progressToken": 5}},
                         on_notification=heard)
    assert [m["params"]["progress"] for m in seen] == list(range(1, 11))


async def test_a_cancelled_stdio_request_is_cancelled_in_the_process(stdio: tuple[UpstreamClient, Side]) -> None:
    client, side = stdio
    started = asyncio.Event()

    async def heard(message: dict[str, Any]) -> None:
        started.set()

    call = asyncio.create_task(client.request("tools/call", {"name": "slow", "arguments": {"seconds": 30},
                                                             "_meta": {"progressToken": 1}}, on_notification=heard))
    async with asyncio.timeout(15):
        await started.wait()
    call.cancel()
    await asyncio.wait([call])

    async def cancelled() -> bool:
        return len((await side.stats())["cancelled"]) == 1

    await eventually(cancelled, "the process to see the call cancelled")


async def test_an_exited_process_is_started_again(stdio: tuple[UpstreamClient, Side]) -> None:
    client, side = stdio
    _, first = await client.request("resources/read", {"uri": "note://1"})
    await side.kill()
    stdio = client._stdio
    assert stdio is not None
    await eventually(lambda: stdio.session_id == "", "the client to see the process gone")  # else a request
    # written to it as it dies fails with it, as any request the process was given and never answered
    read, second = await client.request("resources/read", {"uri": "note://1"})
    assert read["contents"][0]["text"] == "one" and second is not None and first is not None
    assert second.id != first.id


async def test_a_watch_of_a_stdio_upstream(stdio: tuple[UpstreamClient, Side]) -> None:
    client, side = stdio
    a = secrets.token_hex(3)
    events = Recorder()
    watch = UpstreamWatch(client, events)
    watch.want(notes(a))
    task = asyncio.create_task(watch.run())
    try:
        await eventually(lambda: notes(a) in events.gaps(), "the watch to be up")
        await side_up(side)
        await side.set_note(a, "1")
        await eventually(lambda: events.updates(f"note://{a}") == 1, "the update")
        await side.kill()
        await eventually(lambda: events.gaps().count(notes(a)) == 2, "the gap once the process was started again")
        await side_up(side)
        await side.set_note(a, "2")
        await eventually(lambda: events.updates(f"note://{a}") == 2, "an update from the new process")
    finally:
        task.cancel()
        await asyncio.wait([task])


async def test_a_command_that_cannot_start_is_unavailable() -> None:
    client = UpstreamClient(UpstreamSpec(name="notes", command=("/nonexistent/upstream",)), client_info=CLIENT_INFO)
    try:
        with pytest.raises(UpstreamUnavailable, match="cannot start /nonexistent/upstream"):
            await client.request("resources/read", {"uri": "note://1"})
    finally:
        await client.aclose()
