"""Fan-out: from the change log into feed inboxes and listen streams (docs/ARCHITECTURE.md, "The path of a change").

Each fan-out consumer takes a batch of changes from the log's consumer group, turns them into
frames for every subscribed feed, appends those frames to the inboxes, broadcasts the
changes to the workers holding listens, and only then acknowledges the batch. A consumer
that dies before acknowledging leaves its batch pending; another claims it after
``fanout_claim_idle_ms``. Fan-out is therefore at least once, and a redone batch adds nothing
twice to an inbox nor reaches a listen twice: every frame and broadcast change names the change
behind it (docs/DESIGN-NOTES.md, "Repeats: inbox appends are idempotent per change").

A consumer stopped for shutdown (its task cancelled) finishes the batch in hand, for at most
``fanout_stop_timeout`` seconds, before it gives its leases up: the next holder then has no
half-done batch to redo.

Order: one consumer at a time reads a partition of the log (the backend's lease), and a batch
that failed is handed out again before anything newer, so the notifications of one URI leave
in the order its changes were published. A batch that keeps failing (three times and 30 s) for
a reason other than the backend is dropped, with its ids in the log (docs/DESIGN-NOTES.md,
"Order: one holder per partition").

Within a batch, repeated updates of one URI coalesce into one frame (the newest change's
``meta`` wins), and a tenant's ``list_changed`` is sent at most once.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Sequence
from dataclasses import replace

from broker.backends.base import Backend
from broker.backends.types import Frame
from broker.changes import Change
from broker.config import Settings
from broker.errors import BackendUnavailable, raise_if_cancelled
from broker.metrics import NO_METRICS, Gauge, Metrics, TenantCounter, TenantLabels
from broker.notifications import LIST_CHANGED, changes_list, targets, update_frame
from broker.ops.tracing import Tracer

__all__ = ["Fanout", "plan"]

logger = logging.getLogger(__name__)

#: A batch that fails for a reason other than the backend this many times, over at least this
#: many seconds, is dropped (a bug or an unreadable change, not a passing outage).
POISON_ATTEMPTS = 3
POISON_SECONDS = 30.0
#: Seconds a stopping consumer spends giving up its leases.
RELEASE_TIMEOUT = 1.0
#: Seconds between two reports of the change-log lag and the leases held (one backend call each).
REPORT_INTERVAL = 2.0
#: Milliseconds an idle fan-out read waits for a change before it reads again.
READ_BLOCK_MS = 1000

def plan(batch: Sequence[tuple[str, Change]]) -> tuple[dict[str, dict[str, tuple[str, Change]]], dict[str, str]]:
    """Per tenant, the URIs to notify, each with the newest change behind it (and its id), and
    the tenants whose lists changed, each with the id of the newest change that changed it."""
    updates: dict[str, dict[str, tuple[str, Change]]] = {}
    listed: dict[str, str] = {}
    for change_id, change in batch:
        per_tenant = updates.setdefault(change.tenant, {})
        for uri in targets(change):
            per_tenant.pop(uri, None)  # re-insert so the order follows the newest change
            per_tenant[uri] = (change_id, change)
        if changes_list(change):
            listed[change.tenant] = change_id
    return updates, listed


def newest(batch: Sequence[tuple[str, Change]]) -> list[tuple[str, Change]]:
    """The batch as listens need it: the newest change of each URI (and kind of change), with its
    id, in order (so ids still grow along the list, per partition)."""
    latest: dict[tuple[str, str, bool], tuple[str, Change]] = {}
    for change_id, change in batch:
        key = (change.tenant, change.uri, changes_list(change))
        latest.pop(key, None)
        latest[key] = (change_id, change)
    return list(latest.values())


class Fanout:
    """One fan-out consumer. ``run`` loops until cancelled; ``process`` handles one batch.

    It reads the change log and the subscription index, and hands each batch's frames, its
    changes for the listens and its acknowledgement to the backend in one step (``deliver``).
    """

    def __init__(self, settings: Settings, backend: Backend, name: str | None = None, *,
                 metrics: Metrics = NO_METRICS, tenant_labels: TenantLabels | None = None,
                 tracer: Tracer | None = None) -> None:
        """``tracer``: a span per change fanned out, whose context its notifications carry (None: tracing is off)."""
        self.settings = settings
        self.tracer = tracer
        self.changelog = backend.changelog
        self.subscriptions = backend.subscriptions
        self.sessions = backend.sessions
        self.deliver = backend.deliver
        self.name = name or f"fanout-{secrets.token_hex(4)}"
        self.processed = 0
        self._changes = metrics.counter("mcp_broker_fanout_changes_total")
        self._frames = metrics.counter("mcp_broker_fanout_frames_total")
        self._batch_seconds = metrics.histogram("mcp_broker_fanout_batch_seconds")
        self._dropped = metrics.counter("mcp_broker_fanout_dropped_batches_total")
        self._tenant_frames = TenantCounter(metrics, "mcp_broker_tenant_frames_total",
                                            tenant_labels or TenantLabels(settings.metrics_tenant_limit))
        self._metrics = metrics
        self._leases = metrics.gauge("mcp_broker_fanout_leases_held")
        #: Per partition reported, its lag gauges (entries, seconds).
        self._lag: dict[int, tuple[Gauge, Gauge]] = {}

    async def process(self, batch: Sequence[tuple[str, Change]], read_under: str = "") -> None:
        """Fan one batch out; ``read_under`` is the store's epoch before it was read (``Backend.deliver``)."""
        if not batch:
            return
        began = time.perf_counter()
        updates, listed = plan(batch)
        # Every frame names the change behind it, so appending a batch again (it was redone:
        # its acknowledgement, or the reply to its append, was lost) adds nothing twice.
        frames: list[tuple[str, Frame]] = []
        found: dict[str, dict[str, list[str]]] = {}
        for tenant, by_uri in updates.items():
            subscribers = found[tenant] = await self.subscriptions.subscribers(tenant, list(by_uri))
            before = len(frames)
            for uri, sids in subscribers.items():
                change_id, change = by_uri[uri]
                frame = update_frame(uri, change.meta, change_id)
                frames.extend((sid, frame) for sid in sids)
            if len(frames) > before:
                self._tenant_frames.inc(tenant, len(frames) - before)
        for tenant, change_id in listed.items():
            frame = replace(LIST_CHANGED, change=change_id)
            before = len(frames)
            frames.extend((sid, frame) for sid in await self.subscriptions.tenant_sessions(tenant))
            if len(frames) > before:
                self._tenant_frames.inc(tenant, len(frames) - before)
        gone = set(await self.deliver(frames, newest(batch), [change_id for change_id, _ in batch], read_under))
        if gone:
            # Sessions that expired without cleaning the index (a store that expires keys does
            # that). The batch is acknowledged already: should this fail, the next change of the
            # URI finds them gone again.
            try:
                for tenant, subscribers in found.items():
                    for uri, sids in subscribers.items():
                        for sid in gone.intersection(sids):
                            await self.subscriptions.remove(sid, tenant, uri)
            except BackendUnavailable as exc:
                logger.warning("could not drop %d gone sessions from the subscription index (%s); "
                               "the next change of their URIs finds them again", len(gone), exc)
        self.processed += len(batch)
        self._changes.inc(len(batch))
        self._frames.inc(len(frames))
        self._batch_seconds.observe(time.perf_counter() - began)

    async def run(self) -> None:
        """Consume the change log until cancelled, surviving backend outages.

        On the way out the consumer gives up its leases, so another one takes its partitions
        over at its next hold (within a sixth of ``fanout_claim_idle_ms``) instead of after
        the whole lease (a rolling restart would stall fan-out that long otherwise).
        """
        reporter = asyncio.create_task(self._metrics.sample_every(REPORT_INTERVAL, self._report), name="fanout-metrics")
        try:
            await self._consume()
        finally:
            reporter.cancel()
            try:
                async with asyncio.timeout(RELEASE_TIMEOUT):
                    await self.changelog.release(self.name)
            except (BackendUnavailable, TimeoutError):
                pass  # the leases lapse by themselves
            except Exception:  # must not replace the CancelledError that is ending the task
                logger.exception("fan-out could not give up its leases; they lapse by themselves")
            self._reported({})

    async def _report(self) -> None:
        """The partitions this consumer holds and each one's lag, sampled every ``REPORT_INTERVAL`` seconds.

        Off the hot path: one backend call per round, asked of the change log, which knows its
        partitions (``lag``). Without metrics no round is made (``Metrics.sample_every``).
        """
        try:
            self._reported(await self.changelog.lag(self.name))
        except BackendUnavailable:
            pass  # the figures stay as last seen; fan-out logs the outage
        except Exception:  # the sample's boundary: the next round must still run
            raise_if_cancelled()
            logger.exception("could not report the change-log lag")

    def _reported(self, lag: dict[int, tuple[int, float]]) -> None:
        """Set the gauges: ``lag`` per partition held; a partition no longer held reports 0, so the
        holder's figure is the largest of the deployment (``prometheus.GAUGE_MODES``)."""
        self._leases.set(len(lag))
        for partition in lag.keys() - self._lag.keys():
            self._lag[partition] = (
                self._metrics.gauge("mcp_broker_changelog_lag_entries", partition=str(partition)),
                self._metrics.gauge("mcp_broker_changelog_lag_seconds", partition=str(partition)))
        for partition, (entries, seconds) in self._lag.items():
            figures = lag.get(partition, (0, 0.0))
            entries.set(figures[0])
            seconds.set(figures[1])

    async def _process_to_the_end(self, batch: Sequence[tuple[str, Change]], read_under: str) -> None:
        """``process``, which a shutdown (a cancellation) lets finish for ``fanout_stop_timeout``.

        A batch cut short after its append leaves its changes pending, and the next holder
        redoes it: the inboxes and the listen broadcast skip what they already had, but the
        partition waits for that redo. So a stopping consumer finishes what it has
        taken, then gives its leases up. Cancellations that come meanwhile (a shutdown repeats
        them) do not shorten the bound; past it the batch is abandoned to the next holder.
        """
        if not batch:
            return
        work = asyncio.ensure_future(self.process(batch, read_under) if self.tracer is None
                                     else self._traced(self.tracer, batch, read_under))
        try:
            await asyncio.shield(work)
        except asyncio.CancelledError:
            if work.done():
                raise
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.settings.fanout_stop_timeout
            while not work.done() and (left := deadline - loop.time()) > 0:
                try:
                    await asyncio.wait([work], timeout=left)
                except asyncio.CancelledError:
                    continue
            if not work.done():
                work.cancel()
                logger.warning("fan-out stopped with a batch of %d changes unfinished; the next holder redoes it",
                               len(batch))
            elif not work.cancelled() and work.exception() is not None:
                logger.warning("fan-out stopped on a failed batch (%s); the next holder redoes it", work.exception())
            raise

    async def _traced(self, tracer: Tracer, batch: Sequence[tuple[str, Change]], read_under: str) -> None:
        """``process`` in a span per change, each continuing the trace of its publish."""
        traced, finish = tracer.fanning_out(batch)
        try:
            await self.process(traced, read_under)
        except BaseException as exc:
            finish(None, exc)
            raise
        finish(None, None)

    async def _consume(self) -> None:
        settings = self.settings
        backoff = 0.05
        #: The first change of the batch that failed last, and how many times in a row it did.
        failing: str | None = None
        attempts = 0
        loop = asyncio.get_running_loop()
        since = loop.time()
        #: When the backend first did not answer, while it does not; None while it does.
        outage: float | None = None
        while True:
            batch: Sequence[tuple[str, Change]] = ()
            try:
                # A batch that failed stays pending, and the backend hands it out again before
                # anything newer: a URI's frames keep their order.
                # The batch stays in hand across a restart that empties the store: what it was read
                # under tells the appends which sessions were made since (``Backend.deliver``).
                read_under = self.sessions.epoch
                batch = await self.changelog.read(self.name, settings.fanout_batch, READ_BLOCK_MS)
                await self._process_to_the_end(batch, read_under)
                if outage is not None:
                    logger.info("fan-out resumed: the backend answers again, %.1fs after fan-out first found it "
                                "unavailable", loop.time() - outage)
                    outage = None
                failing, attempts = None, 0
                backoff = 0.05
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the fan-out boundary: log, back off, keep the worker alive
                raise_if_cancelled()
                if isinstance(exc, BackendUnavailable):
                    outage = loop.time() if outage is None else outage
                    logger.warning("fan-out paused: backend unavailable (%s); retrying in %.2fs", exc, backoff)
                elif not batch:
                    logger.exception("fan-out could not read the change log; retrying in %.2fs", backoff)
                else:
                    if batch[0][0] != failing:
                        failing, attempts, since = batch[0][0], 0, loop.time()
                    attempts += 1
                    if attempts < POISON_ATTEMPTS or loop.time() - since < POISON_SECONDS:
                        logger.exception("fan-out batch failed; retrying it in %.2fs", backoff)
                    else:
                        # Not the backend: the batch itself fails, every time, for a while.
                        # Dropped (its ids in the log) rather than holding up everything after it.
                        logger.exception("fan-out batch of %d changes failed %d times in %.0fs; dropping %s",
                                         len(batch), attempts, loop.time() - since,
                                         ", ".join(cid for cid, _ in batch))
                        self._dropped.inc()
                        try:
                            await self.changelog.ack([cid for cid, _ in batch])
                        except Exception:  # it is handed out again and tried once more
                            raise_if_cancelled()
                            logger.exception("could not drop the failing batch")
                        failing, attempts = None, 0
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
