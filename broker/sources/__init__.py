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
again from half a second once a run lasted a minute); one refused by the change log's bounds
(``PublishRefused``) the same, with one line at info level and no traceback: a full log is not
the source's fault, and the source publishes what it kept when it starts again; one whose ``run`` returns is done and is
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
from broker.errors import PublishRefused
from broker.leasing import HeldLease, stop_task
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
        self.owner = f"{source.name}-{secrets.token_hex(4)}"
        self._running = metrics.gauge("mcp_broker_sources_running", source=source.name)
        #: Whether the source runs here now (under its lease, when it is exclusive): what the console shows.
        self.running = False
        self._lease = HeldLease(leases, self.lease_name, self.owner, lease_ms, f"change source {source.name}")

    @property
    def lease_name(self) -> str:
        return "source:" + self.source.name

    async def run(self) -> None:
        """Until cancelled: take the lease (exclusive sources), run the source, start it again if it fails."""
        loop = asyncio.get_running_loop()
        backoff = 0.5
        while True:
            if self.source.exclusive and not await self._lease.hold():  # another holds it, or no answer
                await asyncio.sleep(self._lease.lease / 3)
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

    async def _run_once(self) -> str:
        """Run the source until it returns (``finished``), fails (``failed``) or loses its lease (``lost``)."""
        task = asyncio.create_task(self.source.run(self.publisher), name=f"source-{self.source.name}")
        self._running.inc()
        self.running = True
        lost = False
        try:
            if self.source.exclusive:
                lost = await self._lease.keep(task)
            else:
                await asyncio.wait({task})
        finally:
            try:
                await stop_task(task)
            finally:
                self._running.dec()
                self.running = False
                if self.source.exclusive:
                    await self._lease.release()  # only once the source has stopped
        if lost:
            return "lost"
        if task.cancelled():
            return "failed"
        if isinstance(error := task.exception(), PublishRefused):
            # The change log's bound (the tenant's, or the partition's) is full: not a fault of the
            # source, which keeps what it has not published and publishes it when started again.
            logger.info("change source %s: the change log refused its changes (%s); starting it again after a "
                        "pause", self.source.name, error)
            return "failed"
        if error is not None:
            logger.error("change source %s failed; starting it again", self.source.name, exc_info=error)
            return "failed"
        return "finished"
