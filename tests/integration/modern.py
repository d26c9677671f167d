"""Raw 2026-07-28 requests for the integration tier: exact envelopes and headers, listen streams frame by frame."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import orjson

VERSION = "2026-07-28"
SUBSCRIPTION_ID = "io.modelcontextprotocol/subscriptionId"
SERVER_INFO = "io.modelcontextprotocol/serverInfo"
TIMEOUT = 10.0


def meta(**overrides: Any) -> dict[str, Any]:
    """A complete modern ``_meta`` envelope; pass a key with None to leave it out."""
    fields: dict[str, Any] = {
        "io.modelcontextprotocol/protocolVersion": VERSION,
        "io.modelcontextprotocol/clientCapabilities": {},
        "io.modelcontextprotocol/clientInfo": {"name": "tests", "version": "1"},
    }
    for key, value in overrides.items():
        full = f"io.modelcontextprotocol/{key}"
        if value is None:
            fields.pop(full, None)
        else:
            fields[full] = value
    return fields


def request(method: str, params: dict[str, Any] | None = None, id_: Any = 1, **meta_overrides: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": id_, "method": method, "params": {"_meta": meta(**meta_overrides),
                                                                      **(params or {})}}


def headers(method: str, name: str | None = None, version: str | None = VERSION, auth: str | None = None,
            **extra: str) -> dict[str, str]:
    """The SEP-2243 header set for a request; ``version=None`` leaves MCP-Protocol-Version out."""
    out = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json", "Mcp-Method": method}
    if version is not None:
        out["MCP-Protocol-Version"] = version
    if name is not None:
        out["Mcp-Name"] = name
    if auth is not None:
        out["Authorization"] = f"Bearer {auth}"
    out.update(extra)
    return out


def base64_header(value: str) -> str:
    return "=?base64?" + base64.b64encode(value.encode()).decode() + "?="


async def call(http: httpx.AsyncClient, method: str, params: dict[str, Any] | None = None, *,
               name: str | None = None, auth: str | None = None) -> httpx.Response:
    """A well-formed modern request (envelope and headers right)."""
    return await http.post("/mcp", content=orjson.dumps(request(method, params)),
                           headers=headers(method, name, auth=auth))


class ListenStream:
    """A listen's SSE response, read message by message; keep-alive comments are counted."""

    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self._lines = response.aiter_lines()
        self.comments = 0

    async def next(self, timeout: float = TIMEOUT) -> dict[str, Any] | None:
        """The next JSON-RPC message, or None when the server closed the stream."""
        return await asyncio.wait_for(self._next(), timeout)

    async def _next(self) -> dict[str, Any] | None:
        data: list[str] = []
        async for line in self._lines:
            if line.startswith(":"):
                self.comments += 1
            elif line.startswith("data:"):
                data.append(line[5:].lstrip(" "))
            elif line == "" and data:
                message: dict[str, Any] = orjson.loads("\n".join(data))
                return message
        return None

    async def wait_comment(self, timeout: float = TIMEOUT) -> None:
        """Read until a keep-alive comment arrives (fails on any message in between)."""
        async with asyncio.timeout(timeout):
            async for line in self._lines:
                assert not line.startswith("data:"), line
                if line.startswith(":"):
                    self.comments += 1
                    return


@asynccontextmanager
async def listen(http: httpx.AsyncClient, uris: list[str], id_: Any = "listen-1", *, auth: str | None = None,
                 **flags: bool) -> AsyncIterator[ListenStream]:
    """Open a listen; fails unless it is answered with an SSE stream."""
    body = request("subscriptions/listen", {"notifications": {"resourceSubscriptions": uris, **flags}}, id_)
    async with http.stream("POST", "/mcp", content=orjson.dumps(body),
                           headers=headers("subscriptions/listen", auth=auth)) as response:
        assert response.status_code == 200, (await response.aread()).decode()
        assert response.headers["content-type"].startswith("text/event-stream")
        yield ListenStream(response)


async def listen_count(http: httpx.AsyncClient) -> int:
    count: int = (await http.get("/healthz")).json()["listens"]
    return count


async def wait_listens(http: httpx.AsyncClient, expected: int, timeout: float = TIMEOUT) -> None:
    """Wait until the broker's own count of open listens is ``expected`` (probing another process)."""
    async with asyncio.timeout(timeout):
        while await listen_count(http) != expected:
            await asyncio.sleep(0.02)


async def put_record(http: httpx.AsyncClient, collection: str, record_id: str, value: Any,
                     auth: str | None = None) -> str:
    """Write a record through the REST API; returns its URI."""
    response = await http.put(f"/collections/{collection}/{record_id}", json=value,
                              headers={"Authorization": f"Bearer {auth}"} if auth else {})
    assert response.status_code in (200, 201), response.text
    uri: str = response.json()["uri"]
    return uri
