"""A ``Metrics`` binding in one file: every instrument counts into one dict, keyed by name and labels.

Good for tests and for a look at what the broker reports; a Prometheus binding has the same
shape (one ``prometheus_client`` object per ``broker.metrics.CATALOG`` entry). Wire it in with
one line::

    broker = Broker(settings, metrics=CountingMetrics())
"""

from __future__ import annotations

from collections import defaultdict

from broker.metrics import CATALOG


class _Instrument:
    def __init__(self, name: str, values: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> None:
        if name not in CATALOG:
            raise KeyError(f"{name} is not in broker.metrics.CATALOG")
        self.name = name
        self.values = values

    def _key(self, labels: dict[str, str]) -> tuple[str, tuple[tuple[str, str], ...]]:
        return self.name, tuple(sorted(labels.items()))

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        self.values[self._key(labels)] += amount

    def dec(self, amount: float = 1.0, **labels: str) -> None:
        self.values[self._key(labels)] -= amount

    def set(self, value: float, **labels: str) -> None:
        self.values[self._key(labels)] = value

    def observe(self, value: float, **labels: str) -> None:  # a histogram's count and sum
        self.values[self._key({**labels, "stat": "count"})] += 1
        self.values[self._key({**labels, "stat": "sum"})] += value


class CountingMetrics:
    def __init__(self) -> None:
        self.values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = defaultdict(float)

    def counter(self, name: str) -> _Instrument:
        return _Instrument(name, self.values)

    gauge = histogram = counter

    def get(self, name: str, **labels: str) -> float:
        return self.values.get((name, tuple(sorted(labels.items()))), 0.0)
