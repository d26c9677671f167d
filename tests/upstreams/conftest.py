"""The upstream side: ``broker.upstreams`` against ``tests/upstream_server.py`` (the official SDK) in its own process.

``upstream`` is that server in either era ("modern": it serves both eras and the client picks
2026-07-28; "legacy": it refuses 2026-07-28, as a 2025 server does), one per module and era;
tests that stop it or change its tokens start their own ``UpstreamProcess``.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import pytest

from broker.upstreams.client import UpstreamClient
from broker.upstreams.spec import AuthSpec, UpstreamSpec
from tests.support import ROOT, free_port, wait_until

ERAS = ["modern", "legacy"]
CLIENT_INFO = {"name": "mcp-broker", "version": "test"}
DEADLINE = 15.0


class UpstreamProcess:
    """``python -m tests.upstream_server`` on a loopback port (the same one again after ``stop`` and ``start``)."""

    def __init__(self, *, era: str = "modern", tokens: tuple[str, ...] = (), issuer: str | None = None,
                 port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.era = era
        self.args = ["--port", str(self.port), "--era", "legacy" if era == "legacy" else "both",
                     *(arg for token in tokens for arg in ("--token", token)),
                     *(["--issuer", issuer] if issuer else [])]
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def mcp_url(self) -> str:
        return self.url + "/mcp"

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.upstream_server", *self.args], cwd=ROOT,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(lambda: httpx.get(self.url + "/healthz", timeout=1).status_code == 200,
                   what="the upstream to listen")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    async def stats(self) -> dict[str, Any]:
        async with httpx.AsyncClient(base_url=self.url, timeout=5) as http:
            found: dict[str, Any] = (await http.get("/stats")).json()
            return found

    async def side(self, method: str, path: str, body: Any = None) -> None:
        """A side door of the server (``PUT /notes/{id}``, ``POST /streams/drop``, ``PUT /tokens``)."""
        async with httpx.AsyncClient(base_url=self.url, timeout=5) as http:
            response = await http.request(method, path, json=body)
        assert response.status_code == 204, response.text

    async def set_note(self, key: str, text: str) -> None:
        await self.side("PUT", f"/notes/{key}", {"text": text})


@pytest.fixture(scope="module", params=ERAS)
def upstream(request: pytest.FixtureRequest) -> Iterator[UpstreamProcess]:
    proc = UpstreamProcess(era=request.param)
    yield proc
    proc.stop()


def spec_for(url: str, **fields: Any) -> UpstreamSpec:
    return UpstreamSpec(name="notes", url=url, **{"timeout": 10.0, "auth": AuthSpec(), **fields})


@pytest.fixture
async def client(upstream: UpstreamProcess) -> AsyncIterator[UpstreamClient]:
    """A client of ``upstream``, its era learnt."""
    upstream_client = UpstreamClient(spec_for(upstream.mcp_url), client_info=CLIENT_INFO)
    await upstream_client.probe()
    yield upstream_client
    await upstream_client.aclose()


async def eventually(check: Callable[[], Any], what: str, timeout: float = DEADLINE) -> None:
    """Wait for ``check()`` (awaited if it returns an awaitable) to be true, within a deadline."""
    try:
        async with asyncio.timeout(timeout):
            while True:
                found = check()
                if asyncio.iscoroutine(found):
                    found = await found
                if found:
                    return
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"timed out waiting for {what}") from None
