"""The ASGI application: ``/mcp``, ``POST /changes``, the REST API and health, around one Broker.

Every HTTP request passes the same checks once, in order, before its route: the ``Host``
(421), the ``Origin`` and the caller's credentials (``transport/edge.py``: 403, 401). Then the
route table sends it on. The two hot paths, ``/mcp`` (every SSE frame passes through its
``send``) and ``/changes`` (every publish), are served directly: FastAPI's middleware stack
wraps ``send`` three times and its routing and dependency solving cost more per request than
the broker's own work there. Everything else, lifespan included, is the FastAPI app.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Final

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from broker.config import Settings
from broker.errors import BackendUnavailable
from broker.runtime import Broker
from broker.transport.edge import Edge, Style, refusal
from broker.transport.guards import NO_SNIFF_NO_STORE, HostPolicy
from broker.transport.http import McpEndpoint
from broker.transport.publish import ChangesEndpoint
from broker.transport.rest import build_router

__all__ = ["BrokerApp", "app_from_env", "create_app"]

logger = logging.getLogger(__name__)


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
_API: Final = Route(Style.REST, authenticate=True)
_PUBLIC: Final = Route(Style.REST, authenticate=False)


class BrokerApp:
    """The edge checks, then ``/mcp`` and ``/changes`` straight to their endpoints, the rest to FastAPI."""

    def __init__(self, broker: Broker, api: FastAPI) -> None:
        settings = broker.settings
        self.settings = settings
        self.api = api
        self.hosts = HostPolicy(settings.allowed_hosts, settings.host)
        self.edge = Edge(settings.allowed_origins, broker.authenticator)
        self._warned_host = False
        self.mcp = McpEndpoint(broker.dispatcher, max_body_bytes=settings.max_body_bytes, retry_ms=settings.retry_ms)
        #: Served directly, each with its edge policy; ``/mcp`` is run below, in this frame.
        self._direct: dict[str, tuple[ASGIApp, Route]] = {
            "/changes": (ChangesEndpoint(broker.publisher, settings.max_body_bytes), CHANGES),
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.api(scope, receive, send)  # lifespan
            return
        path = scope["path"]
        root = scope.get("root_path", "")
        if root and path.startswith(root):  # routes are matched as FastAPI matches them, below the root path
            path = path[len(root):]
        # The try is here rather than in a helper awaited from here: each frame a GET stream awaits
        # through stays suspended for as long as the stream is open.
        try:
            direct = self._direct.get(path)
            route = MCP if path == "/mcp" else direct[1] if direct is not None else (
                _API if path == API_PREFIX or path.startswith(API_PREFIX + "/") else _PUBLIC)
            if not self.hosts.any and not self.hosts.allows(host := _header(scope, b"host")):
                self._warn_host(host)
                await refusal(route.style, 421, "Misdirected Request: Host not allowed" if route.style is Style.RPC
                              else "Host not allowed")(scope, receive, send)
                return
            if route.methods is not None and scope["method"] not in route.methods:
                allowed = ", ".join(sorted(route.methods))
                await refusal(route.style, 405, "Method Not Allowed", {"Allow": allowed})(scope, receive, send)
                return
            refused = await self.edge.admit(scope, route.style, authenticate=route.authenticate)
            if refused is not None:
                await refused(scope, receive, send)
            elif path == "/mcp":
                # Run here rather than in McpEndpoint.__call__: one frame fewer stays suspended for
                # as long as a GET stream is open (about 280 bytes each).
                response = await self.mcp.respond(scope, receive)
                await response(scope, receive, send)
            elif direct is not None:
                await direct[0](scope, receive, send)
            else:
                await self.api(scope, receive, _with_safe_headers(send))
        except ClientDisconnect:
            # A client that leaves before its body is read is no error of the server's: no traceback.
            logger.debug("%s %s: the client left before its request body was read", scope["method"], path)

    def _warn_host(self, host: str | None) -> None:
        if not self._warned_host:
            self._warned_host = True
            logger.warning("answering 421 to Host %r, a name this server does not answer to: see "
                           "MCP_BROKER_ALLOWED_HOSTS (unset, only loopback names are allowed while "
                           "MCP_BROKER_HOST is a loopback address; it is %s)", host, self.settings.host)


def _with_safe_headers(send: Send) -> Send:
    """``send`` adding ``NO_SNIFF_NO_STORE`` to whatever FastAPI answers (routes, 404, 405, 422, handlers)."""

    async def wrapped(message: Message) -> None:
        if message["type"] == "http.response.start":
            message["headers"] = [*message.get("headers", ()), *NO_SNIFF_NO_STORE]
        await send(message)

    return wrapped


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
        await broker.start()
        try:
            yield
        finally:
            await broker.stop()

    # No trailing-slash redirects: Starlette builds their Location from the request's Host.
    api = FastAPI(title="mcp-broker", version=broker.server_info["version"], lifespan=lifespan,
                  redirect_slashes=False)
    api.state.broker = broker
    api.include_router(build_router(broker.settings, broker.records, broker.health))

    @api.exception_handler(BackendUnavailable)
    async def unavailable(request: Request, exc: BackendUnavailable) -> JSONResponse:
        return JSONResponse({"detail": "backend unavailable"}, status_code=503, headers={"Retry-After": "1"})

    return BrokerApp(broker, api)


def app_from_env() -> BrokerApp:
    """Factory for ``uvicorn --factory``: settings from ``MCP_BROKER_*``."""
    return create_app(Settings())
