"""One worker at a time: a named lease held while a task runs, with ``SourceRunner``'s timing.

The lease is renewed every third of its length and counted from the moment its last
successful renewal was *sent*, so it cannot have lapsed on the server before this worker
thinks so; a renewal may take no longer than the margin left, and a worker whose renewals do
not succeed for two thirds of the lease cancels its task, releasing the lease only once the
task has stopped. Another worker can take it only once it lapsed, a whole lease after that
last renewal: two never run at once unless a task takes more than a third of a lease to stop.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from broker.backends.base import Leases
from broker.errors import BackendUnavailable, raise_if_cancelled

__all__ = ["LeasedTask"]

logger = logging.getLogger(__name__)


class LeasedTask:
    def __init__(self, leases: Leases, name: str, owner: str, lease_ms: int) -> None:
        self.leases = leases
        self.name = name
        self.owner = owner
        self.lease = lease_ms / 1000
        self._held_since = 0.0

    async def run(self, work: Callable[[], Awaitable[None]], on_renew: Callable[[], Awaitable[None]]) -> bool:
        """Run ``work`` while this worker holds the lease; False when another holds it (nothing ran).

        ``on_renew`` runs after each renewal (a failure of it is logged, and costs nothing else).
        """
        if not await self._hold():
            return False
        task = asyncio.ensure_future(work())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=self.lease / 3)
                if task.done():
                    break
                held = await self._hold()
                if held is False or (held is None and not self._trusted()):
                    logger.warning("lease %s lost; stopping its work here", self.name)
                    break
                try:
                    await on_renew()
                except Exception:
                    raise_if_cancelled()
                    logger.debug("after renewing %s", self.name, exc_info=True)
        finally:
            await _stop(task)
            await self._release()
        if not task.cancelled() and (error := task.exception()) is not None:
            if not isinstance(error, BackendUnavailable):
                logger.error("the work of lease %s failed", self.name, exc_info=error)
        return True

    async def _hold(self) -> bool | None:
        loop = asyncio.get_running_loop()
        sent = loop.time()
        deadline = sent + self.lease / 3
        if self._held_since:
            deadline = max(self._held_since + self.lease * 2 / 3, sent + 0.001)
        try:
            async with asyncio.timeout(deadline - sent):
                held = await self.leases.hold(self.name, self.owner, int(self.lease * 1000))
        except Exception as exc:  # the lease store's failure is a lease not known to be held
            raise_if_cancelled()
            if not isinstance(exc, BackendUnavailable | TimeoutError):
                logger.exception("lease %s could not be asked for", self.name)
            return None
        if held:
            self._held_since = sent
        return held

    def _trusted(self) -> bool:
        return asyncio.get_running_loop().time() < self._held_since + self.lease * 2 / 3

    async def _release(self) -> None:
        self._held_since = 0.0
        try:
            async with asyncio.timeout(1.0):
                await self.leases.release(self.name, self.owner)
        except (BackendUnavailable, TimeoutError):
            pass  # it lapses by itself


async def _stop(task: asyncio.Future[None]) -> None:
    """Cancel ``task`` and wait until it has ended, whatever cancellations reach this one meanwhile."""
    cancelled = False
    while not task.done():
        task.cancel()
        try:
            await asyncio.wait({task})
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
