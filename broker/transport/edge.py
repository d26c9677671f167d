"""The edge every HTTP request passes once: Origin, authentication, and the answers shared by all routes.

``Edge.admit`` runs before any route (``broker.runtime.app.BrokerApp``): it refuses a foreign
``Origin`` (403), asks the ``Authenticator`` who the caller is on the routes that need one
(401 with the authenticator's ``WWW-Authenticate`` challenge otherwise), and puts the
``Principal`` in the ASGI scope, where every route reads it with ``principal_of``. A route
answers in one of two shapes: the JSON-RPC error of ``/mcp`` or the ``{"detail": ...}`` of the
REST API and ``POST /changes``; ``Style`` says which, so each refusal is built in one place.
A domain ``Refusal`` is answered by ``rpc_error`` (the JSON-RPC spelling of
``broker.protocol.refusals``, the status of ``broker.transport.rpc``) or by ``refused`` (the REST
statuses of ``REST_STATUS``), on HTTP and stdio alike.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import Any, Final

import orjson
from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Scope

from broker.auth import Authenticator, AuthUnavailable, Principal, ProtectedResource, Unauthorized, scopes
from broker.auth.identity import PEER, peer_key
from broker.errors import BackendUnavailable, Reason, Refusal
from broker.protocol import jsonrpc as rpc
from broker.transport.guards import NO_SNIFF_NO_STORE, BodyTooLarge, OriginPolicy, read_body
from broker.transport.rpc import as_rpc, status_of

__all__ = ["CORS_REQUEST_HEADERS", "PRINCIPAL", "REST_STATUS", "BadBody", "Edge", "Style", "detail", "json_response",
           "principal_of", "read_json", "refusal", "refused", "rpc_error", "scope_challenger", "unavailable"]

#: Where the edge leaves the request's principal in the ASGI scope.
PRINCIPAL: Final = "mcp_broker.principal"
JSON: Final = "application/json"


class Style(Enum):
    """How a route words a refusal."""

    RPC = "rpc"  # /mcp: a JSON-RPC error object
    REST = "rest"  # the REST API and POST /changes: {"detail": "..."}


def json_response(body: bytes | Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    """A JSON answer (``body`` already encoded, or a value to encode), never sniffed nor cached."""
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    response = Response(data, status_code=status, media_type=JSON, headers=headers)
    response.raw_headers += NO_SNIFF_NO_STORE
    return response


def rpc_error(error: rpc.RpcError | Refusal, id_: rpc.Id | None = None,
              headers: dict[str, str] | None = None) -> Response:
    """A JSON-RPC error (or a refusal, spelled as one) as the whole answer, with its HTTP status
    (``broker.transport.rpc.status_of``) and ``Retry-After`` when it has one."""
    error = as_rpc(error)
    if error.retry_after is not None:
        headers = {**(headers or {}), "Retry-After": str(error.retry_after)}
    return json_response(rpc.encode_error(id_, error), status_of(error), headers)


#: The status of a REST answer (``{"detail": ...}``) refused for this reason.
REST_STATUS: Final[dict[Reason, int]] = {
    Reason.QUOTA: 429,
    Reason.BACKLOG: 429,
    Reason.TOO_LARGE: 413,  # more changes in one request than the tenant may ever have waiting
    Reason.LOG_FULL: 503,
    Reason.UNAVAILABLE: 503,
    Reason.SESSIONS: 503,
    Reason.LISTENS: 503,
    Reason.SUBSCRIPTIONS: 429,
    Reason.WEBHOOKS: 429,
    Reason.RECORDS: 507,  # the tenant's records: nothing was written
    Reason.UPSTREAM_UNREACHABLE: 502,
    Reason.UPSTREAM_TIMEOUT: 504,
    Reason.UPSTREAM_BUSY: 503,
    Reason.WATCHES: 429,
}
#: The REST ``detail`` of a reason whose message is not for clients (an outage's names the backend call).
REST_TEXT: Final[dict[Reason, str]] = {Reason.UNAVAILABLE: "backend unavailable"}


def detail(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    """A REST-style refusal: ``{"detail": message}``."""
    return json_response({"detail": message}, status, headers)


def refused(refusal: Refusal) -> Response:
    """A REST answer to a domain refusal: ``REST_STATUS``'s status, ``{"detail": message}``, ``Retry-After``."""
    headers = None if refusal.retry_after is None else {"Retry-After": str(refusal.retry_after)}
    return detail(REST_STATUS[refusal.reason], REST_TEXT.get(refusal.reason, refusal.message), headers)


