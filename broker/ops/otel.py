"""OpenTelemetry traces over OTLP/HTTP: the ``Tracer`` of ``broker.ops.tracing`` when tracing is on.

Imported only when ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT`` is
set (``broker.ops.tracing.enabled``): a broker without them never imports OpenTelemetry. The SDK
reads the standard ``OTEL_*`` variables itself: the endpoint, headers, timeout and compression
of the exporter, the sampler (``OTEL_TRACES_SAMPLER``, parent-based by default), the batch
processor's delays and sizes (``OTEL_BSP_*``), the resource (``OTEL_SERVICE_NAME``,
``OTEL_RESOURCE_ATTRIBUTES``; ``service.name`` is ``mcp-broker`` unless they name it).

Spans, as the MCP semantic conventions of OpenTelemetry name them where they cover the step:

* ``publish`` (producer): a change appended to the change log, child of the context the
  producer gave (``meta``, or the ``traceparent`` header of ``POST /changes``);
* ``fanout`` (consumer): the change fanned out, on whichever worker holds its partition, child of
  the publish span, whose context the change log carried;
* ``notifications/resources/updated`` and ``notifications/resources/list_changed`` (client, the
  server-initiated side in the conventions): the notification written to a client, with
  ``mcp.session.id``, child of the fan-out span, whose context the notification carries in
  ``params._meta.traceparent``;
* ``{mcp.method.name}`` (server): an MCP request, child of the context in its ``params._meta``.

Span names leave the resource URI out (the conventions advise against high-cardinality names);
it is the ``mcp.resource.uri`` attribute.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Final

import orjson
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import Span, SpanKind, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from broker.changes import Change
from broker.ops.tracing import (
    CONTEXT_KEYS,
    TRACEPARENT,
    TRACESTATE,
    Finish,
    header_context,
    valid_traceparent,
    valid_tracestate,
)
from broker.protocol.jsonrpc import RpcError

__all__ = ["OtelTracer"]

_PROPAGATOR: Final = TraceContextTextMapPropagator()
_MARK: Final = b'"' + TRACEPARENT.encode() + b'"'


def _parent(meta: Mapping[str, Any] | None) -> Context | None:
    """The context a change's ``meta`` (or a message's ``_meta``) carries; None without a valid one.

    The propagator gets only a ``traceparent`` and a ``tracestate`` of the W3C grammar: anything
    else is dropped here, silently, as OpenTelemetry would log it verbatim, once per message."""
    if not meta:
        return None
    traceparent = meta.get(TRACEPARENT)
    if not isinstance(traceparent, str) or not valid_traceparent(traceparent):
        return None
    carrier = {TRACEPARENT: traceparent}
    tracestate = meta.get(TRACESTATE)
    if isinstance(tracestate, str) and valid_tracestate(tracestate):
        carrier[TRACESTATE] = tracestate
    return _PROPAGATOR.extract(carrier)


def _carrying(change: Change, span: Span, max_meta_bytes: int | None = None) -> Change:
    """``change`` with ``span``'s context in its ``meta``, for the next step to continue the trace.

    Unless that ``meta`` would encode to more than ``max_meta_bytes``, the bound a stored change
    keeps: then the change goes on as it came, without the span's context (never refused for it)."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    if not carrier:
        return change
    meta = {key: value for key, value in (change.meta or {}).items() if key not in CONTEXT_KEYS}
    meta.update(carrier)
    if max_meta_bytes is not None and len(orjson.dumps(meta)) > max_meta_bytes:
        return change
    return replace(change, meta=meta)


def _failed(span: Span, error: BaseException) -> None:
    span.set_attribute("error.type", str(error.code) if isinstance(error, RpcError) else type(error).__qualname__)
    span.set_status(StatusCode.ERROR, str(error))


def _resource() -> Resource:
    named = bool(os.environ.get("OTEL_SERVICE_NAME")) or "service.name=" in os.environ.get(
        "OTEL_RESOURCE_ATTRIBUTES", "")
    attributes: dict[str, Any] = {"process.pid": os.getpid()}
    if not named:
        attributes[SERVICE_NAME] = "mcp-broker"
    return Resource.create(attributes)


