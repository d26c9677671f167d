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
``/.well-known/oauth-protected-resource`` (and ``.../mcp``)
    With OAuth on, this server's protected resource metadata (RFC 9728): the authorization
    server a client gets its token from, and the scopes it may ask for (docs/OAUTH.md).

None of them needs credentials, and none says anything per tenant.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.responses import Response
from starlette.types import Receive, Scope

from broker.auth import SCOPES
from broker.auth.oauth import metadata_paths
from broker.auth.scopes import ADMIN
from broker.config import Settings
from broker.ops.health import Health
from broker.transport.edge import detail, json_response

__all__ = ["Livez", "MetricsEndpoint", "Readyz", "ResourceMetadata", "resource_metadata_paths"]

#: What a metrics binding renders: the body and its content type, or None when it has no exposition.
Render = Callable[[], tuple[bytes, str] | None]


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
    def __init__(self, render: Render) -> None:
        self.render = render

    async def respond(self, scope: Scope, receive: Receive) -> Response:
        exposition = self.render()
        if exposition is None:
            return detail(404, "no metrics binding is configured")
        body, content_type = exposition
        return Response(body, media_type=content_type)


class ResourceMetadata:
    """The protected resource metadata document (RFC 9728 §2), the same at each of its paths."""

    def __init__(self, settings: Settings) -> None:
        self.document = {
            "resource": settings.oauth_resource or settings.oauth_audience,
            "authorization_servers": [settings.oauth_issuer],
            "scopes_supported": [*SCOPES, ADMIN],
            "bearer_methods_supported": ["header"],
            "resource_name": settings.server_name,
        }

    async def respond(self, scope: Scope, receive: Receive) -> Response:
        return json_response(self.document)


def resource_metadata_paths(settings: Settings) -> tuple[str, ...]:
    """Where ``ResourceMetadata`` is served: nowhere unless OAuth is on."""
    return metadata_paths(settings.oauth_resource or settings.oauth_audience) if "oauth" in settings.auth_methods \
        else ()
