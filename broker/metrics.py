"""The metrics seam: counters, gauges and histograms behind a small interface, off by default.

Components get a ``Metrics`` through their constructor and ask it for their instruments once,
when they are built, with their label values bound (``metrics.counter(name, era="legacy")``,
as ``prometheus_client``'s ``labels()`` does); the hot path then calls ``inc`` / ``set`` /
``observe`` on an instrument it already holds, one method call with no keyword arguments, and
with ``NO_METRICS`` (the default) that call does nothing. Labels known only later (an end
reason) ask for the instrument then, off the hot path. A binding (Prometheus, StatsD, a test's
recorder) implements ``Instruments`` in one file and is wired in with one line:
``Broker(settings, metrics=MyMetrics())``.

The wiring asks three more things of the binding (``Metrics``): to sample figures that are
counted off the request path (a store's session count, the change log's lag) on an interval,
its exposition for ``GET /metrics``, and to let go when the process stops. ``NO_METRICS`` does
none of them, and a sample it is given never runs, so nothing is counted for nobody; nothing
in the broker asks whether metrics are on. An instrument says whether it keeps what it is given
(``records``): where measuring costs more than the call (a request's duration), the measure is
skipped for an instrument of ``NoMetrics``. A binding that lacks any of the three gets the
default (``complete``): samples on the interval, no exposition, nothing to close.

Every instrument the broker reports is declared here, in ``CATALOG``, with its kind, help text
and label names, so the names exist once and a binding can create them all up front (and a
scrape shows every series from the start, zeros included). Label values are always short
and bounded: kinds, eras, reasons, never URIs or session ids.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Final, Literal, Protocol, runtime_checkable

__all__ = [
    "CATALOG",
    "NO_METRICS",
    "OTHER_TENANTS",
    "Counter",
    "Gauge",
    "Histogram",
    "Instrument",
    "Instruments",
    "MCP_DURATION_BUCKETS",
    "Metrics",
    "NoMetrics",
    "Sample",
    "TenantCounter",
    "TenantLabels",
    "accepted_at",
    "complete",
    "records",
    "sample_periodically",
]


class Counter(Protocol):
    def inc(self, amount: float = 1.0) -> None: ...


class Gauge(Protocol):
    def set(self, value: float) -> None: ...

    def inc(self, amount: float = 1.0) -> None: ...

    def dec(self, amount: float = 1.0) -> None: ...


class Histogram(Protocol):
    def observe(self, value: float) -> None: ...


#: One round of figures counted off the request path: it reads them and sets its gauges.
Sample = Callable[[], Awaitable[None]]


class Instruments(Protocol):
    """Where instruments come from: ``name`` is one of ``CATALOG``'s, ``labels`` its label values.

    All that a binding must implement; ``complete`` makes a ``Metrics`` of it.
    """

    def counter(self, name: str, **labels: str) -> Counter: ...

    def gauge(self, name: str, **labels: str) -> Gauge: ...

    def histogram(self, name: str, **labels: str) -> Histogram: ...


@runtime_checkable
class Metrics(Instruments, Protocol):
    """The seam as the broker uses it: the instruments, and what the wiring asks of the binding besides."""

    async def sample_every(self, seconds: float, sample: Sample) -> None:
        """Run ``sample`` now and every ``seconds`` after, until cancelled (``sample_periodically``);
        a binding that records nothing returns at once, and the figures are never counted."""

    def render(self) -> tuple[bytes, str] | None:
        """The exposition ``GET /metrics`` serves, and its content type; None: there is none (404)."""

    def close(self) -> None:
        """The process stops reporting (a worker's live gauges leave the merged figures)."""


async def sample_periodically(seconds: float, sample: Sample) -> None:
    """``sample`` now and every ``seconds`` after, until cancelled: ``Metrics.sample_every`` of a binding
    that records. ``sample`` handles its own failures (the next round must still run)."""
    while True:
        await sample()
        await asyncio.sleep(seconds)


def complete(binding: Instruments) -> Metrics:
    """``binding`` as the whole seam: its own ``sample_every``, ``render`` and ``close`` where it has them,
    the defaults where it does not (samples on the interval, no exposition, nothing to close)."""
    if isinstance(binding, Metrics):
        return binding
    return _Completed(binding)


class _Completed:
    """A binding that implements only some of ``Metrics``, with the defaults for the rest."""

    def __init__(self, binding: Instruments) -> None:
        self.binding = binding
        # The binding is the user's object: asked once, here, what else it has.
        self._sample_every: Callable[[float, Sample], Awaitable[None]] = getattr(
            binding, "sample_every", sample_periodically)
        self._render: Callable[[], tuple[bytes, str] | None] = getattr(binding, "render", lambda: None)
        self._close: Callable[[], None] = getattr(binding, "close", lambda: None)

    def counter(self, name: str, **labels: str) -> Counter:
        return self.binding.counter(name, **labels)

    def gauge(self, name: str, **labels: str) -> Gauge:
        return self.binding.gauge(name, **labels)

    def histogram(self, name: str, **labels: str) -> Histogram:
        return self.binding.histogram(name, **labels)

    async def sample_every(self, seconds: float, sample: Sample) -> None:
        await self._sample_every(seconds, sample)

    def render(self) -> tuple[bytes, str] | None:
        return self._render()

    def close(self) -> None:
        self._close()


@dataclass(frozen=True, slots=True)
class Instrument:
    kind: Literal["counter", "gauge", "histogram"]
    help: str
    labels: Sequence[str] = ()
    #: A histogram's bucket bounds (seconds); empty: the binding's defaults.
    buckets: Sequence[float] = ()


#: The bounds the MCP semantic conventions of OpenTelemetry advise for ``mcp.server.operation.duration``.
MCP_DURATION_BUCKETS: Final = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


#: Every instrument, by name (Prometheus style: ``_total`` for counters, base units).
CATALOG: Final[dict[str, Instrument]] = {
    "mcp_broker_changes_published_total": Instrument(
        "counter", "Changes accepted into the change log, by source of the publish", ("source",)),
    "mcp_broker_changes_refused_total": Instrument(
        "counter", "Publishes refused before they were acknowledged, by reason", ("reason",)),
    "mcp_broker_fanout_changes_total": Instrument("counter", "Changes fan-out processed"),
    "mcp_broker_fanout_frames_total": Instrument(
        "counter", "Frames fan-out handed to session inboxes (repeats an inbox skips included)"),
    "mcp_broker_fanout_batch_seconds": Instrument("histogram", "Time fan-out spent on one batch"),
    "mcp_broker_fanout_dropped_batches_total": Instrument(
        "counter", "Batches fan-out dropped after failing repeatedly"),
    "mcp_broker_notifications_sent_total": Instrument(
        "counter", "Notifications written to clients, by era and kind (updated, list_changed)", ("era", "kind")),
    "mcp_broker_frames_replayed_total": Instrument(
        "counter", "Frames a legacy stream read back from its inbox rather than from a wake-up"),
    "mcp_broker_gap_resyncs_total": Instrument(
        "counter", "Streams and listens told to re-read everything (the gap rule), by era", ("era",)),
    "mcp_broker_stream_takeovers_total": Instrument("counter", "Legacy streams ended by a newer stream"),
    "mcp_broker_sessions_restored_total": Instrument(
        "counter", "Sessions put back by their open stream after the store lost its data"),
    "mcp_broker_streams_open": Instrument("gauge", "Open streams of this process, by era", ("era",)),
    "mcp_broker_streams_ended_total": Instrument("counter", "Streams that ended, by era and reason",
                                                 ("era", "reason")),
    "mcp_broker_backend_outages_total": Instrument(
        "counter", "Times open streams were ended because the backend stopped answering"),
    "mcp_broker_pubsub_reconnects_total": Instrument("counter", "Times the Redis pub/sub connection was re-made"),
    "mcp_broker_backend_data_losses_total": Instrument(
        "counter", "Times this process found the backend's data lost (a new epoch: Redis restarted empty)"),
    "mcp_broker_sources_running": Instrument("gauge", "Change sources this process runs now", ("source",)),
    "mcp_broker_upstream_requests_total": Instrument("counter", "Requests forwarded to an upstream, by method",
                                                     ("upstream", "method")),
    "mcp_broker_upstream_errors_total": Instrument(
        "counter", "Forwarded requests that failed, by kind (rpc, unavailable, timeout, busy)", ("upstream", "kind")),
    "mcp_broker_upstream_request_duration_seconds": Instrument(
        "histogram", "Seconds a request forwarded to an upstream took, answered or not", ("upstream",)),
    "mcp_broker_upstream_watched_uris": Instrument(
        "gauge", "URIs of an upstream its one watch covers, on the worker holding it", ("upstream",)),
    "mcp_broker_upstream_changes_total": Instrument(
        "counter", "Resource updates received from an upstream's watch", ("upstream",)),
    "mcp_broker_upstream_gaps_total": Instrument(
        "counter", "Times an upstream's watch may have missed something and published the gap rule's updates",
        ("upstream",)),
    "mcp_broker_sessions_open": Instrument(
        "gauge", "Live 2025 sessions of the deployment, as this worker last counted them"),
    "mcp_broker_feeds_open": Instrument(
        "gauge", "Live feeds of the deployment (sessions, resumable listens, poll and webhook subscriptions: "
                 "what MCP_BROKER_MAX_SESSIONS bounds), as this worker last counted them"),
    "mcp_broker_publish_to_frame_seconds": Instrument(
        "histogram", "From a change's acceptance into the change log to its frame's write to a client, by era",
        ("era",)),
    "mcp_broker_changelog_lag_entries": Instrument(
        "gauge", "Changes of a change-log partition not yet fanned out", ("partition",)),
    "mcp_broker_changelog_lag_seconds": Instrument(
        "gauge", "Age of the oldest change of a partition not yet fanned out", ("partition",)),
    "mcp_broker_changelog_trimmed_total": Instrument("counter", "Fanned-out changes trimmed from the change log"),
    "mcp_broker_inbox_trimmed_total": Instrument("counter", "Frames trimmed from session inboxes (length or age)"),
    "mcp_broker_fanout_leases_held": Instrument("gauge", "Change-log partitions this process fans out now"),
    "mcp_broker_backend_outage_seconds_total": Instrument(
        "counter", "Seconds the backend did not answer this process's health pings while streams were open"),
    "mcp_broker_tenant_sessions_created_total": Instrument(
        "counter", "Sessions created, per tenant (bounded: MCP_BROKER_METRICS_TENANT_LIMIT)", ("tenant",)),
    "mcp_broker_tenant_subscriptions_total": Instrument(
        "counter", "Subscriptions made, per tenant (bounded)", ("tenant",)),
    "mcp_broker_tenant_publishes_total": Instrument("counter", "Changes accepted, per tenant (bounded)", ("tenant",)),
    "mcp_broker_tenant_frames_total": Instrument("counter", "Frames fanned out, per tenant (bounded)", ("tenant",)),
    "mcp_broker_http_answers_total": Instrument(
        "counter", "HTTP answers by route and status (a stream counts when it starts)", ("route", "status")),
    # The MCP semantic conventions' ``mcp.server.operation.duration``, by ``mcp.method.name``.
    "mcp_server_operation_duration_seconds": Instrument(
        "histogram", "MCP request duration as observed on the server, from its receipt to its answer, by method",
        ("mcp_method_name",), MCP_DURATION_BUCKETS),
}


class _Nothing:
    """Every instrument, doing nothing."""

    __slots__ = ()

    def inc(self, amount: float = 1.0) -> None:
        return None

    def dec(self, amount: float = 1.0) -> None:
        return None

    def set(self, value: float) -> None:
        return None

    def observe(self, value: float) -> None:
        return None


_NOTHING: Final = _Nothing()


def records(instrument: Counter | Gauge | Histogram) -> bool:
    """Does ``instrument`` keep what it is given? False for the instruments of ``NoMetrics``, which do nothing,
    so that what only feeds it (a duration's two clock reads) can be skipped; True for any binding's own."""
    return not isinstance(instrument, _Nothing)


class NoMetrics:
    """The binding of a broker without metrics: instruments that record nothing, samples never taken,
    no exposition, nothing to close."""

    __slots__ = ()

    def counter(self, name: str, **labels: str) -> Counter:
        return _NOTHING

    def gauge(self, name: str, **labels: str) -> Gauge:
        return _NOTHING

    def histogram(self, name: str, **labels: str) -> Histogram:
        return _NOTHING

    async def sample_every(self, seconds: float, sample: Sample) -> None:
        return None  # nothing would record the figures: they are not counted

    def render(self) -> None:
        return None

    def close(self) -> None:
        return None


NO_METRICS: Final = NoMetrics()


#: The ``tenant`` label of every tenant beyond ``metrics_tenant_limit`` (and of all of them at 0).
OTHER_TENANTS: Final = "other"


class TenantLabels:
    """Which ``tenant`` label a tenant's counts go under: bounded, and stable for the process's life.

    The first ``limit`` tenants seen get a label of their own, and keep it; every later tenant
    counts as ``other``. With ``limit`` 0 (the default) no tenant name ever appears: every tenant
    is ``other``, and the per-tenant counters are plain totals. One object per process, shared by
    every per-tenant counter, so a tenant has the same label in all of them. Workers choose
    independently: on two workers the same tenant may be named on one and ``other`` on the other.
    """

    __slots__ = ("_assigned", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._assigned: dict[str, str] = {}

    def __call__(self, tenant: str) -> str:
        label = self._assigned.get(tenant)
        if label is None:
            if len(self._assigned) >= self.limit:
                return OTHER_TENANTS  # not remembered: memory stays bounded by ``limit``
            label = self._assigned[tenant] = tenant
        return label


class TenantCounter:
    """One per-tenant counter (``mcp_broker_tenant_*_total``), its bound children made once per label."""

    __slots__ = ("_by_label", "_labels", "_metrics", "_name", "_named")

    def __init__(self, metrics: Metrics, name: str, labels: TenantLabels) -> None:
        self._metrics = metrics
        self._name = name
        self._labels = labels
        #: Tenants with a label of their own (at most ``limit``), and every label's child.
        self._named: dict[str, Counter] = {}
        self._by_label: dict[str, Counter] = {}

    def inc(self, tenant: str, amount: float = 1.0) -> None:
        child = self._named.get(tenant)
        if child is None:
            label = self._labels(tenant)
            child = self._by_label.get(label)
            if child is None:
                child = self._by_label[label] = self._metrics.counter(self._name, tenant=label)
            if label == tenant:
                self._named[tenant] = child
        child.inc(amount)


def accepted_at(change_id: str) -> float | None:
    """When a change was accepted into the change log (Unix seconds), from its id; None for another form.

    Ids are ``[<partition>:]<ms>-<seq>`` on both backends (a Redis stream id's milliseconds, the
    memory log's clock the same way), so the acceptance time travels with the change for free.
    """
    entry = change_id.rpartition(":")[2]
    ms = entry.partition("-")[0]
    if not ms.isdigit() or len(ms) < 12:  # not a clock: ms since 1970 have had 12+ digits since 2001
        return None
    return int(ms) / 1000
