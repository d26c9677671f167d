"""Streamable HTTP on ``/mcp``: both protocol eras on one endpoint; statuses, headers and SSE only.

What each message means is ``broker.dispatch``'s; this module picks the era
(``protocol.envelope.http_era``, as the official Python SDK routes: docs/PROTOCOL.md), checks
what HTTP itself asks (methods, ``Accept``, ``Content-Type``, the body's size, the session
header) and turns the dispatcher's answers into responses. Origin and authentication were
checked at the edge (``transport/edge.py``) before the request got here.

Legacy choices the specification leaves open:

* POST requests are answered with ``application/json``, except a request forwarded to an upstream
  whose caller asked for progress (``params._meta.progressToken``): an SSE stream of the
  upstream's ``notifications/progress``, then the answer, without event ids. Only the GET stream
  carries them, so ``Last-Event-ID`` always names a position in the session's inbox.
* One live GET stream per session: a second GET *takes over* and the first one ends. A
  client whose connection died half-open is never locked out (a 409 would lock it out until
  the server noticed), and a message goes to exactly one stream.
* A GET without ``Last-Event-ID`` starts at the beginning of the inbox when the session never
  had a stream (so nothing published between ``initialize`` and the first GET is lost), and
  at its head otherwise.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from broker.auth import Principal, scopes
from broker.auth.scopes import SUBSCRIBE
from broker.delivery import EndReason, Listen
from broker.dispatch import Dispatcher
from broker.errors import BackendUnavailable, Refusal, SessionNotFound
from broker.feeds.listen import ResumableListen
from broker.feeds.model import Cursor, parse_event_id
from broker.feeds.service import SessionRecord, honours
from broker.methods import FORWARDED, Call
from broker.protocol import jsonrpc as rpc
from broker.protocol.envelope import http_era
from broker.protocol.versions import DEFAULT_LEGACY, LEGACY_VERSIONS, MODERN_VERSIONS, PRIMING_VERSIONS
from broker.transport.edge import (
    BadBody,
    Style,
    json_response,
    principal_of,
    read_json,
    refusal,
    rpc_error,
    unavailable,
)
from broker.transport.rpc import as_rpc
from broker.transport.sse import SSEResponse, SSEWriter

__all__ = ["McpEndpoint"]

logger = logging.getLogger(__name__)

SESSION_HEADER = "mcp-session-id"
JSON = "application/json"


class HttpError(Exception):
    """Ends a request with ``response`` (a refusal found on the way)."""

    def __init__(self, response: Response) -> None:
        self.response = response


def http_error(status: int, message: str, headers: dict[str, str] | None = None) -> HttpError:
    """A refusal of what HTTP itself asks (method, headers, body, session header), with its own status."""
    return HttpError(refusal(Style.RPC, status, message, headers))


def _accepts(accept: str, media_type: str) -> bool:
    kinds = {part.split(";")[0].strip().lower() for part in accept.split(",")}
    major = media_type.split("/")[0]
    return media_type in kinds or "*/*" in kinds or f"{major}/*" in kinds


class McpEndpoint:
    """The ASGI app mounted at ``/mcp``."""

    def __init__(self, dispatcher: Dispatcher, *, max_body_bytes: int, retry_ms: int,
                 challenge: Callable[[str], str] = scopes.challenge) -> None:
        self.dispatcher = dispatcher
        self.max_body_bytes = max_body_bytes
        self.retry_ms = retry_ms
        #: The ``WWW-Authenticate`` value of a 403 for a missing scope (it names the resource metadata).
        self.challenge = challenge

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = await self.respond(scope, receive)
        await response(scope, receive, send)

    async def respond(self, scope: Scope, receive: Receive) -> Response | SSEResponse:
        """The response to one request, for the caller to run.

        ``BrokerApp`` runs it in its own frame: a stream then keeps no frame of this endpoint
        suspended for its lifetime, nor the request object (it is not kept past ``handle``).
        """
        try:
            return await self.handle(Request(scope, receive), principal_of(scope))
        except HttpError as exc:
            return exc.response
        except BackendUnavailable as exc:
            return unavailable(Style.RPC, exc)

    async def handle(self, request: Request, principal: Principal) -> Response | SSEResponse:
        version_header = request.headers.get("mcp-protocol-version")
        modern_header = version_header is not None and version_header not in LEGACY_VERSIONS
        method = request.method
        if method == "POST":
            return await self.post(request, principal, version_header)
        if method in ("GET", "DELETE") and modern_header and version_header not in MODERN_VERSIONS:
            # A version nobody speaks is a bad request (docs/PROTOCOL.md), not a modern GET (405).
            raise http_error(400, f"Bad Request: unsupported MCP-Protocol-Version {version_header}")
        if method == "GET" and not modern_header:
            return await self.get(request, principal, version_header)
        if method == "DELETE" and not modern_header:
            await self.dispatcher.end_session(await self._session(request, principal))
            return Response(status_code=200)
        raise http_error(405, "Method not allowed", {"Allow": "POST" if modern_header else "GET, POST, DELETE"})

    # -- POST -------------------------------------------------------------------------------
    async def post(self, request: Request, principal: Principal, version_header: str | None) -> Response | SSEResponse:
        accept = request.headers.get("accept", "")
        if not (_accepts(accept, JSON) and _accepts(accept, "text/event-stream")):
            raise http_error(406, "Not Acceptable: Accept must list application/json and text/event-stream")
        if request.headers.get("content-type", "").split(";")[0].strip().lower() != JSON:
            raise http_error(415, "Unsupported Media Type: Content-Type must be application/json")
        try:
            obj = await read_json(request, self.max_body_bytes)
        except BadBody as exc:
            if exc.status != 400:
                raise http_error(exc.status, f"Request body larger than {self.max_body_bytes} bytes") from exc
            raise HttpError(rpc_error(rpc.RpcError(rpc.PARSE_ERROR, "Parse error: body is not valid JSON"))) from exc
        era = http_era(version_header, obj)
        if era is None:
            raise http_error(400, f"Bad Request: unsupported MCP-Protocol-Version {version_header}")
        if era == "modern":
            return await self.post_modern(request, principal, obj)
        return await self.post_legacy(request, principal, obj)

    async def post_legacy(self, request: Request, principal: Principal, obj: Any) -> Response | SSEResponse:
        if isinstance(obj, list):
            try:
                self.dispatcher.check_batch(obj)  # before the session: a refused batch touches nothing
            except rpc.RpcError as exc:
                return rpc_error(exc)
            call = Call(principal, False, await self._session(request, principal), request.headers.get)
            try:
                body = await self.dispatcher.batch(call, obj)
            except rpc.RpcError as exc:
                return rpc_error(exc)
            return Response(status_code=202) if body is None else json_response(body)
        msg = _parse(obj)
        if msg.method == "initialize":
            try:
                body, record = await self.dispatcher.initialize(principal, msg, request.headers.get)
            except (rpc.RpcError, Refusal) as exc:
                return rpc_error(exc, msg.id)
            return json_response(body, headers={"Mcp-Session-Id": record.id})
        if msg.is_request and (refused := self.dispatcher.refusal(principal, msg.method)) is not None:
            return self._error(refused, msg.id)
        try:
            call = Call(principal, False, await self._session(request, principal), request.headers.get)
            if _wants_progress(msg):
                return self._forwarded(msg, lambda progress: self.dispatcher.legacy(
                    replace(call, progress=progress), msg))
            reply = await self.dispatcher.legacy(call, msg, whole=True)
        except (rpc.RpcError, Refusal) as exc:  # e.g. a quota's refusal: 429 with Retry-After
            return rpc_error(exc, msg.id)
        return Response(status_code=202) if reply is None else json_response(reply)

    async def post_modern(self, request: Request, principal: Principal, obj: Any) -> Response | SSEResponse:
        if isinstance(obj, list):
            raise http_error(400, "Invalid Request: batches are not supported")
        msg = _parse(obj)
        if msg.kind == "notification":
            return Response(status_code=202)  # e.g. a stray notifications/cancelled: accepted and dropped
        if msg.kind == "response":
            raise http_error(400, "Clients must not send responses")
        if _wants_progress(msg):
            if (refused := self.dispatcher.refusal(principal, msg.method)) is not None:
                return self._error(refused, msg.id)
            header = request.headers.get
            return self._forwarded(msg, lambda progress: self._modern_reply(principal, msg, header, progress))
        try:
            answer = await self.dispatcher.modern(principal, msg, request.headers.get)
        except (rpc.RpcError, Refusal) as exc:
            return self._error(exc, msg.id)
        if isinstance(answer, Listen | ResumableListen):
            return self._listen_response(answer)
        return json_response(answer)

    async def _modern_reply(self, principal: Principal, msg: rpc.Message, header: Callable[[str], str | None],
                            progress: Callable[[dict[str, Any]], Awaitable[None]]) -> bytes:
        answer = await self.dispatcher.modern(principal, msg, header, progress)
        assert isinstance(answer, bytes)  # a forwarded method is no listen
        return answer

    def _forwarded(self, msg: rpc.Message,
                   reply: Callable[[Callable[[dict[str, Any]], Awaitable[None]]], Awaitable[bytes | None]],
                   ) -> SSEResponse:
        """A forwarded request answered as SSE: the upstream's notifications about it, then its answer.
        The client going away cancels it (2026-07-28: closing the stream is the cancel; before, nothing
        else could still receive the answer), and the cancel reaches the upstream."""
        holder: dict[str, asyncio.Task[bytes | None]] = {}

        async def run(writer: SSEWriter) -> None:
            async def progress(note: dict[str, Any]) -> None:
                await writer.send(orjson.dumps(note))

            task = holder["task"] = asyncio.ensure_future(reply(progress))
            try:
                answer = await task
            except (rpc.RpcError, Refusal) as exc:
                answer = rpc.encode_error(msg.id, as_rpc(exc))
            except asyncio.CancelledError:
                if task.cancelled() and not _cancelling():
                    return  # the client left: nothing to answer
                raise
            if answer is not None:
                await writer.send(answer)

        def disconnected() -> None:
            task = holder.get("task")
            if task is not None:
                task.cancel()

        return SSEResponse(run, disconnected, retry_ms=self.retry_ms)

    def _listen_response(self, listen: Listen | ResumableListen) -> SSEResponse:
        """The stream of an opened listen; after its ack only notifications follow."""
        dispatcher = self.dispatcher
        return _ListenResponse(listen.run, lambda: listen.end(EndReason.DISCONNECT),
                               lambda: dispatcher.close_listen(listen), retry_ms=self.retry_ms)

    # -- GET (legacy) -----------------------------------------------------------------------------
    async def get(self, request: Request, principal: Principal, version_header: str | None) -> Response | SSEResponse:
        if not _accepts(request.headers.get("accept", ""), "text/event-stream"):
            raise http_error(406, "Not Acceptable: Accept must list text/event-stream")
        if SUBSCRIBE not in principal.scopes:
            raise HttpError(self._error(scopes.forbidden("the GET stream", SUBSCRIBE), None))
        session = await self._session(request, principal)
        if self.dispatcher.closing:
            # A stopping worker still answers requests on open connections while it drains (see
            # broker/runtime/server.py): a stream asked for now ends at once the way the streams open here
            # ended, with ``retry:``, and the client comes back on another worker, with no error.
            return SSEResponse(SSEWriter.retry, _nothing, retry_ms=self.retry_ms)
        last_event_id = request.headers.get("last-event-id")
        cursor: int | None = None
        resync = False
        if last_event_id is not None:
            parsed = parse_event_id(last_event_id)
            if parsed is None:
                raise http_error(400, "Bad Request: malformed Last-Event-ID")
            cursor = parsed[1]
            if not honours(session, Cursor(session.id, *parsed)):
                resync, cursor = True, 0  # the gap rule, never "replay everything"
        version = version_header or session.protocol_version or DEFAULT_LEGACY
        try:
            release = await self.dispatcher.stream_lease(session)
        except Refusal as exc:
            return rpc_error(exc)
        # Made once its place is held: a stream bound to its credential holds a timer until it runs.
        stream = self.dispatcher.legacy_stream(session, cursor, resync=resync, priming=version in PRIMING_VERSIONS,
                                               principal=principal)
        if release is not None:  # the tenant's streams quota: its place goes back however the stream ends
            return _ListenResponse(stream.run, stream.disconnect, lambda: release(stream.ended), retry_ms=self.retry_ms)
        # Bound methods rather than closures: nothing else per stream to keep for its lifetime.
        return SSEResponse(stream.run, stream.disconnect, retry_ms=self.retry_ms)

    def _error(self, error: rpc.RpcError | Refusal, id_: rpc.Id | None) -> Response:
        """``error`` as the whole answer; a missing scope's 403 says which in ``WWW-Authenticate``."""
        if not isinstance(error, rpc.RpcError) or error.code != rpc.INSUFFICIENT_SCOPE:
            return rpc_error(error, id_)
        return rpc_error(error, id_, {"WWW-Authenticate": self.challenge(error.data["scope"])})

    async def _session(self, request: Request, principal: Principal) -> SessionRecord:
        sid = request.headers.get(SESSION_HEADER)
        if not sid:
            raise http_error(400, "Bad Request: Mcp-Session-Id header is required")
        try:
            return await self.dispatcher.load_session(sid, principal)
        except SessionNotFound as exc:
            raise http_error(404, "Session not found") from exc


def _wants_progress(msg: rpc.Message) -> bool:
    """A request forwarded to an upstream whose caller asked for its progress: answered as SSE."""
    if msg.method not in FORWARDED or not msg.is_request:
        return False
    meta = msg.params.get("_meta")
    return isinstance(meta, dict) and isinstance(meta.get("progressToken"), str | int)


def _cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _parse(obj: Any) -> rpc.Message:
    try:
        return rpc.parse_message(obj)
    except rpc.RpcError as exc:
        raise HttpError(rpc_error(exc, rpc.request_id_of(obj))) from exc


class _ListenResponse(SSEResponse):
    """An SSE response that releases its listen (or a stream's quota place) however it ends, even if
    the stream never started."""

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


def _nothing() -> None:
    """A disconnect of a response that has nothing left to stop."""
