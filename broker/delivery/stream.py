"""What every stream shares: where its messages go, how it sleeps and wakes, and why it ended.

A stream is one long-lived answer to a client: a 2025 session's GET stream or a resumable
listen (views of a feed, ``feeds.session``, ``feeds.listen``) or a plain 2026-07-28 listen
(``delivery.listen``). Each runs in the task of the
request that opened it, writes through a ``Writer`` (an SSE response or the stdio channel)
and ends for one ``EndReason``; the reason says what the client is told at the end.

Who ends whom: a stream ends when its writer reports a disconnect, when the worker shuts down,
when the backend has been unreachable for ``outage_grace`` seconds (``delivery.hub``), when its
caller's credential expires (a timer set by ``bind``) or is revoked (the Hub's check), or
(legacy) when another stream of the same session takes over. Ending only sets the reason and
wakes the stream's own task, which then returns; nothing is cancelled from outside.
"""

from __future__ import annotations

import asyncio
import time
from enum import StrEnum
from typing import Final, Protocol

from broker.feeds.model import FeedKind
from broker.metrics import Metrics, accepted_at
from broker.ops.tracing import Tracer

__all__ = ["EndReason", "Stream", "StreamMetrics", "Streams", "Writer"]


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


class EndReason(StrEnum):
    """Why a stream ended, and with it what its client is told."""

    #: The client went away (or closed the stream).
    DISCONNECT = "disconnect"
    #: A listen cancelled by its client (stdio ``notifications/cancelled``).
    CANCELLED = "cancelled"
    #: This worker is stopping.
    SHUTDOWN = "shutdown"
    #: The backend has not answered for ``outage_grace`` seconds.
    UNAVAILABLE = "unavailable"
    #: The session was lost with the store's data and could not be put back.
    LOST = "lost"
    #: The session was ended (DELETE, expiry): there is nothing to come back to.
    GONE = "gone"
    #: A newer stream of the same session took over.
    TAKEOVER = "takeover"
    #: The caller's credential expired: the client comes back with a fresh one.
    EXPIRED = "expired"
    #: The caller's credential was revoked (a stored key); likewise.
    REVOKED = "revoked"

    @property
    def reconnect(self) -> bool:
        """The client should come back (on another worker, or here later): a legacy stream sends ``retry:``."""
        return self in _RECONNECT

    @property
    def completes(self) -> bool:
        """A listen ends with its ``complete`` result (2026-07-28's graceful end) rather than a cut."""
        return self in _COMPLETES

    @property
    def resumable(self) -> bool:
        """This worker may resume the stream itself from its cursor (stdio has no client-side reconnect)."""
        return self in _RESUMABLE


_RECONNECT: Final = frozenset({EndReason.SHUTDOWN, EndReason.UNAVAILABLE, EndReason.LOST, EndReason.EXPIRED,
                              EndReason.REVOKED})
#: A listen whose credential ends closes as a drained worker's do: the client listens again, with a new one.
_COMPLETES: Final = frozenset({EndReason.SHUTDOWN, EndReason.EXPIRED, EndReason.REVOKED})
_RESUMABLE: Final = frozenset({EndReason.UNAVAILABLE, EndReason.LOST})


#: One write batch in this many has its publish-to-frame time measured (per era and process); the
#: first one is. Reading the clock and observing a histogram costs a few thousand instructions,
#: a tenth of a frame's whole cost, so the histogram is sampled rather than fed by every write.
SAMPLE_EVERY: Final = 16


class StreamMetrics:
    """The instruments streams of one era report to, made once per process and era, and its tracer.

    ``traces``: told of every notification written (a span for each that carries a trace
    context), or None when tracing is off: streams test it once per write batch.
    """

    __slots__ = ("_metrics", "countdown", "era", "latency", "open", "replayed", "restored", "resyncs", "sent",
                 "sent_lists", "takeovers", "traces")

    def __init__(self, metrics: Metrics, era: str, traces: Tracer | None = None) -> None:
        self._metrics = metrics
        self.traces = traces
        self.era = era
        self.open = metrics.gauge("mcp_broker_streams_open", era=era)
        #: Notifications written, by kind: ``updated`` and ``list_changed``.
        self.sent = metrics.counter("mcp_broker_notifications_sent_total", era=era, kind="updated")
        self.sent_lists = metrics.counter("mcp_broker_notifications_sent_total", era=era, kind="list_changed")
        self.resyncs = metrics.counter("mcp_broker_gap_resyncs_total", era=era)
        self.replayed = metrics.counter("mcp_broker_frames_replayed_total")
        self.takeovers = metrics.counter("mcp_broker_stream_takeovers_total")
        self.restored = metrics.counter("mcp_broker_sessions_restored_total")
        self.latency = metrics.histogram("mcp_broker_publish_to_frame_seconds", era=era)
        #: Write batches left before the next sample (``SAMPLE_EVERY``).
        self.countdown = 1

    def ended(self, reason: EndReason) -> None:
        """A stream ended (off the hot path: the instrument is looked up now)."""
        self.open.dec()
        self._metrics.counter("mcp_broker_streams_ended_total", era=self.era, reason=reason.value).inc()

    def due(self) -> bool:
        """Whether this write batch is the one in ``SAMPLE_EVERY`` to be measured (one decrement otherwise)."""
        self.countdown -= 1
        if self.countdown > 0:
            return False
        self.countdown = SAMPLE_EVERY
        return True

    def observe(self, change_id: str) -> None:
        """A frame of the change ``change_id`` was just written: how long since the change was accepted."""
        accepted = accepted_at(change_id)
        if accepted is not None:
            self.latency.observe(max(time.time() - accepted, 0.0))


