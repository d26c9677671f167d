"""One upstream as a worker knows it: its configuration, its client, what its probe learnt, its counts."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from broker.metrics import Metrics
from broker.upstreams.client import UpstreamClient
from broker.upstreams.spec import UpstreamSpec

__all__ = ["Upstream"]


class Upstream:
    """One upstream, as this worker knows it."""

    def __init__(self, spec: UpstreamSpec, client: UpstreamClient, metrics: Metrics) -> None:
        self.spec = spec
        self.name = spec.name
        self.client = client
        #: The URI prefixes it owns: configured, or learnt by the probe (empty until then).
        self.prefixes: tuple[str, ...] = spec.prefixes or ()
        #: Its capabilities as the probe found them; None until it answered.
        self.capabilities: dict[str, Any] | None = None
        self.state = "unknown"
        self.error = ""
        #: Tool and prompt names it offers (without ``name_prefix``), as its lists were last seen.
        self.names: dict[str, set[str]] = {"tools": set(), "prompts": set()}
        #: Set once the first probe answered or failed.
        self.learnt = asyncio.Event()
        #: The prefixes its listings showed (when the map leaves them out); ``prefixes`` is what it keeps of them.
        self.found: set[str] = set()
        self._metrics = metrics
        self._requests: dict[str, Any] = {}
        self._errors: dict[str, Any] = {}
        self._latency = metrics.histogram("mcp_broker_upstream_request_duration_seconds", upstream=spec.name)

    def owns(self, uri: str) -> bool:
        return any(uri.startswith(prefix) for prefix in self.prefixes)

    def counted(self, method: str, error: str | None, began: float) -> None:
        """One forwarded request: counted by method, its error by kind, timed."""
        counter = self._requests.get(method)
        if counter is None:
            counter = self._requests[method] = self._metrics.counter("mcp_broker_upstream_requests_total",
                                                                     upstream=self.name, method=method)
        counter.inc()
        self._latency.observe(time.perf_counter() - began)
        if error is not None:
            errors = self._errors.get(error)
            if errors is None:
                errors = self._errors[error] = self._metrics.counter("mcp_broker_upstream_errors_total",
                                                                     upstream=self.name, kind=error)
            errors.inc()
