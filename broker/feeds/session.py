"""The session view: the GET stream (SSE or stdio) of a 2025 session, a cursor into the session's inbox.

The stream owns no buffer of its own: the session's inbox in the backend is the source of
truth and the stream is a cursor into it. Wake-ups usually carry the frame, so the common case
needs no read; whenever the carried frames are not contiguous with the cursor the stream reads
the inbox instead. The handoff from replay to live is loss-free because the stream watches the
session *before* it reads the inbox, and merges by offset (a frame at or below the cursor is
never sent twice). Event ids are ``<epoch>-<offset>``; any worker can resolve them.

The stream keeps its session's record and a copy of its subscriptions, so that a session lost
with the store's data is put back and given the gap rule, while an ended one ends the stream
(docs/DESIGN-NOTES.md, "A store that lost its data"). That rule, the reading and the resync
are ``feeds.reader``'s loop; the stream is its ``View``, and keeps the fast path of its own:
frames carried in wake-ups, sent with no read.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

from broker.backends.base import Inboxes, SessionStore, SubscriptionIndex
from broker.backends.types import CLOSE_ALL, Frame, InboxRead, SessionRecord, Wake
from broker.delivery.stream import SAMPLE_EVERY, EndReason, Stream, StreamMetrics, Streams, Writer
from broker.errors import BackendUnavailable
from broker.feeds.model import FeedKind, format_event_id
from broker.feeds.reader import Batch, FeedReader, Gone, View, batch_of
from broker.notifications import LIST_CHANGED_KEY, resync_frames

__all__ = ["SessionServices", "SessionStream", "coalesce"]

logger = logging.getLogger(__name__)

def coalesce(frames: list[tuple[int, Frame]]) -> list[tuple[int, Frame]]:
    """Keep only the newest frame of each key, in offset order.

    Safe because every frame is a level trigger; the newest frame's id still covers the skipped ones.
    """
    if len(frames) < 2:
        return frames
    newest: dict[str, int] = {frame.key: off for off, frame in frames}
    return [(off, frame) for off, frame in frames if newest[frame.key] == off]


@dataclass(frozen=True, slots=True)
class SessionServices:
    """What every session stream of the process uses: one object, shared, so a stream holds one reference."""

    inboxes: Inboxes
    reader: FeedReader
    sessions: SessionStore
    subscriptions: SubscriptionIndex
    streams: Streams
    metrics: StreamMetrics
    #: Frames per inbox read.
    inbox_batch: int
    #: Frames carried by wake-ups a stream keeps before it reads its inbox instead.
    stream_buffer: int


class SessionStream(Stream, View):
    """The one live GET stream of a 2025 session: a ``View`` of its feed."""

    __slots__ = ("_dirty", "_expect", "_from_head", "_live", "_priming", "_resync_first", "_sub_log", "_superseded",
                 "_writer", "cursor", "generation", "services", "session", "subscriptions")

    kind = FeedKind.SESSION

    def __init__(self, services: SessionServices, session: SessionRecord, cursor: int | None, *,
                 resync: bool = False, priming: bool = False) -> None:
        """``cursor`` None: from the start of the inbox for a session's first stream, else from its head.

        ``resync``: the client's cursor is of another data generation; the stream starts with the gap rule.
        """
        super().__init__()
        self.services = services
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
        self._writer: Writer | None = None

    def _on_wake(self, wake: Wake) -> None:
        if wake.kind == "takeover":
            # A wake may arrive before our own claim returns: remember it, judge it then.
            if self.generation is None:
                self._superseded = max(self._superseded, wake.generation)
            elif wake.generation > self.generation:
                self.end(EndReason.TAKEOVER)
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
            and len(self._live) < self.services.stream_buffer
        ):
            self._live.append((wake.offset, wake.frame))
            self._expect = wake.offset + 1
        else:
            self._dirty = True
        self.active = True
        self._wake()

    def disconnect(self) -> None:
        """The client went away."""
        self.end(EndReason.DISCONNECT)

    async def run(self, writer: Writer) -> EndReason:
        """Serve the stream on ``writer`` until it ends; returns why it ended."""
        services = self.services
        unwatch: Callable[[], Awaitable[None]] | None = None
        self._writer = writer
        services.streams.add(self, self.session.id, self.kind)
        services.metrics.open.inc()
        if services.streams.closing:  # shutdown began while this stream was being set up
            self.end(EndReason.SHUTDOWN)
        try:
            unwatch = await services.inboxes.watch(self.session.id, self._on_wake)
            await self._start(writer)
            while self.ended is None:
                if self._dirty:
                    await self._drain()
                elif self._live:
                    live, self._live = self._live, []
                    if len(live) > 1 or live[0][0] <= self.cursor:  # one new frame, as is usual, is sent as it is
                        live = [(off, f) for off, f in live if off > self.cursor]
                    await self._send(writer, live)
                elif self.ping:
                    self.ping = False
                    await writer.comment()
                else:
                    await self._sleep()
        except BackendUnavailable:
            self.end(EndReason.UNAVAILABLE)
        finally:
            self.unbind()
            services.streams.remove(self, self.kind)
            self._writer = None
            services.metrics.ended(self.ended or EndReason.DISCONNECT)
            if unwatch is not None:
                try:
                    await unwatch()
                except BackendUnavailable:
                    pass
        reason = self.ended or EndReason.DISCONNECT
        if reason is EndReason.TAKEOVER:
            services.metrics.takeovers.inc()
        if reason.reconnect:
            await writer.retry()
        return reason

    async def _start(self, writer: Writer) -> None:
        """Load the subscriptions, claim the session and send what is due, from one backend step."""
        # Wakes from here on may or may not be in the start's read: they mark the stream dirty.
        self._dirty = False
        start = await self.services.inboxes.start_stream(self.session.id, self.session.epoch, self.cursor,
                                                         self.services.inbox_batch)
        self._apply_sub_log(start.subscriptions)
        self.subscriptions = start.subscriptions
        self.generation = start.claim.generation
        if self._superseded > start.claim.generation:
            self.end(EndReason.TAKEOVER)
            return
        if start.claim.generation == CLOSE_ALL:
            # The session was gone when the claim ran (deleted, or lost with the store's data):
            # the client starts again from a 404 rather than this stream restoring it unclaimed.
            gone = batch_of(self.session.epoch, start.read).gone is Gone.ENDED
            self.end(EndReason.GONE if gone else EndReason.LOST)
            return
        first: InboxRead | None = start.read
        # A resync stands for everything up to the head: what is older is not replayed as well.
        if self._resync_first or (self._from_head and start.claim.had_stream):
            self.cursor = start.read.head
            first, self._dirty = None, True
        if self._priming:
            await writer.prime(format_event_id(self.session.epoch, self.cursor))
        if self._resync_first:
            await self._resync(writer)
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

    async def restore(self) -> bool:
        """Put back a session the store lost; False when that is impossible (the stream ends)."""
        sessions = self.services.sessions
        record = replace(self.session)
        if not await sessions.restore(record, set(self.subscriptions or ())):
            found = await sessions.get(record.id)  # restored meanwhile (or never lost)
            if found is None or found.principal != record.principal:
                return False
            record = found
        logger.warning("session %s was lost with the backend's data; restored it with %d subscriptions",
                       record.id, len(self.subscriptions or ()))
        self.services.metrics.restored.inc()
        self.session = record
        # Claim it again: the restored record holds no generation, and the next claim must come
        # from the same store as the one a later stream will make. Takeovers that arrive
        # meanwhile are judged against the new claim, as at the start.
        self.generation, self._superseded = None, 0
        claim = await self.services.inboxes.claim_stream(record.id)
        self.generation = claim.generation
        if self._superseded > claim.generation:
            self.end(EndReason.TAKEOVER)
        return True

    async def _drain(self, first: InboxRead | None = None) -> None:
        """Send what the inbox holds after the cursor (``FeedReader.drain``); ``first`` is a read already
        made from it (the stream's start), with ``_dirty`` cleared before it was made."""
        if first is None:
            self._dirty = False
            self._live = []
            # Wakes that arrive while the read is in flight may or may not be in it: mark them dirty.
            self._expect = None
        await self.services.reader.drain(self, self.services.inbox_batch, first)
        self._expect = self.cursor + 1

    # The View: the loop's reading of this stream's feed.

    def position(self) -> tuple[str, str, int]:
        return self.session.id, self.session.epoch, self.cursor

    def reading(self) -> bool:
        return self.ended is None

    async def send(self, batch: Batch) -> None:
        self.services.metrics.replayed.inc(len(batch.frames))
        await self._send(self._writer_now(), batch.frames)

    async def resync(self, epoch: str, head: int) -> None:
        self.session.epoch, self.cursor = epoch, head
        await self._resync(self._writer_now())

    async def over(self, gone: Gone) -> None:
        self.end(EndReason.GONE if gone is Gone.ENDED else EndReason.LOST)

    def _writer_now(self) -> Writer:
        if self._writer is None:
            raise RuntimeError("a stream is read only while it runs")
        return self._writer

    async def _resync(self, writer: Writer) -> None:
        """The gap rule: tell the client to re-read everything it watches; the cursor is at the head.

        The frames cover the store's subscriptions and the stream's copy together: a
        subscription made while wake-ups were being lost (a pub/sub reconnect, which is also when
        gaps happen) is in the store but not in the copy, and a store that has just lost its data
        returns less than the copy. The copy takes what the store adds and loses nothing, so a
        restore after this never drops a subscription (an unsubscription whose wake was lost may
        linger in it: a needless notification, never a missed one).

        The frames go straight to the stream, not through the inbox: a session with more
        subscriptions than ``inbox_maxlen`` would otherwise trim its own resync and gap again,
        forever. Only the last frame carries an id (the head): a client cut off halfway resumes
        from its old cursor and is resynchronised once more, which is safe for level triggers.
        """
        self._resync_first = False
        stored = await self.services.subscriptions.of_session(self.session.id)
        copy = self.subscriptions
        if copy is None:  # not loaded yet (cannot happen after the start): the store's is all there is
            self._apply_sub_log(stored)
            self.subscriptions = copy = stored
        else:
            copy |= stored
        frames = resync_frames(copy)
        head_id = format_event_id(self.session.epoch, self.cursor)
        if self.ended is None:
            metrics = self.services.metrics
            metrics.resyncs.inc()
            await writer.send_many([(f.data, head_id if i == len(frames) - 1 else None) for i, f in enumerate(frames)])
            metrics.sent.inc(len(frames) - 1)  # an update of every URI, then list_changed
            metrics.sent_lists.inc()

    async def _send(self, writer: Writer, frames: list[tuple[int, Frame]]) -> None:
        if self.ended is not None:
            return
        epoch = self.session.epoch
        batch = coalesce(frames)
        metrics = self.services.metrics
        if len(batch) == 1:
            frame = batch[0][1]
            await writer.send(frame.data, format_event_id(epoch, batch[0][0]))
            (metrics.sent_lists if frame.key == LIST_CHANGED_KEY else metrics.sent).inc()
        elif batch:
            await writer.send_many([(frame.data, format_event_id(epoch, off)) for off, frame in batch])
            # A coalesced batch holds at most one frame of each key, so at most one list change.
            lists = 0
            for _, frame in batch:
                if frame.key == LIST_CHANGED_KEY:
                    lists = 1
                    break
            metrics.sent.inc(len(batch) - lists)
            if lists:
                metrics.sent_lists.inc()
        if batch:
            metrics.countdown -= 1  # inline: a method call per write is a measurable share of a frame
            if metrics.traces is not None:
                metrics.traces.delivered(self.session.id, [frame.data for _, frame in batch])
            if metrics.countdown <= 0:
                metrics.countdown = SAMPLE_EVERY
                # Frames read back from Redis, or woken from another worker, carry no change id
                # (those of the memory backend, and of this worker's own fan-out, keep it):
                # those batches are not measured.
                metrics.observe(batch[-1][1].change)
        if frames:
            self.cursor = max(self.cursor, frames[-1][0])
