"""JSON-RPC to one upstream MCP server over Streamable HTTP, in whichever era it speaks.

``probe`` learns the era once: ``server/discover`` (2026-07-28, stateless: every request carries
the ``_meta`` envelope and the SEP-2243 headers), else the ``initialize`` handshake of a 2025
server, whose session is kept as this client's shared one. ``request`` sends one request and
returns its result, whether the answer is JSON or an SSE stream (the notifications before the
answer, progress above all, go to ``on_notification``). The broker's own credentials
(``auth.UpstreamAuth``) go with each request; every header is built here, so nothing a client of
the broker sent, its token least of all, reaches the upstream.

Bounds: ``spec.concurrency`` requests in flight per client (one more is refused at once, not
queued: ``UpstreamBusy``), ``spec.timeout`` seconds for the whole of one (``UpstreamTimeout``), and
``max_bytes`` for an answer, read as it comes, never buffered past that. A request whose caller
goes away is cancelled at the upstream: its response stream is closed (that is the cancel in
2026-07-28) and, on a 2025 session, ``notifications/cancelled`` is sent.

``listen`` and ``session_stream`` open the long-lived streams ``watch.UpstreamWatch`` reads; they
are outside the concurrency bound, and only their opening is timed. Only ``url`` upstreams are
spoken to here: a ``command`` (stdio) upstream is refused at construction.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import logging
import re
import secrets
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final

import httpx
import orjson

from broker.upstreams.auth import UpstreamAuth
from broker.upstreams.errors import (
    UpstreamBusy,
    UpstreamError,
    UpstreamRpcError,
    UpstreamSessionGone,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from broker.upstreams.spec import UpstreamSpec

__all__ = ["LEGACY", "MAX_BYTES", "MODERN", "SseEvent", "UpstreamBusy", "UpstreamClient", "UpstreamError",
           "UpstreamRpcError", "UpstreamSession", "UpstreamSessionGone", "UpstreamTimeout", "UpstreamUnavailable",
           "read_events"]

logger = logging.getLogger(__name__)

MODERN: Final = "2026-07-28"
#: The version offered in ``initialize``; the server answers the one the session speaks.
LEGACY: Final = "2025-11-25"
#: The largest answer read, by default (a larger one is refused, not truncated).
MAX_BYTES: Final = 16 * 1024 * 1024
#: Seconds a ``notifications/cancelled`` (or a session's DELETE) may take; it is sent and forgotten.
CANCEL_TIMEOUT: Final = 2.0
#: Bytes of an error answer kept to read its JSON-RPC error from.
_ERROR_BYTES: Final = 65_536
_ACCEPT: Final = "application/json, text/event-stream"
_VERSION_KEY: Final = "io.modelcontextprotocol/protocolVersion"
_CAPABILITIES_KEY: Final = "io.modelcontextprotocol/clientCapabilities"
_CLIENT_INFO_KEY: Final = "io.modelcontextprotocol/clientInfo"
_SERVER_INFO_KEY: Final = "io.modelcontextprotocol/serverInfo"
#: The methods whose ``Mcp-Name`` header repeats a parameter (SEP-2243), and which one.
_NAMED: Final = {"tools/call": "name", "prompts/get": "name", "resources/read": "uri"}
_EOL: Final = re.compile(rb"\r\n|\r|\n")
_REFUSED: Final = "the upstream refused the broker's credentials"


@dataclass(frozen=True, slots=True)
class UpstreamSession:
    """A 2025 session at the upstream: its ``Mcp-Session-Id`` ("" for a server without sessions) and the
    protocol version ``initialize`` agreed on."""

    id: str
    version: str


@dataclass(frozen=True, slots=True)
class SseEvent:
    """One server-sent event: its ``id`` (a resumption cursor), and its data as a JSON-RPC message (None for
    an event without one, such as a priming event)."""

    id: str | None
    message: dict[str, Any] | None


class _Unauthorized(Exception):
    """A 401: the credentials are to be fetched again (``challenge``: its ``WWW-Authenticate``)."""

    def __init__(self, challenge: str | None) -> None:
        self.challenge = challenge


class _TooLarge(Exception):
    pass


async def read_events(chunks: AsyncIterator[bytes], limit: int, *, whole: bool) -> AsyncGenerator[SseEvent, None]:
    """The events of an SSE body. ``limit``: bytes of the whole body (``whole``, a request's answer) or of any
    one event (a long-lived stream); past it, ``_TooLarge``. Lines end in CR, LF or CRLF; comments (the
    keep-alives) and fields MCP does not use are skipped."""
    buffer = bytearray()
    total = 0
    pending = 0  # bytes of the event being read, its lines so far
    data: list[bytes] = []
    event_id: str | None = None
    seen = False
    async for chunk in chunks:
        total += len(chunk)
        if whole and total > limit:
            raise _TooLarge
        buffer += chunk
        start = 0
        for match in _EOL.finditer(buffer):
            if match.group() == b"\r" and match.end() == len(buffer):
                break  # perhaps the first half of a CRLF: wait for the next chunk
            line = bytes(buffer[start:match.start()])
            pending += match.end() - start
            start = match.end()
            if line:
                name, _, value = line.partition(b":")
                value = value[1:] if value.startswith(b" ") else value
                if name == b"data":
                    data.append(value)
                elif name == b"id":
                    event_id = value.decode(errors="replace")
                seen = seen or bool(name)
                continue
            if not whole and pending > limit:
                raise _TooLarge
            if seen:
                yield SseEvent(event_id, _decode(b"\n".join(data)) if data else None)
            data, event_id, seen, pending = [], None, False, 0
        del buffer[:start]
        if not whole and pending + len(buffer) > limit:
            raise _TooLarge


def _decode(raw: bytes) -> dict[str, Any] | None:
    try:
        message = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    return message if isinstance(message, dict) else None


def header_value(value: str) -> str:
    """A value for an ``Mcp-*`` header: plain printable ASCII as it is, anything else in SEP-2243's base64 form."""
    plain = value.isascii() and value.isprintable() and value == value.strip() and not value.startswith("=?")
    if plain:
        return value
    return "=?base64?" + base64.b64encode(value.encode()).decode() + "?="


class UpstreamClient:
    """Requests to one upstream from this worker (see the module's docstring)."""

    def __init__(self, spec: UpstreamSpec, *, client_info: dict[str, Any],
                 transport: httpx.AsyncBaseTransport | None = None, max_bytes: int = MAX_BYTES) -> None:
        if spec.url is None:
            raise ValueError(f"upstream {spec.name!r}: only url upstreams are spoken to over HTTP")
        self.spec = spec
        self.name = spec.name
        self.url = spec.url
        self.client_info = dict(client_info)
        self.max_bytes = max_bytes
        self.http = httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(spec.timeout),
                                      follow_redirects=False, headers={"User-Agent": "mcp-broker"})
        self.auth = UpstreamAuth(spec.auth, spec.url, self.http, spec.timeout, upstream=spec.name)
        #: "modern" or "legacy" once ``probe`` succeeded.
        self.era: str | None = None
        #: Requests in flight now (``request`` only).
        self.in_flight = 0
        self._server: dict[str, Any] | None = None
        self._shared: UpstreamSession | None = None
        self._probing = asyncio.Lock()
        self._opening = asyncio.Lock()
        self._ids = itertools.count(1)
        self._id_prefix = "mcpb-" + secrets.token_hex(3) + "-"
        self._background: set[asyncio.Task[None]] = set()

    # -- the era -------------------------------------------------------------------------------
    async def probe(self) -> dict[str, Any]:
        """``{"capabilities", "serverInfo", "instructions"?}`` of the upstream, learnt once (again after a
        failure), and with them its era.

        Raises:
            UpstreamError: it could not be asked (unreachable, refused the credentials, timed out).
        """
        if self._server is None:
            async with self._probing:
                if self._server is None:
                    try:
                        async with asyncio.timeout(self.spec.timeout):
                            self._server = await self._discover()
                    except TimeoutError:
                        raise UpstreamTimeout(self.name, f"no answer to server/discover or initialize within "
                                                         f"{self.spec.timeout:g} s") from None
        return self._server

    async def _discover(self) -> dict[str, Any]:
        """2026-07-28 when ``server/discover`` offers it; else the handshake (a 2025 server answers a
        modern request with a 400, 404 or 405, or a JSON-RPC error)."""
        found: dict[str, Any] | None = None
        try:
            message, _ = await self._post(self._modern_body(self._fresh_id(), "server/discover", {}),
                                          self._modern_headers("server/discover", {}), None)
            found = self._result(message)
        except UpstreamRpcError:
            pass
        except UpstreamUnavailable as exc:
            if isinstance(exc, UpstreamSessionGone) or exc.status not in (400, 404, 405):
                raise
        if found is not None and MODERN in (found.get("supportedVersions") or ()):
            self.era = "modern"
            meta = found.get("_meta")
            return _server(found, meta.get(_SERVER_INFO_KEY) if isinstance(meta, dict) else None)
        session, result = await self._initialize()
        self._shared, self.era = session, "legacy"
        return _server(result, result.get("serverInfo"))

    # -- 2025 sessions ---------------------------------------------------------------------------
    async def open_session(self) -> UpstreamSession:
        """A new 2025 session at the upstream (``initialize``, then ``notifications/initialized``)."""
        try:
            async with asyncio.timeout(self.spec.timeout):
                session, _ = await self._initialize()
        except TimeoutError:
            raise UpstreamTimeout(self.name, f"no answer to initialize within {self.spec.timeout:g} s") from None
        return session

    async def _initialize(self) -> tuple[UpstreamSession, dict[str, Any]]:
        body = {"jsonrpc": "2.0", "id": self._fresh_id(), "method": "initialize",
                "params": {"protocolVersion": LEGACY, "capabilities": {}, "clientInfo": self.client_info}}
        message, headers = await self._post(body, {}, None)
        result = self._result(message)
        session = UpstreamSession(str(headers.get("mcp-session-id") or ""), str(result.get("protocolVersion")
                                                                                  or LEGACY))
        await self._post({"jsonrpc": "2.0", "method": "notifications/initialized"}, _session_headers(session), None)
        return session, result

    async def _shared_session(self) -> UpstreamSession:
        if self._shared is None:
            async with self._opening:
                if self._shared is None:
                    self._shared, _ = await self._initialize()
        return self._shared

    async def _renew(self, gone: UpstreamSession, *, shared: bool) -> UpstreamSession:
        """A session in place of one the upstream forgot; the shared one is renewed once for all its users."""
        if not shared:
            return (await self._initialize())[0]
        async with self._opening:
            if self._shared is None or self._shared == gone:
                self._shared = None
                self._shared, _ = await self._initialize()
            return self._shared

    async def close_session(self, session: UpstreamSession) -> None:
        """End a 2025 session (DELETE); a failure is only logged: the upstream forgets idle sessions itself."""
        if self._shared == session:
            self._shared = None
        if not session.id:
            return
        try:
            async with asyncio.timeout(CANCEL_TIMEOUT):
                await self.http.delete(self.url, headers={**_session_headers(session), **await self.auth.headers()})
        except Exception as exc:  # best effort, whatever went wrong (the client may be closed already)
            logger.debug("upstream %r: ending a session failed: %s", self.name, exc)

    # -- requests ------------------------------------------------------------------------------
    async def request(self, method: str, params: dict[str, Any], *, session: UpstreamSession | None = None,
                      request_id: str | int | None = None,
                      on_notification: Callable[[dict[str, Any]], Awaitable[None]] | None = None,
                      ) -> tuple[dict[str, Any], UpstreamSession | None]:
        """The result of ``method`` and the 2025 session it went on (None in 2026-07-28).

        2025: on ``session``, else this client's shared one; a session the upstream forgot is opened
        again, once, and the new one returned. ``request_id`` is the JSON-RPC id (a fresh one if None).
        A failure of ``on_notification`` ends the request with it.

        Raises:
            UpstreamBusy, UpstreamTimeout, UpstreamRpcError, UpstreamUnavailable.
        """
        if self.in_flight >= self.spec.concurrency:
            raise UpstreamBusy(self.name, f"{self.spec.concurrency} requests are in flight to it already")
        self.in_flight += 1
        id_ = request_id if request_id is not None else self._fresh_id()
        sent_on: list[UpstreamSession] = []
        try:
            async with asyncio.timeout(self.spec.timeout):
                await self.probe()
                return await self._send(method, params, id_, session, on_notification, sent_on)
        except TimeoutError:
            self._cancel_later(sent_on, id_, "the broker's timeout")
            raise UpstreamTimeout(self.name, f"{method} took longer than {self.spec.timeout:g} s") from None
        except asyncio.CancelledError:
            self._cancel_later(sent_on, id_, "the client went away")
            raise
        finally:
            self.in_flight -= 1

    async def _send(self, method: str, params: dict[str, Any], id_: str | int, session: UpstreamSession | None,
                    on_notification: Callable[[dict[str, Any]], Awaitable[None]] | None,
                    sent_on: list[UpstreamSession]) -> tuple[dict[str, Any], UpstreamSession | None]:
        if self.era == "modern":
            message, _ = await self._post(self._modern_body(id_, method, params),
                                          self._modern_headers(method, params), on_notification)
            return self._result(message), None
        used = session or await self._shared_session()
        body = {"jsonrpc": "2.0", "id": id_, "method": method, "params": params}
        sent_on.append(used)
        try:
            message, _ = await self._post(body, _session_headers(used), on_notification)
        except UpstreamSessionGone:
            used = await self._renew(used, shared=session is None)
            sent_on.append(used)
            message, _ = await self._post(body, _session_headers(used), on_notification)
        return self._result(message), used

    async def session_request(self, method: str, params: dict[str, Any], session: UpstreamSession) -> dict[str, Any]:
        """A request on ``session`` outside the concurrency bound (a watch's subscriptions), with no renewal.

        Raises:
            UpstreamSessionGone: the upstream forgot the session; and as ``request``.
        """
        try:
            async with asyncio.timeout(self.spec.timeout):
                body = {"jsonrpc": "2.0", "id": self._fresh_id(), "method": method, "params": params}
                message, _ = await self._post(body, _session_headers(session), None)
        except TimeoutError:
            raise UpstreamTimeout(self.name, f"{method} took longer than {self.spec.timeout:g} s") from None
        return self._result(message)

    async def notify(self, method: str, params: dict[str, Any], *, session: UpstreamSession | None = None) -> None:
        """Send a notification (on ``session``, else the shared session, in 2025).

        Raises:
            UpstreamSessionGone: the upstream forgot the session (the shared one is opened anew by the next
            request); and as ``request``.
        """
        body = {"jsonrpc": "2.0", "method": method, "params": params}
        try:
            async with asyncio.timeout(self.spec.timeout):
                await self.probe()
                if self.era == "modern":
                    await self._post(body, {"MCP-Protocol-Version": MODERN, "Mcp-Method": method}, None)
                    return
                used = session or await self._shared_session()
                try:
                    await self._post(body, _session_headers(used), None)
                except UpstreamSessionGone:
                    if session is None and self._shared == used:
                        self._shared = None
                    raise
        except TimeoutError:
            raise UpstreamTimeout(self.name, f"{method} took longer than {self.spec.timeout:g} s") from None

    def _cancel_later(self, sent_on: list[UpstreamSession], request_id: str | int, reason: str) -> None:
        """Tell a 2025 session its request is abandoned, without waiting (2026-07-28: the closed stream said it)."""
        if not sent_on:
            return
        body = {"jsonrpc": "2.0", "method": "notifications/cancelled",
                "params": {"requestId": request_id, "reason": reason}}
        task = asyncio.get_running_loop().create_task(self._send_quietly(body, sent_on[-1]))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _send_quietly(self, body: dict[str, Any], session: UpstreamSession) -> None:
        try:
            async with asyncio.timeout(CANCEL_TIMEOUT):
                await self._post(body, _session_headers(session), None)
        except Exception as exc:  # fire and forget: nobody waits for it
            logger.debug("upstream %r: %s was not delivered: %s", self.name, body["method"], exc)

    async def aclose(self) -> None:
        """Let the cancellations under way finish, end the shared session, close the connections."""
        if self._background:
            await asyncio.wait(set(self._background), timeout=CANCEL_TIMEOUT)
        if self._shared is not None:
            await self.close_session(self._shared)
        await self.http.aclose()

    # -- the wire --------------------------------------------------------------------------------
    def _fresh_id(self) -> str:
        return f"{self._id_prefix}{next(self._ids)}"

    def _modern_body(self, id_: str | int, method: str, params: dict[str, Any]) -> dict[str, Any]:
        """The request with 2026-07-28's envelope in ``_meta``: the broker's own capabilities (none) and identity,
        whatever the caller's ``_meta`` said of them."""
        meta = params.get("_meta")
        envelope = {**(meta if isinstance(meta, dict) else {}), _VERSION_KEY: MODERN, _CAPABILITIES_KEY: {},
                    _CLIENT_INFO_KEY: self.client_info}
        return {"jsonrpc": "2.0", "id": id_, "method": method, "params": {**params, "_meta": envelope}}

    @staticmethod
    def _modern_headers(method: str, params: dict[str, Any]) -> dict[str, str]:
        headers = {"MCP-Protocol-Version": MODERN, "Mcp-Method": method}
        named = params.get(_NAMED.get(method, ""))
        if isinstance(named, str):
            headers["Mcp-Name"] = header_value(named)
        return headers

    def _result(self, message: dict[str, Any] | None) -> dict[str, Any]:
        if message is None:
            raise UpstreamUnavailable(self.name, "it accepted a request without answering it")
        error = message.get("error")
        if isinstance(error, dict):
            code = error.get("code")
            raise UpstreamRpcError(self.name, code if isinstance(code, int) else -32603,
                                   str(error.get("message", "")), error.get("data"))
        result = message.get("result")
        if not isinstance(result, dict):
            raise UpstreamUnavailable(self.name, "its answer is not a JSON-RPC result")
        return result

    async def _post(self, body: dict[str, Any], headers: dict[str, str],
                    on_notification: Callable[[dict[str, Any]], Awaitable[None]] | None,
                    ) -> tuple[dict[str, Any] | None, httpx.Headers]:
        """POST one message: its answer (None for an accepted notification) and the response's headers. A 401
        fetches the credentials again, once."""
        content = orjson.dumps(body)
        for attempt in (1, 2):
            request = self.http.build_request("POST", self.url, content=content, headers={
                "Accept": _ACCEPT, "Content-Type": "application/json", **headers, **await self.auth.headers()})
            try:
                return await self._exchange(request, body.get("id"), "Mcp-Session-Id" in headers, on_notification)
            except _Unauthorized as exc:
                if attempt == 2:
                    raise UpstreamUnavailable(self.name, _REFUSED, status=401) from None
                self.auth.invalidate(exc.challenge)
        raise AssertionError("unreachable")

    async def _exchange(self, request: httpx.Request, id_: Any, in_session: bool,
                        on_notification: Callable[[dict[str, Any]], Awaitable[None]] | None,
                        ) -> tuple[dict[str, Any] | None, httpx.Headers]:
        response = await self._open(request)
        try:
            await self._check(response, in_session)
            if response.status_code == 202 or id_ is None:
                return None, response.headers
            kind = str(response.headers.get("content-type", "")).split(";")[0].strip().lower()
            message: dict[str, Any] | None
            if kind == "text/event-stream":
                message = await self._answer_in(response, id_, on_notification)
            elif kind == "application/json":
                message = _decode(await self._body(response, self.max_bytes))
            else:
                raise UpstreamUnavailable(self.name, f"it answered {kind or 'no content type'}, not MCP",
                                          status=response.status_code)
            if message is None:
                raise UpstreamUnavailable(self.name, "its answer is not a JSON-RPC message")
            return message, response.headers
        except _TooLarge:
            raise UpstreamUnavailable(self.name, f"its answer is larger than {self.max_bytes} bytes") from None
        except httpx.TimeoutException:
            raise UpstreamTimeout(self.name, "it stopped sending its answer") from None
        except httpx.HTTPError as exc:
            raise UpstreamUnavailable(self.name, f"the connection broke ({type(exc).__name__})") from None
        finally:
            await response.aclose()  # before the answer's end: the request's cancel, in 2026-07-28

    async def _open(self, request: httpx.Request) -> httpx.Response:
        try:
            return await self.http.send(request, stream=True)
        except httpx.TimeoutException:
            raise UpstreamTimeout(self.name, "no connection or answer in time") from None
        except httpx.HTTPError as exc:
            raise UpstreamUnavailable(self.name, f"cannot reach {self.url} ({type(exc).__name__})") from None

    async def _check(self, response: httpx.Response, in_session: bool) -> None:
        """Raise for a status that is no answer: 401/403, a forgotten session, an error, a failure."""
        status = response.status_code
        if status in (200, 202):
            return
        body = await self._body(response, _ERROR_BYTES, cut=True)
        if status == 401:
            raise _Unauthorized(response.headers.get("www-authenticate"))
        if status == 403:
            raise UpstreamUnavailable(self.name, _REFUSED, status=status)
        if status == 404 and in_session:
            raise UpstreamSessionGone(self.name, "it no longer knows the session (404)", status=status)
        message = _decode(body) if status < 500 else None
        error = message.get("error") if message is not None else None
        if isinstance(error, dict) and isinstance(error.get("code"), int):
            raise UpstreamRpcError(self.name, error["code"], str(error.get("message", "")), error.get("data"))
        raise UpstreamUnavailable(self.name, f"it answered HTTP {status}", status=status)

    async def _body(self, response: httpx.Response, limit: int, *, cut: bool = False) -> bytes:
        """The body, at most ``limit`` bytes: past it, ``_TooLarge`` (or the first ``limit`` bytes, ``cut``)."""
        declared = response.headers.get("content-length", "")
        if not cut and declared.isdigit() and int(declared) > limit:
            raise _TooLarge
        data = bytearray()
        async for chunk in response.aiter_bytes():
            data += chunk
            if len(data) > limit:
                if cut:
                    return bytes(data[:limit])
                raise _TooLarge
        return bytes(data)

    async def _answer_in(self, response: httpx.Response, id_: Any,
                         on_notification: Callable[[dict[str, Any]], Awaitable[None]] | None) -> dict[str, Any]:
        """The answer to ``id_`` in an SSE stream; the notifications before it go to ``on_notification``.
        A request of the upstream's is left unanswered: the broker declares no client capability."""
        async with contextlib.aclosing(read_events(response.aiter_bytes(), self.max_bytes, whole=True)) as events:
            async for event in events:
                message = event.message
                if message is None:
                    continue
                if "method" not in message and message.get("id") == id_:
                    return message
                if "method" in message and "id" not in message and on_notification is not None:
                    await on_notification(message)
        raise UpstreamUnavailable(self.name, "it ended the answer's stream without the answer")

    # -- long-lived streams ------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def listen(self, notifications: dict[str, Any], request_id: str) -> AsyncIterator[AsyncIterator[SseEvent]]:
        """A 2026-07-28 ``subscriptions/listen`` with this filter: its events, until the block is left (which
        ends the listen at the upstream)."""
        body = self._modern_body(request_id, "subscriptions/listen", {"notifications": notifications})
        async with self._stream("POST", orjson.dumps(body), {
                "Accept": _ACCEPT, "Content-Type": "application/json",
                **self._modern_headers("subscriptions/listen", {})}, in_session=False) as events:
            yield events

    @contextlib.asynccontextmanager
    async def session_stream(self, session: UpstreamSession,
                             last_event_id: str | None = None) -> AsyncIterator[AsyncIterator[SseEvent]]:
        """The GET stream of a 2025 session (resumed after ``last_event_id``): its events, until the block is
        left.

        Raises:
            UpstreamSessionGone: the upstream forgot the session.
        """
        headers = {"Accept": "text/event-stream", **_session_headers(session)}
        if last_event_id is not None:
            headers["Last-Event-ID"] = last_event_id
        async with self._stream("GET", None, headers, in_session=True) as events:
            yield events

    @contextlib.asynccontextmanager
    async def _stream(self, method: str, content: bytes | None, headers: dict[str, str], *,
                      in_session: bool) -> AsyncIterator[AsyncIterator[SseEvent]]:
        response = await self._open_stream(method, content, headers, in_session)
        events = self._stream_events(response)
        try:
            yield events
        finally:
            await events.aclose()
            await response.aclose()

    async def _open_stream(self, method: str, content: bytes | None, headers: dict[str, str],
                           in_session: bool) -> httpx.Response:
        """An SSE response, opened within ``spec.timeout`` and then read for as long as it lasts."""
        timeout = httpx.Timeout(self.spec.timeout, read=None)
        try:
            async with asyncio.timeout(self.spec.timeout):
                for attempt in (1, 2):
                    request = self.http.build_request(method, self.url, content=content, timeout=timeout,
                                                      headers={**headers, **await self.auth.headers()})
                    response = await self._open(request)
                    try:
                        await self._check(response, in_session)
                        kind = str(response.headers.get("content-type", "")).split(";")[0].strip().lower()
                        if kind != "text/event-stream":
                            message = _decode(await self._body(response, _ERROR_BYTES, cut=True))
                            if message is not None:
                                self._result(message)  # the upstream's error, passed on
                            raise UpstreamUnavailable(self.name, f"it answered {method} without a stream")
                        return response
                    except _Unauthorized as exc:
                        await response.aclose()
                        if attempt == 2:
                            raise UpstreamUnavailable(self.name, _REFUSED, status=401) from None
                        self.auth.invalidate(exc.challenge)
                    except BaseException:
                        await response.aclose()
                        raise
        except TimeoutError:
            raise UpstreamTimeout(self.name, f"its stream did not open within {self.spec.timeout:g} s") from None
        except httpx.HTTPError as exc:
            raise UpstreamUnavailable(self.name, f"the connection broke ({type(exc).__name__})") from None
        raise AssertionError("unreachable")

    async def _stream_events(self, response: httpx.Response) -> AsyncGenerator[SseEvent, None]:
        try:
            async with contextlib.aclosing(read_events(response.aiter_bytes(), self.max_bytes, whole=False)) as events:
                async for event in events:
                    yield event
        except _TooLarge:
            raise UpstreamUnavailable(self.name, f"it sent an event larger than {self.max_bytes} bytes") from None
        except httpx.HTTPError as exc:
            raise UpstreamUnavailable(self.name, f"its stream broke ({type(exc).__name__})") from None


def _session_headers(session: UpstreamSession) -> dict[str, str]:
    headers = {"MCP-Protocol-Version": session.version}
    if session.id:
        headers["Mcp-Session-Id"] = session.id
    return headers


def _server(result: dict[str, Any], server_info: Any) -> dict[str, Any]:
    """What ``probe`` tells of a server, the same in both eras."""
    found: dict[str, Any] = {
        "capabilities": result.get("capabilities") if isinstance(result.get("capabilities"), dict) else {},
        "serverInfo": server_info if isinstance(server_info, dict) else {}}
    if isinstance(result.get("instructions"), str):
        found["instructions"] = result["instructions"]
    return found
