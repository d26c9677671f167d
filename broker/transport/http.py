"""Streamable HTTP on ``/mcp``: both protocol eras on one endpoint.

Routing (docs/PROTOCOL.md, as the official Python SDK does): a request whose ``MCP-Protocol-Version``
header names a modern version, or that carries the modern ``_meta`` envelope and is not
``initialize``, is handled statelessly; everything else is the legacy, session-based shape.

Legacy choices the specification leaves open:

* POST requests are answered with ``application/json``, never with an SSE stream; only the
  GET stream carries event ids, so ``Last-Event-ID`` always names a position in the
  session's inbox.
* One live GET stream per session: a second GET *takes over* and the first one ends. A
  client whose connection died half-open is never locked out (a 409 would lock it out until
  the server noticed), and a message goes to exactly one stream.
* A GET without ``Last-Event-ID`` starts at the beginning of the inbox when the session never
  had a stream (so nothing published between ``initialize`` and the first GET is lost), and
  at its head otherwise.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from broker.auth import Principal, Unauthorized, authenticate
from broker.core import Broker
from broker.delivery import LegacyStream, Listen, parse_event_id
from broker.errors import BackendUnavailable, LimitExceeded, SessionNotFound
from broker.methods import Call
from broker.protocol import jsonrpc as rpc
from broker.protocol.envelope import check_meta, has_modern_meta
from broker.protocol.jsonrpc import Message
from broker.protocol.versions import (
    BATCH_VERSIONS,
    DEFAULT_LEGACY,
    LEGACY_VERSIONS,
    MODERN_VERSIONS,
    PRIMING_VERSIONS,
)
from broker.transport.batches import answer_batch, check_batch, encode_batch
from broker.transport.guards import NO_SNIFF_NO_STORE, BodyTooLarge, OriginPolicy, read_body
from broker.transport.sse import SSEResponse, SSEWriter

__all__ = ["McpEndpoint"]

logger = logging.getLogger(__name__)

SESSION_HEADER = "mcp-session-id"
JSON = "application/json"


def json_response(body: bytes, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    response = Response(body, status_code=status, media_type=JSON, headers=headers)
    response.raw_headers += NO_SNIFF_NO_STORE
    return response


def error_response(error: rpc.RpcError, id_: rpc.Id | None = None, headers: dict[str, str] | None = None) -> Response:
    return json_response(rpc.encode_error(id_, error), error.status, headers)


def http_error(status: int, code: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return error_response(rpc.RpcError(code, message, status=status), None, headers)


def _accepts(accept: str, media_type: str) -> bool:
    kinds = {part.split(";")[0].strip().lower() for part in accept.split(",")}
    major = media_type.split("/")[0]
    return media_type in kinds or "*/*" in kinds or f"{major}/*" in kinds


class McpEndpoint:
    """The ASGI app mounted at ``/mcp``."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.settings = broker.settings
        self.methods = broker.methods
        self.origins = OriginPolicy(self.settings.allowed_origins)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = await self.respond(scope, receive)
        await response(scope, receive, send)

    async def respond(self, scope: Scope, receive: Receive) -> Response | SSEResponse:
        """The response to one request, for the caller to run.

        ``BrokerApp`` runs it in its own frame: a stream then keeps no frame of this endpoint
        suspended for its lifetime, nor the request object (it is not kept past ``handle``).
        """
        try:
            return await self.handle(Request(scope, receive))
        except BackendUnavailable:
            return http_error(503, rpc.SERVICE_UNAVAILABLE, "Service unavailable: the backend cannot be reached",
                              {"Retry-After": "1"})

    # -- checks shared by every method ------------------------------------------------------
    async def handle(self, request: Request) -> Response | SSEResponse:
        if not self.origins.allows(request.headers.get("origin")):
            return http_error(403, rpc.INVALID_REQUEST, "Forbidden: Origin not allowed")
        try:
            principal = authenticate(self.settings, request.headers.get("authorization"))
        except Unauthorized as exc:
            return http_error(401, rpc.INVALID_REQUEST, f"Unauthorized: {exc}", {"WWW-Authenticate": "Bearer"})
        version_header = request.headers.get("mcp-protocol-version")
        modern_header = version_header is not None and version_header not in LEGACY_VERSIONS
        method = request.method
        if method == "POST":
            return await self.post(request, principal, version_header)
        if method in ("GET", "DELETE") and modern_header and version_header not in MODERN_VERSIONS:
            # A version nobody speaks is a bad request (docs/PROTOCOL.md), not a modern GET (405).
            return http_error(400, rpc.INVALID_REQUEST,
                              f"Bad Request: unsupported MCP-Protocol-Version {version_header}")
        if method in ("GET", "DELETE") and not modern_header:
            if method == "GET":
                return await self.get(request, principal, version_header)
            return await self.delete(request, principal, version_header)
        allow = "POST" if modern_header else "GET, POST, DELETE"
        return http_error(405, rpc.INVALID_REQUEST, "Method not allowed", {"Allow": allow})

    # -- POST -------------------------------------------------------------------------------
    async def post(self, request: Request, principal: Principal,
                   version_header: str | None) -> Response | SSEResponse:
        accept = request.headers.get("accept", "")
        if not (_accepts(accept, JSON) and _accepts(accept, "text/event-stream")):
            return http_error(406, rpc.INVALID_REQUEST,
                              "Not Acceptable: Accept must list application/json and text/event-stream")
        content_type = request.headers.get("content-type", "")
        if content_type.split(";")[0].strip().lower() != JSON:
            return http_error(415, rpc.INVALID_REQUEST, "Unsupported Media Type: Content-Type must be application/json")
        try:
            body = await read_body(request, self.settings.max_body_bytes)
        except BodyTooLarge as exc:
            return http_error(413, rpc.INVALID_REQUEST, str(exc))
        try:
            obj = rpc.parse_body(body)
        except rpc.RpcError as exc:
            return error_response(exc)
        if version_header in LEGACY_VERSIONS:
            return await self.post_legacy(request, principal, version_header, obj)
        is_initialize = isinstance(obj, dict) and obj.get("method") == "initialize"
        if version_header in MODERN_VERSIONS or (not is_initialize and has_modern_meta(obj)):
            # An unknown version with the modern envelope is answered the modern way (-32022).
            return await self.post_modern(request, principal, obj)
        if version_header is not None:
            return http_error(400, rpc.INVALID_REQUEST,
                              f"Bad Request: unsupported MCP-Protocol-Version {version_header}")
        return await self.post_legacy(request, principal, version_header, obj)

    async def post_legacy(self, request: Request, principal: Principal, version_header: str | None,
                          obj: Any) -> Response:
        if isinstance(obj, list):
            return await self.post_batch(request, principal, version_header, obj)
        try:
            msg = rpc.parse_message(obj)
        except rpc.RpcError as exc:
            return error_response(exc, rpc.request_id_of(obj))
        if msg.method == "initialize":
            return await self.initialize(principal, msg)
        session = await self._session(request, principal, version_header)
        if isinstance(session, Response):
            return session
        if not msg.is_request:
            await self._legacy_notification(session.id, msg)
            return Response(status_code=202)
        reply = await self._legacy_request(Call(principal, False, session), msg)
        return json_response(reply)

    async def post_batch(self, request: Request, principal: Principal, version_header: str | None,
                         items: list[Any]) -> Response:
        try:
            check_batch(items, self.settings.max_batch_items)
        except rpc.RpcError as exc:
            return error_response(exc)
        session = await self._session(request, principal, version_header)
        if isinstance(session, Response):
            return session
        if session.protocol_version not in BATCH_VERSIONS:
            return error_response(rpc.RpcError(
                rpc.INVALID_REQUEST, f"Invalid Request: batches are not part of {session.protocol_version}",
                status=400))
        call = Call(principal, False, session)

        async def handle(msg: Message) -> bytes | None:
            if msg.is_request:
                return await self._legacy_request(call, msg)
            await self._legacy_notification(session.id, msg)
            return None

        replies = await answer_batch(items, handle, self.settings.max_response_bytes)
        if not replies:
            return Response(status_code=202)
        return json_response(encode_batch(replies))

    async def initialize(self, principal: Principal, msg: Message) -> Response:
        if not msg.is_request:
            return error_response(rpc.RpcError(rpc.INVALID_REQUEST, "initialize must be a request", status=400))
        try:
            version, client_info, caps = self.methods.initialize(msg.params)
            record = await self.broker.sessions.create(principal, version, client_info, caps)
        except rpc.RpcError as exc:
            return error_response(exc, msg.id)
        except LimitExceeded:
            return error_response(rpc.RpcError(rpc.INTERNAL_ERROR, "Too many sessions; retry later", status=503),
                                  msg.id, {"Retry-After": "5"})
        body = rpc.encode_result(msg.id, self.methods.initialize_result(version))
        return json_response(body, headers={"Mcp-Session-Id": record.id})

    async def _session(self, request: Request, principal: Principal, version_header: str | None) -> Any:
        """The request's session, or the error response that ends the request."""
        sid = request.headers.get(SESSION_HEADER)
        if not sid:
            return http_error(400, rpc.INVALID_REQUEST, "Bad Request: Mcp-Session-Id header is required")
        try:
            return await self.broker.sessions.load(sid, principal)
        except SessionNotFound:
            return http_error(404, rpc.INVALID_REQUEST, "Session not found")

    async def _legacy_notification(self, session_id: str, msg: Message) -> None:
        if msg.method == "notifications/initialized":
            await self.broker.backend.update_session(session_id, initialized=True)
        # notifications/cancelled: every request is answered before its POST returns, so there is
        # nothing in flight to cancel. Responses and other notifications are accepted and dropped.

    async def _legacy_request(self, call: Call, msg: Message) -> bytes:
        assert msg.method is not None and msg.id is not None  # a request has both (parse_message)
        try:
            return rpc.encode_result(msg.id, await self.methods.call(call, msg.method, msg.params))
        except rpc.RpcError as exc:
            return rpc.encode_error(msg.id, exc)

    # -- GET and DELETE (legacy) ------------------------------------------------------------------
    async def get(self, request: Request, principal: Principal, version_header: str | None) -> Response | SSEResponse:
        if not _accepts(request.headers.get("accept", ""), "text/event-stream"):
            return http_error(406, rpc.INVALID_REQUEST, "Not Acceptable: Accept must list text/event-stream")
        session = await self._session(request, principal, version_header)
        if isinstance(session, Response):
            return session
        if self.broker.hub.closing:
            # A stopping worker still answers requests on open connections while it drains (see
            # broker/server.py): a stream asked for now ends at once the way the streams open here
            # ended, with ``retry:``, and the client comes back on another worker, with no error.
            return SSEResponse(SSEWriter.retry, _nothing, retry_ms=self.settings.retry_ms)
        last_event_id = request.headers.get("last-event-id")
        cursor: int | None = None
        resync = False
        if last_event_id is not None:
            parsed = parse_event_id(last_event_id)
            if parsed is None:
                return http_error(400, rpc.INVALID_REQUEST, "Bad Request: malformed Last-Event-ID")
            epoch, cursor = parsed
            if epoch != session.epoch:
                # A cursor from another data generation: the gap rule, never "replay everything".
                resync, cursor = True, 0
        version = version_header or session.protocol_version or DEFAULT_LEGACY
        stream = LegacyStream(self.broker.hub, session, _PendingWriter(), cursor, resync=resync,
                              priming=version in PRIMING_VERSIONS)
        # Bound methods rather than closures: nothing else per stream to keep for its lifetime.
        return SSEResponse(stream.serve, stream.disconnect, retry_ms=self.settings.retry_ms)

    async def delete(self, request: Request, principal: Principal, version_header: str | None) -> Response:
        session = await self._session(request, principal, version_header)
        if isinstance(session, Response):
            return session
        await self.broker.sessions.end(session.id)
        return Response(status_code=200)

    # -- 2026-07-28 --------------------------------------------------------------------------
    async def post_modern(self, request: Request, principal: Principal, obj: Any) -> Response | SSEResponse:
        if isinstance(obj, list):
            return error_response(rpc.RpcError(rpc.INVALID_REQUEST, "Invalid Request: batches are not supported",
                                               status=400))
        try:
            msg = rpc.parse_message(obj)
        except rpc.RpcError as exc:
            return error_response(exc, rpc.request_id_of(obj))
        if msg.kind == "notification":
            return Response(status_code=202)  # e.g. a stray notifications/cancelled: accepted and dropped
        if msg.kind == "response":
            return error_response(rpc.RpcError(rpc.INVALID_REQUEST, "Clients must not send responses", status=400))
        try:
            check_meta(msg, request.headers.get)
            call = Call(principal, True)
            assert msg.method is not None and msg.id is not None
            if msg.method == "subscriptions/listen":
                return self.listen(call, msg)
            result = await self.methods.call(call, msg.method, msg.params)
        except rpc.RpcError as exc:
            return error_response(exc, msg.id)
        return json_response(rpc.encode_result(msg.id, result))

    def listen(self, call: Call, msg: Message) -> SSEResponse:
        """Refusals come back as JSON before the stream starts; after the ack only notifications follow."""
        assert msg.id is not None
        uris, list_changed, ack = self.methods.listen_filter(call, msg.params)
        hub = self.broker.hub
        self.methods.check_listen_capacity()
        listen = Listen(hub, msg.id, call.principal.tenant, uris, list_changed, _PendingWriter())
        # Registered in the same step as the capacity check (no await between them), so
        # concurrent listens cannot overshoot the limit; changes pushed before the stream
        # starts wait in the listen and follow the ack.
        hub.add_listen(listen)
        if hub.closing:
            # Asked of a worker that is stopping (on a connection it still answers while it
            # drains): the same end as the listens open at the stop, the ack and then the
            # ``complete`` result, so the client listens again elsewhere without an error.
            listen.end("shutdown")

        async def run(writer: SSEWriter) -> None:
            listen.writer = writer
            await listen.run(ack)

        return _ListenResponse(run, lambda: listen.end("disconnect"), lambda: hub.remove_listen(listen),
                               retry_ms=self.settings.retry_ms)


class _ListenResponse(SSEResponse):
    """An SSE response that releases its listen however it ends, even if the stream never started."""

    __slots__ = ("release",)

    def __init__(self, run: Callable[[SSEWriter], Awaitable[Any]], on_disconnect: Callable[[], None],
                 release: Callable[[], None], *, retry_ms: int) -> None:
        super().__init__(run, on_disconnect, retry_ms=retry_ms)
        self.release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.release()


class _PendingWriter:
    """Stands in until the response has started and the real writer exists."""

    async def send(self, message: bytes, event_id: str | None = None) -> None:
        raise RuntimeError("stream not started")

    async def send_many(self, items: list[tuple[bytes, str | None]]) -> None:
        raise RuntimeError("stream not started")

    async def comment(self) -> None:
        return None

    async def retry(self) -> None:
        return None

    async def prime(self, event_id: str) -> None:
        return None


def _nothing() -> None:
    """A disconnect of a response that has nothing left to stop."""
