"""The ASGI application: ``/mcp``, the REST API and health, around one Broker."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.routing import Route

from broker.config import Settings
from broker.core import Broker
from broker.errors import BackendUnavailable
from broker.transport.http import McpEndpoint
from broker.transport.rest import build_router

__all__ = ["app_from_env", "create_app"]


def create_app(settings: Settings | None = None, broker: Broker | None = None) -> FastAPI:
    """An app serving ``broker`` (or a new one built from ``settings``); it starts and stops with the app."""
    broker = broker or Broker(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await broker.start()
        try:
            yield
        finally:
            await broker.stop()

    app = FastAPI(title="mcp-broker", version=broker.server_info["version"], lifespan=lifespan)
    app.state.broker = broker
    app.include_router(build_router(broker))
    # A plain ASGI route: /mcp needs no request parsing or response models from FastAPI.
    app.router.routes.append(Route("/mcp", McpEndpoint(broker), include_in_schema=False))

    @app.exception_handler(BackendUnavailable)
    async def unavailable(request: Request, exc: BackendUnavailable) -> JSONResponse:
        return JSONResponse({"detail": "backend unavailable"}, status_code=503, headers={"Retry-After": "1"})

    return app


def app_from_env() -> FastAPI:
    """Factory for ``uvicorn --factory``: settings from ``MCP_BROKER_*``."""
    return create_app(Settings())
