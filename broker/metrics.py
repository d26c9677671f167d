"""The metrics seam: counters, gauges and histograms behind a small interface, off by default.

Components get a ``Metrics`` through their constructor and ask it for their instruments once,
when they are built, with their label values bound (``metrics.counter(name, era="legacy")``,
as ``prometheus_client``'s ``labels()`` does); the hot path then calls ``inc`` / ``set`` /
``observe`` on an instrument it already holds, one method call with no keyword arguments, and
with ``NO_METRICS`` (the default) that call does nothing. Labels known only later (an end
reason) ask for the instrument then, off the hot path. A binding (Prometheus, StatsD, a test's
recorder) implements ``Metrics`` in one file and is wired in with one line:
``Broker(settings, metrics=MyMetrics())``.

Every instrument the broker reports is declared here, in ``CATALOG``, with its kind, help text
and label names, so the names exist once and a binding can create them all up front (and a
scrape shows every series from the start, zeros included). Label values are always short
and bounded: kinds, eras, reasons, never URIs or session ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal, Protocol

__all__ = [
    "CATALOG",
    "NO_METRICS",
    "Counter",
    "Gauge",
    "Histogram",
    "Instrument",
    "Metrics",
    "NoMetrics",
]


class Counter(Protocol):
    def inc(self, amount: float = 1.0) -> None: ...


class Gauge(Protocol):
    def set(self, value: float) -> None: ...

    def inc(self, amount: float = 1.0) -> None: ...

    def dec(self, amount: float = 1.0) -> None: ...


class Histogram(Protocol):
    def observe(self, value: float) -> None: ...


class Metrics(Protocol):
    """Where instruments come from: ``name`` is one of ``CATALOG``'s, ``labels`` its label values."""

    def counter(self, name: str, **labels: str) -> Counter: ...

    def gauge(self, name: str, **labels: str) -> Gauge: ...

    def histogram(self, name: str, **labels: str) -> Histogram: ...


@dataclass(frozen=True, slots=True)
class Instrument:
    kind: Literal["counter", "gauge", "histogram"]
    help: str
    labels: Sequence[str] = ()


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
        "counter", "Notifications written to clients, by era", ("era",)),
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
    "mcp_broker_http_answers_total": Instrument(
        "counter", "HTTP answers by route and status (a stream counts when it starts)", ("route", "status")),
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


class NoMetrics:
    """The default binding: instruments that record nothing."""

    __slots__ = ()

    def counter(self, name: str, **labels: str) -> Counter:
        return _NOTHING

    def gauge(self, name: str, **labels: str) -> Gauge:
        return _NOTHING

    def histogram(self, name: str, **labels: str) -> Histogram:
        return _NOTHING


NO_METRICS: Final = NoMetrics()
