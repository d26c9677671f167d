"""A webhook subscription's deliveries on one worker at a time: its work under a ``HeldLease``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from broker.backends.base import Leases
from broker.errors import BackendUnavailable, Refusal
from broker.leasing import HeldLease, stop_task

__all__ = ["LeasedTask"]

logger = logging.getLogger(__name__)


class LeasedTask:
    def __init__(self, leases: Leases, name: str, owner: str, lease_ms: int) -> None:
        self.name = name
        self.lease = HeldLease(leases, name, owner, lease_ms, f"the work of lease {name}")

    async def run(self, work: Callable[[], Awaitable[None]], on_renew: Callable[[], Awaitable[None]]) -> bool:
        """Run ``work`` while this worker holds the lease; False when another holds it (nothing ran).

        ``on_renew`` runs after each renewal (a failure of it is logged, and costs nothing else).
        """
        if not await self.lease.hold():
            return False
        task = asyncio.ensure_future(work())
        try:
            await self.lease.keep(task, on_renew)
        finally:
            await stop_task(task)
            await self.lease.release()
        if not task.cancelled() and (error := task.exception()) is not None:
            if isinstance(error, Refusal) and not isinstance(error, BackendUnavailable):
                # e.g. a gone feed made again while sessions are full: the next holder tries again
                logger.warning("the work of lease %s was refused: %s", self.name, error)
            elif not isinstance(error, BackendUnavailable):
                logger.error("the work of lease %s failed", self.name, exc_info=error)
        return True