class OtelTracer:
    """``broker.ops.tracing.Tracer`` on the OpenTelemetry SDK, exporting over OTLP/HTTP (or to ``exporter``)."""

    def __init__(self, version: str, exporter: SpanExporter | None = None) -> None:
        self.provider = TracerProvider(resource=_resource())  # the sampler of OTEL_TRACES_SAMPLER
        self.provider.add_span_processor(BatchSpanProcessor(exporter or OTLPSpanExporter()))
        self._tracer = self.provider.get_tracer("mcp-broker", version)

    def publishing(self, changes: list[Change], source: str, max_meta_bytes: int) -> tuple[list[Change], Finish]:
        spans = [self._tracer.start_span("publish", _parent(change.meta), SpanKind.PRODUCER, {
            "mcp.resource.uri": change.uri, "mcp_broker.tenant": change.tenant, "mcp_broker.change.kind": change.kind,
            "mcp_broker.publish.source": source, "messaging.operation.type": "send"}) for change in changes]

        def finish(ids: Sequence[str] | None, error: BaseException | None) -> None:
            for i, span in enumerate(spans):
                if ids is not None and i < len(ids):
                    span.set_attribute("mcp_broker.change.id", ids[i])
                if error is not None:
                    _failed(span, error)
                span.end()

        carried = [_carrying(change, span, max_meta_bytes) for change, span in zip(changes, spans, strict=True)]
        return carried, finish

    def fanning_out(self, batch: Sequence[tuple[str, Change]]) -> tuple[Sequence[tuple[str, Change]], Finish]:
        spans = [self._tracer.start_span("fanout", _parent(change.meta), SpanKind.CONSUMER, {
            "mcp.resource.uri": change.uri, "mcp_broker.tenant": change.tenant, "mcp_broker.change.id": change_id,
            "messaging.operation.type": "process", "messaging.batch.message_count": len(batch)})
            for change_id, change in batch]

        def finish(ids: Sequence[str] | None, error: BaseException | None) -> None:
            for span in spans:
                if error is not None:
                    _failed(span, error)
                span.end()

        carried = [(change_id, _carrying(change, span)) for (change_id, change), span in zip(batch, spans, strict=True)]
        return carried, finish

    def delivered(self, session_id: str | None, frames: Iterable[bytes]) -> None:
        for data in frames:
            if _MARK not in data:
                continue  # no trace context: nothing to continue
            message = orjson.loads(data)
            params = message.get("params") or {}
            method = message.get("method") or "notification"
            attributes: dict[str, Any] = {"mcp.method.name": method}
            if session_id is not None:
                attributes["mcp.session.id"] = session_id
            if isinstance(params.get("uri"), str):
                attributes["mcp.resource.uri"] = params["uri"]
            self._tracer.start_span(method, _parent(params.get("_meta")), SpanKind.CLIENT, attributes).end()

    def request(self, method: str, params: dict[str, Any], session_id: str | None,
                header: Callable[[str], str | None] | None = None) -> Finish:
        attributes: dict[str, Any] = {"mcp.method.name": method}
        if session_id is not None:
            attributes["mcp.session.id"] = session_id
        if isinstance(params.get("uri"), str):
            attributes["mcp.resource.uri"] = params["uri"]
        meta = params.get("_meta")
        parent = _parent(meta if isinstance(meta, dict) else None)
        if parent is None and header is not None:
            parent = _parent(header_context(header(TRACEPARENT), header(TRACESTATE)))
        span = self._tracer.start_span(method, parent, SpanKind.SERVER, attributes)

        def finish(ids: Sequence[str] | None, error: BaseException | None) -> None:
            if error is not None:
                _failed(span, error)
            span.end()

        return finish

    def close(self) -> None:
        self.provider.shutdown()  # exports what the batch processor holds
