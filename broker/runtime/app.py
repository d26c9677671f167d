"""The ASGI application: ``/mcp``, ``POST /changes``, the REST API and health, around one Broker.

Every HTTP request passes the same checks once, in order, before its route: the ``Host`` (421;
not for the probes and ``/metrics``), a CORS preflight (answered here), the route's methods
(405), the ``Origin`` and the caller's credentials (``transport/edge.py``: 403, 401). Then the
route table sends it on, and every answer is counted by route and status. The two hot paths,
``/mcp`` (every SSE frame passes through its ``send``) and ``/changes`` (every publish), are
served directly: FastAPI's middleware stack wraps ``send`` three times and its routing and
dependency solving cost more per request than the broker's own work there; so are the probes.
Everything else, lifespan included, is the FastAPI app.

``broker.mount.mount_broker(app, "/broker")`` serves a broker inside an existing FastAPI or
Starlette app, started and stopped with that app.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Final, Protocol

from fastapi import FastAPI, Request
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from broker.auth import Anonymous
from broker.config import Settings
from broker.errors import Refusal
from broker.metrics import Counter
from broker.ops import logs
from broker.runtime import Broker
from broker.transport.admin import build_admin_router
from broker.transport.console import CONSOLE_PATHS, STATE_PATH, ConsolePage, ConsoleRedirect, ConsoleState
from broker.transport.edge import Edge, Style, principal_of, refusal, refused, scope_challenger
from broker.transport.guards import NO_SNIFF_NO_STORE, HostPolicy
from broker.transport.http import McpEndpoint
from broker.transport.openapi import describe
from broker.transport.ops import Livez, MetricsEndpoint, Readyz, ResourceMetadata, resource_metadata_paths
from broker.transport.publish import ChangesEndpoint
from broker.transport.rest import build_router

__all__ = ["BrokerApp", "app_from_env", "create_app"]

logger = logging.getLogger(__name__)


class Responder(Protocol):
    """An endpoint served directly: it builds its response, which the app counts and runs."""

    async def respond(self, scope: Scope, receive: Receive) -> Response: ...


@dataclass(frozen=True, slots=True)
class Route:
    """What the edge does for a path: how refusals are worded, whether a caller must be known, and
    (when the route says) which methods it serves: another method gets 405 before any credential
    is asked for."""

    style: Style
    authenticate: bool
    methods: frozenset[str] | None = None


MCP: Final = Route(Style.RPC, authenticate=True)
CHANGES: Final = Route(Style.REST, authenticate=True, methods=frozenset({"POST"}))
#: Paths under the REST API's prefix need a caller (an unknown one among them too: it says nothing
#: of the API's routes to a stranger); any other path (health, FastAPI's 404) does not.
API_PREFIX: Final = "/collections"
#: The admin API (runtime API keys): never answered to a caller the edge has not authenticated.
ADMIN_PREFIX: Final = "/admin"
_API: Final = Route(Style.REST, authenticate=True)
_PUBLIC: Final = Route(Style.REST, authenticate=False)
_PROBE: Final = Route(Style.REST, authenticate=False, methods=frozenset({"GET", "HEAD"}))
#: The console's figures need a caller (``console:read``) when authentication is on; its page and files
#: hold no figure and need none (``broker.transport.console``).
_CONSOLE: Final = Route(Style.REST, authenticate=True, methods=frozenset({"GET", "HEAD"}))
#: Answered whatever the ``Host``: a kubelet or a scraper names the pod's address, and none of
#: them carries a tenant's data (``/metrics`` shows tenant names only when configured to).
_ANY_HOST: Final = frozenset({"/livez", "/readyz", "/metrics"})
#: Statuses that mean a request was refused, logged at a bounded rate (``broker.ops.logs.rejected``).
_REFUSED: Final = frozenset({400, 401, 403, 404, 405, 408, 413, 415, 421, 422, 429, 431})


class BrokerApp:
    """The edge checks, then ``/mcp``, ``/changes`` and the probes straight to their endpoints, the rest to FastAPI."""

    def __init__(self, broker: Broker, api: FastAPI) -> None:
        settings = broker.settings
        self.broker = broker
        self.settings = settings
        self.api = api
        self.hosts = HostPolicy(settings.allowed_hosts, settings.host)
        self.edge = Edge(settings.allowed_origins, broker.authenticator)
        self.metrics = broker.metrics
        self._answers: dict[tuple[str, int], Counter] = {}
        self._warned_host = False
        self._warned_not_started = False
        challenge = scope_challenger(broker.authenticator)
        auth_on = not isinstance(broker.authenticator, Anonymous)  # every caller anonymous: authentication off
        self.mcp = McpEndpoint(broker.dispatcher, max_body_bytes=settings.max_body_bytes, retry_ms=settings.retry_ms,
                               challenge=challenge)
        #: Served directly, each with its name (for the counters) and edge policy.
        self._direct: dict[str, tuple[Responder, str, Route]] = {
            "/changes": (ChangesEndpoint(broker.publisher, settings.max_body_bytes, challenge), "changes", CHANGES),
            "/livez": (Livez(), "livez", _PROBE),
            "/readyz": (Readyz(broker.health), "readyz", _PROBE),
            "/metrics": (MetricsEndpoint(broker.metrics.render), "metrics", _PROBE),
            # RFC 9728, asked for before a client has any token (with OAuth on; none otherwise).
            **dict.fromkeys(resource_metadata_paths(settings), (ResourceMetadata(settings), "oauth-metadata", _PROBE)),
            "/console": (ConsoleRedirect(), "console-redirect", _PROBE),
            **{path: (ConsolePage(path, auth_on), "console", _PROBE) for path in CONSOLE_PATHS if path != STATE_PATH},
            STATE_PATH: (ConsoleState(broker.console, auth_on, challenge, settings.console_tenants), "console-state",
                         _CONSOLE),
        }

    @property
    def direct_routes(self) -> dict[str, str]:
        """The paths served around FastAPI, each with its route name."""
        return {"/mcp": "mcp", **{path: name for path, (_, name, _) in self._direct.items()}}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.api(scope, receive, send)  # lifespan
            return
        # Routes are matched below the root path, as Starlette matches them: a ``Mount`` (Starlette
        # 0.33 and later, 1.x included) leaves ``path`` whole and appends its prefix to ``root_path``,
        # as does uvicorn's ``--root-path``; an older server or mount that already cut the prefix off
        # leaves a path that does not start with it, taken as it is.
        path = _route_path(scope["path"], scope.get("root_path", ""))
        if not self.broker.started:
            await self._not_started(scope, receive, send, path)
            return
        # The try is here rather than in a helper awaited from here: each frame a GET stream awaits
        # through stays suspended for as long as the stream is open.
        try:
            direct = self._direct.get(path)
            name, route = _route(path) if direct is None else (direct[1], direct[2])
            host, origin, session, request_id = _wanted(scope)
            refused = self._refuse(scope, path, route, host, origin)
            if refused is None:
                refused = await self.edge.admit(scope, route.style, origin, authenticate=route.authenticate)
            if refused is not None:
                self._answered(name, refused.status_code, scope)
                await refused(scope, receive, send)
                return
            if route.authenticate:  # the lines this request's task logs name whom it serves
                logs.bind(tenant=principal_of(scope).tenant, session=session, request=request_id)
            if direct is None and path != "/mcp":
                await self.api(scope, receive, self._counted(send, name, origin, scope))
                return
            # Run here rather than in the endpoint's __call__: one frame fewer stays suspended for
            # as long as a GET stream is open (about 280 bytes each).
            response = await (self.mcp if direct is None else direct[0]).respond(scope, receive)
            if isinstance(response, Response):
                self._answered(name, response.status_code, scope)
                if origin is not None:
                    response.raw_headers += self.edge.cors_headers(origin)
            else:  # a stream: its headers are sent once, nothing is added per frame
                self._answered(name, 200)
                if origin is not None:
                    response.headers = response.headers + self.edge.cors_headers(origin)
            await response(scope, receive, send)
        except ClientDisconnect:
            # A client that leaves before its body is read is no error of the server's: no traceback.
            logger.debug("%s %s: the client left before its request body was read", scope["method"], path)

    async def _not_started(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        """503 for every request to a broker that is not running: mounted in another app whose
        lifespan does not start it, it would accept subscriptions and never deliver a change."""
        if not self._warned_not_started:
            self._warned_not_started = True
            logger.error("answering 503 to %s: the broker is not started (its app's lifespan never ran). Mounted "
                         "in another app, mount it with broker.mount.mount_broker(app, prefix), or enter "
                         "broker.mount.broker_lifespan(broker) in the host's lifespan", path)
        style = Style.RPC if path == "/mcp" else Style.REST
        response = refusal(style, 503, NOT_STARTED, {"Retry-After": "1"})
        self._answered("mcp" if path == "/mcp" else "other", 503, scope)
        await response(scope, receive, send)

    def _refuse(self, scope: Scope, path: str, route: Route, host: str | None, origin: str | None) -> Response | None:
        """The checks before credentials: the ``Host``, a CORS preflight, the route's methods."""
        if path not in _ANY_HOST and not self.hosts.any and not self.hosts.allows(host):
            self._warn_host(host)
            return refusal(route.style, 421, "Misdirected Request: Host not allowed" if route.style is Style.RPC
                           else "Host not allowed")
        if scope["method"] == "OPTIONS" and origin is not None:
            return self.edge.preflight(origin, _header(scope, b"access-control-request-headers"), route.style)
        if route.methods is not None and scope["method"] not in route.methods:
            return refusal(route.style, 405, "Method Not Allowed", {"Allow": ", ".join(sorted(route.methods))})
        return None

    def _answered(self, route: str, status: int, scope: Scope | None = None) -> None:
        counter = self._answers.get((route, status))
        if counter is None:
            counter = self._answers[(route, status)] = self.metrics.counter(
                "mcp_broker_http_answers_total", route=route, status=str(status))
        counter.inc()
        if status in _REFUSED:
            logs.rejected(route, status, method=scope["method"] if scope else "", path=scope["path"] if scope else "")

    def _counted(self, send: Send, route: str, origin: str | None, scope: Scope) -> Send:
        """``send`` for FastAPI's answers: counting the status, adding ``NO_SNIFF_NO_STORE`` (and, for a
        browser's, the CORS headers)."""
        extra = [*NO_SNIFF_NO_STORE, *(self.edge.cors_headers(origin) if origin is not None else ())]

        async def wrapped(message: Message) -> None:
            if message["type"] == "http.response.start":
                self._answered(route, message["status"], scope)
                if extra:
                    message["headers"] = [*message.get("headers", ()), *extra]
            await send(message)

        return wrapped

    def _warn_host(self, host: str | None) -> None:
        if not self._warned_host:
            self._warned_host = True
            logger.warning("answering 421 to Host %r, a name this server does not answer to: see "
                           "MCP_BROKER_ALLOWED_HOSTS (unset, only loopback names are allowed while "
                           "MCP_BROKER_HOST is a loopback address; it is %s)", host, self.settings.host)


