"""The API description (``/openapi.json``, ``/docs``; ``MCP_BROKER_DOCS``): every HTTP route the broker answers.

FastAPI describes the routes it serves itself (``/healthz``, the REST API under ``/collections``,
the admin API under ``/admin``). The routes the app serves directly, around FastAPI, are described
here by the name the app counts them under (``broker.runtime.app``): ``/mcp``, ``/changes``, the
probes, ``/metrics``, the console under ``/console/`` and, with OAuth on, the protected resource
metadata. The POSTs the broker
sends to webhook callbacks (``events/subscribe``) are OpenAPI 3.1 ``webhooks``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from fastapi import FastAPI

__all__ = ["DIRECT_ROUTES", "WEBHOOKS", "describe"]


def _answers(*statuses: int, ok: dict[str, Any] | None = None) -> dict[str, Any]:
    said = {200: "the answer", 202: "accepted", 204: "done", 400: "a malformed request", 401: "no valid credential",
            403: "a foreign Origin, a missing scope, another tenant's URI", 404: "an unknown session",
            405: "another method", 406: "Accept lacks a type the answer needs", 408: "head or body too slow",
            409: "a conflict with the session's state", 413: "a body over MCP_BROKER_MAX_BODY_BYTES",
            415: "not application/json", 421: "a Host this server does not answer to", 422: "not a valid change",
            429: "a quota or the tenant's share, with Retry-After", 431: "a request head too large",
            503: "the backend is unreachable, or a bound is reached, with Retry-After"}
    answers: dict[str, Any] = {str(status): {"description": said[status]} for status in statuses}
    if ok is not None:
        answers.update(ok)
    return answers


_JSON_RPC: Final = {"description": "A JSON-RPC message, or (2025-03-26) a batch of them",
                    "content": {"application/json": {"schema": {"oneOf": [{"type": "object"},
                                                                          {"type": "array",
                                                                           "items": {"type": "object"}}]}}}}
_SESSION: Final = {"name": "Mcp-Session-Id", "in": "header", "required": False, "schema": {"type": "string"},
                   "description": "the session (2025 era), from the answer to initialize"}
_REFUSED_AT_THE_EDGE: Final = (400, 401, 403, 405, 408, 413, 421, 429, 431, 503)
_PROBE_OK: Final = {"content": {"application/json": {"schema": {"type": "object"}}}}

#: Each route served around FastAPI, by the name the app counts it under: its OpenAPI path item.
DIRECT_ROUTES: Final[dict[str, dict[str, Any]]] = {
    "mcp": {
        "post": {"summary": "MCP over Streamable HTTP: a request, notification or response (both eras)",
                 "tags": ["MCP"], "parameters": [_SESSION], "requestBody": _JSON_RPC,
                 "responses": _answers(*_REFUSED_AT_THE_EDGE, 202, 404, 406, 415, ok={"200": {
                     "description": "the JSON-RPC answer; a 2026-07-28 subscriptions/listen answers with a stream",
                     "content": {"application/json": {}, "text/event-stream": {}}}})},
        "get": {"summary": "the session's stream of notifications (2025 era), resumed from Last-Event-ID",
                "tags": ["MCP"], "parameters": [_SESSION, {"name": "Last-Event-ID", "in": "header",
                                                            "required": False, "schema": {"type": "string"}}],
                "responses": _answers(401, 403, 404, 405, 406, 421, 429, 503, ok={"200": {
                    "description": "server-sent events", "content": {"text/event-stream": {}}}})},
        "delete": {"summary": "end the session (2025 era)", "tags": ["MCP"], "parameters": [_SESSION],
                   "responses": _answers(204, 401, 403, 404, 405, 421, 503)},
    },
    "changes": {
        "post": {"summary": "publish changes: every subscriber of a URI is notified (scope changes:publish)",
                 "tags": ["changes"],
                 "requestBody": {"content": {"application/json": {"schema": {"oneOf": [
                     {"$ref": "#/components/schemas/Change"},
                     {"type": "array", "items": {"$ref": "#/components/schemas/Change"}}]}}}},
                 "responses": _answers(400, 401, 403, 405, 413, 415, 421, 422, 429, 503, ok={"202": {
                     "description": "in the change log: each change's id",
                     "content": {"application/json": {"schema": {
                         "type": "object", "properties": {"ids": {"type": "array", "items": {"type": "string"}}}}}}}})},
    },
    "livez": {"get": {"summary": "liveness: the process serves requests (asks the backend nothing)",
                      "tags": ["operations"], "responses": _answers(ok={"200": _PROBE_OK | {"description": "alive"}})}},
    "readyz": {"get": {"summary": "readiness: the backend answers and the worker is not draining",
                       "tags": ["operations"],
                       "responses": _answers(503, ok={"200": _PROBE_OK | {"description": "ready"}})}},
    "metrics": {"get": {"summary": "Prometheus metrics of every worker (MCP_BROKER_METRICS)", "tags": ["operations"],
                        "responses": _answers(404, ok={"200": {"description": "the text exposition format",
                                                               "content": {"text/plain": {}}}})}},
    "console": {"get": {"summary": "the live console: its page, script or style (no figure; docs/CONSOLE.md)",
                        "tags": ["operations"],
                        "responses": _answers(403, 421, ok={"200": {"description": "the file",
                                                                    "content": {"text/html": {}}}})}},
    "console-redirect": {"get": {"summary": "to /console/", "tags": ["operations"],
                                 "responses": {"308": {"description": "Location: console/"}}}},
    "console-state": {"get": {"summary": "the live console's figures (scope console:read, a tenant of "
                                         "MCP_BROKER_CONSOLE_TENANTS; with authentication off, this machine only)",
                              "tags": ["operations"],
                              "responses": _answers(401, 403, 405, 421, ok={"200": _PROBE_OK | {
                                  "description": "the deployment's figures"}})}},
    "oauth-metadata": {"get": {"summary": "OAuth 2.0 protected resource metadata (RFC 9728), with OAuth on",
                               "tags": ["operations"],
                               "responses": _answers(ok={"200": _PROBE_OK | {"description": "the metadata"}})}},
}

_CHANGE: Final = {
    "type": "object", "required": ["uri"],
    "properties": {"uri": {"type": "string", "description": "the resource that changed"},
                   "kind": {"type": "string", "enum": ["updated", "created", "deleted"], "default": "updated"},
                   "meta": {"type": "object", "description": "copied into each notification's params._meta"}},
}

#: The POSTs the broker makes to a subscriber's callback (``events/subscribe``, docs/EVENTS.md).
WEBHOOKS: Final[dict[str, Any]] = {
    "resourceEvent": {"post": {
        "summary": "an event of a watched resource, a gap, or the verification handshake, signed (Standard Webhooks)",
        "tags": ["events"],
        "parameters": [{"name": name, "in": "header", "required": True, "schema": {"type": "string"}}
                       for name in ("webhook-id", "webhook-timestamp", "webhook-signature", "X-MCP-Subscription-Id")],
        "requestBody": {"content": {"application/json": {"schema": {"oneOf": [
            {"type": "object", "required": ["eventId", "name", "timestamp", "data"],
             "properties": {"eventId": {"type": "string"}, "name": {"type": "string"},
                            "timestamp": {"type": "string", "format": "date-time"}, "cursor": {"type": "string"},
                            "data": {"type": "object", "properties": {"uri": {"type": "string"},
                                                                      "_meta": {"type": "object"}}}}},
            {"type": "object", "properties": {"type": {"const": "gap"}, "cursor": {"type": "string"}}},
            {"type": "object", "properties": {"type": {"const": "verification"},
                                              "challenge": {"type": "string"}}}]}}}},
        "responses": {"2XX": {"description": "acknowledged; anything else is retried, then dead-lettered"}},
    }},
}


def describe(api: FastAPI, direct: Mapping[str, str]) -> None:
    """Make ``api``'s description hold ``direct`` (path to route name, served around it) and the webhooks."""
    undescribed = {"get": {"summary": "(not described)", "responses": {"200": {"description": "the answer"}}}}
    items = {path: DIRECT_ROUTES.get(name, undescribed) for path, name in direct.items()}
    fastapi_description = api.openapi

    def openapi() -> dict[str, Any]:
        described = api.openapi_schema is not None
        schema = fastapi_description()  # FastAPI's routes, made once and kept as api.openapi_schema
        if not described:
            schema["paths"] = {**items, **schema.get("paths", {})}
            schema["webhooks"] = {**schema.get("webhooks", {}), **WEBHOOKS}
            schema.setdefault("components", {}).setdefault("schemas", {})["Change"] = _CHANGE
        return schema

    api.openapi = openapi  # type: ignore[method-assign]
