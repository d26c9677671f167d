"""One worker at a time: a named lease held while a task runs, and the timing that makes it safe.

The lease is renewed every third of its length and counted from the moment its last
successful renewal was *sent*, so it cannot have lapsed on the server before this worker thinks
so; a renewal may take no longer than the margin left, and a worker whose renewals do not
succeed for two thirds of the lease stops its task, releasing the lease only once the task has
stopped. Another worker can take it only once it lapsed, a whole lease after that last
renewal: two never run at once unless a task takes more than a third of a lease to stop (or the
clocks of the lease store and the worker drift by as much). Change sources
(``broker.sources``) and webhook deliveries (``broker.events``) run under it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from broker.backends.base import Leases
from broker.errors import BackendUnavailable, raise_if_cancelled

__all__ = ["HeldLease", "stop_task"]

logger = logging.getLogger(__name__)


class HeldLease:
    """A named lease this worker asks for, renews while its task runs, and gives back after it."""

    def __init__(self, leases: Leases, name: str, owner: str, lease_ms: int, label: str) -> None:
        """``label`` names what runs under it in the log (``change source files``)."""
        self.leases = leases
        self.name = name
        self.owner = owner
        self.lease = lease_ms / 1000
        self.label = label
        #: Loop time at which the last successful hold was sent: the lease is ours until then + lease.
        self._held_since = 0.0

    async def hold(self) -> bool | None:
        """Take or renew the lease, within the time it has left: True when this worker holds it now,
        False when another one does, None when the lease store did not answer in time."""
        loop = asyncio.get_running_loop()
        sent = loop.time()
        # A renewal may take no longer than the margin that is left; a first take, a third of a lease.
        deadline = sent + self.lease / 3
        if self._held_since:
            deadline = max(self._held_since + self.lease * 2 / 3, sent + 0.001)
        try:
            async with asyncio.timeout(deadline - sent):
                held = await self.leases.hold(self.name, self.owner, int(self.lease * 1000))
        except Exception as exc:  # the lease store's failure is a lease not known to be held (a bug is logged)
            raise_if_cancelled()
            if not isinstance(exc, BackendUnavailable | TimeoutError):
                logger.exception("%s: its lease could not be asked for", self.label)
            return None
        if held:
            self._held_since = sent
        return held

    def trusted(self) -> bool:
        """The lease is surely still ours: less than two thirds of it since the last renewal was sent."""
        return asyncio.get_running_loop().time() < self._held_since + self.lease * 2 / 3

    async def keep(self, task: asyncio.Future[None],
                   on_renew: Callable[[], Awaitable[None]] | None = None) -> bool:
        """Renew the lease while ``task`` runs; True when it was lost (the task must stop), False once it ended.

        ``on_renew`` runs after each renewal (a failure of it is logged, and costs nothing else).
        """
        while not task.done():
            await asyncio.wait({task}, timeout=self.lease / 3)
            if task.done():
                return False
            held = await self.hold()
            if held is False or (held is None and not self.trusted()):
                logger.warning("%s lost its lease; stopping it here", self.label)
                return True
            if on_renew is not None:
                try:
                    await on_renew()
                except Exception:
                    raise_if_cancelled()
                    logger.debug("after renewing %s", self.name, exc_info=True)
        return False

    async def release(self) -> None:
        """Give the lease back (call it only once the task has stopped); one that cannot be reached lapses."""
        self._held_since = 0.0
        try:
            async with asyncio.timeout(1.0):
                await self.leases.release(self.name, self.owner)
        except (BackendUnavailable, TimeoutError):
            pass  # it lapses by itself


async def stop_task(task: asyncio.Future[None]) -> None:
    """Cancel ``task`` and wait until it has ended, whatever cancellations reach this one meanwhile."""
    cancelled = False
    while not task.done():
        task.cancel()
        try:
            await asyncio.wait({task})
        except asyncio.CancelledError:
            cancelled = True  # a shutdown repeats its cancel: still wait for the task to stop
    if cancelled:
        raise asyncio.CancelledError
