"""What the app says about itself: every route in its API description, method and path in its refusal lines.

In-process: the app over ``httpx.ASGITransport`` on the memory backend.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import httpx
import pytest

from broker.config import Settings
from broker.ops import logs
from broker.runtime import Broker
from broker.runtime.app import create_app
from broker.transport.openapi import DIRECT_ROUTES, WEBHOOKS

OAUTH = {"auth": "keys,oauth", "oauth_issuer": "https://issuer.example", "oauth_audience": "https://broker.example/mcp"}


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    broker = Broker(Settings(_env_file=None, docs=True, auth="keys"))  # type: ignore[call-arg]
    await broker.start()
    transport = httpx.ASGITransport(app=create_app(broker=broker))
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        yield client
    await broker.stop()


def test_every_route_the_app_serves_is_in_its_api_description() -> None:
    app = create_app(Settings(_env_file=None, docs=True, **OAUTH))  # type: ignore[call-arg, arg-type]
    described = app.api.openapi()
    assert set(app.direct_routes) >= {"/mcp", "/changes", "/livez", "/readyz", "/metrics",
                                      "/.well-known/oauth-protected-resource"}
    assert set(app.direct_routes.values()) <= set(DIRECT_ROUTES), "a route served around FastAPI is not described"
    assert set(described["paths"]) >= set(app.direct_routes)
    # FastAPI's own routes stay: health, the REST API, the admin API.
    assert {"/healthz", "/collections", "/collections/{name}/{record_id}", "/admin/keys"} <= set(described["paths"])
    assert set(described["paths"]["/mcp"]) == {"post", "get", "delete"}
    assert described["webhooks"] == WEBHOOKS and "Change" in described["components"]["schemas"]


async def test_the_served_description_lists_the_routes_served_around_fastapi(http: httpx.AsyncClient) -> None:
    paths = (await http.get("/openapi.json")).json()["paths"]
    assert {"/mcp", "/changes", "/livez", "/readyz", "/metrics", "/healthz", "/admin/keys"} <= set(paths)


async def test_a_refusal_line_names_the_method_and_the_path_escaped(
        http: httpx.AsyncClient, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logs, "_refused", {})  # no line of another test holds this one back
    with caplog.at_level(logging.WARNING, logger="broker.requests"):
        answer = await http.put("/collections/notes/a%0Atenant=x", json={"v": 1})
        assert answer.status_code == 401
        await http.post("/changes", json={"uri": "x:y"}, headers={"origin": "https://evil.example"})
    lines = [record.getMessage() for record in caplog.records]
    assert "refused a request to api with 401: PUT /collections/notes/a%0Atenant%3Dx" in lines, lines
    assert "refused a request to changes with 403: POST /changes" in lines, lines
