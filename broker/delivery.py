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

One ``Hub`` per process drives keep-alives for every stream from a single timer, keeps the
idle clock of sessions with an open stream from running out, watches the backend's health
while streams are open (one ping at a time, on its own schedule), and ends every stream on
shutdown (``retry:`` for legacy streams, the ``complete`` result for listens).

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
from typing import Any, Final, Protocol

from broker.backends.base import CLOSE_ALL, Backend, Frame, InboxRead, SessionRecord, Wake
from broker.changes import Change, ChangeKind
from broker.config import Settings
from broker.errors import BackendUnavailable, raise_if_cancelled
from broker.frames import LIST_CHANGED, update_frame
from broker.protocol import messages
from broker.uris import notify_targets

__all__ = ["Hub", "LegacyStream", "Listen", "Writer", "coalesce", "format_event_id", "parse_event_id"]

logger = logging.getLogger(__name__)

SUBSCRIPTION_ID: Final = "io.modelcontextprotocol/subscriptionId"
#: Keep-alives go out to one slot of streams per tick, KEEPALIVE_SLOTS ticks per interval.
KEEPALIVE_SLOTS: Final = 8
#: Open sessions touched per backend call. A call builds its whole pipeline before it yields,
#: so 10,000 sessions in one call held every stream of a Redis worker up for ~200 ms.
TOUCH_CHUNK: Final = 200


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


