"""The metrics seam as the wiring uses it: a binding that records, and the null one that does nothing at all."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from broker.config import Settings
from broker.metrics import NO_METRICS, Metrics, NoMetrics, complete
from broker.ops.prometheus import PrometheusMetrics
from broker.runtime import Broker
from examples.counting_metrics import CountingMetrics


async def test_no_metrics_takes_no_sample_has_no_exposition_and_nothing_to_close() -> None:
    taken: list[int] = []

    async def sample() -> None:
        taken.append(1)

    await asyncio.wait_for(NO_METRICS.sample_every(0.0, sample), 1)  # returns at once: nothing would record it
    assert taken == []
    assert NO_METRICS.render() is None
    NO_METRICS.close()


async def test_a_binding_with_only_instruments_is_completed_with_samples_on_the_interval() -> None:
    binding = CountingMetrics()
    metrics = complete(binding)
    assert isinstance(metrics, Metrics) and not isinstance(binding, Metrics)
    assert metrics.render() is None  # no exposition: GET /metrics answers 404
    metrics.close()
    rounds = asyncio.Event()
    taken: list[int] = []

    async def sample() -> None:
        metrics.gauge("mcp_broker_sessions_open").set(7)
        taken.append(1)
        if len(taken) == 2:
            rounds.set()

    task = asyncio.create_task(metrics.sample_every(0.0, sample))
    await asyncio.wait_for(rounds.wait(), 5)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert binding.get("mcp_broker_sessions_open") == 7  # the binding's own instruments took the figures


def test_a_complete_binding_is_used_as_it_is() -> None:
    prometheus = PrometheusMetrics()
    assert complete(prometheus) is prometheus
    body, content_type = prometheus.render()
    assert b"mcp_broker_sessions_open" in body and content_type.startswith("text/plain")


async def test_a_broker_samples_its_open_sessions_for_a_binding_that_records() -> None:
    binding = CountingMetrics()
    counted = asyncio.Event()
    broker = Broker(Settings(_env_file=None), metrics=binding)  # type: ignore[call-arg]
    count = broker.backend.sessions.count

    async def counting() -> int:
        counted.set()
        return await count()

    broker.backend.sessions.count = counting  # type: ignore[method-assign]
    await broker.start()
    try:
        await asyncio.wait_for(counted.wait(), 5)
    finally:
        await broker.stop()
    assert ("mcp_broker_sessions_open", ()) in binding.values  # set from the count, 0 sessions


class Clock:
    """``time.perf_counter`` as ``broker.methods`` sees it, counting its reads."""

    def __init__(self) -> None:
        self.reads = 0

    def perf_counter(self) -> float:
        self.reads += 1
        return float(self.reads)


def test_without_metrics_or_tracing_a_request_reads_no_clock_and_makes_no_closure(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import broker.methods

    clock = Clock()
    monkeypatch.setattr(broker.methods, "time", clock)
    for metrics in (NO_METRICS, complete(NoMetrics())):  # the null binding, however it is wrapped
        methods = Broker(Settings(_env_file=None, metrics=False), metrics=metrics).methods  # type: ignore[call-arg]
        ends = {id(methods.begin("ping", {})) for _ in range(3)}
        for method in ("ping", "resources/read"):
            methods.begin(method, {})(None)
        assert clock.reads == 0 and len(ends) == 1
    binding = CountingMetrics()
    methods = Broker(Settings(_env_file=None), metrics=binding).methods  # type: ignore[call-arg]
    methods.begin("ping", {})(None)
    assert clock.reads == 2
    assert binding.get("mcp_server_operation_duration_seconds_count", mcp_method_name="ping") == 1
