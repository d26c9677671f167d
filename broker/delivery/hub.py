"""The Hub: the timers that keep one process's streams, its backend health check, and its shutdown.

One ``Hub`` per process drives keep-alives for every stream from a single timer, keeps the idle
clock of sessions with an open stream from running out, watches the backend's health while
streams are open (one ping at a time, on its own schedule, ending every stream with ``retry:``
once the backend has not answered for ``outage_grace`` seconds), subscribes the process's
listens to the broadcast of processed changes while it has any, ends the streams of stored
credentials that were revoked (one batched check of them all every
``credential_check_seconds``; expiry is each stream's own timer, ``Stream.bind``), and ends
every stream on shutdown (``retry:`` for legacy streams, the ``complete`` result for listens).
It knows the streams only through the ``Streams`` registry; they never reach back into it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Final

from broker.backends.base import Broadcast
from broker.config import Settings
from broker.delivery.broadcast import ListenBroadcast
from broker.delivery.listen import ListenIndex
from broker.delivery.stream import EndReason, Stream, Streams
from broker.errors import BackendUnavailable, raise_if_cancelled
from broker.metrics import Metrics

__all__ = ["Hub"]

logger = logging.getLogger(__name__)

#: Keep-alives go out to one slot of streams per tick, KEEPALIVE_SLOTS ticks per interval.
KEEPALIVE_SLOTS: Final = 8
#: Open sessions touched per backend call. A call builds its whole pipeline before it yields,
#: so 10,000 sessions in one call held every stream of a Redis worker up for ~200 ms.
TOUCH_CHUNK: Final = 200
#: Idle clocks are restarted for one slot of the open sessions per tick, TOUCH_SLOTS ticks per
#: round: all of them at once, in chunks, cost a Redis worker with 10,000 streams ~160 ms of
#: CPU in one burst every round, and the frames queued behind it.
TOUCH_SLOTS: Final = 16


class Hub:
    """One keep-alive timer, the backend's health, and shutdown, over every stream of this process."""

    def __init__(self, settings: Settings, streams: Streams, listens: ListenIndex, broadcast: Broadcast, *,
                 touch: Callable[[Sequence[str]], Awaitable[None]], ping: Callable[[], Awaitable[None]],
                 metrics: Metrics, revoked: Callable[[Collection[str]], Awaitable[set[str]]] | None = None) -> None:
        """``touch`` restarts the idle clock of sessions; ``ping`` raises ``BackendUnavailable`` when the
        backend does not answer; ``revoked`` says which of the stored credentials given no longer
        hold (None: no stored credentials, nothing to check)."""
        self.settings = settings
        self.streams = streams
        self.listens = listens
        self.broadcast = broadcast
        self.touch = touch
        self.ping = ping
        self.revoked = revoked
        self._outages = metrics.counter("mcp_broker_backend_outages_total")
        self._outage_seconds = metrics.counter("mcp_broker_backend_outage_seconds_total")
        self._tasks: list[asyncio.Task[None]] = []
        #: The broadcast, subscribed while this process has listens open; given up a keep-alive
        #: interval after the last one closed.
        self.listen_broadcast = ListenBroadcast(broadcast, listens, streams, idle_ticks=KEEPALIVE_SLOTS)
        listens.ready = self.listen_broadcast.ready
        #: Loop time at which the first backend ping that did not answer was sent; None while
        #: the backend answers (or no stream is open to care).
        self.outage_since: float | None = None

    async def start(self) -> None:
        """Start the timers."""
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._tick(), name="hub-keepalive"),
                       loop.create_task(self._touch(), name="hub-touch"),
                       loop.create_task(self._watch_backend(), name="hub-health")]
        if self.revoked is not None:
            self._tasks.append(loop.create_task(self._check_credentials(self.revoked), name="hub-credentials"))

    async def _tick(self) -> None:
        # Keep-alives are spread over KEEPALIVE_SLOTS ticks per interval, and only streams that
        # sent nothing since their last turn get one: 10,000 streams woken in the same instant
        # stalled every other stream for tens of milliseconds (measured: p99 of the targeted
        # benchmark 170 ms with one burst per interval, 25 ms without).
        turn = 0
        while True:
            await asyncio.sleep(self.settings.keepalive_interval / KEEPALIVE_SLOTS)
            turn = (turn + 1) % KEEPALIVE_SLOTS
            self.listen_broadcast.tick()
            for stream in self.streams.all():
                if hash(stream) % KEEPALIVE_SLOTS == turn:
                    if stream.active:
                        stream.active = False
                    else:
                        stream.keepalive()

    async def _touch(self) -> None:
        """Sessions with an open stream are touched well within their TTL, whatever the keep-alive interval.

        Every session once a round (at most a third of the TTL), a slot of them per tick, so the
        work is spread over the round rather than done in one burst. A task of its own, so a
        touch that waits out the Redis timeouts holds up neither keep-alives nor the health check.
        """
        every = min(self.settings.keepalive_interval, self.settings.session_ttl / 3)
        turn = 0
        while True:
            await asyncio.sleep(every / TOUCH_SLOTS)
            turn = (turn + 1) % TOUCH_SLOTS
            sids = [sid for sid in set(self.streams.feeds.values()) if hash(sid) % TOUCH_SLOTS == turn]
            try:
                for start in range(0, len(sids), TOUCH_CHUNK):
                    await self.touch(sids[start:start + TOUCH_CHUNK])
            except BackendUnavailable as exc:
                logger.warning("could not refresh the idle clocks of %d open sessions: %s", len(sids), exc)
            except Exception:  # the task's boundary: the next round must still run
                raise_if_cancelled()
                logger.exception("refreshing the idle clocks of open sessions failed")

    async def _check_credentials(self, revoked: Callable[[Collection[str]], Awaitable[set[str]]]) -> None:
        """End (``REVOKED``) the streams whose stored credential no longer holds, on every worker.

        One task for the whole process, and one backend call per round for every credential of
        its open streams (``TOUCH_CHUNK`` at a time): an idle stream costs no check of its own.
        A revocation is seen at most ``credential_check_seconds`` (and a lookup) after it was made.
        """
        while True:
            await asyncio.sleep(self.settings.credential_check_seconds)
            held: dict[str, list[Stream]] = {}
            for stream in self.streams.all():
                if stream.credential is not None and stream.ended is None:
                    held.setdefault(stream.credential, []).append(stream)
            ids = list(held)
            try:
                for start in range(0, len(ids), TOUCH_CHUNK):
                    for credential in await revoked(ids[start:start + TOUCH_CHUNK]):
                        for stream in held.get(credential, ()):
                            stream.end(EndReason.REVOKED)
            except BackendUnavailable:
                pass  # checked again next round; a long outage ends the streams anyway (``_watch_backend``)
            except Exception:  # the task's boundary: the next round must still run
                raise_if_cancelled()
                logger.exception("checking the credentials of open streams failed")

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
        counted_to = 0.0  # loop time up to which outage seconds were counted
        try:
            while True:
                now = loop.time()
                counted_to = self._count_outage(now, counted_to)
                if ping is not None and ping.done():
                    answered = not ping.cancelled() and ping.exception() is None
                    ping = None
                    if answered:
                        if self.outage_since is not None:
                            logger.warning("backend answers again after %.1fs", now - self.outage_since)
                        self.outage_since = ended_for = None
                    elif self.outage_since is None:
                        self.outage_since = sent
                streams = bool(self.streams.feeds or self.streams.listens)
                if not streams and ping is None:
                    self.outage_since = None  # nothing to protect; a later stream starts afresh
                elif ping is None and now >= next_ping:
                    sent, next_ping = now, now + interval
                    ping = loop.create_task(self._ping(max(grace, interval)), name="hub-ping")
                since = self.outage_since if self.outage_since is not None else (sent if ping is not None else None)
                if streams and since is not None and now - since >= grace:
                    if ended_for != since:
                        ended_for = since
                        self._outages.inc()
                        logger.warning("backend unavailable for %.1fs: ending %d streams with retry:",
                                       now - since, len(self.streams))
                    # Wake-ups may have been lost and nothing can be read: clients resume from their
                    # cursors (elsewhere, or here later) rather than sit on a stream that went deaf.
                    for stream in self.streams.all():
                        stream.end(EndReason.UNAVAILABLE)
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

    def _count_outage(self, now: float, counted_to: float) -> float:
        """Add the outage seconds since ``counted_to`` (or since the outage began); the new mark.

        Counted as they pass (a scrape during an outage sees the figure grow), from the moment
        the first unanswered ping was sent.
        """
        if self.outage_since is None:
            return counted_to
        begun = max(self.outage_since, counted_to)
        if now > begun:
            self._outage_seconds.inc(now - begun)
            return now
        return counted_to

    async def _ping(self, deadline: float) -> None:
        """Raises ``BackendUnavailable`` or ``TimeoutError``: the backend did not answer."""
        async with asyncio.timeout(deadline):
            await self.ping()

    async def shutdown(self, timeout: float = 5.0) -> None:
        """End every stream (``retry:`` / ``complete``) and wait for them to go, at most ``timeout``."""
        self.streams.closing = True
        for stream in self.streams.all():
            stream.end(EndReason.SHUTDOWN)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.streams and loop.time() < deadline:
            await asyncio.sleep(0.01)
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=1.0)
        await self.listen_broadcast.close()
