"""The Prometheus binding of the metrics seam: every ``CATALOG`` instrument on ``prometheus_client``.

``PrometheusMetrics`` creates every instrument of ``broker.metrics.CATALOG`` up front, in a
registry of its own (never the process-wide default one, so two brokers in one process, as the
tests run them, do not collide), and hands out bound children (``.labels(**labels)``, made once
per label set and cached). ``render`` is what ``GET /metrics`` serves.

One worker or many. ``mcp-broker serve --workers N`` runs N processes behind one port, and a
scrape lands on any one of them; yet it must cover all of them. So with several workers the
binding runs in prometheus_client's multiprocess mode: ``prepare_processes`` (called by the CLI
in the parent, before uvicorn spawns the workers) makes a fresh private directory and sets
``PROMETHEUS_MULTIPROC_DIR``; each worker then writes its values into files of that directory
(``prometheus_client`` picks the file-backed values when it is imported with the variable set,
which a spawned worker is), and ``render`` merges every worker's files with a
``MultiProcessCollector``. Counters and histograms are summed over every process that ever
ran (so a restarted worker's counts are not lost); each gauge is merged by the mode that
fits what it measures (``GAUGE_MODES``). A worker that exits should have its live gauges
dropped (``process_exited``); a worker that stops cleanly does that itself (``close``).
A single process needs no directory: its values live in its memory.

Beside the catalog, each worker's process and Python runtime figures (memory, CPU, descriptors,
GC): prometheus_client's collectors, per worker in either mode (``broker.ops.process_metrics``).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from collections.abc import Mapping
from typing import Any, Final, Literal

from prometheus_client import CollectorRegistry, disable_created_metrics, generate_latest
from prometheus_client import Counter as PromCounter
from prometheus_client import Gauge as PromGauge
from prometheus_client import Histogram as PromHistogram
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from broker.metrics import CATALOG, Counter, Gauge, Histogram, Instrument, Sample, sample_periodically
from broker.ops.process_metrics import RECORD_EVERY, WorkerFigures, register

__all__ = ["CONTENT_TYPE", "ENV", "GAUGE_MODES", "PrometheusMetrics", "multiprocess_dir", "prepare_processes",
           "process_exited"]

#: The variable prometheus_client reads (at import) to keep its values in files, one set per process.
ENV: Final = "PROMETHEUS_MULTIPROC_DIR"

GaugeMode = Literal["all", "liveall", "min", "livemin", "max", "livemax", "sum", "livesum", "mostrecent",
                    "livemostrecent"]

#: How each gauge is merged over the worker processes of one ``serve --workers N`` (multiprocess
#: mode only). ``live*``: a process that exited no longer counts (``process_exited``).
GAUGE_MODES: Final[dict[str, GaugeMode]] = {
    # Per process: the streams and sources each one holds add up to the host's.
    "mcp_broker_streams_open": "livesum",
    "mcp_broker_sources_running": "livesum",
    # Per process too: each worker holds its own share of the partitions.
    "mcp_broker_fanout_leases_held": "livesum",
    # A deployment-wide figure every worker counts for itself (the store's session count): summing
    # would multiply it by the workers; the most recent count is the freshest one.
    "mcp_broker_sessions_open": "livemostrecent",
    "mcp_broker_feeds_open": "livemostrecent",
    # Reported by the partition's fan-out holder; every other worker reports 0 for a partition it
    # does not hold (it sets 0 when it loses the lease), so the largest live value is the holder's.
    "mcp_broker_changelog_lag_entries": "livemax",
    "mcp_broker_changelog_lag_seconds": "livemax",
}

#: The text format every Prometheus reads (2.x and 3.x alike): the names are plain ASCII, so the body
#: is the same as in the newer 1.0.0 format.
CONTENT_TYPE: Final = CONTENT_TYPE_PLAIN_0_0_4

_created_dir: str | None = None


def multiprocess_dir() -> str | None:
    """The directory of multiprocess mode when this process runs in it, else None."""
    path = os.environ.get(ENV)
    return path if path and os.path.isdir(path) else None


def prepare_processes(workers: int) -> None:
    """Call in the parent, before worker processes are started: with ``workers > 1``, a fresh private
    directory for every worker's values (removed when the parent exits) in ``PROMETHEUS_MULTIPROC_DIR``.

    Fresh each time: files another run left behind would add its counts to this one's. A single
    process needs nothing (its values stay in memory), and nothing is done for it.
    """
    global _created_dir
    if workers <= 1:
        return
    if _created_dir is not None:
        shutil.rmtree(_created_dir, ignore_errors=True)
    _created_dir = path = tempfile.mkdtemp(prefix="mcp-broker-metrics-")  # mode 0700: this user's only
    os.environ[ENV] = path
    atexit.register(shutil.rmtree, path, ignore_errors=True)


def process_exited(pid: int) -> None:
    """A worker process ``pid`` is gone (exited, or killed): its ``live*`` gauges stop counting.

    For the parent (the supervisor) to call when it sees a worker exit, by whatever cause; a
    no-op outside multiprocess mode. Counters and histograms of the process keep counting in the
    sums, as they should.
    """
    path = multiprocess_dir()
    if path is not None:
        mark_process_dead(pid, path)  # type: ignore[no-untyped-call]


class _Value:
    """A counter's or gauge's value in one process, without prometheus_client's lock and checks.

    Put in place of the child's own value (``_value``), so the child's samples read it. The broker
    counts on its event loop's thread alone, and a scrape renders on that thread too, so no lock
    is needed; prometheus_client's own path (two calls, a negativity check, a lock) cost about
    1,500 instructions per increment, a tenth of a frame's whole cost in fan-out. Not used in
    multiprocess mode, where the values live in files.
    """

    __slots__ = ("_value",)

    def __init__(self) -> None:
        self._value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self._value += amount

    def dec(self, amount: float = 1.0) -> None:
        self._value -= amount

    def set(self, value: float, timestamp: float | None = None) -> None:
        self._value = value

    def get(self) -> float:
        return self._value

    def set_exemplar(self, exemplar: object) -> None:
        return None

    def get_exemplar(self) -> None:
        return None


def _name(name: str, kind: str) -> str:
    # prometheus_client adds ``_total`` to a counter's samples itself, and refuses it in the name.
    return name.removesuffix("_total") if kind == "counter" else name


class PrometheusMetrics:
    """A ``broker.metrics.Metrics`` binding on prometheus_client; ``render()`` is the exposition.

    Every instrument is created up front, so a scrape shows each unlabelled series (zeros
    included) from the start; labelled ones appear with their first use.
    """

    def __init__(self, catalog: Mapping[str, Instrument] = CATALOG) -> None:
        # No ``*_created`` series (a timestamp beside every counter and histogram child, which doubles
        # the exposition; multiprocess mode has none either, so both modes show the same series).
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry(auto_describe=True)
        self.catalog = catalog
        self._instruments: dict[str, Any] = {}
        self._children: dict[tuple[str, str, tuple[tuple[str, str], ...]], Any] = {}
        self._multiprocess = multiprocess_dir()
        for name, spec in catalog.items():
            self._instruments[name] = self._make(name, spec)
        #: This worker's process figures, copied where every worker's are merged; None: read at each scrape.
        self._worker: WorkerFigures | None = None
        if self._multiprocess is None:
            register(self.registry)
        else:
            self._worker = WorkerFigures(self.registry)
            self._worker.record()

    def _make(self, name: str, spec: Instrument) -> Any:
        labels = tuple(spec.labels)
        if spec.kind == "counter":
            return PromCounter(_name(name, "counter"), spec.help, labels, registry=self.registry)
        if spec.kind == "gauge":
            return PromGauge(name, spec.help, labels, registry=self.registry,
                             multiprocess_mode=GAUGE_MODES.get(name, "livesum"))
        if spec.buckets:
            return PromHistogram(name, spec.help, labels, registry=self.registry, buckets=spec.buckets)
        return PromHistogram(name, spec.help, labels, registry=self.registry)

    def _child(self, kind: str, name: str, labels: dict[str, str]) -> Any:
        key = (kind, name, tuple(sorted(labels.items())))
        child = self._children.get(key)
        if child is None:
            spec = self.catalog[name]  # a KeyError for a name the catalog lacks
            if spec.kind != kind:
                raise ValueError(f"{name} is a {spec.kind}, not a {kind}")
            instrument = self._instruments[name]
            child = instrument.labels(**labels) if spec.labels else instrument
            if kind != "histogram" and self._multiprocess is None:
                child._value = _Value()  # the child's samples read it; callers hold it alone
                child = child._value
            self._children[key] = child
        return child

    def counter(self, name: str, **labels: str) -> Counter:
        child: Counter = self._child("counter", name, labels)
        return child

    def gauge(self, name: str, **labels: str) -> Gauge:
        child: Gauge = self._child("gauge", name, labels)
        return child

    def histogram(self, name: str, **labels: str) -> Histogram:
        child: Histogram = self._child("histogram", name, labels)
        return child

    async def sample_every(self, seconds: float, sample: Sample) -> None:
        worker = self._worker
        if worker is None:
            await sample_periodically(seconds, sample)
            return

        async def and_the_workers_figures() -> None:
            # Every periodic round of a worker also records its process figures (at most once a
            # second over all rounds), so a scrape answered by another worker shows them fresh.
            await sample()
            worker.record(at_most_every=RECORD_EVERY)

        await sample_periodically(seconds, and_the_workers_figures)

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type: of every worker process in multiprocess mode."""
        if self._multiprocess is None:
            return generate_latest(self.registry), CONTENT_TYPE
        if self._worker is not None:
            self._worker.record()  # this worker's own figures, as of now
        merged = CollectorRegistry()
        MultiProcessCollector(merged, path=self._multiprocess)  # type: ignore[no-untyped-call]
        return generate_latest(merged), CONTENT_TYPE

    def close(self) -> None:
        """This process stops serving: its live gauges leave the merged figures (multiprocess mode)."""
        if self._multiprocess is not None:
            mark_process_dead(os.getpid(), self._multiprocess)  # type: ignore[no-untyped-call]
