"""One watch of an upstream for the whole deployment, however many clients and workers watch it.

Wanting. Whatever subscribes to an upstream's URI (a 2025 ``resources/subscribe``, a listen, a
resumable listen, an events poll or webhook) records it in the backend's ``Demand`` under the
upstream's name, with a deadline ``watch_grace`` ahead (``Wants.want``). Subscriptions kept in the
subscription index (sessions and every other feed) need nothing more: the holder asks the index
whether they still stand. A plain listen lives on its worker alone, so its worker pushes its
deadline back while it is open (``Wants.refresh``).

Holding. ``WatchSource`` is an exclusive change source (``broker.sources``): one worker of the
deployment holds its lease and runs it. Every ``POLL`` seconds it reads the demand; a URI past its
deadline is kept (its deadline pushed back) while one of the upstream's tenants still has a
subscriber to it, and dropped otherwise, so a watch outlives its last subscriber by ``watch_grace``
to ``watch_grace`` + ``POLL``. While anything is wanted it runs the one ``UpstreamWatch``
(``broker.upstreams.watch``); the upstream's changes become changes in the change log for each of
its tenants, and reach every subscriber through the one fan-out.

Never silence. Whenever the watch may have missed something (its first look at a URI, a broken
stream it could not resume, an upstream that restarted, a lease that moved: a new holder starts
with a new watch), ``gap`` publishes ``updated`` for those URIs: each subscriber reads them again.
A change published twice costs a client one read; a change missed would cost it the truth.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

from broker.backends.base import Demand, SubscriptionIndex
from broker.changes import ChangeKind
from broker.errors import BackendUnavailable, LimitExceeded, PublishRefused, raise_if_cancelled
from broker.leasing import stop_task
from broker.metrics import NO_METRICS, Metrics
from broker.protocol.refusals import Reason
from broker.publisher import Publisher
from broker.upstreams.service import Upstream, Upstreams
from broker.upstreams.watch import UpstreamWatch

if TYPE_CHECKING:
    from broker.delivery import ListenIndex

__all__ = ["POLL", "WatchSource", "Wants"]

logger = logging.getLogger(__name__)

#: Seconds between two reads of an upstream's demand by the worker holding its watch: how long a
#: new subscriber may wait before the upstream is watched for it (it then gets ``updated`` at once).
POLL: Final = 0.5
#: The shortest deadline a want sets, whatever ``watch_grace`` says: a few reads of the demand.
MIN_GRACE: Final = 4 * POLL


def _grace(upstream: Upstream) -> float:
    return max(upstream.spec.watch_grace, MIN_GRACE)


class Wants:
    """The wanting side, on every worker."""

    def __init__(self, upstreams: Upstreams, demand: Demand) -> None:
        self.upstreams = upstreams
        self.demand = demand

    async def want(self, tenant: str, uris: Sequence[str]) -> None:
        """Record that ``tenant`` watches ``uris`` (those an upstream of its owns; the rest are not upstreams').

        Raises:
            LimitExceeded: the upstream's watch covers its ``max_watches`` URIs already (the URIs it
                took are wanted until their deadline, and dropped then if nobody subscribes to them).
            BackendUnavailable: not recorded.
        """
        per: dict[str, list[str]] = {}
        for uri in uris:
            upstream = self.upstreams.owner(tenant, uri)
            if upstream is not None:
                per.setdefault(upstream.name, []).append(uri)
        now = time.time()
        for name, owned in per.items():
            upstream = self.upstreams.by_name[name]
            most = upstream.spec.max_watches
            if await self.demand.want(name, owned, now + _grace(upstream), most):
                raise LimitExceeded(f"upstream {name!r} is watched for {most} URIs at most (its max_watches); "
                                    "unsubscribe one of its URIs first", reason=Reason.WATCHES,
                                    data={"upstream": name, "limit": most})

    async def refresh(self, listens: ListenIndex) -> None:
        """Push back the deadlines of what this worker's open listens watch."""
        per: dict[str, list[str]] = {}
        for tenant, uri in listens.watched():
            upstream = self.upstreams.owner(tenant, uri)
            if upstream is not None:
                per.setdefault(tenant, []).append(uri)
        for tenant, uris in per.items():
            try:
                await self.want(tenant, uris)
            except LimitExceeded as exc:  # only a listen whose entry lapsed meanwhile can meet it
                logger.warning("a listen's upstream URIs are not all watched: %s", exc)

    async def run(self, listens: ListenIndex) -> None:
        """``refresh`` every third of the shortest grace, until cancelled."""
        every = min(_grace(upstream) for upstream in self.upstreams.all) / 3
        while True:
            await asyncio.sleep(every)
            try:
                await self.refresh(listens)
            except BackendUnavailable:
                pass  # the next one tries again, well within the grace
            except Exception:  # the loop's boundary
                raise_if_cancelled()
                logger.exception("refreshing the listens' upstream watches failed")


