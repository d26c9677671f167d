"""A ``Metrics`` binding in one file: every instrument counts into one dict, keyed by name and labels.

Good for tests and for a look at what the broker reports; a Prometheus binding has the same
shape (``counter(name, **labels)`` is ``prometheus_client``'s ``Counter(...).labels(**labels)``,
one object per ``broker.metrics.CATALOG`` entry). Wire it in with one line::

    broker = Broker(settings, metrics=CountingMetrics())
"""

from __future__ import annotations

from collections import defaultdict

from broker.metrics import CATALOG

Key = tuple[str, tuple[tuple[str, str], ...]]


def key(name: str, labels: dict[str, str]) -> Key:
    return name, tuple(sorted(labels.items()))


class _Instrument:
    """One instrument with its label values bound."""

    def __init__(self, values: dict[Key, float], name: str, labels: dict[str, str]) -> None:
        wanted = set(CATALOG[name].labels)  # a KeyError for a name the catalog lacks
        if set(labels) != wanted:
            raise ValueError(f"{name} takes the labels {sorted(wanted)}, not {sorted(labels)}")
        self.values = values
        self.key = key(name, labels)
        self.name, self.labels = name, labels

    def inc(self, amount: float = 1.0) -> None:
        self.values[self.key] += amount

    def dec(self, amount: float = 1.0) -> None:
        self.values[self.key] -= amount

    def set(self, value: float) -> None:
        self.values[self.key] = value

    def observe(self, value: float) -> None:  # a histogram's count and sum
        self.values[key(self.name + "_count", self.labels)] += 1
        self.values[key(self.name + "_sum", self.labels)] += value


class CountingMetrics:
    def __init__(self) -> None:
        self.values: dict[Key, float] = defaultdict(float)

    def counter(self, name: str, **labels: str) -> _Instrument:
        return _Instrument(self.values, name, labels)

    gauge = histogram = counter

    def get(self, name: str, **labels: str) -> float:
        return self.values.get(key(name, labels), 0.0)
