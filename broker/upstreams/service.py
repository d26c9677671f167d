"""What the MCP methods ask of the upstreams: which ones a tenant sees, merged lists, forwarded calls.

Each worker holds one ``UpstreamClient`` per upstream (``broker.upstreams.client``), made at start
and probed in the background: its era, its capabilities and, when the map leaves them out, the
URI prefixes it owns. Nothing here is kept that another worker would need: a 2025 session's own
session at an upstream is in the session's record (``SessionRecord.upstreams``), so any worker
forwards any request of any session.

Rules every forwarded request follows:

* **No credential of the caller's travels.** The client builds every header itself, with the
  broker's own credentials for that upstream (``broker.upstreams.auth``). Of the caller's
  ``params._meta`` only what belongs to the request is kept (``progressToken``, a trace context,
  the caller's own keys); the protocol's envelope is the client's to write. What the upstream learns
  of the caller is opt-in: ``caller`` in the map puts ``tenant`` and ``subject`` in
  ``_meta["mcp-broker/caller"]``.
* **A slow or dead upstream costs only its callers.** Each request is bounded in time and in
  number per upstream (``timeout``, ``concurrency``); the error names the upstream, with 502, 503
  or 504 semantics (``UpstreamRefused``). The broker's own resources never wait on an upstream.
* **Names never collide silently.** Tools and prompts carry the upstream's ``name_prefix``; two
  upstreams of one tenant offering one name are logged once as an error naming both, and the name
  is served by the first of the tenant's in the map.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Final

import orjson

from broker.auth import Principal
from broker.errors import BackendUnavailable, NotFound, Refusal
from broker.metrics import NO_METRICS, Metrics
from broker.protocol import jsonrpc as rpc
from broker.protocol.refusals import Reason
from broker.upstreams.client import (
    UpstreamBusy,
    UpstreamClient,
    UpstreamError,
    UpstreamRpcError,
    UpstreamSession,
    UpstreamTimeout,
)
from broker.upstreams.probe import Probes
from broker.upstreams.spec import UpstreamSpec
from broker.upstreams.upstream import Upstream

if TYPE_CHECKING:
    from broker.backends.base import SessionStore
    from broker.backends.types import SessionRecord

__all__ = ["CALLER_KEY", "LISTS", "Upstream", "UpstreamRefused", "Upstreams"]

logger = logging.getLogger(__name__)

#: Where the caller's tenant and subject go in a forwarded request's ``_meta``, when its upstream asks.
CALLER_KEY: Final = "mcp-broker/caller"
#: The list methods merged across upstreams: method -> the result's list field.
LISTS: Final = {"tools/list": "tools", "prompts/list": "prompts", "resources/list": "resources",
                "resources/templates/list": "resourceTemplates"}
#: ``_meta`` keys of the protocol's envelope (2026-07-28): the client writes its own.
_ENVELOPE: Final = "io.modelcontextprotocol/"
#: What an upstream's answer says of itself and of its era, never passed on (``Upstreams.forward``).
_UPSTREAM_FIELDS: Final = ("resultType", "ttlMs", "cacheScope")
_SERVER_INFO: Final = "io.modelcontextprotocol/serverInfo"
#: The error of a request its client cancelled (the official SDKs' code for it).
REQUEST_CANCELLED: Final = -32800
#: Seconds a client's cancel may take to reach one upstream.
CANCEL_WAIT: Final = 2.0


class UpstreamRefused(Refusal):
    """A forwarded request that its upstream did not answer (``reason``: unreachable, 502; busy, 503;
    timeout, 504); ``data.upstream`` names it."""

    def __init__(self, upstream: str, reason: Reason, message: str, retry_after: int | None = None) -> None:
        super().__init__(message, reason=reason, retry_after=retry_after, data={"upstream": upstream})
        self.upstream = upstream


#: JSON-RPC codes that mean something of the broker itself (its statuses, its scopes, its bounds): an
#: upstream answering one is not passed on as it is, but as the upstream's error (-31004, 502).
_BROKERS_CODES: Final = frozenset({
    rpc.PARSE_ERROR, rpc.INVALID_REQUEST, rpc.HEADER_MISMATCH, rpc.MISSING_CLIENT_CAPABILITY,
    rpc.UNSUPPORTED_PROTOCOL_VERSION, rpc.INSUFFICIENT_SCOPE, rpc.SERVICE_UNAVAILABLE, rpc.QUOTA_EXCEEDED,
    rpc.NOT_RUN_RESPONSE_TOO_LARGE, rpc.UPSTREAM_UNREACHABLE, rpc.UPSTREAM_TIMEOUT, rpc.EVENTS_NOT_FOUND,
    rpc.EVENTS_FORBIDDEN, rpc.EVENTS_EXHAUSTED, rpc.EVENTS_UNSUPPORTED, rpc.EVENTS_CALLBACK_ERROR,
})


def _passed_on(upstream: Upstream, exc: UpstreamRpcError) -> rpc.RpcError | UpstreamRefused:
    """The upstream's own error for a request, as its caller gets it."""
    data = exc.data if isinstance(exc.data, dict) else None
    if exc.code in _BROKERS_CODES:
        return UpstreamRefused(upstream.name, Reason.UPSTREAM_UNREACHABLE,
                               f"upstream {upstream.name!r} answered error {exc.code}: {str(exc.message)[:200]}")
    return rpc.RpcError(exc.code, str(exc.message), data)


