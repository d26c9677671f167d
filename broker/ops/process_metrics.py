"""Process and Python runtime metrics of each worker: prometheus_client's own collectors, per process.

prometheus_client's ``ProcessCollector`` (resident and virtual memory, CPU seconds, open and
maximum descriptors, start time), ``GCCollector`` (collections, collected and uncollectable
objects, per generation) and ``PlatformCollector`` (``python_info``) read the process that
renders the exposition. With one process that is the whole story, and they are registered as
they are (``register``): the figures are read at each scrape.

With ``serve --workers N`` a scrape lands on one worker but must show every worker's figures,
which only each worker can read. So each worker copies its collectors' samples into gauges of
the multiprocess files (``WorkerFigures.record``), merged with ``liveall``: one series per live
worker, told apart by the ``pid`` label prometheus_client adds, gone when the worker stops.
A worker records them at every scrape it answers and every few seconds besides
(``PrometheusMetrics.sample_every``), so another worker's figures are at most that old. In that
mode every figure is a gauge (a counter's samples are summed over the processes, which would
lose the worker), under the same names: ``process_cpu_seconds_total`` is then a gauge per worker.
"""

from __future__ import annotations

import time
from typing import Final

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector
from prometheus_client import Gauge as PromGauge

__all__ = ["RECORD_EVERY", "WorkerFigures", "register"]

#: Seconds between two records of a worker's figures by its periodic rounds (a scrape records at once).
RECORD_EVERY: Final = 1.0


def _collectors(registry: CollectorRegistry) -> None:
    ProcessCollector(registry=registry)
    GCCollector(registry=registry)
    PlatformCollector(registry=registry)


def register(registry: CollectorRegistry) -> None:
    """The process, GC and platform collectors, read at each scrape (one process)."""
    _collectors(registry)


class WorkerFigures:
    """This worker's process and runtime figures, copied into multiprocess gauges (``liveall``)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._source = CollectorRegistry(auto_describe=False)
        _collectors(self._source)
        self._registry = registry
        self._gauges: dict[str, PromGauge] = {}
        self._last = 0.0

    def record(self, *, at_most_every: float = 0.0) -> None:
        """Read the collectors and set the gauges (unless recorded less than ``at_most_every`` seconds ago)."""
        now = time.monotonic()
        if at_most_every and now - self._last < at_most_every:
            return
        self._last = now
        for family in self._source.collect():
            for sample in family.samples:
                gauge = self._gauges.get(sample.name)
                if gauge is None:
                    gauge = self._gauges[sample.name] = PromGauge(
                        sample.name, family.documentation, tuple(sample.labels), registry=self._registry,
                        multiprocess_mode="liveall")
                (gauge.labels(**sample.labels) if sample.labels else gauge).set(sample.value)
