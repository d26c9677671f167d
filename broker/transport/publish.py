"""``POST /changes``: the publish path, served without FastAPI's request machinery.

A publisher may call this thousands of times a second, so it is a plain ASGI endpoint:
measured on this machine, FastAPI's routing, dependency solving and middleware cost more
than the publish itself (a sync dependency even hopped to a thread for every request).
Errors keep the REST API's shape: ``{"detail": "..."}`` with 400, 401, 403 (a foreign
``Origin``, or a record URI of another tenant), 405, 413, 422, 429 (the tenant has
``changelog_tenant_max`` changes not yet delivered) or 503 (the backend is unreachable, or the
change log is full). A 202 means every change of the request passed ``ChangeRules`` and is in
the change log; one refused change refuses the request, and none of it is published (a 429 or
503 from the change log's bounds too).
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from broker.auth import Unauthorized, authenticate
from broker.changes import Change, ChangeRules, ForeignNamespace, InvalidChange
from broker.core import Broker
from broker.errors import BackendUnavailable, LogFull, QuotaExceeded
from broker.transport.guards import NO_SNIFF_NO_STORE, BodyTooLarge, OriginPolicy, read_body

__all__ = ["ChangesEndpoint"]

class Invalid(Exception):
    def __init__(self, status: int, detail: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.headers = headers


def _json(body: Any, status: int, headers: dict[str, str] | None = None) -> Response:
    response = Response(orjson.dumps(body), status_code=status, media_type="application/json", headers=headers)
    response.raw_headers += NO_SNIFF_NO_STORE
    return response


class ChangesEndpoint:
    """Publish one change (a JSON object) or several (a JSON list); 202 with their ids."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.origins = OriginPolicy(broker.settings.allowed_origins)
        self.rules = ChangeRules.from_settings(broker.settings)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        if not self.origins.allows(request.headers.get("origin")):
            response = _json({"detail": "Origin not allowed"}, 403)
        elif request.method != "POST":
            response = _json({"detail": "Method Not Allowed"}, 405, {"Allow": "POST"})
        else:
            try:
                ids = await self.publish(request)
                response = _json({"ids": ids}, 202)
            except Invalid as exc:
                response = _json({"detail": exc.detail}, exc.status, exc.headers)
            except BackendUnavailable:
                response = _json({"detail": "backend unavailable"}, 503, {"Retry-After": "1"})
            except QuotaExceeded as exc:
                # More changes in one request than the tenant may ever have waiting: retrying cannot help.
                status = 413 if exc.asked > exc.limit else 429
                response = _json({"detail": str(exc)}, status, {"Retry-After": str(exc.retry_after)})
            except LogFull as exc:
                response = _json({"detail": str(exc)}, 503, {"Retry-After": str(exc.retry_after)})
        await response(scope, receive, send)

    async def publish(self, request: Request) -> list[str]:
        settings = self.broker.settings
        try:
            principal = authenticate(settings, request.headers.get("authorization"))
        except Unauthorized as exc:
            raise Invalid(401, str(exc), {"WWW-Authenticate": "Bearer"}) from exc
        try:
            body = await read_body(request, settings.max_body_bytes)
        except BodyTooLarge as exc:
            raise Invalid(413, f"body larger than {exc.limit} bytes") from exc
        try:
            parsed = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise Invalid(400, f"body is not valid JSON: {exc}") from exc
        if not isinstance(parsed, list):
            return await self.broker.backend.publish_many([self.change(principal.tenant, parsed, "")])
        if not parsed:
            raise Invalid(422, "no changes given")
        if len(parsed) > settings.changelog_tenant_max:
            # Refused before each change is checked: more than the tenant may ever have waiting.
            raise Invalid(413, f"{len(parsed)} changes in one request; at most {settings.changelog_tenant_max} "
                               "(MCP_BROKER_CHANGELOG_TENANT_MAX) may wait for fan-out at once")
        changes = [self.change(principal.tenant, item, f"change {i}: ") for i, item in enumerate(parsed)]
        return await self.broker.backend.publish_many(changes)

    def change(self, tenant: str, item: Any, where: str) -> Change:
        if not isinstance(item, dict):
            raise Invalid(422, where + "each change must be an object")
        try:
            return self.rules.change(tenant, item.get("uri"), item.get("kind", "updated"), item.get("meta"))
        except ForeignNamespace as exc:
            raise Invalid(403, where + str(exc)) from exc
        except InvalidChange as exc:
            raise Invalid(422, where + str(exc)) from exc