class Stream:
    """How a stream's task sleeps and wakes, and its end reason.

    The task sleeps on a bare future that exists only while it sleeps. An ``asyncio.Event``
    cost about 1 KB more per idle stream: its waiter deque preallocates a block, and
    ``Event.wait`` adds a coroutine frame. Every reason to wake is also kept in the stream's
    state (``ended``, ``ping``, a subclass's pending frames), which the task looks at before
    it sleeps again, so a wake that comes while the task is busy is never lost.

    A stream opened with a credential that expires (``bind``) also sleeps until that moment: a
    timer on the event loop ends it then, so an idle stream costs nothing until it is due.
    """

    __slots__ = ("_deadline", "_waiter", "active", "credential", "ended", "ping")

    def __init__(self) -> None:
        self.ended: EndReason | None = None
        self.ping = False
        #: Woke up for something other than a keep-alive since the Hub last looked.
        self.active = False
        self._waiter: asyncio.Future[None] | None = None
        #: The stored credential (a runtime key's id) the caller came with, for the Hub's revocation check.
        self.credential: str | None = None
        self._deadline: asyncio.TimerHandle | None = None

    def bind(self, credential: str | None, expires_at: float | None) -> None:
        """Tie the stream to its caller's credential: it ends (``EXPIRED``) at ``expires_at`` (Unix
        seconds; None: never), and the Hub ends it (``REVOKED``) once ``credential`` is revoked."""
        self.credential = credential
        if expires_at is None:
            return
        left = expires_at - time.time()
        if left <= 0:
            self.end(EndReason.EXPIRED)
        else:
            self._deadline = asyncio.get_running_loop().call_later(left, self.end, EndReason.EXPIRED)

    def end(self, reason: EndReason) -> None:
        if self.ended is None:
            self.ended = reason
        self.unbind()
        self._wake()

    def unbind(self) -> None:
        """Drop the expiry timer (the stream is over): it would hold the stream until it fired."""
        deadline, self._deadline = self._deadline, None
        if deadline is not None:
            deadline.cancel()

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


class Streams:
    """The streams this process holds now, for the Hub's timers, health check and shutdown.

    ``feeds`` maps each open stream that reads a feed (a 2025 session's GET stream, a resumable
    listen) to its feed's id, whose idle clock the Hub keeps running; ``by_kind`` counts them by
    the kind of their feed, so a resumable listen counts as the listen it is, not as a session.
    ``listens`` holds the open plain listens (``ListenIndex`` adds and removes them).
    ``closing`` is set once the worker stops: a stream asked for from then on ends at once.
    """

    __slots__ = ("by_kind", "closing", "feeds", "listens")

    def __init__(self) -> None:
        self.feeds: dict[Stream, str] = {}
        self.by_kind: dict[FeedKind, int] = dict.fromkeys(FeedKind, 0)
        self.listens: dict[Stream, None] = {}
        self.closing = False

    def add(self, stream: Stream, feed: str, kind: FeedKind) -> None:
        """``stream`` reads ``feed``, of ``kind``, from now on."""
        if stream not in self.feeds:
            self.by_kind[kind] += 1
        self.feeds[stream] = feed

    def remove(self, stream: Stream, kind: FeedKind) -> None:
        if self.feeds.pop(stream, None) is not None:
            self.by_kind[kind] -= 1

    @property
    def sessions(self) -> int:
        """Open GET streams of 2025 sessions."""
        return self.by_kind[FeedKind.SESSION]

    @property
    def all_listens(self) -> int:
        """Open listens, plain and resumable."""
        return len(self.listens) + self.by_kind[FeedKind.LISTEN]

    def all(self) -> list[Stream]:
        return [*self.feeds, *self.listens]

    def __len__(self) -> int:
        return len(self.feeds) + len(self.listens)
