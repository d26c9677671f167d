"""Streamable HTTP, both eras: a 2025 session with its GET stream, or 2026-07-28 listens.

``open_http`` negotiates as the specification's dual-era clients do: ``server/discover`` first,
and the ``initialize`` handshake when the server answers it with an error (a 2025 server).
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import itertools
from datetime import UTC, datetime
from typing import Any

import httpx

from broker_client import sse, wire
from broker_client.channel import RESUMED, RESYNCED, Channel
from broker_client.errors import Dropped, NotSupported, RpcError, SessionGone, WatchError

ACCEPT = "application/json, text/event-stream"
#: The longest wait a ``Retry-After`` is honoured for: a misconfigured server cannot park a watch for a day.
MAX_RETRY_AFTER = 3600.0
_listen_ids = itertools.count(1)


class Http:
    """POSTs to one MCP endpoint; answers may be JSON or an SSE stream that ends with the answer."""

    def __init__(self, client: httpx.AsyncClient, url: str) -> None:
        self.client = client
        self.url = url

    async def post(self, message: dict[str, Any], headers: dict[str, str]) -> tuple[dict[str, Any], httpx.Headers]:
        """The answer to ``message`` and the response's headers; HTTP failures become our errors."""
        try:
            async with self.client.stream("POST", self.url, content=wire.encode(message),
                                          headers={"Accept": ACCEPT, "Content-Type": "application/json",
                                                   **headers}) as response:
                check_status(response, await response.aread() if not is_sse(response) else b"",
                             session="Mcp-Session-Id" in headers)
                if response.status_code == 202:
                    return {}, response.headers
                if not is_sse(response):
                    answer = wire.decode(response.content)
                else:
                    answer = await answer_in_stream(response, message.get("id"))
                if answer is None:
                    raise Dropped(f"no answer to {message.get('method')}")
                return answer, response.headers
        except httpx.TransportError as exc:
            raise Dropped(f"{type(exc).__name__}: {exc}") from exc


def is_sse(response: httpx.Response) -> bool:
    return str(response.headers.get("content-type", "")).startswith("text/event-stream")


def check_status(response: httpx.Response, body: bytes, *, session: bool) -> None:
    """Raise for a status that is not an answer: 404 of a session, 5xx (retry), other 4xx (an error body)."""
    status = response.status_code
    if status in (200, 202):
        return
    if status == 404 and session:
        raise SessionGone("the server no longer knows the session (404)")
    if status >= 500 or status in (408, 409, 429):  # worth another try, after the wait the server asks for
        said = _said(body)
        raise Dropped(f"HTTP {status}" + (f": {said}" if said else ""), retry_after=retry_after(response.headers))
    message = wire.decode(body) if body else None
    error = message.get("error") if message is not None else None
    if isinstance(error, dict):
        raise RpcError(int(error.get("code", -status)), f"HTTP {status}: {error.get('message', '')}", error.get("data"))
    raise RpcError(-status, f"HTTP {status}: {body[:200].decode(errors='replace')}")


def _said(body: bytes) -> str:
    """What a refusal's body says, on one line: a JSON-RPC error's message, a REST ``detail``, or its text."""
    message = wire.decode(body) if body else None
    if message is not None:
        error = message.get("error")
        text = error.get("message") if isinstance(error, dict) else message.get("detail")
        if isinstance(text, str):
            return " ".join(text.split())[:300]
    return " ".join(body[:300].decode(errors="replace").split())


def retry_after(headers: httpx.Headers) -> float | None:
    """``Retry-After`` in seconds (delay-seconds or an HTTP date), at most an hour; None when absent or unreadable."""
    value = str(headers.get("retry-after", "")).strip()
    if value.isascii() and value.isdigit():  # "²" is a digit to str.isdigit, not to float
        return min(float(value), MAX_RETRY_AFTER)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        return None
    return min(max(0.0, (when - datetime.now(UTC)).total_seconds()), MAX_RETRY_AFTER)


async def answer_in_stream(response: httpx.Response, id_: Any) -> dict[str, Any] | None:
    async for event in sse.events(response.aiter_lines()):
        message = wire.decode(event.data) if event.data else None
        if message is not None and message.get("id") == id_ and "method" not in message:
            return message
    return None


async def open_http(client: httpx.AsyncClient, url: str, uris: list[str], era: str) -> Channel:
    """Negotiate the era, subscribe, and return the channel once the subscription is confirmed."""
    http = Http(client, url)
    if era in ("auto", "modern"):
        discover = wire.request("server/discover", {}, modern=True)
        try:
            found, _ = await http.post(discover, modern_headers("server/discover"))
            found = wire.result(found)
        except RpcError:
            if era == "modern":
                raise NotSupported("the server does not speak 2026-07-28 (server/discover failed)") from None
        else:
            if wire.modern_offered(found):
                return await _started(ModernHttp(http, uris, found.get("capabilities")))
            if era == "modern":
                raise NotSupported("the server does not offer 2026-07-28")
    return await _started(LegacyHttp(http, uris))


