"""The servers the client tier watches, and a watch that runs in a task while a test breaks things.

Each target is a running server and a way to change its data from outside: mcp-broker's REST
API (``PUT /collections``), or ``PUT /content`` of ``tests/client/sdk_target.py``. Writes go
straight to the server, never through whatever the test puts between it and the watcher.
"""

from __future__ import annotations

import asyncio
import secrets
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx

from broker_client import Status, Update, Watcher
from tests.support import BIN, ROOT, BrokerProcess, RedisProcess, free_port, wait_until

TIMEOUT = 15.0


class SdkProcess:
    """``tests/client/sdk_target.py`` serving Streamable HTTP on a free port."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.client.sdk_target", "--port", str(self.port)],
                                     cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(lambda: httpx.get(self.url + "/healthz", timeout=1).status_code == 200, what="SDK server start")

    @property
    def mcp_url(self) -> str:
        return self.url + "/mcp"

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


@dataclass
class Target:
    """A server to watch: ``watch`` is what ``Watcher`` is given, ``base`` where its data is written."""

    name: str
    watch: str | list[str]
    base: str
    broker: bool
    tag: str = field(default_factory=lambda: secrets.token_hex(3))

    def uri(self, key: str) -> str:
        return f"mcpb://default/watch{self.tag}/{key}" if self.broker else f"test://watch{self.tag}/{key}"

    def text(self, value: int) -> str:
        """The content a read returns after ``write(key, value)``."""
        return f'{{"v":{value}}}' if self.broker else str(value)

    async def write(self, key: str, value: int) -> None:
        """Change the data; waits for a side door that is still opening (a stdio server just started)."""
        async with httpx.AsyncClient(base_url=self.base, timeout=TIMEOUT) as http, asyncio.timeout(TIMEOUT):
            while True:
                try:
                    if self.broker:
                        response = await http.put(f"/collections/watch{self.tag}/{key}", json={"v": value})
                    else:
                        response = await http.put("/content", json={"uri": self.uri(key), "text": str(value)})
                    break
                except httpx.ConnectError:
                    await asyncio.sleep(0.05)
        assert response.status_code in (200, 201, 204), response.text


def stdio_target(kind: str, redis: RedisProcess | None) -> Iterator[Target]:
    """A stdio server the watcher starts itself; its data is written through a side door."""
    if kind == "broker":
        assert redis is not None
        env = {"MCP_BROKER_REDIS_URL": redis.url}
        with BrokerProcess(env=env) as writer:  # same Redis: its writes reach the stdio process
            yield Target("broker-stdio", ["env", f"MCP_BROKER_REDIS_URL={redis.url}", str(BIN), "stdio"],
                         writer.url, broker=True)
        return
    port = free_port()
    yield Target("sdk-stdio", ["env", f"PYTHONPATH={ROOT}", sys.executable, "-m", "tests.client.sdk_target",
                               "--stdio", "--port", str(port)], f"http://127.0.0.1:{port}", broker=False)


class Seen:
    """What a watch delivered, collected by a task, so a test can wait for a state to arrive."""

    def __init__(self) -> None:
        self.updates: list[Update] = []
        self.statuses: list[Status] = []
        self.latest: dict[str, str | None] = {}
        self.changed = asyncio.Event()
        self.error: BaseException | None = None
        self.watcher: Watcher | None = None

    def status(self, status: Status) -> None:
        self.statuses.append(status)
        self.changed.set()

    def kinds(self) -> list[str]:
        return [s.kind for s in self.statuses]

    async def until(self, check: Callable[[], bool], what: str, timeout: float = TIMEOUT) -> None:
        try:
            async with asyncio.timeout(timeout):
                while not check():
                    if self.error is not None:
                        raise self.error
                    self.changed.clear()
                    await self.changed.wait()
        except TimeoutError:
            raise AssertionError(f"timed out waiting for {what}; latest {self.latest}, statuses {self.kinds()}") \
                from None

    async def content(self, uri: str, text: str) -> None:
        await self.until(lambda: self.latest.get(uri) == text, f"{uri} to read {text!r}")


async def collect(watcher: Watcher, uris: list[str], seen: Seen) -> None:
    try:
        async for update in watcher.watch(uris):
            seen.updates.append(update)
            seen.latest[update.uri] = update.text
            seen.changed.set()
    except Exception as exc:
        seen.error = exc
        seen.changed.set()
        raise


@asynccontextmanager
async def watching(target: str | list[str], uris: list[str], **options: Any) -> AsyncIterator[Seen]:
    """A watch running in a task while the block runs; what it delivered is in the ``Seen``."""
    seen = Seen()
    async with Watcher(target, on_status=seen.status, **options) as watcher:
        seen.watcher = watcher
        task = asyncio.ensure_future(collect(watcher, uris, seen))
        try:
            yield seen
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
