"""Traces in one process: the spans of a change's way to a listen, of MCP requests, and the trace
context notifications carry with tracing off as well."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from broker.config import Settings
from broker.methods import Call
from broker.ops.otel import OtelTracer
from broker.protocol import jsonrpc as rpc
from broker.runtime import Broker
from tests.dispatcher.conftest import TIMEOUT, Client, is_ack, is_update

TRACE = "0af7651916cd43dd8448eb211c80319c"
PARENT = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE}-{PARENT}-01"

Connect = Callable[..., Client]


class Traced:
    def __init__(self, broker: Broker, exporter: InMemorySpanExporter, tracer: OtelTracer) -> None:
        self.broker, self.exporter, self.tracer = broker, exporter, tracer

    async def span(self, name: str, trace_id: str = TRACE) -> ReadableSpan:
        """The span ``name`` of the trace, once it has ended (no fixed wait: polled until it is there)."""
        async with asyncio.timeout(TIMEOUT):
            while True:
                self.tracer.provider.force_flush()
                for span in self.exporter.get_finished_spans():
                    if span.name == name and f"{span.context.trace_id:032x}" == trace_id:
                        return span
                await asyncio.sleep(0.01)


@pytest.fixture
async def traced() -> AsyncIterator[Traced]:
    exporter = InMemorySpanExporter()
    tracer = OtelTracer("test", exporter)
    broker = Broker(Settings(_env_file=None, metrics=False), tracer=tracer)  # type: ignore[call-arg]
    await broker.start()
    yield Traced(broker, exporter, tracer)
    await broker.stop()


def parent_of(span: ReadableSpan) -> str:
    assert span.parent is not None
    return f"{span.parent.span_id:016x}"


def span_id(span: ReadableSpan) -> str:
    return f"{span.context.span_id:016x}"


async def test_a_change_with_a_trace_context_is_one_trace_from_its_publish_to_a_listens_notification(
        traced: Traced, connect: Connect) -> None:
    client = connect(traced.broker)
    await client.listen("l1", "x:traced")
    await client.until(is_ack("l1"))
    await traced.broker.publish("x:traced", meta={"traceparent": TRACEPARENT, "etag": "v2"})
    frame = await client.until(is_update("l1", "x:traced"))
    publish, fanout = await traced.span("publish"), await traced.span("fanout")
    delivery = await traced.span("notifications/resources/updated")
    assert parent_of(publish) == PARENT and publish.kind is SpanKind.PRODUCER
    assert parent_of(fanout) == span_id(publish) and fanout.kind is SpanKind.CONSUMER
    assert parent_of(delivery) == span_id(fanout) and delivery.kind is SpanKind.CLIENT
    assert frame["params"]["_meta"]["traceparent"] == f"00-{TRACE}-{span_id(fanout)}-01"
    assert frame["params"]["_meta"]["etag"] == "v2"
    assert delivery.attributes is not None and delivery.attributes["mcp.resource.uri"] == "x:traced"
    assert publish.attributes is not None and publish.attributes["mcp_broker.publish.source"] == "python"


async def test_a_change_without_a_context_starts_a_trace_its_notification_carries(
        traced: Traced, connect: Connect) -> None:
    client = connect(traced.broker)
    await client.listen("l1", "x:fresh")
    await client.until(is_ack("l1"))
    await traced.broker.publish("x:fresh")
    frame = await client.until(is_update("l1", "x:fresh"))
    trace_id = frame["params"]["_meta"]["traceparent"].split("-")[1]
    publish = await traced.span("publish", trace_id)
    assert publish.parent is None
    assert parent_of(await traced.span("fanout", trace_id)) == span_id(publish)


async def test_a_request_is_a_server_span_child_of_its_meta_or_else_of_its_traceparent_header(
        traced: Traced, connect: Connect) -> None:
    client = connect(traced.broker)
    await client.initialize()
    await client.initialized()
    answer = await client.request("resources/subscribe", {"uri": "x:a", "_meta": {"traceparent": TRACEPARENT}})
    assert "result" in answer
    subscribe = await traced.span("resources/subscribe")
    assert subscribe.kind is SpanKind.SERVER and parent_of(subscribe) == PARENT
    assert subscribe.attributes is not None and subscribe.attributes["mcp.method.name"] == "resources/subscribe"
    assert subscribe.attributes["mcp.resource.uri"] == "x:a"
    assert subscribe.attributes["mcp.session.id"] == client.server.session.id  # type: ignore[union-attr]

    other = "1" * 32
    headers = {"traceparent": f"00-{other}-{PARENT}-01"}
    call = Call(client.server.principal, False, client.server.session, headers.get)
    reply = await traced.broker.dispatcher.legacy(call, rpc.parse_message(
        {"jsonrpc": "2.0", "id": 9, "method": "resources/read", "params": {"uri": "x:missing"}}))
    assert reply is not None and b'"error"' in reply
    read = await traced.span("resources/read", other)
    assert parent_of(read) == PARENT
    assert read.attributes is not None and read.attributes["error.type"] == str(rpc.RESOURCE_NOT_FOUND)


async def test_with_tracing_off_a_notification_still_carries_its_changes_context(
        broker: Broker, connect: Connect) -> None:
    assert broker.tracer is None  # no OTEL_EXPORTER_OTLP_ENDPOINT in the tests' environment
    client: Client = connect(broker)
    await client.listen("l1", "x:passed")
    await client.until(is_ack("l1"))
    await broker.publish("x:passed", meta={"traceparent": TRACEPARENT, "tracestate": "vendor=1"})
    frame = await client.until(is_update("l1", "x:passed"))
    assert frame["params"]["_meta"]["traceparent"] == TRACEPARENT
    assert frame["params"]["_meta"]["tracestate"] == "vendor=1"