async def _started(channel: LegacyHttp | ModernHttp) -> Channel:
    """The channel once subscribed; closed again if that fails half way (a stream may be open)."""
    try:
        await channel.start()
    except BaseException:
        await channel.close()
        raise
    return channel


def modern_headers(method: str, name: str | None = None) -> dict[str, str]:
    headers = {"MCP-Protocol-Version": wire.MODERN, "Mcp-Method": method}
    if name is not None:
        headers["Mcp-Name"] = wire.header_value(name)
    return headers


def contents_of(answer: dict[str, Any]) -> list[dict[str, Any]]:
    contents = wire.result(answer).get("contents")
    return [c for c in contents if isinstance(c, dict)] if isinstance(contents, list) else []


class LegacyHttp(Channel):
    """A 2025 session: ``initialize``, the GET stream, ``resources/subscribe`` per URI."""

    def __init__(self, http: Http, uris: list[str]) -> None:
        super().__init__(uris)
        self.http = http
        self.session: str | None = None
        self.version = wire.LEGACY
        self.last_event_id: str | None = None
        self._resumed_at: tuple[str, int] | None = None

    def headers(self) -> dict[str, str]:
        assert self.session is not None
        return {"Mcp-Session-Id": self.session, "MCP-Protocol-Version": self.version}

    async def start(self) -> None:
        answer, headers = await self.http.post(wire.initialize(), {})
        found = wire.result(answer)
        if not wire.can_subscribe(found.get("capabilities")):
            raise NotSupported("the server does not offer resources.subscribe: no update would ever arrive")
        self.session = headers.get("mcp-session-id")
        if self.session is None:
            raise WatchError("the server answered initialize without an Mcp-Session-Id")
        self.version = str(found.get("protocolVersion") or wire.LEGACY)
        self.era = self.version
        await self.http.post(wire.notification("notifications/initialized"), self.headers())
        # The stream first, then the subscriptions: a change right after a subscribe has a stream to go to.
        await self._open_stream(None)
        for uri in self.uris:
            wire.result((await self.http.post(wire.request("resources/subscribe", {"uri": uri}, modern=False),
                                              self.headers()))[0])

    async def _open_stream(self, last_event_id: str | None) -> bool:
        """Open the GET stream (from ``last_event_id``); False if the server refused that cursor."""
        headers = {"Accept": "text/event-stream", **self.headers()}
        if last_event_id is not None:
            headers["Last-Event-ID"] = last_event_id
        try:
            response = await self.http.client.send(self.http.client.build_request("GET", self.http.url,
                                                                                  headers=headers), stream=True)
        except httpx.TransportError as exc:
            raise Dropped(f"{type(exc).__name__}: {exc}") from exc
        if response.status_code == 200 and is_sse(response):
            self.run_reader(self._read(response))
            return True
        body = await response.aread()
        await response.aclose()
        if last_event_id is not None and response.status_code == 400:
            return False  # a cursor the server cannot resume from: start afresh and re-read
        if response.status_code == 405:
            raise NotSupported("the server offers no GET stream: notifications have nowhere to arrive")
        check_status(response, body, session=True)
        raise Dropped(f"the GET stream was answered {response.status_code}")

    async def _read(self, response: httpx.Response) -> None:
        try:
            async for event in sse.events(response.aiter_lines()):
                self.progress += 1
                if event.id:
                    self.last_event_id = event.id
                message = wire.decode(event.data) if event.data else None
                if message is not None and (uri := wire.updated_uri(message)) is not None:
                    self.heard(uri)
        except httpx.TransportError as exc:
            raise Dropped(f"the GET stream broke: {type(exc).__name__}") from exc
        finally:
            await response.aclose()
        raise Dropped("the server ended the GET stream")

    async def recover(self) -> str:
        """Resume from the last event id (the server replays what was missed), else re-read everything."""
        if self.reading():
            return RESUMED  # a request failed, the stream did not: nothing was missed
        await self.stop_reader()
        if self._resumed_at == (self.last_event_id, self.progress):
            # The last resume from this cursor delivered nothing before it ended: a server that
            # accepts a cursor it cannot replay from. Start afresh, and re-read.
            self.last_event_id = None
        if self.last_event_id is not None and await self._open_stream(self.last_event_id):
            self._resumed_at = (self.last_event_id, self.progress)
            return RESUMED
        await self._open_stream(None)
        return RESYNCED

    async def read(self, uri: str) -> list[dict[str, Any]]:
        answer, _ = await self.http.post(wire.request("resources/read", {"uri": uri}, modern=False), self.headers())
        return contents_of(answer)

    async def close(self) -> None:
        await self.stop_reader()
        if self.session is None:
            return
        with contextlib.suppress(WatchError, Dropped):
            for uri in self.uris:
                await self.http.post(wire.request("resources/unsubscribe", {"uri": uri}, modern=False),
                                     self.headers())
        with contextlib.suppress(httpx.HTTPError):
            await self.http.client.delete(self.http.url, headers=self.headers())


