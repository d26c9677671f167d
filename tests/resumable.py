"""A raw client of resumable listens (``dev.mcp-broker/resumable-listen``), for the tests of every tier."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from tests.integration import modern

EXTENSION = "dev.mcp-broker/resumable-listen"
UPDATED = "notifications/resources/updated"
LIST_CHANGED = "notifications/resources/list_changed"
ACK = "notifications/subscriptions/acknowledged"
#: On stdio: where an event carries its id, and where a resuming listen names the last one it received.
EVENT_ID = "dev.mcp-broker/eventId"
LAST_EVENT_ID = "dev.mcp-broker/lastEventId"
TIMEOUT = 10.0


def capabilities(resumable: bool = True) -> dict[str, Any]:
    return {"extensions": {EXTENSION: {}}} if resumable else {}


def listen_body(uris: list[str], id_: Any = "listen-1", *, resumable: bool = True, **flags: bool) -> dict[str, Any]:
    return modern.request("subscriptions/listen", {"notifications": {"resourceSubscriptions": uris, **flags}}, id_,
                          clientCapabilities=capabilities(resumable))


@dataclass
class Event:
    id: str | None
    message: dict[str, Any] | None  # None: an id-only event

    @property
    def method(self) -> str | None:
        return None if self.message is None else self.message.get("method")

    @property
    def uri(self) -> str | None:
        return None if self.message is None else self.message.get("params", {}).get("uri")


class Events:
    """A listen's SSE response, event by event (ids kept); ``last_id`` is what a client would resume from."""

    def __init__(self, response: httpx.Response) -> None:
        self.response = response
        self._lines = response.aiter_lines()
        self.last_id: str | None = None
        #: The ack's ``_meta`` (``open_listen`` sets it).
        self.ack_meta: dict[str, Any] = {}

    async def next(self, timeout: float = TIMEOUT) -> Event | None:
        """The next event with data or an id (comments skipped); None when the server closed the stream."""
        return await asyncio.wait_for(self._next(), timeout)

    async def _next(self) -> Event | None:
        data: list[str] = []
        event_id: str | None = None
        seen_id = False
        async for line in self._lines:
            if line.startswith(":"):
                continue
            if line.startswith("id:"):
                event_id, seen_id = line[3:].lstrip(" "), True
            elif line.startswith("data:"):
                data.append(line[5:].lstrip(" "))
            elif line == "" and (data or seen_id):
                if seen_id:
                    self.last_id = event_id
                payload = "\n".join(data)
                return Event(event_id, orjson.loads(payload) if payload else None)
        return None

    async def notification(self, timeout: float = TIMEOUT) -> Event:
        """The next event that is a notification (id-only events skipped); fails if the stream ends."""
        while True:
            event = await self.next(timeout)
            assert event is not None, "the stream ended"
            if event.message is not None:
                return event

    async def updates(self, count: int, timeout: float = TIMEOUT) -> list[str]:
        """The URIs of the next ``count`` updates (other notifications skipped)."""
        found: list[str] = []
        while len(found) < count:
            event = await self.notification(timeout)
            if event.method == UPDATED:
                assert event.uri is not None
                found.append(event.uri)
        return found


@asynccontextmanager
async def open_listen(http: httpx.AsyncClient, uris: list[str], *, last_id: str | None = None, auth: str | None = None,
                      resumable: bool = True, id_: Any = "listen-1", **flags: bool) -> AsyncIterator[Events]:
    """A listen's stream, its ack read: fails unless the broker answers with SSE and acknowledges."""
    extra = {"Last-Event-ID": last_id} if last_id is not None else {}
    headers = modern.headers("subscriptions/listen", auth=auth, **extra)
    body = orjson.dumps(listen_body(uris, id_, resumable=resumable, **flags))
    async with http.stream("POST", "/mcp", content=body, headers=headers) as response:
        assert response.status_code == 200, (await response.aread()).decode()
        events = Events(response)
        ack = await events.notification()
        assert ack.method == ACK, ack
        events.ack_meta = (ack.message or {})["params"]["_meta"]
        yield events
