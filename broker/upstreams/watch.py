"""The one watch of an upstream's URIs for the whole deployment, run on the worker that holds its lease.

It holds one stream of the upstream's notifications, for every URI wanted (``want``), and tells
``WatchEvents`` what came: a resource updated, a list changed, or a gap (what it may have missed,
for the subscribers of those URIs to read again).

* 2026-07-28: one ``subscriptions/listen`` for every URI and the three list changes. A new set of
  URIs is a new listen, acknowledged before the old one is closed, so nothing between the two is
  missed. A listen cannot be resumed: after a break, the new one's URIs are all a gap.
* 2025: a session of its own, its GET stream opened first and then ``resources/subscribe`` per
  URI (``resources/unsubscribe`` for one no longer wanted). A broken stream is resumed from its
  last event id, and the upstream replays what was sent meanwhile: no gap. A stream that could not
  be resumed (no event ids, a cursor the upstream no longer has) is a gap of every URI; a session
  the upstream forgot (404, a restart) is a new session, every URI subscribed again, and a gap.

URIs newly covered are a gap too, once the upstream confirmed them: a subscriber may have come
before the watch covered its URI. The watch reconnects by itself, after a pause that grows from
``MIN_PAUSE`` to ``MAX_PAUSE`` while it keeps failing. A failing ``WatchEvents`` callback is
logged and the watch goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Final, Protocol

from broker.upstreams.client import (
    SseEvent,
    UpstreamClient,
    UpstreamRpcError,
    UpstreamSession,
    UpstreamSessionGone,
    UpstreamUnavailable,
)

__all__ = ["MAX_PAUSE", "MIN_PAUSE", "UpstreamWatch", "WatchEvents"]

logger = logging.getLogger(__name__)

MIN_PAUSE: Final = 0.2
MAX_PAUSE: Final = 10.0
UPDATED: Final = "notifications/resources/updated"
ACKNOWLEDGED: Final = "notifications/subscriptions/acknowledged"
SUBSCRIPTION_ID: Final = "io.modelcontextprotocol/subscriptionId"
LIST_CHANGED: Final = {"notifications/resources/list_changed": "resources",
                       "notifications/tools/list_changed": "tools",
                       "notifications/prompts/list_changed": "prompts"}
_listen_ids = itertools.count(1)


class WatchEvents(Protocol):
    """What the watch tells (the broker publishes it to the subscribers)."""

    async def updated(self, uri: str) -> None: ...

    async def list_changed(self, what: str) -> None:
        """``what``: "resources", "tools" or "prompts"."""

    async def gap(self, uris: frozenset[str]) -> None:
        """Changes of these URIs may have been missed."""


class _Broken(Exception):
    """The stream ended or cannot go on (the reason is the message)."""


class _Reader:
    """One stream read by a task of its own: a listen, or a session's GET stream."""

    def __init__(self, task: asyncio.Task[None]) -> None:
        self.task = task

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.wait([self.task])
        if not self.task.cancelled():
            self.task.exception()  # retrieved: it was logged, or is of no interest once closed

    def failure(self) -> BaseException:
        """Why it ended (it has)."""
        if self.task.cancelled():
            return _Broken("its reader was cancelled")
        return self.task.exception() or _Broken("it ended")


