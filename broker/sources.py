"""The change-source seam: code that watches data somewhere and publishes its changes.

A ``ChangeSource`` is started and stopped with the broker (``Broker.add_source``) and publishes
through the broker's one ``Publisher``. A source marked ``exclusive`` runs on one worker of the
deployment at a time, under a lease named after it (``Backend.leases``, ``source_lease_ms`` long):
every worker asks for the lease, the one that gets it runs the source and renews it every third
of the lease. The lease is counted from the moment its last successful renewal was *sent*, so
it cannot have lapsed on the server before this worker thinks so; a worker whose renewals do
not succeed for two thirds of the lease cancels its source, and releases the lease only once the
source has stopped. Another worker can take the lease only once it lapsed, a whole lease after
that last renewal: the two never run at once, unless a source takes longer than a third of the
lease to stop when cancelled (or the clocks of Redis and the worker drift by as much). A source
that must never publish twice anyway keeps a cursor of its own; a published change is a level
trigger, and publishing one twice costs a client one read.

A source whose ``run`` fails is started again after a pause that grows to 30 s (and starts
again from half a second once a run lasted a minute); one whose ``run`` returns is done and is
not started again. A worker that lost the lease asks for it again, then every third of a lease.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Protocol

from broker.backends.base import Leases
from broker.errors import BackendUnavailable, raise_if_cancelled
from broker.metrics import NO_METRICS, Metrics
from broker.publisher import Publisher
from broker.resources.base import ResourceProvider

__all__ = ["ChangeSource", "Extension", "SourceRunner"]

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


@dataclass(frozen=True, slots=True)
class Extension:
    """What a built-in source module or a deployment's own ``module:factory`` adds: providers that
    answer for its URIs, and the change sources that publish their changes."""

    providers: Sequence[ResourceProvider] = ()
    sources: Sequence[ChangeSource] = ()


class SourceRunner:
    """Runs one source for as long as the broker runs, under its lease when it is exclusive."""

    def __init__(self, source: ChangeSource, publisher: Publisher, leases: Leases, lease_ms: int, *,
                 metrics: Metrics = NO_METRICS) -> None:
        self.source = source
        self.publisher = publisher
        self.leases = leases
        self.lease = lease_ms / 1000
        self.owner = f"{source.name}-{secrets.token_hex(4)}"
        self._running = metrics.gauge("mcp_broker_sources_running", source=source.name)
        #: Loop time at which the last successful hold was sent: the lease is ours until then + lease.
        self._held_since = 0.0

    @property
    def lease_name(self) -> str:
        return "source:" + self.source.name

    async def run(self) -> None:
        """Until cancelled: take the lease (exclusive sources), run the source, start it again if it fails."""
        loop = asyncio.get_running_loop()
        backoff = 0.5
        while True:
            if self.source.exclusive and not await self._hold():  # another holds it, or no answer
                await asyncio.sleep(self.lease / 3)
                continue
            began = loop.time()
            outcome = await self._run_once()
            if outcome == "finished":
                logger.info("change source %s finished", self.source.name)
                return
            if outcome == "failed":
                backoff = 0.5 if loop.time() - began > 60 else backoff
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, MAX_BACKOFF)

    async def _hold(self) -> bool | None:
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
                held = await self.leases.hold(self.lease_name, self.owner, int(self.lease * 1000))
        except Exception as exc:  # the lease store's failure is a lease not known to be held (a bug is logged)
            raise_if_cancelled()
            if not isinstance(exc, BackendUnavailable | TimeoutError):
                logger.exception("change source %s: its lease could not be asked for", self.source.name)
            return None
        if held:
            self._held_since = sent
        return held

    def _trusted(self) -> bool:
        """The lease is surely still ours: less than two thirds of it since the last renewal was sent."""
        return asyncio.get_running_loop().time() < self._held_since + self.lease * 2 / 3

    async def _run_once(self) -> str:
        """Run the source until it returns (``finished``), fails (``failed``) or loses its lease (``lost``)."""
        task = asyncio.create_task(self.source.run(self.publisher), name=f"source-{self.source.name}")
        self._running.inc()
        lost = False
        try:
            if self.source.exclusive:
                lost = await self._keep_lease(task)
            else:
                await asyncio.wait({task})
        finally:
            try:
                await self._stop(task)
            finally:
                self._running.dec()
                if self.source.exclusive:
                    await self._release()  # only once the source has stopped
        if lost:
            return "lost"
        if task.cancelled():
            return "failed"
        if (error := task.exception()) is not None:
            logger.error("change source %s failed; starting it again", self.source.name, exc_info=error)
            return "failed"
        return "finished"

    async def _keep_lease(self, task: asyncio.Task[None]) -> bool:
        """Renew the lease while ``task`` runs; True when it was lost (the task must stop), False once it ended."""
        while not task.done():
            await asyncio.wait({task}, timeout=self.lease / 3)
            if task.done():
                return False
            held = await self._hold()
            if held is False or (held is None and not self._trusted()):
                logger.warning("change source %s lost its lease; stopping it here", self.source.name)
                return True
        return False

    @staticmethod
    async def _stop(task: asyncio.Task[None]) -> None:
        """Cancel ``task`` and wait until it has ended, whatever cancellations reach this one meanwhile."""
        cancelled = False
        while not task.done():
            task.cancel()
            try:
                await asyncio.wait({task})
            except asyncio.CancelledError:
                cancelled = True  # a shutdown repeats its cancel: still wait for the source to stop
        if cancelled:
            raise asyncio.CancelledError

    async def _release(self) -> None:
        self._held_since = 0.0
        try:
            async with asyncio.timeout(1.0):
                await self.leases.release(self.lease_name, self.owner)
        except (BackendUnavailable, TimeoutError):
            pass  # it lapses by itself