def refusal(style: Style, status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    """A refusal of the request's HTTP itself (its Origin, credentials, method, headers), with ``status``."""
    if style is Style.RPC:
        return json_response(rpc.encode_error(None, rpc.RpcError(rpc.INVALID_REQUEST, message)), status, headers)
    return detail(status, message, headers)


def unavailable(style: Style, exc: BackendUnavailable | None = None) -> Response:
    """503 for a request the backend could not serve; the client may retry after a second."""
    outage = exc or BackendUnavailable("the backend cannot be reached")
    return rpc_error(outage) if style is Style.RPC else refused(outage)


def scope_challenger(authenticator: Authenticator) -> Callable[[str], str]:
    """The ``WWW-Authenticate`` value of a 403 for a missing scope, naming the authenticator's resource
    metadata (RFC 9728) when it has one, so a client can ask its authorization server for that scope."""
    metadata = authenticator.resource_metadata if isinstance(authenticator, ProtectedResource) else None
    return lambda scope: scopes.challenge(scope, metadata)


def principal_of(scope: Scope) -> Principal:
    """The principal ``Edge.admit`` found for this request."""
    principal: Principal = scope[PRINCIPAL]
    return principal


class BadBody(Exception):
    """A request body that cannot be used: ``status`` 413 (too large) or 400 (not JSON)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


async def read_json(request: Request, limit: int) -> Any:
    """The body, at most ``limit`` bytes, decoded as JSON.

    Raises:
        BadBody: 413 for a larger body, 400 for one that is not JSON.
        starlette.requests.ClientDisconnect: the client left before the body was complete.
    """
    try:
        body = await read_body(request, limit)
    except BodyTooLarge as exc:
        raise BadBody(413, f"body larger than {exc.limit} bytes") from exc
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise BadBody(400, f"body is not valid JSON: {exc}") from exc


#: What a browser client may send and read across origins: the MCP headers, and what a refusal says.
CORS_REQUEST_HEADERS: Final = ("authorization", "content-type", "accept", "last-event-id", "mcp-session-id",
                               "mcp-protocol-version", "mcp-method", "mcp-name")
CORS_EXPOSED: Final = b"Mcp-Session-Id, Mcp-Protocol-Version, WWW-Authenticate, Retry-After"
CORS_METHODS: Final = b"GET, POST, PUT, PATCH, DELETE, OPTIONS"
#: Seconds a browser may keep a preflight's answer.
CORS_MAX_AGE: Final = b"600"


class Edge:
    """The checks every route shares, done once per request."""

    def __init__(self, origins: list[str], authenticator: Authenticator) -> None:
        self.origins = OriginPolicy(origins)
        self.authenticator = authenticator

    def cors_headers(self, origin: str) -> list[tuple[bytes, bytes]]:
        """What an answer to a browser from an allowed ``origin`` adds, so that page may read it (none otherwise)."""
        if not self.origins.allows(origin):
            return []
        return [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin"),
                (b"access-control-expose-headers", CORS_EXPOSED)]

    def preflight(self, origin: str, asked: str | None, style: Style) -> Response:
        """The answer to a CORS preflight: 204 with what ``origin`` may send, or 403 for an origin not allowed.

        The request headers a page asks for are granted when they are among ``CORS_REQUEST_HEADERS``;
        the browser refuses the real request if it needs another.
        """
        if not self.origins.allows(origin):
            return refusal(style, 403, "Forbidden: Origin not allowed" if style is Style.RPC else "Origin not allowed")
        wanted = {name.strip().lower() for name in (asked or "").split(",") if name.strip()}
        granted = [name for name in CORS_REQUEST_HEADERS if name in wanted] or list(CORS_REQUEST_HEADERS)
        response = Response(status_code=204)
        response.raw_headers += [
            (b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin"),
            (b"access-control-allow-methods", CORS_METHODS),
            (b"access-control-allow-headers", ", ".join(granted).encode()),
            (b"access-control-max-age", CORS_MAX_AGE),
        ]
        return response

    async def admit(self, scope: Scope, style: Style, origin: str | None, *, authenticate: bool) -> Response | None:
        """None when the request may go on (its principal in the scope), else the refusal to send.

        ``origin`` is the request's ``Origin`` header (None without one: not a browser).
        """
        if not self.origins.allows(origin):
            return refusal(style, 403, "Forbidden: Origin not allowed" if style is Style.RPC else "Origin not allowed")
        if not authenticate:
            return None
        client = scope.get("client")
        PEER.set(peer_key(client[0] if client else None))  # each request runs in a task of its own
        try:
            scope[PRINCIPAL] = await self.authenticator.authenticate(Headers(scope=scope))
        except Unauthorized as exc:
            message = f"Unauthorized: {exc}" if style is Style.RPC else str(exc)
            return refusal(style, 401, message, {"WWW-Authenticate": exc.challenge})
        except BackendUnavailable:
            return unavailable(style)
        except AuthUnavailable as exc:  # the token cannot be checked now: neither accepted nor refused
            if style is Style.RPC:
                return rpc_error(rpc.RpcError(rpc.SERVICE_UNAVAILABLE, f"Service unavailable: {exc}",
                                              retry_after=exc.retry_after))
            return detail(503, str(exc), {"Retry-After": str(exc.retry_after)})
        return None