#: What a request to a broker that is not running is told.
NOT_STARTED: Final = ("Service unavailable: the broker is not started (mounted in another app? "
                      "use broker.mount.mount_broker, see docs/sources/custom.md)")


def _route_path(path: str, root: str) -> str:
    """``path`` below ``root`` (Starlette's ``get_route_path``): ``/p/mcp`` under ``/p`` is ``/mcp``."""
    if not root or not path.startswith(root):
        return path
    rest = path[len(root):]
    return rest if rest.startswith("/") else ("/" if not rest else path)


def _route(path: str) -> tuple[str, Route]:
    """The name and edge policy of a path not served directly."""
    if path == "/mcp":
        return "mcp", MCP
    if path == API_PREFIX or path.startswith(API_PREFIX + "/"):
        return "api", _API
    if path == ADMIN_PREFIX or path.startswith(ADMIN_PREFIX + "/"):
        return "admin", _API
    return ("healthz" if path == "/healthz" else "other"), _PUBLIC


_WANTED: Final = (b"host", b"origin", b"mcp-session-id", b"x-request-id")


def _wanted(scope: Scope) -> tuple[str | None, str | None, str | None, str | None]:
    """The ``Host``, ``Origin``, ``Mcp-Session-Id`` and ``X-Request-Id`` headers, in one pass over the head."""
    found: list[str | None] = [None, None, None, None]
    for key, value in scope["headers"]:
        if key in _WANTED:
            found[_WANTED.index(key)] = value.decode("latin-1")
    return found[0], found[1], found[2], found[3]


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


