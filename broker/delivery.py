"""Delivery: the streams one worker holds, and how frames reach them.

Two kinds of stream live here:

``LegacyStream``
    The GET stream of a handshake-era session. It owns no buffer of its own: the session's
    inbox in the backend is the source of truth and the stream is a cursor into it. Wake-ups
    usually carry the frame, so the common case needs no read; whenever the carried frames
    are not contiguous with the cursor the stream reads the inbox instead. The handoff from
    replay to live is loss-free because the stream watches the session *before* it reads the
    inbox, and merges by offset (a frame at or below the cursor is never sent twice).

``Listen``
    A 2026-07-28 ``subscriptions/listen`` stream. It has no replay by specification. Its
    pending frames are coalesced per URI, so its buffer is bounded by the size of its filter.
    When the backend may have lost broadcasts (on Redis, the worker's pub/sub connection was
    re-made), every listen gets the gap rule: an ``updated`` for each URI of its filter, and
    ``list_changed`` if it asked for those, so its client re-reads instead of missing a change.

One ``Hub`` per process (``broker/hub.py``) holds every stream of the process and drives them.

Who cancels whom: a stream ends when its writer reports a disconnect, when the Hub shuts
down, when the backend has been unreachable for ``outage_grace`` seconds (``retry:``), or
(legacy) when another stream of the same session takes over. Ending only sets a flag and
wakes the stream's own task, which then returns; nothing is cancelled from outside.

A store that lost its data (Redis restarted empty, a failover to a replica that had not
caught up) takes the sessions with it. A ``LegacyStream`` keeps what it needs to put its
session back: the record, and an exact copy of the subscription set, loaded when the stream
starts and kept current by the ``subscribe``/``unsubscribe`` wakes the backend sends with
every change to the set (no polling). When a read finds the session gone under a *new*
backend epoch, the stream restores it (``Backend.restore_session``: same id, principal and
tenant, new epoch, the copied subscriptions) and applies the gap rule, so the client
re-reads everything it watches and keeps its session. A session gone under the *same* epoch
was ended (DELETE, expiry) and the stream ends. A client whose stream was not open at the
time has nobody to restore its session: its next request gets 404 and it initializes again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Final, Protocol

from broker.backends.base import CLOSE_ALL, Frame, InboxRead, SessionRecord, Wake
from broker.errors import BackendUnavailable
from broker.protocol import messages

if TYPE_CHECKING:
    from broker.hub import Hub

__all__ = ["LegacyStream", "Listen", "Writer", "coalesce", "format_event_id", "parse_event_id"]

logger = logging.getLogger(__name__)

SUBSCRIPTION_ID: Final = "io.modelcontextprotocol/subscriptionId"


class Writer(Protocol):
    """Where a stream's messages go: an SSE response or the stdio channel."""

    async def send(self, message: bytes, event_id: str | None = None) -> None: ...

    async def send_many(self, items: list[tuple[bytes, str | None]]) -> None:
        """Like ``send`` for each item, in order, in as few writes as the transport allows."""

    async def comment(self) -> None: ...

    async def retry(self) -> None:
        """Tell the client when to reconnect (SSE ``retry:``); a no-op where that means nothing."""

    async def prime(self, event_id: str) -> None:
        """Give the client a cursor before any message (SSE priming event); a no-op where that means nothing."""


def format_event_id(epoch: str, offset: int) -> str:
    return f"{epoch}-{offset}"


def parse_event_id(value: str) -> tuple[str, int] | None:
    """``<epoch>-<offset>`` as issued by this broker; None for anything else."""
    epoch, sep, offset = value.strip().rpartition("-")
    # isascii(): str.isdigit() also accepts digits such as "²" that int() then refuses.
    if not sep or not epoch or not epoch.isascii() or not epoch.isalnum() or len(epoch) > 32:
        return None
    if not offset.isascii() or not offset.isdigit() or len(offset) > 19:
        return None
    return epoch, int(offset)


def coalesce(frames: list[tuple[int, Frame]]) -> list[tuple[int, Frame]]:
    """Keep only the newest frame of each key, in offset order.

    Safe because every frame is a level trigger; the newest frame's id still covers the skipped ones.
    """
    if len(frames) < 2:
        return frames
    newest: dict[str, int] = {frame.key: off for off, frame in frames}
    return [(off, frame) for off, frame in frames if newest[frame.key] == off]