class WatchSource:
    """The change source of one upstream's watch: exclusive, so one worker of the deployment runs it."""

    exclusive = True

    def __init__(self, upstream: Upstream, demand: Demand, subscriptions: SubscriptionIndex, *,
                 metrics: Metrics = NO_METRICS) -> None:
        self.upstream = upstream
        self.name = f"upstream-{upstream.name}"
        self.demand = demand
        self.subscriptions = subscriptions
        self.publisher: Publisher | None = None
        #: The watch while this worker runs one (the console and ``mcp-broker upstreams`` show it).
        self.watch: UpstreamWatch | None = None
        self._watched = metrics.gauge("mcp_broker_upstream_watched_uris", upstream=upstream.name)
        self._changes = metrics.counter("mcp_broker_upstream_changes_total", upstream=upstream.name)
        self._gaps = metrics.counter("mcp_broker_upstream_gaps_total", upstream=upstream.name)

    async def run(self, publisher: Publisher) -> None:
        self.publisher = publisher
        task: asyncio.Task[None] | None = None
        try:
            while True:
                try:
                    wanted = await self._wanted()
                except BackendUnavailable:  # the watch goes on as it is; the lease says when to stop
                    await asyncio.sleep(POLL)
                    continue
                if wanted and task is None:
                    self.watch = UpstreamWatch(self.upstream.client, self)
                    task = asyncio.create_task(self.watch.run(), name=f"upstream-watch-{self.upstream.name}")
                    logger.info("upstream %s: watching it for the deployment", self.upstream.name)
                if self.watch is not None:
                    self.watch.want(frozenset(wanted))
                    self._watched.set(len(self.watch.watched))
                if not wanted and task is not None:
                    await stop_task(task)
                    task, self.watch = None, None
                    self._watched.set(0)
                    logger.info("upstream %s: nothing of it is watched any more; its watch is closed",
                                self.upstream.name)
                if task is not None and task.done():
                    task.result()  # a watch that failed fails the source: it is started again
                await asyncio.sleep(POLL)
        finally:
            if task is not None:
                await stop_task(task)
            self.watch = None
            self._watched.set(0)

    async def _wanted(self) -> set[str]:
        """The URIs wanted now; those past their deadline kept while a tenant still subscribes to them."""
        spec = self.upstream.spec
        found = await self.demand.wanted(self.upstream.name, spec.max_watches)
        now = time.time()
        due = [uri for uri, until in found.items() if until <= now]
        if due:
            kept: set[str] = set()
            for tenant in spec.tenants:
                subscribed = await self.subscriptions.subscribers(tenant, due)
                kept |= {uri for uri, sessions in subscribed.items() if sessions}
            if kept:  # all already wanted: pushed back, never refused
                await self.demand.want(self.upstream.name, sorted(kept), now + _grace(self.upstream), spec.max_watches)
            gone = [uri for uri in due if uri not in kept]
            await self.demand.drop(self.upstream.name, gone, now)
            for uri in gone:
                del found[uri]
        return set(found)

    # -- WatchEvents: what the upstream says becomes changes of each of its tenants ---------------
    async def updated(self, uri: str) -> None:
        self._changes.inc()
        await self._publish([uri], ChangeKind.UPDATED)

    async def list_changed(self, what: str) -> None:
        if what == "resources" and self.watch is not None and self.watch.watched:
            # The broker's list_changed follows a created or deleted change; which URI is not known,
            # so one it watches stands for it (its subscribers read it again: a resync, not a loss).
            await self._publish([min(self.watch.watched)], ChangeKind.CREATED)

    async def gap(self, uris: frozenset[str]) -> None:
        if uris:
            self._gaps.inc()
            await self._publish(sorted(uris), ChangeKind.UPDATED)

    async def _publish(self, uris: list[str], kind: ChangeKind) -> None:
        assert self.publisher is not None
        items = [{"uri": uri, "kind": kind.value} for uri in uris]
        for tenant in self.upstream.spec.tenants:
            for start in range(0, len(items), 100):  # within a tenant's backlog bound per request
                while True:
                    try:
                        await self.publisher.publish_items(tenant, items[start:start + 100],
                                                           source=f"upstream:{self.upstream.name}")
                        break
                    except (PublishRefused, BackendUnavailable) as exc:
                        # A full backlog or an outage: the watch waits (and the upstream's stream with it)
                        # rather than drop a change; the lease says when this worker must stop.
                        await asyncio.sleep(exc.retry_after or 1)
