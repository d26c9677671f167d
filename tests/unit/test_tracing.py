"""When tracing is on, and which trace context a publish request carries into its changes."""

from __future__ import annotations

import logging

import pytest

from broker.ops.tracing import enabled, header_context, valid_tracestate
from broker.runtime import default_tracer

PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.mark.parametrize(("environ", "on"), [
    ({}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, True),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, True),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "  "}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_SDK_DISABLED": "true"}, False),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318", "OTEL_TRACES_EXPORTER": "none"}, False),
])
def test_tracing_is_on_exactly_when_an_otlp_endpoint_is_set_and_not_disabled(environ: dict[str, str],
                                                                               on: bool) -> None:
    assert enabled(environ) is on


def test_without_an_endpoint_a_broker_has_no_tracer(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    assert default_tracer() is None


def test_a_valid_traceparent_header_becomes_the_changes_context_with_its_tracestate() -> None:
    assert header_context(PARENT, "vendor=abc") == {"traceparent": PARENT, "tracestate": "vendor=abc"}
    assert header_context(PARENT.upper(), None) == {"traceparent": PARENT}


@pytest.mark.parametrize("value", [
    "", "garbage", PARENT.replace("00-", "ff-", 1), PARENT[:-1],
    "00-00000000000000000000000000000000-b7ad6b7169203331-01",  # a zero trace id
    "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",  # a zero parent id
    "00-0af7651916cd43dd8448eb211c80319g-b7ad6b7169203331-01",  # not hex
])
def test_an_invalid_traceparent_header_is_ignored(value: str) -> None:
    assert header_context(value, "vendor=abc") is None
    assert header_context(None, None) is None


def test_an_endpoint_without_the_tracing_extra_installed_stops_the_command_with_one_line(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import importlib.util

    from broker.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name.startswith("opentelemetry") else real(name, *args))
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    assert main(["config", "check"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["mcp-broker: bad setting, not started: OTEL_EXPORTER_OTLP_ENDPOINT asks for traces, but "
                     "OpenTelemetry's SDK and OTLP/HTTP exporter are not installed: pip install "
                     "'mcp-broker[tracing]' (docs/TRACING.md)"]


@pytest.mark.parametrize("value", [
    "vendor=abc", "a=1, b=2", "tenant@system=v", " a=1 ,,", "k=" + "v" * 255,
    ",".join(f"k{i}=v" for i in range(32)),
])
def test_a_tracestate_of_the_w3c_grammar_is_valid(value: str) -> None:
    assert valid_tracestate(value)


@pytest.mark.parametrize("value", [
    "a=1\nWARNING forged log line", "a=1\r\nx=2", "Vendor=abc", "a=1,a=2", "a=", "=1", "a=1=2", "a=é",
    ",".join(f"k{i}=v" for i in range(33)), "k=" + "v" * 600,
])
def test_any_other_tracestate_is_invalid_and_never_stored_from_a_header(value: str) -> None:
    assert not valid_tracestate(value)
    assert header_context(PARENT, value) == {"traceparent": PARENT}


def test_a_bad_trace_context_in_a_message_is_dropped_without_a_log_line(caplog: pytest.LogCaptureFixture) -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from broker.ops.otel import OtelTracer

    exporter = InMemorySpanExporter()
    tracer = OtelTracer("test", exporter)
    caplog.set_level(logging.DEBUG)
    for meta in ({"traceparent": PARENT, "tracestate": "a=1\nWARNING forged"},
                 {"traceparent": PARENT, "tracestate": ",".join(f"k{i}=v" for i in range(40))},
                 {"traceparent": PARENT + "-\nforged", "tracestate": "a=1"},
                 {"traceparent": "x" * 600}):
        tracer.request("ping", {"_meta": meta}, None)(None, None)
    tracer.close()
    assert [record.getMessage() for record in caplog.records if record.name.startswith("opentelemetry")] == []
    spans = exporter.get_finished_spans()
    assert [(span.parent.span_id if span.parent else None) for span in spans[:2]] == [0xb7ad6b7169203331] * 2
    assert all(not span.context.trace_state for span in spans)


def test_a_publish_span_context_is_left_out_of_a_meta_it_would_push_past_the_bound() -> None:
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from broker.changes import Change
    from broker.ops.otel import OtelTracer

    tracer = OtelTracer("test", InMemorySpanExporter())
    near = Change("default", "x:a", meta={"pad": "x" * 80})  # 92 bytes encoded
    [kept], finish = tracer.publishing([near], "python", 100)
    [carried], finish_too = tracer.publishing([near], "python", 8192)
    finish(None, None)
    finish_too(None, None)
    tracer.close()
    assert kept.meta == {"pad": "x" * 80}
    assert carried.meta is not None and set(carried.meta) == {"pad", "traceparent"}
