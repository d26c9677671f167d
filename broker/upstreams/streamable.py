"""Streamable HTTP, as the broker speaks it to an upstream: one POST and its answer, or a stream held open.

An answer is JSON or an SSE stream (notifications, then the answer); both are read as they come,
never buffered past ``max_bytes``. The statuses that are no answer become the errors of
``errors``: a 401 fetches the credentials again once, 403 and 5xx make the upstream unavailable, a
404 to a request in a session says the session is gone, and any other refusal with a JSON-RPC
error in its body is that error, passed on. Closing a response before its end is how a
2026-07-28 request is cancelled, and every response is closed when its reader is done with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final

import httpx
import orjson

from broker.upstreams.auth import UpstreamAuth
from broker.upstreams.errors import UpstreamRpcError, UpstreamSessionGone, UpstreamTimeout, UpstreamUnavailable

__all__ = ["HttpWire", "Notify", "SseEvent", "read_events", "rpc_result"]

ACCEPT: Final = "application/json, text/event-stream"
#: Bytes of an error answer kept to read its JSON-RPC error from.
_ERROR_BYTES: Final = 65_536
_EOL: Final = re.compile(rb"\r\n|\r|\n")
_REFUSED: Final = "the upstream refused the broker's credentials"

#: Where the notifications before an answer go.
Notify = Callable[[dict[str, Any]], Awaitable[None]]


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


def rpc_result(upstream: str, message: dict[str, Any] | None) -> dict[str, Any]:
    """The result of a JSON-RPC answer; its error raised as the upstream's own."""
    if message is None:
        raise UpstreamUnavailable(upstream, "it accepted a request without answering it")
    error = message.get("error")
    if isinstance(error, dict):
        code = error.get("code")
        raise UpstreamRpcError(upstream, code if isinstance(code, int) else -32603, str(error.get("message", "")),
                               error.get("data"))
    result = message.get("result")
    if not isinstance(result, dict):
        raise UpstreamUnavailable(upstream, "its answer is not a JSON-RPC result")
    return result


class HttpWire:
    """The HTTP of one upstream: its endpoint, the connections to it, the broker's credentials for it."""

    def __init__(self, name: str, url: str, http: httpx.AsyncClient, auth: UpstreamAuth, *, timeout: float,
                 max_bytes: int) -> None:
        """``timeout``: seconds a stream may take to open; ``max_bytes``: of an answer, or of one event."""
        self.name = name
        self.url = url
        self.http = http
        self.auth = auth
        self.timeout = timeout
        self.max_bytes = max_bytes

    async def post(self, body: dict[str, Any], headers: dict[str, str], on_notification: Notify | None,
                   ) -> tuple[dict[str, Any] | None, httpx.Headers]:
        """POST one message: its answer (None for an accepted notification) and the response's headers. A 401
        fetches the credentials again, once."""
        content = orjson.dumps(body)
        for attempt in (1, 2):
            request = self.http.build_request("POST", self.url, content=content, headers={
                "Accept": ACCEPT, "Content-Type": "application/json", **headers, **await self.auth.headers()})
            try:
                return await self._exchange(request, body.get("id"), "Mcp-Session-Id" in headers, on_notification)
            except _Unauthorized as exc:
                if attempt == 2:
                    raise UpstreamUnavailable(self.name, _REFUSED, status=401) from None
                self.auth.invalidate(exc.challenge)
        raise AssertionError("unreachable")

    async def _exchange(self, request: httpx.Request, id_: Any, in_session: bool,
                        on_notification: Notify | None,
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
                         on_notification: Notify | None) -> dict[str, Any]:
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

    @contextlib.asynccontextmanager
    async def stream(self, method: str, content: bytes | None, headers: dict[str, str], *,
                     in_session: bool) -> AsyncIterator[AsyncIterator[SseEvent]]:
        """An SSE response (``method`` GET or POST) and its events, until the block is left."""
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
        timeout = httpx.Timeout(self.timeout, read=None)
        try:
            async with asyncio.timeout(self.timeout):
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
                                rpc_result(self.name, message)  # the upstream's error, passed on
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
            raise UpstreamTimeout(self.name, f"its stream did not open within {self.timeout:g} s") from None
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