class ModernHttp(Channel):
    """2026-07-28: one ``subscriptions/listen`` (a POST answered by an SSE stream) for all the URIs."""

    era = wire.MODERN

    def __init__(self, http: Http, uris: list[str], capabilities: Any) -> None:
        super().__init__(uris)
        self.http = http
        self.capabilities = capabilities
        self.extensions = wire.extensions(capabilities)
        #: The server offers the resumable-listen extension: a dropped listen resumes from its last event id.
        self.resumable = wire.RESUMABLE_LISTEN in self.extensions
        self.last_event_id: str | None = None
        #: The last ack said the server continued the listen it knew (else: a new one, the gap rule).
        self.ack_resumed = False
        self.listen_id = ""
        self._acked: asyncio.Future[None] | None = None

    async def start(self) -> None:
        if not wire.can_subscribe(self.capabilities):
            raise NotSupported("the server does not offer resources.subscribe: no update would ever arrive")
        await self._listen()

    async def _listen(self, last_event_id: str | None = None) -> None:
        """Open a listen (resuming after ``last_event_id``) and wait for its acknowledgment (raises
        ``NotSupported`` if it leaves a URI out)."""
        self.listen_id = f"watch-{next(_listen_ids)}"
        body = wire.listen(self.uris, self.listen_id, resumable=self.resumable)
        headers = {"Accept": ACCEPT, "Content-Type": "application/json", **modern_headers("subscriptions/listen")}
        if last_event_id is not None:
            headers["Last-Event-ID"] = last_event_id
        request = self.http.client.build_request("POST", self.http.url, content=wire.encode(body), headers=headers)
        try:
            response = await self.http.client.send(request, stream=True)
        except httpx.TransportError as exc:
            raise Dropped(f"{type(exc).__name__}: {exc}") from exc
        if not (response.status_code == 200 and is_sse(response)):
            body_bytes = await response.aread()
            await response.aclose()
            check_status(response, body_bytes, session=False)
            wire.result(wire.decode(body_bytes) or {})
            raise WatchError("the server answered subscriptions/listen without a stream")
        self._acked = asyncio.get_running_loop().create_future()
        self.run_reader(self._read(response, self.listen_id, self._acked))
        await self._acked

    async def _read(self, response: httpx.Response, listen_id: str, acked: asyncio.Future[None]) -> None:
        try:
            async for event in sse.events(response.aiter_lines()):
                if event.id:
                    self.last_event_id = event.id  # an id-only event moves the position on too
                message = wire.decode(event.data) if event.data else None
                if message is None or (wire.subscription_of(message) != listen_id
                                       and message.get("id") != listen_id):
                    continue
                self.progress += 1
                if message.get("method") == wire.ACKNOWLEDGED:
                    meta = (message.get("params") or {}).get("_meta") or {}
                    self.ack_resumed = meta.get(wire.RESUMED) is True
                    if not acked.done():
                        _settle_ack(acked, self.watched, message)
                elif (uri := wire.updated_uri(message)) is not None:
                    self.heard(uri)
                elif "method" not in message:  # the listen's own answer: its end
                    if "error" in message:
                        raise Dropped(f"the listen failed: {message['error']}")
                    raise Dropped("the server completed the listen", complete=True)
        except httpx.TransportError as exc:
            raise Dropped(f"the listen broke: {type(exc).__name__}") from exc
        finally:
            await response.aclose()
            if not acked.done():
                acked.set_exception(Dropped("the listen ended before its acknowledgment"))
        raise Dropped("the server ended the listen")

    async def recover(self) -> str:
        """Resume the listen from its last event id when the server offers the resumable-listen
        extension (it replays what was missed, or sends an update of every URI when it cannot);
        else a new listen and a re-read of everything: 2026-07-28 itself has no replay."""
        await self.stop_reader()
        if self.resumable and self.last_event_id is not None:
            try:
                await self._listen(self.last_event_id)
            except RpcError:
                pass  # an id the server refuses (400): a fresh listen, and a re-read
            else:
                # The server says whether it knew the listen; if not, it sent an update of every URI.
                return RESUMED if self.ack_resumed else RESYNCED
        await self._listen()
        return RESYNCED

    async def read(self, uri: str) -> list[dict[str, Any]]:
        answer, _ = await self.http.post(wire.request("resources/read", {"uri": uri}, modern=True),
                                         modern_headers("resources/read", uri))
        return contents_of(answer)

    async def close(self) -> None:
        await self.stop_reader()  # closing the stream ends the listen


def _settle_ack(acked: asyncio.Future[None], watched: frozenset[str], ack: dict[str, Any]) -> None:
    """The ack names the URIs the server honours: one left out would never be notified."""
    honored = ((ack.get("params") or {}).get("notifications") or {}).get("resourceSubscriptions")
    missing = sorted(watched - set(honored or ()))
    if missing:
        acked.set_exception(NotSupported(f"the listen was acknowledged without {missing}"))
    else:
        acked.set_result(None)
