"""What operators' tools ask of a worker: liveness, readiness and metrics, answered without FastAPI.

``/livez``
    200 while the process serves requests at all; it asks the backend nothing, so a Redis
    outage never makes an orchestrator restart every worker at once.
``/readyz``
    200 when the backend answers and this worker is not draining; 503 otherwise, so a load
    balancer stops sending it new connections: from the first moment of a SIGTERM drain, and
    while Redis is away.
``/metrics``
    The metrics binding's exposition (Prometheus text format), when one is configured.

None of them needs credentials, and none says anything per tenant.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from broker.health import Health
from broker.transport.edge import detail, json_response

__all__ = ["Livez", "MetricsEndpoint", "Readyz"]

#: What a metrics binding renders: the body and its content type.
Render = Callable[[], tuple[bytes, str]]


class Livez:
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await json_response({"status": "ok"})(scope, receive, send)


class Readyz:
    def __init__(self, health: Health) -> None:
        self.health = health

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.health.draining:
            response = json_response({"status": "draining"}, 503)
        else:
            ok, report = await self.health.check()
            response = json_response(report, 200 if ok else 503)
        await response(scope, receive, send)


class MetricsEndpoint:
    def __init__(self, render: Render | None) -> None:
        self.render = render

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.render is None:
            response = detail(404, "no metrics binding is configured")
        else:
            body, content_type = self.render()
            response = Response(body, media_type=content_type)
        await response(scope, receive, send)
