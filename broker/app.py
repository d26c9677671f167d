"""The ASGI application: ``/mcp``, ``POST /changes``, the REST API and health, around one Broker.

The two hot paths, ``/mcp`` (every SSE frame passes through its ``send``) and
``/changes`` (every publish), are dispatched before FastAPI: its middleware stack wraps
``send`` three times and its routing and dependency solving cost more per request than the
broker's own work there. Everything else, lifespan included, is the FastAPI app.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from broker.config import Settings
from broker.core import Broker
from broker.errors import BackendUnavailable
from broker.protocol import jsonrpc as rpc
from broker.transport.guards import NO_SNIFF_NO_STORE, HostPolicy
from broker.transport.http import McpEndpoint, http_error
from broker.transport.publish import ChangesEndpoint
from broker.transport.rest import build_router

__all__ = ["BrokerApp", "app_from_env", "create_app"]

logger = logging.getLogger(__name__)


class BrokerApp:
    """Routes ``/mcp`` and ``/changes`` straight to their endpoints, the rest to FastAPI."""

    def __init__(self, broker: Broker, api: FastAPI) -> None:
        self.broker = broker
        self.api = api
        self.hosts = HostPolicy(broker.settings.allowed_hosts, broker.settings.host)
        self._warned_host = False
        self.mcp = McpEndpoint(broker)
        self._direct: dict[str, ASGIApp] = {"/changes": ChangesEndpoint(broker)}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.api(scope, receive, send)  # lifespan
            return
        path = scope["path"]
        # The try is here rather than in a helper awaited from here: each frame a GET stream awaits
        # through stays suspended for as long as the stream is open.
        try:
            if not self.hosts.any and not self.hosts.allows(host := _header(scope, b"host")):
                if not self._warned_host:
                    self._warned_host = True
                    logger.warning("answering 421 to Host %r, a name this server does not answer to: see "
                                   "MCP_BROKER_ALLOWED_HOSTS (unset, only loopback names are allowed while "
                                   "MCP_BROKER_HOST is a loopback address; it is %s)", host, self.broker.settings.host)
                await _misdirected(path)(scope, receive, send)
                return
            if path == "/mcp":
                # Run here rather than in McpEndpoint.__call__: one frame fewer stays suspended for
                # as long as a GET stream is open (about 280 bytes each).
                response = await self.mcp.respond(scope, receive)
                await response(scope, receive, send)
                return
            endpoint = self._direct.get(path)
            if endpoint is not None:
                await endpoint(scope, receive, send)
                return
            await self.api(scope, receive, _with_safe_headers(send))
        except ClientDisconnect:
            # A client that leaves before its body is read is no error of the server's: no traceback.
            logger.debug("%s %s: the client left before its request body was read", scope["method"], path)


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


def _misdirected(path: str) -> Response:
    if path == "/mcp":
        return http_error(421, rpc.INVALID_REQUEST, "Misdirected Request: Host not allowed")
    response = JSONResponse({"detail": "Host not allowed"}, status_code=421)
    response.raw_headers += NO_SNIFF_NO_STORE
    return response


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
    api.include_router(build_router(broker))

    @api.exception_handler(BackendUnavailable)
    async def unavailable(request: Request, exc: BackendUnavailable) -> JSONResponse:
        return JSONResponse({"detail": "backend unavailable"}, status_code=503, headers={"Retry-After": "1"})

    return BrokerApp(broker, api)


def app_from_env() -> BrokerApp:
    """Factory for ``uvicorn --factory``: settings from ``MCP_BROKER_*``."""
    return create_app(Settings())