def _progress_of(params: dict[str, Any], progress: Callable[[dict[str, Any]], Awaitable[None]],
                 ) -> Callable[[dict[str, Any]], Awaitable[None]]:
    """The upstream's notifications about a request that its caller may be given: its progress, for the
    token the caller gave, and nothing else."""
    meta = params.get("_meta")
    token = meta.get("progressToken") if isinstance(meta, dict) else None

    async def passed(note: dict[str, Any]) -> None:
        note_params = note.get("params")
        if (token is not None and note.get("method") == "notifications/progress" and isinstance(note_params, dict)
                and note_params.get("progressToken") == token):
            await progress({"jsonrpc": "2.0", "method": "notifications/progress", "params": note_params})

    return passed


def _answer(result: dict[str, Any]) -> dict[str, Any]:
    """An upstream's result as the broker's own to its caller: its era's fields and caching hints are the
    broker's (a list the upstream calls public is one tenant's here), and so is its server's name."""
    for key in _UPSTREAM_FIELDS:
        result.pop(key, None)
    meta = result.get("_meta")
    if isinstance(meta, dict):
        meta.pop(_SERVER_INFO, None)
    if not isinstance(meta, dict) or not meta:
        result.pop("_meta", None)
    return result


def _encode_cursor(index: int, cursor: str | None) -> str:
    return base64.urlsafe_b64encode(orjson.dumps([index, cursor])).decode()


def _decode_cursor(cursor: str) -> tuple[int, str | None]:
    try:
        index, inner = orjson.loads(base64.urlsafe_b64decode(cursor.encode()))
    except (binascii.Error, orjson.JSONDecodeError, ValueError, TypeError) as exc:
        raise rpc.RpcError(rpc.INVALID_PARAMS, "Invalid cursor", {"cursor": cursor}) from exc
    if not isinstance(index, int) or index < 0 or not (inner is None or isinstance(inner, str)):
        raise rpc.RpcError(rpc.INVALID_PARAMS, "Invalid cursor", {"cursor": cursor})
    return index, inner


