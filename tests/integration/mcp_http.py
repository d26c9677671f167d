"""A raw Streamable HTTP client for the integration tier: exact requests, and SSE read frame by frame."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

ACCEPT_BOTH = "application/json, text/event-stream"
TIMEOUT = 10.0


@dataclass
class Event:
    """One SSE event; ``message`` is the decoded JSON-RPC message, None for an empty ``data``."""

    id: str | None
    data: str | None
    retry: int | None

    @property
    def message(self) -> Any:
        return orjson.loads(self.data) if self.data else None

    @property
    def method(self) -> str | None:
        message = self.message
        return message.get("method") if isinstance(message, dict) else None

    @property
    def uri(self) -> str | None:
        message = self.message
        return message.get("params", {}).get("uri") if isinstance(message, dict) else None


class StreamEnded(Exception):
    """The server closed the SSE stream."""


class SSEStream:
    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self._lines = response.aiter_lines()
        self.comments = 0

    async def _line(self) -> str:
        try:
            return await self._lines.__anext__()
        except StopAsyncIteration:
            raise StreamEnded from None

    async def next_event(self, timeout: float = TIMEOUT) -> Event:
        """The next event (comments are counted and skipped); raises StreamEnded or TimeoutError."""
        return await asyncio.wait_for(self._next_event(), timeout)

    async def _next_event(self) -> Event:
        fields: dict[str, str] = {}
        while True:
            line = await self._line()
            if line == "":
                if fields:
                    retry = fields.get("retry")
                    return Event(fields.get("id"), fields.get("data"), int(retry) if retry else None)
                continue
            if line.startswith(":"):
                self.comments += 1
                continue
            name, _, value = line.partition(":")
            fields[name] = value[1:] if value.startswith(" ") else value

    async def keepalive(self, timeout: float = TIMEOUT) -> None:
        """Wait for the next comment line (an SSE keep-alive); fails if an event comes first."""
        async with asyncio.timeout(timeout):
            while not (line := await self._line()).startswith(":"):
                assert line == "", f"an event arrived before the keep-alive: {line!r}"
            self.comments += 1

    async def next_message(self, timeout: float = TIMEOUT) -> Event:
        """The next event that carries a message (skips priming and bare ``retry:`` events)."""
        async with asyncio.timeout(timeout):
            while True:
                event = await self._next_event()
                if event.data:
                    return event

    async def messages(self, count: int, timeout: float = TIMEOUT) -> list[Event]:
        return [await self.next_message(timeout) for _ in range(count)]

    async def until_end(self, timeout: float = TIMEOUT) -> list[Event]:
        """Every event until the server closes the stream."""
        events: list[Event] = []
        async with asyncio.timeout(timeout):
            while True:
                try:
                    events.append(await self._next_event())
                except StreamEnded:
                    return events


class McpSession:
    """One legacy session driven by hand."""

    def __init__(self, http: httpx.AsyncClient, version: str = "2025-11-25", auth: str | None = None) -> None:
        self.http = http
        self.version = version
        self.auth = auth
        self.id: str | None = None
        self._next_id = 0

    def headers(self, **extra: str) -> dict[str, str]:
        headers = {"Accept": ACCEPT_BOTH, "Content-Type": "application/json"}
        if self.id is not None:
            headers["Mcp-Session-Id"] = self.id
            headers["MCP-Protocol-Version"] = self.version
        if self.auth is not None:
            headers["Authorization"] = f"Bearer {self.auth}"
        headers.update(extra)
        return headers

    async def initialize(self) -> McpSession:
        response = await self.post({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": self.version, "capabilities": {}, "clientInfo": {"name": "tests", "version": "1"}}})
        assert response.status_code == 200, response.text
        self.id = response.headers["mcp-session-id"]
        assert (await self.post({"jsonrpc": "2.0", "method": "notifications/initialized"})).status_code == 202
        return self

    async def post(self, body: Any, **headers: str) -> httpx.Response:
        content = body if isinstance(body, bytes) else orjson.dumps(body)
        return await self.http.post("/mcp", content=content, headers=self.headers(**headers))

    async def call(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        """Send a request; returns the whole JSON-RPC reply (result or error)."""
        self._next_id += 1
        body: dict[str, Any] = {"jsonrpc": "2.0", "id": self._next_id, "method": method}
        if params is not None:
            body["params"] = params
        response = await self.post(body)
        assert response.status_code == 200, response.text
        assert response.headers["content-type"].startswith("application/json")
        reply: dict[str, Any] = response.json()
        assert reply["id"] == self._next_id
        return reply

    async def result(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        reply = await self.call(method, params)
        assert "result" in reply, reply
        return reply["result"]  # type: ignore[no-any-return]

    async def subscribe(self, *uris: str) -> None:
        for uri in uris:
            assert await self.result("resources/subscribe", {"uri": uri}) == {}

    @asynccontextmanager
    async def stream(self, last_event_id: str | None = None, **extra: str) -> AsyncIterator[SSEStream]:
        """Open the session's GET stream; fails unless the broker answers with SSE."""
        headers = self.headers(Accept="text/event-stream", **extra)
        headers.pop("Content-Type")
        if last_event_id is not None:
            headers["Last-Event-ID"] = last_event_id
        async with self.http.stream("GET", "/mcp", headers=headers) as response:
            assert response.status_code == 200, (await response.aread()).decode()
            assert response.headers["content-type"].startswith("text/event-stream")
            yield SSEStream(response)


async def publish(http: httpx.AsyncClient, *uris: str, kind: str = "updated", auth: str | None = None) -> None:
    """Publish one change per URI, all in one ``POST /changes``."""
    headers = {"Authorization": f"Bearer {auth}"} if auth else {}
    response = await http.post("/changes", json=[{"uri": uri, "kind": kind} for uri in uris], headers=headers)
    assert response.status_code == 202, response.text
