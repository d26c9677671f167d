"""JSON-RPC to one upstream MCP server, in whichever era it speaks: over Streamable HTTP, or to its process.

``probe`` learns the era once: ``server/discover`` (2026-07-28, stateless: every request carries
the ``_meta`` envelope and the SEP-2243 headers), else the ``initialize`` handshake of a 2025
server, whose session is kept as this client's shared one. ``request`` sends one request and
returns its result, whether the answer is JSON or an SSE stream (the notifications before the
answer, progress above all, go to ``on_notification``). The broker's own credentials
(``auth.UpstreamAuth``) go with each request; every header is built here and in
``streamable.HttpWire``, so nothing a client of the broker sent, its token least of all, reaches
the upstream.

Bounds: ``spec.concurrency`` requests in flight per client (one more is refused at once, not
queued: ``UpstreamBusy``), ``spec.timeout`` seconds for the whole of one (``UpstreamTimeout``), and
``max_bytes`` for an answer, read as it comes, never buffered past that. A request whose caller
goes away is cancelled at the upstream: its response stream is closed (that is the cancel in
2026-07-28) and, on a 2025 session, ``notifications/cancelled`` is sent.

``listen`` and ``session_stream`` open the long-lived streams ``watch.UpstreamWatch`` reads; they
are outside the concurrency bound, and only their opening is timed.

A ``command`` upstream (``stdio.StdioUpstream``) is one process per client, in the 2025 era: the
process is the one session (``open_session`` returns it, a new one once the process was started
again), and a request's id on its wire is always one of the client's own, since every caller
shares the process (``request_id`` is not used).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import logging
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
from broker.upstreams.stdio import StdioUpstream
from broker.upstreams.streamable import ACCEPT, HttpWire, Notify, SseEvent, read_events, rpc_result

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
_VERSION_KEY: Final = "io.modelcontextprotocol/protocolVersion"
_CAPABILITIES_KEY: Final = "io.modelcontextprotocol/clientCapabilities"
_CLIENT_INFO_KEY: Final = "io.modelcontextprotocol/clientInfo"
_SERVER_INFO_KEY: Final = "io.modelcontextprotocol/serverInfo"
#: The methods whose ``Mcp-Name`` header repeats a parameter (SEP-2243), and which one.
_NAMED: Final = {"tools/call": "name", "prompts/get": "name", "resources/read": "uri"}


@dataclass(frozen=True, slots=True)
class UpstreamSession:
    """A 2025 session at the upstream: its ``Mcp-Session-Id`` ("" for a server without sessions) and the
    protocol version ``initialize`` agreed on."""

    id: str
    version: str


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
        self.spec = spec
        self.name = spec.name
        self.url = spec.url or ""
        #: A ``command`` upstream's process (then no HTTP is spoken).
        self._stdio = StdioUpstream(spec.name, spec.command, max_bytes, spec.env) if spec.command else None
        self.client_info = dict(client_info)
        self.max_bytes = max_bytes
        self.http = httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(spec.timeout),
                                      follow_redirects=False, headers={"User-Agent": "mcp-broker"})
        self.auth = UpstreamAuth(spec.auth, spec.url, self.http, spec.timeout, upstream=spec.name)
        self._http = HttpWire(spec.name, self.url, self.http, self.auth, timeout=spec.timeout, max_bytes=max_bytes)
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
            if self._stdio is not None:
                raise UpstreamRpcError(self.name, -32601, "a stdio upstream is spoken to in the 2025 era")
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
        if self._stdio is not None:  # the process is the session: opened once per process
            session_id, opened = await self._stdio.open(body)
            result = self._result(opened)
            return UpstreamSession(session_id, str(result.get("protocolVersion") or LEGACY)), result
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
        if not session.id or self._stdio is not None:
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
        id_ = request_id if request_id is not None and self._stdio is None else self._fresh_id()
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
        if self._stdio is not None:
            await self._stdio.aclose()
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
        return rpc_result(self.name, message)

    async def _post(self, body: dict[str, Any], headers: dict[str, str], on_notification: Notify | None,
                    ) -> tuple[dict[str, Any] | None, httpx.Headers]:
        """One message to the upstream, and its answer (None for a notification): POSTed, or written to the
        process in the session it names."""
        if self._stdio is not None:
            return await self._stdio.send(body, headers.get("Mcp-Session-Id"), on_notification), httpx.Headers()
        return await self._http.post(body, headers, on_notification)

    # -- long-lived streams ------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def listen(self, notifications: dict[str, Any], request_id: str) -> AsyncIterator[AsyncIterator[SseEvent]]:
        """A 2026-07-28 ``subscriptions/listen`` with this filter: its events, until the block is left (which
        ends the listen at the upstream)."""
        body = self._modern_body(request_id, "subscriptions/listen", {"notifications": notifications})
        if self._stdio is not None:
            raise UpstreamUnavailable(self.name, "a stdio upstream is spoken to in the 2025 era, without listens")
        async with self._http.stream("POST", orjson.dumps(body), {
                "Accept": ACCEPT, "Content-Type": "application/json",
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
        if self._stdio is not None:  # the process's notifications, with no cursor to resume from
            async with self._stdio.stream(session.id) as messages:
                yield _as_events(messages)
            return
        headers = {"Accept": "text/event-stream", **_session_headers(session)}
        if last_event_id is not None:
            headers["Last-Event-ID"] = last_event_id
        async with self._http.stream("GET", None, headers, in_session=True) as events:
            yield events

async def _as_events(messages: AsyncIterator[dict[str, Any]]) -> AsyncGenerator[SseEvent, None]:
    async for message in messages:
        yield SseEvent(None, message)


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