class Hub:
    """Every stream this process holds, one keep-alive timer, the backend's health, and the listen registry."""

    def __init__(self, settings: Settings, backend: Backend, server_meta: dict[str, Any]) -> None:
        self.settings = settings
        self.backend = backend
        self.server_meta = server_meta
        self.legacy: dict[LegacyStream, None] = {}
        self.listens: set[Listen] = set()
        self._by_uri: dict[tuple[str, str], set[Listen]] = {}
        self._list_changed: dict[str, set[Listen]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._remove_broadcast: Callable[[], Awaitable[None]] | None = None
        self.closing = False
        #: Loop time at which the first backend ping that did not answer was sent; None while
        #: the backend answers (or no stream is open to care).
        self.outage_since: float | None = None

    async def start(self) -> None:
        self._remove_broadcast = await self.backend.on_broadcast(self._on_change, self._on_broadcast_lost)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._tick(), name="hub-keepalive"),
                       loop.create_task(self._touch(), name="hub-touch"),
                       loop.create_task(self._watch_backend(), name="hub-health")]

    def _streams(self) -> list[_Stream]:
        return [*self.legacy, *self.listens]

    async def _tick(self) -> None:
        # Keep-alives are spread over KEEPALIVE_SLOTS ticks per interval, and only streams that
        # sent nothing since their last turn get one: 10,000 streams woken in the same instant
        # stalled every other stream for tens of milliseconds (measured: p99 of the targeted
        # benchmark 170 ms with one burst per interval, 25 ms without).
        turn = 0
        while True:
            await asyncio.sleep(self.settings.keepalive_interval / KEEPALIVE_SLOTS)
            turn = (turn + 1) % KEEPALIVE_SLOTS
            for stream in self._streams():
                if hash(stream) % KEEPALIVE_SLOTS == turn:
                    if stream.active:
                        stream.active = False
                    else:
                        stream.keepalive()

    async def _touch(self) -> None:
        """Sessions with an open stream are touched well within their TTL, whatever the keep-alive interval.

        A task of its own, so a touch that waits out the Redis timeouts holds up neither
        keep-alives nor the health check.
        """
        every = min(self.settings.keepalive_interval, self.settings.session_ttl / 3)
        while True:
            await asyncio.sleep(every)
            sids = [s.session.id for s in self.legacy]
            try:
                for start in range(0, len(sids), TOUCH_CHUNK):
                    await self.backend.touch_sessions(sids[start:start + TOUCH_CHUNK])
            except BackendUnavailable as exc:
                logger.warning("could not refresh the idle clocks of %d open sessions: %s", len(sids), exc)
            except Exception:  # the task's boundary: the next round must still run
                raise_if_cancelled()
                logger.exception("refreshing the idle clocks of open sessions failed")

    async def _watch_backend(self) -> None:
        """End every stream with ``retry:`` once the backend has not answered for ``outage_grace`` seconds.

        While streams are open, one ping every ``outage_check_interval`` seconds, never two at a
        time. An outage is timed from the moment the first ping that did not answer was *sent*:
        a ping that hangs (a frozen Redis, a route that drops packets) counts from then, not
        from when the client library gives up, and the keep-alive interval plays no part. A
        ping that answers late, within the grace, was a blip: streams stay open.
        """
        loop = asyncio.get_running_loop()
        interval = self.settings.outage_check_interval
        grace = self.settings.outage_grace
        ping: asyncio.Task[None] | None = None
        sent = next_ping = loop.time()
        ended_for: float | None = None  # the outage whose streams were ended (logged once)
        try:
            while True:
                now = loop.time()
                if ping is not None and ping.done():
                    answered = not ping.cancelled() and ping.exception() is None
                    ping = None
                    if answered:
                        if self.outage_since is not None:
                            logger.warning("backend answers again after %.1fs", now - self.outage_since)
                        self.outage_since = ended_for = None
                    elif self.outage_since is None:
                        self.outage_since = sent
                streams = bool(self.legacy or self.listens)
                if not streams and ping is None:
                    self.outage_since = None  # nothing to protect; a later stream starts afresh
                elif ping is None and now >= next_ping:
                    sent, next_ping = now, now + interval
                    ping = loop.create_task(self._ping(max(grace, interval)), name="hub-ping")
                since = self.outage_since if self.outage_since is not None else (sent if ping is not None else None)
                if streams and since is not None and now - since >= grace:
                    if ended_for != since:
                        ended_for = since
                        logger.warning("backend unavailable for %.1fs: ending %d streams with retry:",
                                       now - since, len(self.legacy) + len(self.listens))
                    # Wake-ups may have been lost and nothing can be read: clients resume from their
                    # cursors (elsewhere, or here later) rather than sit on a stream that went deaf.
                    for stream in self._streams():
                        stream.end("unavailable")
                # Sleep until the next ping is due, the one in flight settles, or the grace runs out.
                wake = now + interval if ping is not None else next_ping
                if streams and since is not None and now < since + grace:
                    wake = min(wake, since + grace)
                if ping is not None:
                    await asyncio.wait({ping}, timeout=max(0.0, wake - now))
                else:
                    await asyncio.sleep(max(0.0, wake - now) if streams else interval)
        finally:
            if ping is not None:
                ping.cancel()

    async def _ping(self, deadline: float) -> None:
        """Raises ``BackendUnavailable`` or ``TimeoutError``: the backend did not answer."""
        async with asyncio.timeout(deadline):
            await self.backend.ping()

    async def shutdown(self, timeout: float = 5.0) -> None:
        """End every stream (``retry:`` / ``complete``) and wait for them to go, at most ``timeout``."""
        self.closing = True
        for stream in self._streams():
            stream.end("shutdown")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while (self.legacy or self.listens) and loop.time() < deadline:
            await asyncio.sleep(0.01)
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=1.0)
        remove, self._remove_broadcast = self._remove_broadcast, None  # shutdown may run twice
        if remove is not None:
            try:
                await remove()
            except BackendUnavailable:
                pass

    def _on_broadcast_lost(self) -> None:
        """The backend may have lost broadcasts (its connection was re-made): every listen gets the gap rule."""
        if self.listens:
            logger.warning("broadcasts may have been lost; resynchronising %d listens", len(self.listens))
        for listen in self.listens:
            listen.resync()

    # -- listens ------------------------------------------------------------------------
    def add_listen(self, listen: Listen) -> None:
        self.listens.add(listen)
        for uri in listen.uris:
            self._by_uri.setdefault((listen.tenant, uri), set()).add(listen)
        if listen.list_changed:
            self._list_changed.setdefault(listen.tenant, set()).add(listen)

    def remove_listen(self, listen: Listen) -> None:
        self.listens.discard(listen)
        for uri in listen.uris:
            members = self._by_uri.get((listen.tenant, uri))
            if members is not None:
                members.discard(listen)
                if not members:
                    del self._by_uri[(listen.tenant, uri)]
        if listen.list_changed:
            members = self._list_changed.get(listen.tenant)
            if members is not None:
                members.discard(listen)
                if not members:
                    del self._list_changed[listen.tenant]

    def _on_change(self, change: Change) -> None:
        if not self.listens:
            return
        for uri in notify_targets(change.uri):
            for listen in self._by_uri.get((change.tenant, uri), ()):
                listen.push("u:" + uri, "notifications/resources/updated", {"uri": uri}, change.meta)
        if change.kind is not ChangeKind.UPDATED:
            for listen in self._list_changed.get(change.tenant, ()):
                listen.push("l", "notifications/resources/list_changed", {})

    # -- legacy -------------------------------------------------------------------------
    async def resync_frames(self, session: SessionRecord) -> list[Frame]:
        uris = sorted(await self.backend.get_subscriptions(session.id))
        return [*(update_frame(uri) for uri in uris), LIST_CHANGED]