class Upstreams:
    """Every upstream of the deployment, as one worker serves them."""

    def __init__(self, specs: Sequence[UpstreamSpec], server_info: dict[str, Any], *,
                 metrics: Metrics = NO_METRICS, sessions: SessionStore | None = None,
                 clients: Callable[[UpstreamSpec], UpstreamClient] | None = None) -> None:
        """``clients`` makes each upstream's client (a test's transport); ``sessions`` keeps what a
        2025 session holds at each upstream."""
        make = clients or (lambda spec: UpstreamClient(spec, client_info=dict(server_info)))
        self.all = [Upstream(spec, make(spec), metrics) for spec in specs]
        self.by_name = {upstream.name: upstream for upstream in self.all}
        self.sessions = sessions
        self._tenants: dict[str, list[Upstream]] = {}
        for upstream in self.all:
            for tenant in upstream.spec.tenants:
                self._tenants.setdefault(tenant, []).append(upstream)
        self.probes = Probes(self.all)
        #: The forwarded requests of 2025 sessions running on this worker, by (session, request id),
        #: and those of them their client cancelled.
        self._running: dict[tuple[str, rpc.Id], asyncio.Task[Any]] = {}
        self._cancelled: set[tuple[str, rpc.Id]] = set()

    # -- who sees what ----------------------------------------------------------------------
    def of(self, tenant: str) -> list[Upstream]:
        """The upstreams ``tenant`` sees, in the map's order."""
        return self._tenants.get(tenant, [])

    def owner(self, tenant: str, uri: str) -> Upstream | None:
        for upstream in self.of(tenant):
            if upstream.owns(uri):
                return upstream
        return None

    def claims(self, uri: str) -> bool:
        """Whether some upstream owns ``uri`` for some tenant."""
        return any(upstream.owns(uri) for upstream in self.all)

    def capabilities(self, tenant: str) -> dict[str, Any]:
        """What the tenant's upstreams add to the broker's own capabilities: tools, prompts and
        completions each as one of them offers it (all three while one is not yet probed)."""
        added: dict[str, Any] = {}
        for upstream in self.of(tenant):
            found = upstream.capabilities
            for name in ("tools", "prompts", "completions"):
                if found is None or name in found:
                    added[name] = {} if name == "completions" else {"listChanged": False}
        return added

    # -- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        """Probe every upstream (``Probes.start``)."""
        await self.probes.start()

    async def close(self) -> None:
        await self.probes.close()
        for upstream in self.all:
            await upstream.client.aclose()

    async def probe(self, upstream: Upstream) -> None:
        """Learn what ``upstream`` offers (``Probes.probe``). Raises ``UpstreamError``."""
        await self.probes.probe(upstream)

    # -- lists --------------------------------------------------------------------------------
    async def list_page(self, principal: Principal, method: str, cursor: str | None,
                        session: SessionRecord | None = None) -> tuple[list[Any], str | None]:
        """One page of ``method``'s list across the tenant's upstreams that offer it, and the cursor
        of the next (None: the last). Tool and prompt names carry their upstream's ``name_prefix``.

        Raises:
            RpcError: -32602 for a cursor this listing did not issue.
            UpstreamRefused: the upstream of this page did not answer.
        """
        upstreams = self.of(principal.tenant)
        index, inner = (0, None) if cursor is None else _decode_cursor(cursor)
        if index >= max(len(upstreams), 1):
            raise rpc.RpcError(rpc.INVALID_PARAMS, "Invalid cursor", {"cursor": cursor})
        field = LISTS[method]
        kind = "resources" if method.startswith("resources/") else field
        while index < len(upstreams):
            upstream = upstreams[index]
            if upstream.capabilities is not None and kind not in upstream.capabilities:
                index, inner = index + 1, None
                continue
            params = {} if inner is None else {"cursor": inner}
            try:
                result = await self.forward(principal, upstream, method, params, session=session)
            except UpstreamRefused:
                if inner is not None:
                    raise  # the middle of its list: the caller asks for this page again
                # One unreachable upstream does not take the others' lists down, nor the broker's own
                # resources: its items are left out of this listing (logged, and counted as its errors).
                logger.warning("upstream %s: %s left out of the list, it did not answer", upstream.name, method)
                index, inner = index + 1, None
                continue
            found = result.get(field)
            items = [item for item in found if isinstance(item, dict)] if isinstance(found, list) else []
            if field in ("tools", "prompts"):
                items = self._named(principal.tenant, upstream, field, items)
            else:
                items = [item for item in items if upstream.owns(str(item.get("uri", item.get("uriTemplate", ""))))]
            following = result.get("nextCursor")
            if isinstance(following, str) and following:
                return items, _encode_cursor(index, following)
            index += 1
            return items, (_encode_cursor(index, None) if index < len(upstreams) else None)
        return [], None

    def _named(self, tenant: str, upstream: Upstream, kind: str, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Items with their upstream's ``name_prefix``, less the names an earlier upstream of the tenant serves."""
        upstream.names[kind] |= {item["name"] for item in items if isinstance(item.get("name"), str)}
        earlier = self.of_names(tenant, upstream, kind)
        named = []
        for item in items:
            name = upstream.spec.name_prefix + str(item.get("name", ""))
            if name in earlier:
                continue  # logged by ``_check_names``: the first upstream serves it
            named.append({**item, "name": name})
        return named

    def of_names(self, tenant: str, upstream: Upstream, kind: str) -> set[str]:
        """The names of ``kind`` that the tenant's upstreams before ``upstream`` in the map serve."""
        names: set[str] = set()
        for other in self.of(tenant):
            if other is upstream:
                break
            names |= {other.spec.name_prefix + name for name in other.names[kind]}
        return names

    def named(self, tenant: str, kind: str, name: str) -> tuple[Upstream, str] | None:
        """The upstream that serves the tool or prompt ``name`` to ``tenant``, and its own name for it."""
        candidates = [(upstream, name[len(upstream.spec.name_prefix):]) for upstream in self.of(tenant)
                      if name.startswith(upstream.spec.name_prefix)]
        for upstream, own in candidates:
            if own in upstream.names[kind]:
                return upstream, own
        # Not seen in a list yet (a worker that never listed): the one candidate, or the first
        # without a prefix of its own when several could serve it.
        prefixed = [(upstream, own) for upstream, own in candidates if upstream.spec.name_prefix]
        if prefixed:
            return max(prefixed, key=lambda pair: len(pair[0].spec.name_prefix))
        return candidates[0] if candidates else None

    # -- forwarding ---------------------------------------------------------------------------
    async def forward(self, principal: Principal, upstream: Upstream, method: str, params: dict[str, Any], *,
                      session: SessionRecord | None = None, request_id: rpc.Id | None = None,
                      progress: Callable[[dict[str, Any]], Awaitable[None]] | None = None) -> dict[str, Any]:
        """``method`` at ``upstream`` for ``principal``; its result.

        ``session``: the caller's 2025 session, whose own session at a legacy-era upstream is used (made
        at the first request and kept in its record); ``request_id``: the caller's id, forwarded as it
        is on such a session so that its ``notifications/cancelled`` names the same request.

        Raises:
            RpcError: the upstream's own error for the request, passed on.
            UpstreamRefused: it did not answer (502, 503, 504).
        """
        began = time.perf_counter()
        outgoing = self._outgoing(principal, upstream, params)
        running = (session.id, request_id) if session is not None and request_id is not None else None
        task = asyncio.current_task()
        if running is not None and task is not None:
            self._running[running] = task  # its client's cancel, taken by this worker, ends it here too
        try:
            if upstream.client.era is None:
                await self._probe_within(upstream)
            held = await self._session_of(upstream, session)
            result, used = await upstream.client.request(
                method, outgoing, session=held, request_id=request_id if held is not None else None,
                on_notification=None if progress is None else _progress_of(params, progress))
        except UpstreamRpcError as exc:
            upstream.counted(method, "rpc", began)
            raise _passed_on(upstream, exc) from exc
        except UpstreamError as exc:
            kind = "busy" if isinstance(exc, UpstreamBusy) else "timeout" if isinstance(exc, UpstreamTimeout) \
                else "unavailable"
            upstream.counted(method, kind, began)
            raise self._refused(upstream, exc) from exc
        except asyncio.CancelledError:
            if running is None or running not in self._cancelled or task is None or task.cancelling() != 1:
                raise  # a disconnect or a stop as well: that wins
            # Cancelled by its client: the upstream was told (``cancelled``); the POST that carried the
            # request still gets an answer, the error the SDKs give a cancelled request.
            task.uncancel()
            upstream.counted(method, "cancelled", began)
            raise rpc.RpcError(REQUEST_CANCELLED, "Request cancelled", {"upstream": upstream.name}) from None
        finally:
            if running is not None and self._running.get(running) is task:
                del self._running[running]
                self._cancelled.discard(running)
        upstream.counted(method, None, began)
        if session is not None and used is not None and used != held and held is not None:
            await self._keep(session, upstream, used)  # the upstream forgot the old one: a new one, kept
        return _answer(result)

    async def _probe_within(self, upstream: Upstream) -> None:
        """The first probe of an upstream a request needs, within the request's own bounds: its
        ``timeout`` (the wait behind another probe included) and the ``concurrency`` in flight."""
        if upstream.client.in_flight >= upstream.spec.concurrency:
            raise UpstreamBusy(upstream.name, "its bound of requests in flight is full")
        try:
            async with asyncio.timeout(upstream.spec.timeout):
                await upstream.client.probe()
        except TimeoutError as exc:
            raise UpstreamTimeout(upstream.name, "its first answer took too long") from exc

    async def _session_of(self, upstream: Upstream, session: SessionRecord | None) -> UpstreamSession | None:
        """The caller's own session at a 2025-era upstream over HTTP (None: none is needed, the request
        goes on the worker's session): the one in its record, or a new one, kept there. Never the
        worker's: a caller's ids and its cancels would meet another caller's, of any tenant."""
        if session is None or upstream.client.era != "legacy" or upstream.spec.command is not None:
            return None  # a stdio upstream is one process per worker: one session, with the client's own ids
        kept = session.upstreams.get(upstream.name)
        if kept:
            return UpstreamSession(kept[0], kept[1])
        opened = await upstream.client.open_session()
        await self._keep(session, upstream, opened)
        return opened

    @staticmethod
    def _refused(upstream: Upstream, exc: UpstreamError) -> UpstreamRefused:
        name = upstream.name
        if isinstance(exc, UpstreamBusy):
            return UpstreamRefused(name, Reason.UPSTREAM_BUSY, f"upstream {name!r} has {upstream.spec.concurrency} "
                                   "requests in flight from this worker, its bound; retry later", retry_after=1)
        if isinstance(exc, UpstreamTimeout):
            return UpstreamRefused(name, Reason.UPSTREAM_TIMEOUT,
                                   f"upstream {name!r} did not answer within {upstream.spec.timeout:g} s")
        return UpstreamRefused(name, Reason.UPSTREAM_UNREACHABLE, f"upstream {name!r} cannot be reached: {exc}",
                               retry_after=1)

    async def _keep(self, session: SessionRecord, upstream: Upstream, used: UpstreamSession) -> None:
        """Keep the session the upstream gave this one in its record (a new one when it forgot the old).
        Not kept (the backend did not answer), the next request opens another: the request goes on."""
        kept = {**session.upstreams, upstream.name: [used.id, used.version]}
        session.upstreams = kept
        if self.sessions is not None:
            try:
                await self.sessions.update(session.id, upstreams=kept)
            except BackendUnavailable:
                logger.warning("upstream %s: session %s's session there could not be recorded", upstream.name,
                               session.id)

    @staticmethod
    def _outgoing(principal: Principal, upstream: Upstream, params: dict[str, Any]) -> dict[str, Any]:
        """``params`` as the upstream gets them: the envelope's ``_meta`` left to the client, the caller
        named only as the map says."""
        meta = params.get("_meta")
        kept = {key: value for key, value in meta.items() if not key.startswith(_ENVELOPE)} \
            if isinstance(meta, dict) else {}
        kept.pop(CALLER_KEY, None)  # never the caller's own word for who it is
        if upstream.spec.caller:
            kept[CALLER_KEY] = {name: getattr(principal, name) for name in sorted(upstream.spec.caller)}
        outgoing = {key: value for key, value in params.items() if key != "_meta"}
        if kept:
            outgoing["_meta"] = kept
        return outgoing

    async def cancelled(self, session: SessionRecord, params: dict[str, Any]) -> None:
        """A 2025 client's ``notifications/cancelled``: the forwarded request it names ended here when
        this worker runs it, and the cancel passed on to the client's own sessions at its upstreams
        (the request may run on another worker; an upstream ignores an id it does not know, as the
        specification says). Only ``requestId`` and ``reason`` go, each within ``CANCEL_WAIT``."""
        request_id = params.get("requestId")
        if not isinstance(request_id, str | int):
            return
        key = (session.id, request_id)
        if (task := self._running.get(key)) is not None:
            self._cancelled.add(key)
            task.cancel()
        told: dict[str, Any] = {"requestId": request_id}
        if isinstance(reason := params.get("reason"), str):
            told["reason"] = reason[:200]
        for name, (session_id, version) in session.upstreams.items():
            upstream = self.by_name.get(name)
            if upstream is None or upstream.spec.command is not None:
                continue
            try:
                async with asyncio.timeout(CANCEL_WAIT):
                    await upstream.client.notify("notifications/cancelled", told,
                                                 session=UpstreamSession(session_id, version))
            except (UpstreamError, TimeoutError) as exc:
                logger.info("upstream %s: a cancellation could not be passed on: %s", name, exc)

    async def ended(self, session: SessionRecord) -> None:
        """A 2025 session ended: its upstream sessions end too (best effort: an upstream expires them anyway)."""
        for name, (session_id, version) in session.upstreams.items():
            upstream = self.by_name.get(name)
            if upstream is not None:
                try:
                    await upstream.client.close_session(UpstreamSession(session_id, version))
                except UpstreamError:
                    pass

    async def read(self, principal: Principal, uri: str, session: SessionRecord | None = None) -> list[Any]:
        """``resources/read`` of an upstream's URI. Raises NotFound, RpcError, UpstreamRefused."""
        upstream = self.owner(principal.tenant, uri)
        if upstream is None:
            raise NotFound(uri)
        try:
            result = await self.forward(principal, upstream, "resources/read", {"uri": uri}, session=session)
        except rpc.RpcError as exc:
            if exc.code in (rpc.RESOURCE_NOT_FOUND, rpc.INVALID_PARAMS) and "not found" in exc.message.lower():
                raise NotFound(uri) from exc
            raise
        contents = result.get("contents", [])
        return contents if isinstance(contents, list) else []
