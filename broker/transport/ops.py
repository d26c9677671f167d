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
from starlette.types import Receive, Scope

from broker.health import Health
from broker.transport.edge import detail, json_response

__all__ = ["Livez", "MetricsEndpoint", "Readyz"]

#: What a metrics binding renders: the body and its content type.
Render = Callable[[], tuple[bytes, str]]


class Livez:
    async def respond(self, scope: Scope, receive: Receive) -> Response:
        return json_response({"status": "ok"})


class Readyz:
    def __init__(self, health: Health) -> None:
        self.health = health

    async def respond(self, scope: Scope, receive: Receive) -> Response:
        if self.health.draining:
            return json_response({"status": "draining"}, 503)
        ok, report = await self.health.check()
        return json_response(report, 200 if ok else 503)


class MetricsEndpoint:
    def __init__(self, render: Render | None) -> None:
        self.render = render

    async def respond(self, scope: Scope, receive: Receive) -> Response:
        if self.render is None:
            return detail(404, "no metrics binding is configured")
        body, content_type = self.render()
        return Response(body, media_type=content_type)
