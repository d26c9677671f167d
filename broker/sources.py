"""The change-source seam: code that watches data somewhere and publishes its changes.

A ``ChangeSource`` is started and stopped with the broker (``Broker.add_source``) and publishes
through the broker's one ``Publisher``. A source marked ``exclusive`` runs on one worker of the
deployment at a time, under a lease named after it (``Backend.leases``): every worker asks for
the lease, the one that gets it runs the source and renews the lease every third of
``source_lease_ms``; a worker that cannot renew it (it lost the lease, or the backend did not
answer for a whole lease) stops its source, and another worker takes it over once the lease
lapses. Two workers may overlap for at most the time a renewal takes to fail, so a source that
must never publish twice keeps a cursor of its own (a published change is a level trigger:
publishing one twice costs a client one read).

A source whose ``run`` fails is started again after a pause that grows to 30 s; one whose
``run`` returns is done and is not started again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from typing import Final, Protocol

from broker.backends.base import Leases
from broker.errors import BackendUnavailable, raise_if_cancelled
from broker.metrics import NO_METRICS, Metrics
from broker.publisher import Publisher

__all__ = ["ChangeSource", "SourceRunner"]

logger = logging.getLogger(__name__)

#: The longest pause before a failed source is started again, in seconds.
MAX_BACKOFF: Final = 30.0


class ChangeSource(Protocol):
    """Publishes the changes of data the broker does not store itself."""

    #: Names the source in logs, metrics and (for an exclusive source) its lease.
    name: str
    #: Run on one worker of the deployment at a time (True), or on every worker (False).
    exclusive: bool

    async def run(self, publisher: Publisher) -> None:
        """Publish changes until cancelled (or return when there is nothing more to publish)."""


class SourceRunner:
    """Runs one source for as long as the broker runs, under its lease when it is exclusive."""

    def __init__(self, source: ChangeSource, publisher: Publisher, leases: Leases, lease_ms: int, *,
                 metrics: Metrics = NO_METRICS) -> None:
        self.source = source
        self.publisher = publisher
        self.leases = leases
        self.lease_ms = lease_ms
        self.owner = f"{source.name}-{secrets.token_hex(4)}"
        self._running = metrics.gauge("mcp_broker_sources_running")

    @property
    def lease(self) -> str:
        return "source:" + self.source.name

    async def run(self) -> None:
        """Until cancelled: take the lease (exclusive sources), run the source, start it again if it fails."""
        backoff = 0.5
        while True:
            if self.source.exclusive and not await self._take():
                await asyncio.sleep(self.lease_ms / 3000)
                continue
            try:
                finished = await self._run_once()
            finally:
                if self.source.exclusive:
                    await self._release()
            if finished:
                logger.info("change source %s finished", self.source.name)
                return
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF)

    async def _take(self) -> bool:
        try:
            return await self.leases.hold(self.lease, self.owner, self.lease_ms)
        except BackendUnavailable:
            return False

    async def _run_once(self) -> bool:
        """Run the source until it ends (True: it returned) or fails or loses its lease (False)."""
        task = asyncio.create_task(self.source.run(self.publisher), name=f"source-{self.source.name}")
        self._running.inc(source=self.source.name)
        try:
            if self.source.exclusive:
                await self._keep_lease(task)
            else:
                await asyncio.wait({task})
        finally:
            self._running.dec(source=self.source.name)
            if not task.done():
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({task})
        if task.cancelled():
            return False
        if (error := task.exception()) is not None:
            logger.error("change source %s failed; starting it again", self.source.name, exc_info=error)
            return False
        return True

    async def _keep_lease(self, task: asyncio.Task[None]) -> None:
        """Renew the lease while ``task`` runs; return when it ends or the lease can no longer be trusted."""
        loop = asyncio.get_running_loop()
        renewed = loop.time()
        while not task.done():
            await asyncio.wait({task}, timeout=self.lease_ms / 3000)
            if task.done():
                return
            try:
                async with asyncio.timeout(self.lease_ms / 3000):
                    held = await self.leases.hold(self.lease, self.owner, self.lease_ms)
            except (BackendUnavailable, TimeoutError):
                raise_if_cancelled()
                # Not renewed: still ours until the last renewal lapses, and not one moment longer.
                held = loop.time() - renewed < self.lease_ms / 1000 * 2 / 3
            else:
                renewed = loop.time()
            if not held:
                logger.warning("change source %s lost its lease; stopping it here", self.source.name)
                return

    async def _release(self) -> None:
        try:
            async with asyncio.timeout(1.0):
                await self.leases.release(self.lease, self.owner)
        except (BackendUnavailable, TimeoutError):
            pass  # it lapses by itself
