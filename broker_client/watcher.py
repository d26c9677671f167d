"""``Watcher``: the subscriber rules of MCP, done once, for any server.

What it does for the caller, in order: check that the server can notify (``resources.subscribe``,
or the listen's acknowledgment), subscribe, and only then read each URI, so that a change made
between the subscribe and the first read is never missed; on every update, treat the cached copy
as stale and read again; when the transport breaks, resume where the server allows it (a 2025
GET stream with ``Last-Event-ID``), else reconnect and re-read everything (a new listen, or a
new session when the old one is gone); unsubscribe on the way out.
"""

from __future__ import annotations

import asyncio
import random
import shlex
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from broker_client.channel import RESUMED, Channel
from broker_client.errors import Dropped, GaveUp, RpcError, SessionGone
from broker_client.http import open_http
from broker_client.stdio import open_stdio


@dataclass(frozen=True)
class Update:
    """A URI's fresh content: the server's copy at the time of the read that followed a change.

    ``contents`` are the ``resources/read`` result's items; ``error`` is set instead when the
    read failed (e.g. the resource was deleted). ``initial`` marks the first read of a URI.
    """

    uri: str
    contents: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    initial: bool = False

    @property
    def text(self) -> str | None:
        """The text of the text contents, joined (None when there is none)."""
        texts = [c["text"] for c in self.contents if isinstance(c.get("text"), str)]
        return "\n".join(texts) if texts else None

    def same(self, other: Update) -> bool:
        """The same content (a re-read that found nothing new is not an update)."""
        return self.contents == other.contents and self.error == other.error


@dataclass(frozen=True)
class Status:
    """What the connection did: ``connected``, ``resumed``, ``resynced``, ``reinitialized``,
    ``completed`` (the server ended a listen cleanly), ``retrying`` or ``gave_up``."""

    kind: str
    era: str = ""
    detail: str = ""
    attempt: int = 0


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with jitter, and how many failures in a row end the watch.

    The first retry after a stream that was delivering is immediate (a server draining on
    SIGTERM, a load balancer closing an idle connection); later ones wait ``initial * 2**n``
    up to ``maximum``, each a random time in its upper half so that clients spread out. A
    server's ``Retry-After`` (with a 429 or a 503) is waited for when it is longer.
    """

    initial: float = 0.25
    maximum: float = 10.0
    retries: int = 8
    #: A connection that lasted this long was healthy: its failure starts the count afresh.
    healthy: float = 2.0

    def delay(self, failures: int) -> float:
        if failures <= 1:
            return 0.0
        ceiling = min(self.maximum, self.initial * 2 ** (failures - 2))
        return random.uniform(ceiling / 2, ceiling)


class Watcher:
    """Watch resources of an MCP server: ``async with Watcher(url) as w: async for u in w.watch(uris)``.

    ``target`` is an ``http(s)://`` MCP endpoint, or a command (a string or argument list) that
    serves MCP on stdin/stdout. ``era`` is ``auto`` (2026-07-28 when the server offers it),
    ``modern`` or ``legacy``. ``on_status`` hears every connection event; ``on_subscribed`` is
    awaited after each confirmed subscription and before the reads that follow it (a place to
    observe, or to test, that ordering).
    """

    def __init__(self, target: str | Sequence[str], *, headers: dict[str, str] | None = None,
                 token: str | None = None, era: str = "auto", backoff: Backoff | None = None,
                 on_status: Callable[[Status], None] | None = None,
                 on_subscribed: Callable[[], Awaitable[None]] | None = None, timeout: float = 10.0) -> None:
        if era not in ("auto", "modern", "legacy"):
            raise ValueError(f"era must be auto, modern or legacy, not {era!r}")
        self.target = target
        self.era = era
        self.backoff = backoff or Backoff()
        self.on_status = on_status
        self.on_subscribed = on_subscribed
        self.timeout = timeout
        self.headers = dict(headers or {})
        if token is not None:
            self.headers["Authorization"] = f"Bearer {token}"
        self.channel: Channel | None = None
        self._client: httpx.AsyncClient | None = None

    @property
    def is_http(self) -> bool:
        return isinstance(self.target, str) and self.target.startswith(("http://", "https://"))

    async def __aenter__(self) -> Watcher:
        if self.is_http:
            # Streams stay open as long as the server keeps them: no read timeout on them.
            self._client = httpx.AsyncClient(headers=self.headers,
                                             timeout=httpx.Timeout(self.timeout, read=None))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._close_channel()
        if self._client is not None:
            await self._client.aclose()

    def _status(self, kind: str, detail: str = "", attempt: int = 0) -> None:
        if self.on_status is not None:
            era = self.channel.era if self.channel is not None else ""
            self.on_status(Status(kind, era, detail, attempt))

    async def _open(self, uris: list[str]) -> Channel:
        if self._client is not None:
            assert isinstance(self.target, str)
            return await asyncio.wait_for(open_http(self._client, self.target, uris, self.era), self.timeout * 3)
        command = shlex.split(self.target) if isinstance(self.target, str) else list(self.target)
        return await open_stdio(command, uris, self.era, self.timeout)

    async def _close_channel(self) -> None:
        channel, self.channel = self.channel, None
        if channel is not None:
            await channel.close()

    async def watch(self, uris: Sequence[str]) -> AsyncIterator[Update]:
        """Each URI's content once subscribed, then again after every change; raises ``GaveUp``."""
        wanted = list(dict.fromkeys(uris))
        seen: dict[str, Update] = {}
        stale: set[str] = set()
        failures = 0
        up_since = float("inf")
        todo = "connect"
        while True:
            try:
                if todo == "connect":
                    first = self.channel is None and not seen
                    await self._close_channel()
                    self.channel = await self._open(wanted)
                    self._status("connected" if first else "reinitialized")
                    stale = set(wanted)
                    if self.on_subscribed is not None:
                        await self.on_subscribed()
                elif todo == "recover":
                    assert self.channel is not None
                    how = await self.channel.recover()
                    self._status(how)
                    if how != RESUMED:
                        stale = set(wanted)
                todo = ""
                up_since = min(up_since, time.monotonic())
                channel = self.channel
                assert channel is not None
                while stale:
                    uri = min(stale)
                    update = await self._read(channel, uri, initial=uri not in seen)
                    stale.discard(uri)
                    if update.initial or not seen[uri].same(update):
                        seen[uri] = update
                        yield update
                stale |= await channel.changes()
            except (Dropped, TimeoutError) as failure:
                exc = failure if isinstance(failure, Dropped) else Dropped("timed out")
                if time.monotonic() - up_since >= self.backoff.healthy:
                    failures = 0
                up_since = float("inf")
                failures += 1
                todo = "connect" if isinstance(exc, SessionGone) or self.channel is None else "recover"
                if exc.complete:
                    self._status("completed", str(exc))
                if failures > self.backoff.retries:
                    self._status("gave_up", str(exc), failures)
                    raise GaveUp(f"gave up after {failures - 1} retries: {exc}") from exc
                # The server's Retry-After (a 429, a 503) over the backoff's own choice when longer.
                delay = max(self.backoff.delay(failures), exc.retry_after or 0.0)
                self._status("retrying", f"{exc}; next try in {delay:.2f}s", failures)
                await asyncio.sleep(delay)

    async def _read(self, channel: Channel, uri: str, *, initial: bool) -> Update:
        try:
            contents = await channel.read(uri)
        except RpcError as exc:
            return Update(uri, error=str(exc), initial=initial)
        return Update(uri, contents, initial=initial)

