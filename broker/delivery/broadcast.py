"""The listen broadcast, received by a process only while it has listens open.

Every fan-out batch of every worker is broadcast (``base.Broadcast``) for the 2026-07-28
listens. A worker with no listen open does not subscribe it, so it receives and decodes none of
those messages; the first listen subscribes it, and it is given up once no listen has been open
for a while.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from broker.backends.base import Broadcast
from broker.delivery.listen import ListenIndex
from broker.delivery.stream import Streams
from broker.errors import BackendUnavailable, raise_if_cancelled

__all__ = ["ListenBroadcast"]

logger = logging.getLogger(__name__)


def _retrieve(task: asyncio.Task[None]) -> None:
    """An attempt whose waiters were all cancelled: its failure is no one's to raise."""
    if not task.cancelled():
        task.exception()


class ListenBroadcast:
    """The broadcast subscribed for this process's listens while it has any.

    ``ready`` returns once the subscription is confirmed: every change fanned out from then on
    reaches ``ListenIndex.on_change``. A listen awaits it before it is registered and
    acknowledged (``Dispatcher.leased_listen``), so a change published after its ack reaches it.
    Concurrent callers share one attempt and its outcome: during an outage they are all refused
    at once, not one socket timeout after another. The attempt is a task of its own, so a caller
    cancelled meanwhile (a stdio cancellation) leaves it to finish, and the subscription it
    makes is given up like any other. ``tick`` (the Hub's keep-alive timer) gives the
    subscription up once no listen has been open for more than ``idle_ticks`` ticks in a row,
    in a task of its own, so that a slow unsubscribe holds up no keep-alive.
    """

    def __init__(self, broadcast: Broadcast, listens: ListenIndex, streams: Streams, idle_ticks: int) -> None:
        self.broadcast = broadcast
        self.listens = listens
        self.streams = streams
        self.idle_ticks = idle_ticks
        #: Gives the subscription up; None while there is none.
        self._unsubscribe: Callable[[], Awaitable[None]] | None = None
        self._attempt: asyncio.Task[None] | None = None
        self._giving_up: asyncio.Task[None] | None = None
        #: Ticks in a row with the broadcast subscribed and no listen open.
        self._idle = 0
        #: ``close`` was called: an attempt that ends later gives its subscription up at once.
        self._closed = False

    @property
    def subscribed(self) -> bool:
        return self._unsubscribe is not None

    async def ready(self) -> None:
        """Returns once the broadcast is subscribed (at once while it is, or while the process stops:
        a listen opened then ends at once with its ``complete`` result).

        Raises:
            BackendUnavailable: the subscription could not be confirmed; the next listen tries again.
        """
        if self._unsubscribe is not None or self.streams.closing:
            return
        attempt = self._attempt
        if attempt is None:
            attempt = self._attempt = asyncio.get_running_loop().create_task(self._subscribe(),
                                                                              name="broadcast-subscribe")
            attempt.add_done_callback(_retrieve)
        await asyncio.shield(attempt)

    async def _subscribe(self) -> None:
        try:
            listens = self.listens
            unsubscribe = await self.broadcast.subscribe(listens.on_change, listens.on_lost, listens.on_batch)
        finally:
            self._attempt = None
        if self._closed:  # the process stopped meanwhile
            with contextlib.suppress(BackendUnavailable):
                await unsubscribe()
            return
        self._unsubscribe = unsubscribe

    def tick(self) -> asyncio.Task[None] | None:
        """One tick of the Hub's keep-alive timer: give the subscription up once it has been idle
        long enough; the task that gives it up, when this tick started one."""
        idle = (self._unsubscribe is not None and self._attempt is None and not len(self.listens)
                and (self._giving_up is None or self._giving_up.done()))
        self._idle = self._idle + 1 if idle else 0
        if self._idle <= self.idle_ticks:
            return None
        self._idle = 0
        self._giving_up = asyncio.get_running_loop().create_task(self._give_up(), name="broadcast-give-up")
        return self._giving_up

    async def _give_up(self) -> None:
        # Checked again: a listen may have come since the tick. From here on, a new listen finds
        # no subscription and waits for an attempt of its own.
        unsubscribe = self._unsubscribe
        if unsubscribe is None or self._attempt is not None or len(self.listens):
            return
        self._unsubscribe = None
        try:
            await unsubscribe()
        except BackendUnavailable as exc:  # the channel goes with the connection
            logger.info("giving up the broadcast channel: %s", exc)
        except Exception:  # the task's boundary
            raise_if_cancelled()
            logger.exception("giving up the broadcast channel failed")

    async def close(self, timeout: float = 1.0) -> None:
        """Give the subscription up for good (the process stops: ``ready`` subscribes nothing more),
        after an attempt or a give-up under way, for at most ``timeout`` seconds (an attempt that
        ends later gives its subscription up itself)."""
        self._closed = True
        pending = [task for task in (self._attempt, self._giving_up) if task is not None and not task.done()]
        if pending:
            await asyncio.wait(pending, timeout=timeout)
        unsubscribe, self._unsubscribe = self._unsubscribe, None  # shutdown may run twice
        if unsubscribe is not None:
            try:
                await unsubscribe()
            except BackendUnavailable:
                pass