def create_app(settings: Settings | None = None, broker: Broker | None = None) -> BrokerApp:
    """An app serving ``broker`` (or a new one built from ``settings``); it starts and stops with the app."""
    broker = broker or Broker(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        logger.info(logs.startup_line(broker.settings))
        await broker.start()
        try:
            yield
        finally:
            await broker.stop()

    # No trailing-slash redirects: Starlette builds their Location from the request's Host.
    docs = broker.settings.docs
    api = FastAPI(title="mcp-broker", version=broker.server_info["version"], lifespan=lifespan,
                  redirect_slashes=False, docs_url="/docs" if docs else None, redoc_url=None,
                  openapi_url="/openapi.json" if docs else None)
    api.state.broker = broker
    api.include_router(build_router(broker.settings, broker.records, broker.health,
                                    scope_challenger(broker.authenticator)))
    if broker.keys is not None:  # stored keys on: their admin API (otherwise /admin is a 404)
        api.include_router(build_admin_router(broker.keys, scope_challenger(broker.authenticator)))

    @api.exception_handler(Refusal)
    async def refusal_answer(request: Request, exc: Refusal) -> Response:
        return refused(exc)  # an outage, a record quota, the change log's bounds: edge.REST_STATUS

    app = BrokerApp(broker, api)
    if docs:  # the routes served around FastAPI belong in its description too
        describe(api, app.direct_routes)
    return app


def app_from_env() -> BrokerApp:
    """Factory for ``uvicorn --factory`` (in each worker process): settings from ``MCP_BROKER_*``."""
    settings = Settings()
    logs.configure(settings)
    return create_app(settings)