class UpstreamWatch:
    """The watch of one upstream's URIs (see the module's docstring)."""

    def __init__(self, client: UpstreamClient, events: WatchEvents) -> None:
        self.client = client
        self.events = events
        #: The URIs the upstream has confirmed it watches (acknowledged or subscribed) now.
        self.watched: frozenset[str] = frozenset()
        #: "connecting" until the first attempt is up or failed, "watching" while the stream is up, "broken"
        #: from a break (or a failed attempt) until it is up again.
        self.state = "connecting"
        #: Breaks so far, and notifications received (for the metrics).
        self.reconnects = 0
        self.received = 0
        self._wanted: frozenset[str] = frozenset()
        self._changed = asyncio.Event()
        self._up = False
        # 2025: the watch's session, the URIs subscribed on it, where its GET stream was.
        self._session: UpstreamSession | None = None
        self._subscribed: frozenset[str] = frozenset()
        self._last_event_id: str | None = None

    def want(self, uris: frozenset[str]) -> None:
        """Watch these URIs from now on; the others stay watched while the watch adjusts."""
        uris = frozenset(uris)
        if uris != self._wanted:
            self._wanted = uris
            self._changed.set()

    async def run(self) -> None:
        """Watch until cancelled."""
        pause = MIN_PAUSE
        try:
            while True:
                self._up = False
                try:
                    await self.client.probe()
                    await (self._modern() if self.client.era == "modern" else self._legacy())
                except Exception as exc:
                    # It was up, or it answered that it forgot the session (a new one is the way on): the
                    # pauses start afresh. Else they grow while it fails.
                    if self._up or isinstance(exc, UpstreamSessionGone):
                        pause = MIN_PAUSE
                    logger.warning("upstream %r: its watch broke (%s); again in %.1f s", self.client.name, exc, pause)
                self.state, self.watched = "broken", frozenset()
                self.reconnects += 1
                await asyncio.sleep(pause)
                pause = min(pause * 2, MAX_PAUSE)
        finally:
            if self._session is not None:
                session, self._session = self._session, None
                await self.client.close_session(session)

    async def _changes(self, reader: _Reader) -> None:
        """Until the wanted URIs change (then returns) or the reader ends (then raises why)."""
        changed = asyncio.ensure_future(self._changed.wait())
        try:
            await asyncio.wait([reader.task, changed], return_when=asyncio.FIRST_COMPLETED)
        finally:
            changed.cancel()
        if reader.task.done():
            raise reader.failure()

    def _watching(self, watched: frozenset[str]) -> None:
        self.state, self.watched, self._up = "watching", watched, True

    # -- callbacks -------------------------------------------------------------------------------
    async def _tell(self, callback: Callable[[Any], Awaitable[None]], argument: Any) -> None:
        try:
            await callback(argument)
        except Exception:
            logger.exception("upstream %r: the watch's %s failed", self.client.name, callback.__name__)

    async def _gap(self, uris: frozenset[str]) -> None:
        if uris:
            await self._tell(self.events.gap, uris)

    async def _deliver(self, message: dict[str, Any]) -> None:
        method = message.get("method")
        params = _object(message.get("params"))
        if method == UPDATED:
            self.received += 1
            uri = params.get("uri")
            if isinstance(uri, str) and uri in self._wanted:
                await self._tell(self.events.updated, uri)
        elif method in LIST_CHANGED:
            self.received += 1
            await self._tell(self.events.list_changed, LIST_CHANGED[method])

    # -- 2026-07-28 --------------------------------------------------------------------------------
    async def _modern(self) -> None:
        listen, asked, watched = await self._listen()
        try:
            self._watching(watched)
            await self._gap(watched)  # a first listen, or one after a break: nothing before it was seen
            while True:
                await self._changes(listen)
                self._changed.clear()
                if self._wanted == asked:
                    continue
                new, asked, now = await self._listen()  # acknowledged before the old one closes
                old, listen = listen, new
                await old.close()
                added, watched = now - watched, now
                self._watching(watched)
                await self._gap(added)
        finally:
            await listen.close()

    async def _listen(self) -> tuple[_Reader, frozenset[str], frozenset[str]]:
        """A listen for the URIs wanted now, once acknowledged: its reader, the URIs asked for, and those its
        acknowledgement confirms."""
        self._changed.clear()
        uris = self._wanted
        listen_id = f"watch-{next(_listen_ids)}"
        acked: asyncio.Future[frozenset[str]] = asyncio.get_running_loop().create_future()
        reader = _Reader(asyncio.create_task(self._read_listen(listen_id, uris, acked)))
        try:
            async with asyncio.timeout(self.client.spec.timeout):
                honoured = await acked
        except TimeoutError:
            await reader.close()
            raise _Broken(f"the listen was not acknowledged within {self.client.spec.timeout:g} s") from None
        except BaseException:
            await reader.close()
            raise
        if uris - honoured:
            logger.warning("upstream %r: its listen left out %d of the URIs asked for", self.client.name,
                           len(uris - honoured))
        return reader, uris, honoured

    async def _read_listen(self, listen_id: str, uris: frozenset[str], acked: asyncio.Future[frozenset[str]]) -> None:
        notifications = {"resourceSubscriptions": sorted(uris), "resourcesListChanged": True,
                         "toolsListChanged": True, "promptsListChanged": True}
        try:
            async with self.client.listen(notifications, listen_id) as events:
                async for event in events:
                    message = event.message
                    if message is None:
                        continue
                    if "method" not in message:
                        if message.get("id") == listen_id:
                            raise _Broken("the upstream ended the listen")
                        continue
                    params = _object(message.get("params"))
                    if _object(params.get("_meta")).get(SUBSCRIPTION_ID) != listen_id:
                        continue
                    if message["method"] == ACKNOWLEDGED:
                        honoured = _object(params.get("notifications")).get("resourceSubscriptions") or ()
                        if not acked.done():
                            acked.set_result(frozenset(uri for uri in honoured if isinstance(uri, str)))
                    elif acked.done():  # nothing counts before the acknowledgement
                        await self._deliver(message)
            raise _Broken("the upstream closed the listen's stream")
        except BaseException as exc:
            _settle(acked, exc)
            raise

    # -- 2025 --------------------------------------------------------------------------------------
    async def _legacy(self) -> None:
        try:
            if self._session is None:
                self._session = await self.client.open_session()
                self._subscribed, self._last_event_id = frozenset(), None
            session = self._session
            reader, resumed = await self._open_stream(session)
            try:
                if not resumed:
                    await self._gap(self._subscribed)  # subscribed, but what was sent while no stream was open is lost
                while True:
                    await self._subscribe(session)
                    self._watching(self._subscribed)
                    await self._changes(reader)
            finally:
                await reader.close()
        except UpstreamSessionGone:
            # Forgotten (the upstream restarted, or dropped it): a new session subscribes everything again,
            # and each URI is a gap then.
            self._session, self._subscribed, self._last_event_id = None, frozenset(), None
            raise

    async def _open_stream(self, session: UpstreamSession) -> tuple[_Reader, bool]:
        """The session's GET stream, resumed after the last event id when there is one; and whether it was."""
        cursor = self._last_event_id
        opened: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        reader = _Reader(asyncio.create_task(self._read_stream(session, cursor, opened)))
        try:
            await opened
        except BaseException:
            await reader.close()
            raise
        return reader, cursor is not None

    async def _read_stream(self, session: UpstreamSession, cursor: str | None, opened: asyncio.Future[None]) -> None:
        seen = 0
        try:
            async with self.client.session_stream(session, cursor) as events:
                opened.set_result(None)
                seen = await self._read_events(events)
        except BaseException as exc:
            if cursor is not None and isinstance(exc, UpstreamUnavailable) and exc.status == 400:
                self._last_event_id = None  # a cursor the upstream refuses: the next stream starts afresh
            _settle(opened, exc)
            raise
        if cursor is not None and seen == 0:
            # Resumed, and ended before sending anything (not even a priming event): an upstream that
            # accepted a cursor it could not replay from. The next stream starts afresh, with a gap.
            self._last_event_id = None
        raise _Broken("the upstream ended the session's stream")

    async def _read_events(self, events: AsyncIterator[SseEvent]) -> int:
        seen = 0
        async for event in events:
            seen += 1
            if event.id:
                self._last_event_id = event.id
            if event.message is not None and "method" in event.message:
                await self._deliver(event.message)
        return seen

    async def _subscribe(self, session: UpstreamSession) -> None:
        """Subscribe what is wanted and not yet subscribed, unsubscribe the rest; the new URIs are a gap."""
        self._changed.clear()
        wanted = self._wanted
        for uri in sorted(self._subscribed - wanted):
            with contextlib.suppress(UpstreamRpcError):  # refused: it is not watched either way
                await self.client.session_request("resources/unsubscribe", {"uri": uri}, session)
            self._subscribed -= {uri}
        added: set[str] = set()
        try:
            for uri in sorted(wanted - self._subscribed):
                try:
                    await self.client.session_request("resources/subscribe", {"uri": uri}, session)
                except UpstreamRpcError as exc:  # this URI alone: the others are watched all the same
                    logger.warning("upstream %r: it refused to watch a URI: %s", self.client.name, exc)
                    continue
                self._subscribed |= {uri}
                added.add(uri)
        finally:
            await self._gap(frozenset(added))


def _settle(waiter: asyncio.Future[Any], exc: BaseException) -> None:
    """Hand a reader's end to whoever waits for it to start: a cancelled reader is a broken one, never a
    cancellation of the waiter."""
    if not waiter.done():
        waiter.set_exception(_Broken("its reader was cancelled") if isinstance(exc, asyncio.CancelledError) else exc)


def _object(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}