class _Stream:
    """What both kinds of stream share: how the stream's task sleeps and wakes, and an end reason.

    The task sleeps on a bare future that exists only while it sleeps. An ``asyncio.Event``
    cost about 1 KB more per idle stream: its waiter deque preallocates a block, and
    ``Event.wait`` adds a coroutine frame. Every reason to wake is also kept in the stream's
    state (``ended``, ``ping``, a subclass's pending frames), which the task looks at before
    it sleeps again, so a wake that comes while the task is busy is never lost.
    """

    __slots__ = ("_waiter", "active", "ended", "ping", "writer")

    def __init__(self, writer: Writer) -> None:
        self.writer = writer
        self.ended: str | None = None
        self.ping = False
        #: Woke up for something other than a keep-alive since the Hub last looked.
        self.active = False
        self._waiter: asyncio.Future[None] | None = None

    def end(self, reason: str) -> None:
        if self.ended is None:
            self.ended = reason
        self._wake()

    def keepalive(self) -> None:
        self.ping = True
        self._wake()

    def _wake(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _sleep(self) -> asyncio.Future[None]:
        """What the task awaits once it has found nothing to do; the next wake resolves it."""
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        return waiter


class LegacyStream(_Stream):
    """The one live GET stream of a legacy session."""

    __slots__ = ("_dirty", "_expect", "_from_head", "_live", "_priming", "_resync_first", "_sub_log", "_superseded",
                 "cursor", "generation", "hub", "session", "subscriptions")

    def __init__(self, hub: Hub, session: SessionRecord, writer: Writer, cursor: int | None, *, resync: bool = False,
                 priming: bool = False) -> None:
        """``cursor`` None: from the start of the inbox for a session's first stream, else from its head."""
        super().__init__(writer)
        self.hub = hub
        self.session = session
        self.cursor = cursor or 0
        self._from_head = cursor is None
        self._priming = priming
        #: This stream's claim generation, once the claim returned; the newest takeover seen before.
        self.generation: int | None = None
        self._superseded = 0
        self._resync_first = resync
        self._live: list[tuple[int, Frame]] = []
        self._expect: int | None = None
        self._dirty = True
        #: The session's subscriptions, for restoring it; None until loaded. Changes that arrive
        #: while the load is in flight are logged and applied on top of it, in order.
        self.subscriptions: set[str] | None = None
        self._sub_log: list[tuple[bool, str]] = []

    def _on_wake(self, wake: Wake) -> None:
        if wake.kind == "takeover":
            # A wake may arrive before our own claim returns: remember it, judge it then.
            if self.generation is None:
                self._superseded = max(self._superseded, wake.generation)
            elif wake.generation > self.generation:
                self.end("takeover")
            return
        if wake.kind in ("subscribe", "unsubscribe"):
            self._sub_log.append((wake.kind == "subscribe", wake.uri))
            if self.subscriptions is not None:
                self._apply_sub_log(self.subscriptions)
            return
        if (
            wake.frame is not None
            and not self._dirty
            and wake.offset == self._expect
            and len(self._live) < self.hub.settings.stream_buffer
        ):
            self._live.append((wake.offset, wake.frame))
            self._expect = wake.offset + 1
        else:
            self._dirty = True
        self.active = True
        self._wake()

    def serve(self, writer: Writer) -> Coroutine[Any, Any, str]:
        """``run`` on ``writer``, for a transport whose writer exists only once its response has started.

        A plain method that hands back ``run``'s coroutine: no frame of its own stays suspended
        for the life of the stream.
        """
        self.writer = writer
        return self.run()

    def disconnect(self) -> None:
        """The client went away."""
        self.end("disconnect")

    async def run(self) -> str:
        """Serve the stream until it ends; returns why it ended."""
        backend = self.hub.backend
        sid = self.session.id
        unwatch: Callable[[], Awaitable[None]] | None = None
        self.hub.legacy[self] = None
        if self.hub.closing:  # shutdown began while this stream was being set up
            self.end("shutdown")
        try:
            unwatch = await backend.watch(sid, self._on_wake)
            await self._start()
            while self.ended is None:
                if self._dirty:
                    await self._drain()
                elif self._live:
                    live, self._live = self._live, []
                    await self._send([(off, f) for off, f in live if off > self.cursor])
                elif self.ping:
                    self.ping = False
                    await self.writer.comment()
                else:
                    await self._sleep()
        except BackendUnavailable:
            self.end("unavailable")
        finally:
            self.hub.legacy.pop(self, None)
            if unwatch is not None:
                try:
                    await unwatch()
                except BackendUnavailable:
                    pass
        if self.ended in ("shutdown", "unavailable", "lost"):
            await self.writer.retry()
        return self.ended or "closed"

    async def _start(self) -> None:
        """Load the subscriptions, claim the session and send what is due, from one backend step."""
        # Wakes from here on may or may not be in the start's read: they mark the stream dirty.
        self._dirty = False
        start = await self.hub.backend.start_stream(self.session.id, self.session.epoch, self.cursor,
                                                    self.hub.settings.inbox_batch)
        self._apply_sub_log(start.subscriptions)
        self.subscriptions = start.subscriptions
        self.generation = start.claim.generation
        if self._superseded > start.claim.generation:
            self.end("takeover")
            return
        if start.claim.generation == CLOSE_ALL:
            # The session was gone when the claim ran (deleted, or lost with the store's data):
            # the client starts again from a 404 rather than this stream restoring it unclaimed.
            self.end("gone" if start.read.gone and start.read.epoch == self.session.epoch else "lost")
            return
        first: InboxRead | None = start.read
        # A resync stands for everything up to the head: what is older is not replayed as well.
        if self._resync_first or (self._from_head and start.claim.had_stream):
            self.cursor = start.read.head
            first, self._dirty = None, True
        if self._priming:
            await self.writer.prime(format_event_id(self.session.epoch, self.cursor))
        if self._resync_first:
            await self._resync()
        if first is not None:
            await self._drain(first)

    def _apply_sub_log(self, subscriptions: set[str]) -> None:
        # Every change since the watch began, in order, on top of a load taken somewhere in
        # between: each URI ends in the state of its last change (or the load's, if none).
        for added, uri in self._sub_log:
            if added:
                subscriptions.add(uri)
            else:
                subscriptions.discard(uri)
        self._sub_log.clear()

    async def _restore(self) -> bool:
        """Put back a session the store lost; False when that is impossible (the stream ends)."""
        backend = self.hub.backend
        record = replace(self.session)
        if not await backend.restore_session(record, set(self.subscriptions or ())):
            found = await backend.get_session(record.id)  # restored meanwhile (or never lost)
            if found is None or found.principal != record.principal:
                return False
            record = found
        logger.warning("session %s was lost with the backend's data; restored it with %d subscriptions",
                       record.id, len(self.subscriptions or ()))
        self.session = record
        # Claim it again: the restored record holds no generation, and the next claim must come
        # from the same store as the one a later stream will make. Takeovers that arrive
        # meanwhile are judged against the new claim, as at the start.
        self.generation, self._superseded = None, 0
        claim = await backend.claim_stream(record.id)
        self.generation = claim.generation
        if self._superseded > claim.generation:
            self.end("takeover")
        return True

    async def _drain(self, first: InboxRead | None = None) -> None:
        """Send what the inbox holds after the cursor; ``first`` is a read already made from it
        (the stream's start), with ``_dirty`` cleared before it was made."""
        backend = self.hub.backend
        batch = self.hub.settings.inbox_batch
        if first is None:
            self._dirty = False
            self._live = []
            # Wakes that arrive while the read is in flight may or may not be in it: mark them dirty.
            self._expect = None
        restored = False
        while self.ended is None:
            if first is None:
                read = await backend.read_inbox(self.session.id, self.session.epoch, self.cursor, batch)
            else:
                read, first = first, None
            if read.gone:
                if read.epoch == self.session.epoch:
                    self.end("gone")  # ended (DELETE, expiry), not lost: nothing to restore
                elif restored or not await self._restore():
                    self.end("lost")  # lost again at once, or cannot be put back: retry, do not spin
                else:
                    restored = True
                    # The gap rule from the restored (empty) inbox: whatever fan-out appends to it
                    # from now on follows the resync.
                    self.cursor = 0
                    await self._resync()
                continue
            if read.gap:
                self.session.epoch = read.epoch
                self.cursor = read.head
                await self._resync()
                continue
            await self._send(read.frames)
            if len(read.frames) < batch:
                break
        self._expect = self.cursor + 1

    async def _resync(self) -> None:
        """The gap rule: tell the client to re-read everything it watches; the cursor is at the head.

        The frames go straight to the stream, not through the inbox: a session with more
        subscriptions than ``inbox_maxlen`` would otherwise trim its own resync and gap again,
        forever. Only the last frame carries an id (the head): a client cut off halfway resumes
        from its old cursor and is resynchronised once more, which is safe for level triggers.
        """
        self._resync_first = False
        frames = await self.hub.resync_frames(self.session)
        head_id = format_event_id(self.session.epoch, self.cursor)
        if self.ended is None:
            await self.writer.send_many([(f.data, head_id if i == len(frames) - 1 else None)
                                         for i, f in enumerate(frames)])

    async def _send(self, frames: list[tuple[int, Frame]]) -> None:
        if self.ended is not None:
            return
        epoch = self.session.epoch
        batch = coalesce(frames)
        if len(batch) == 1:
            await self.writer.send(batch[0][1].data, format_event_id(epoch, batch[0][0]))
        elif batch:
            await self.writer.send_many([(frame.data, format_event_id(epoch, off)) for off, frame in batch])
        if frames:
            self.cursor = max(self.cursor, frames[-1][0])


class Listen(_Stream):
    """One ``subscriptions/listen`` stream (2026-07-28).

    The transport registers the listen with ``Hub.add_listen`` as soon as its checks pass, in
    the same step as the capacity check, so concurrent requests cannot overshoot the limit;
    ``run`` sends the ack before anything that was pushed in between. It ends on ``end``:
    ``"shutdown"`` sends the ``complete`` result, any other reason (the client closed the
    stream, or cancelled it on stdio) sends nothing more.
    """

    def __init__(self, hub: Hub, request_id: str | int, tenant: str, uris: list[str], list_changed: bool,
                 writer: Writer) -> None:
        super().__init__(writer)
        self.hub = hub
        self.request_id = request_id
        self.tenant = tenant
        self.uris = uris
        self.list_changed = list_changed
        # Pending frames keyed by what they are about: a URI changing twice before the client
        # reads is sent once, so the buffer never holds more than one frame per watched URI.
        self.pending: dict[str, bytes] = {}
        self._stamp = {SUBSCRIPTION_ID: request_id}
        #: Broadcasts may have been lost: the task owes its client the gap rule.
        self._resync = False

    def push(self, key: str, method: str, params: dict[str, Any], meta: dict[str, Any] | None = None) -> None:
        """Queue a notification; a newer one for the same key replaces the pending one in place.

        ``meta`` (the change's) joins the subscription id in ``params._meta``; the id wins a clash.
        A ``meta`` that cannot be encoded (one that predates the publish rules) is left out, as
        fan-out does for inboxes: the notification still says "re-read this".
        """
        if self.ended is None:
            stamp = {**meta, **self._stamp} if meta else self._stamp
            try:
                data = messages.notification(method, {"_meta": stamp, **params})
            except TypeError:  # orjson.JSONEncodeError
                logger.error("the meta of a change of %s cannot be encoded; notifying a listen without it", key)
                data = messages.notification(method, {"_meta": self._stamp, **params})
            self.pending[key] = data
            self.active = True
            self._wake()

    def resync(self) -> None:
        """Changes may have been missed (the backend lost broadcasts): apply the gap rule.

        The listen's own task builds the frames, each through ``push``, so a URI that has a
        frame pending costs nothing more, and a worker resynchronising thousands of listens does
        not hold its event loop for all of them at once.
        """
        if self.ended is None:
            self._resync = True
            self.active = True
            self._wake()

    def _push_resync(self) -> None:
        self._resync = False
        for uri in self.uris:
            self.push("u:" + uri, "notifications/resources/updated", {"uri": uri})
        if self.list_changed:
            self.push("l", "notifications/resources/list_changed", {})

    async def run(self, acknowledged: dict[str, Any]) -> str:
        hub = self.hub
        hub.add_listen(self)
        try:
            await self.writer.send(
                messages.notification("notifications/subscriptions/acknowledged",
                                      {"_meta": self._stamp, "notifications": acknowledged})
            )
            while self.ended is None:
                if self._resync:
                    self._push_resync()
                if self.pending:
                    pending, self.pending = self.pending, {}
                    # One write for all of them, so a cancel cannot land between two frames.
                    await self.writer.send_many([(data, None) for data in pending.values()])
                elif self.ping:
                    self.ping = False
                    await self.writer.comment()
                else:
                    await self._sleep()
            if self.ended == "shutdown":
                await self.writer.send(messages.complete_result(self.request_id, hub.server_meta, self._stamp))
            elif self.ended == "unavailable":
                await self.writer.retry()
        finally:
            hub.remove_listen(self)
        return self.ended or "closed"
