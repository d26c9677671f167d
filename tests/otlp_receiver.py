"""A local OTLP/HTTP trace receiver for tests: ``POST /v1/traces`` of protobuf, decoded with
opentelemetry-proto's own classes, every span kept (with its service's ``process.pid``)."""

from __future__ import annotations

import gzip
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, Any]
    pid: int | None = None
    service: str | None = None


@dataclass
class OtlpReceiver:
    """Serves on a free loopback port from ``start`` to ``stop``; ``spans`` holds what was exported."""

    spans: list[ReceivedSpan] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)

    def start(self) -> OtlpReceiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # the name http.server calls
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                receiver.paths.append(self.path)
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                receiver.take(request)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:
                return None

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def take(self, request: ExportTraceServiceRequest) -> None:
        for resource_spans in request.resource_spans:
            resource = {kv.key: _value(kv.value) for kv in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    self.spans.append(ReceivedSpan(
                        span.name, span.kind, span.trace_id.hex(), span.span_id.hex(), span.parent_span_id.hex(),
                        {kv.key: _value(kv.value) for kv in span.attributes},
                        resource.get("process.pid"), resource.get("service.name")))

    def of_trace(self, trace_id: str) -> list[ReceivedSpan]:
        return [span for span in list(self.spans) if span.trace_id == trace_id]

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _value(value: Any) -> Any:
    return getattr(value, value.WhichOneof("value")) if value.WhichOneof("value") else None
