"""MCP methods, shared by every transport and both eras.

The dispatcher (``broker.dispatch``) routes; this module validates params, calls the resources
and the subscription index, and shapes results for the caller's era. ``subscriptions/listen``
streams, so the dispatcher opens it, but the checks of its filter live here too.

Deliberate departures from the specification, each with its reason:

* ``resources/subscribe`` accepts any absolute URI a provider does not own: changes to data
  that lives elsewhere arrive through ``POST /changes``. URIs a provider owns are checked with
  the same predicate as ``resources/read``.
* Legacy ``resources/subscribe`` does not require an open GET stream (Harper does): frames
  wait in the session inbox until a stream takes them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final, cast

from broker.auth import Principal
from broker.auth.scopes import METHOD_SCOPES, SUBSCRIBE, forbidden
from broker.backends.base import SubscriptionIndex
from broker.backends.types import SessionRecord
from broker.config import Settings
from broker.errors import LimitExceeded, NotFound, OverQuota, Refusal, ResourceRefused
from broker.feeds.listen import RESUMABLE
from broker.metrics import NO_METRICS, Histogram, Metrics, records
from broker.ops.tracing import Finish, Tracer
from broker.protocol import jsonrpc as rpc
from broker.protocol.jsonbounds import JsonRefused, encode_bounded
from broker.protocol.messages import SERVER_INFO_KEY, capabilities
from broker.protocol.versions import MODERN_VERSIONS, negotiate_legacy
from broker.quotas import TenantQuotas
from broker.resources.base import BadCursor, Resources
from broker.upstreams.demand import Wants
from broker.upstreams.methods import ForwardedMethods
from broker.upstreams.service import Upstreams
from broker.uris import BadUri, check_uri

__all__ = ["Call", "Methods"]

logger = logging.getLogger(__name__)

#: Results of these methods carry the 2026-07-28 caching hints.
_CACHEABLE: Final = frozenset({"server/discover", "resources/list", "resources/read", "resources/templates/list",
                               "tools/list", "prompts/list"})
LEGACY_METHODS: Final = frozenset({
    "ping", "resources/list", "resources/read", "resources/templates/list", "resources/subscribe",
    "resources/unsubscribe",
})
#: Served by the upstreams (``MCP_BROKER_UPSTREAMS``) alone, in both eras, when there are any.
FORWARDED: Final = frozenset({"tools/list", "tools/call", "prompts/list", "prompts/get", "completion/complete"})
#: ``subscriptions/listen`` is modern too, but streams: the dispatcher opens it (``Dispatcher.listen``).
MODERN_METHODS: Final = frozenset({
    "server/discover", "resources/list", "resources/read", "resources/templates/list",
})


def _untimed(error: BaseException | None) -> None:
    """The end of a request with nothing to time or trace (no metrics, tracing off)."""


@dataclass(frozen=True, slots=True)
class Call:
    """Who is calling, in which era, and (legacy) within which session."""

    principal: Principal
    modern: bool
    session: SessionRecord | None = None
    #: The request's HTTP headers, looked up by lower-case name (None on stdio): a tracer reads the
    #: W3C ``traceparent`` there when ``params._meta`` has none.
    header: Callable[[str], str | None] | None = None
    #: A request forwarded to an upstream (``FORWARDED``): the caller's id, and where the upstream's
    #: notifications about it (``notifications/progress``) go, when the transport can carry them.
    request_id: rpc.Id | None = None
    progress: Callable[[dict[str, Any]], Awaitable[None]] | None = None


Handler = Callable[["Call", dict[str, Any]], Awaitable[dict[str, Any]]]


class Methods:
    """The request methods of both eras, each a handler from params to result; the one registry of them."""

    def __init__(self, settings: Settings, resources: Resources, subscriptions: SubscriptionIndex,
                 server_info: dict[str, Any], quotas: TenantQuotas | None = None, *, metrics: Metrics = NO_METRICS,
                 tracer: Tracer | None = None, upstreams: Upstreams | None = None) -> None:
        """``quotas``: each tenant's ``subscriptions`` quota, a bound per session of the tenant (docs/QUOTAS.md).
        ``metrics``: each request's duration, by method; ``tracer``: a span per request (None: tracing is off)."""
        self._metrics = metrics
        #: By method: its ``mcp_server_operation_duration_seconds`` child, made at its first request.
        #: The duration histogram of each method begun, None when it would keep nothing (``records``).
        self._durations: dict[str, Histogram | None] = {}
        self.tracer = tracer
        self.settings = settings
        self.quotas = quotas or TenantQuotas()
        self.resources = resources
        self.subscriptions = subscriptions
        self.server_info = server_info
        self._handlers: dict[str, Handler] = {
            "ping": self._ping,
            "server/discover": self._server_discover,
            "resources/list": self._resources_list,
            "resources/read": self._resources_read,
            "resources/templates/list": self._resources_templates_list,
            "resources/subscribe": self._resources_subscribe,
            "resources/unsubscribe": self._resources_unsubscribe,
        }
        #: The MCP servers behind the broker (None: none configured); their methods are served only then.
        self.upstreams = upstreams
        #: Records what listens watch of the upstreams (set by the runtime with ``upstreams``).
        self.wants: Wants | None = None
        self.forwarded = ForwardedMethods(upstreams) if upstreams is not None else None
        if self.forwarded is not None:
            self._handlers.update(self.forwarded.handlers())
        #: The methods served in each era: the broker's own, the upstreams', those of extensions (``extend``).
        self.legacy_methods: frozenset[str] = LEGACY_METHODS | (FORWARDED if upstreams is not None else frozenset())
        self.modern_methods: frozenset[str] = MODERN_METHODS | (FORWARDED if upstreams is not None else frozenset())
        self.extensions: dict[str, Any] = {RESUMABLE: {}}

    # -- validation ------------------------------------------------------------------------
    def uri_param(self, params: dict[str, Any], name: str = "uri", *, canonical: bool = True) -> str:
        """A URI param, checked for type, size and syntax. Raises RpcError -32602."""
        uri = params.get(name)
        if not isinstance(uri, str):
            raise rpc.RpcError(rpc.INVALID_PARAMS, f"params.{name} must be a string")
        self.check_uri(uri, canonical=canonical)
        return uri

    def check_uri(self, uri: str, *, canonical: bool = True) -> None:
        """``broker.uris.check_uri`` with this broker's bound, as a JSON-RPC error. Raises RpcError -32602."""
        try:
            check_uri(uri, self.settings.max_uri_length, canonical=canonical)
        except BadUri as exc:
            raise rpc.RpcError(rpc.INVALID_PARAMS, exc.message, exc.data) from exc

    def not_found(self, call: Call, uri: str) -> rpc.RpcError:
        code = rpc.INVALID_PARAMS if call.modern else rpc.RESOURCE_NOT_FOUND
        return rpc.RpcError(code, f"Resource not found: {uri}", {"uri": uri})

    def check_watch(self, call: Call, uri: str) -> None:
        """May the caller watch ``uri``? The same predicate as read. Raises the era's not-found error."""
        self.check_uri(uri)
        if not self.resources.can_watch(call.principal, uri):
            raise self.not_found(call, uri)

    # -- dispatch ---------------------------------------------------------------------------
    def begin(self, method: str, params: dict[str, Any], session_id: str | None = None,
              header: Callable[[str], str | None] | None = None) -> Callable[[BaseException | None], None]:
        """A request of ``method`` begins (its span, with tracing on); what to call once it is answered,
        with its error if any: its duration (``mcp.server.operation.duration``) and the end of its span.
        A request cancelled before its answer ends its span but has no duration."""
        try:
            histogram = self._durations[method]
        except KeyError:  # once per method: the methods served are a fixed few
            made = self._metrics.histogram("mcp_server_operation_duration_seconds", mcp_method_name=method)
            histogram = self._durations[method] = made if records(made) else None
        finish: Finish | None = None if self.tracer is None else self.tracer.request(method, params, session_id, header)
        if histogram is None:  # no duration to keep (no metrics): no clock read, the span times itself
            return _untimed if finish is None else lambda error: finish(None, error)
        began = time.perf_counter()

        def done(error: BaseException | None) -> None:
            if error is None or isinstance(error, Exception):
                histogram.observe(time.perf_counter() - began)
            if finish is not None:
                finish(None, error)

        return done

    async def call(self, call: Call, method: str, params: dict[str, Any]) -> dict[str, Any]:
        """Run one request; returns its result. Raises RpcError."""
        known = self.modern_methods if call.modern else self.legacy_methods
        if method not in known:
            raise rpc.RpcError(rpc.METHOD_NOT_FOUND, f"Method not found: {method}")
        needed = METHOD_SCOPES.get(method)
        if needed is not None and needed not in call.principal.scopes:
            raise forbidden(method, needed)
        handler = self._handlers[method]
        done = self.begin(method, params, None if call.session is None else call.session.id, call.header)
        try:
            result: dict[str, Any] = await handler(call, params)
        except (rpc.RpcError, Refusal) as exc:  # spelled by the transport
            done(exc)
            raise
        except Exception as exc:  # the method boundary: a provider's bug is an error reply, never a 500
            logger.exception("%s failed", method)
            error = rpc.RpcError(rpc.INTERNAL_ERROR, "Internal error")
            done(error)
            raise error from exc
        except BaseException as exc:  # cancelled
            done(exc)
            raise
        done(None)
        if call.modern:
            result["resultType"] = "complete"
            result.setdefault("_meta", {})[SERVER_INFO_KEY] = self.server_info
            if method in _CACHEABLE:
                result.setdefault("ttlMs", 0)
                result.setdefault("cacheScope", "private")
        return result

    def initialize(self, params: dict[str, Any]) -> tuple[str, dict[str, Any], dict[str, Any]]:
        """Validate legacy ``initialize`` params; returns (negotiated version, client info, client capabilities)."""
        version = params.get("protocolVersion")
        if not isinstance(version, str):
            raise rpc.RpcError(rpc.INVALID_PARAMS, "params.protocolVersion must be a string")
        client_info = params.get("clientInfo", {})
        caps = params.get("capabilities", {})
        if not isinstance(client_info, dict) or not isinstance(caps, dict):
            raise rpc.RpcError(rpc.INVALID_PARAMS, "params.clientInfo and params.capabilities must be objects")
        # Both are kept in the session record for its life (and, on Redis, in every copy of it).
        limit, depth = self.settings.max_client_info_bytes, self.settings.max_input_depth
        try:
            size = sum(len(encode_bounded(value, depth, limit, f"params.{name}"))
                       for name, value in (("clientInfo", client_info), ("capabilities", caps)))
        except JsonRefused as exc:
            raise rpc.RpcError(rpc.INVALID_PARAMS, str(exc), {"maxBytes": limit, "maxDepth": depth}) from exc
        if size > limit:
            raise rpc.RpcError(rpc.INVALID_PARAMS, f"params.clientInfo and params.capabilities are {size} bytes "
                               f"encoded, more than the limit of {limit} bytes", {"maxBytes": limit, "maxDepth": depth})
        return negotiate_legacy(version), client_info, caps

    def capabilities(self, tenant: str) -> dict[str, Any]:
        """The broker's capabilities, with what the tenant's upstreams add (tools, prompts, completions)."""
        if self.upstreams is None:
            return capabilities()
        return {**capabilities(), **self.upstreams.capabilities(tenant)}

    def initialize_result(self, version: str, tenant: str | None = None) -> dict[str, Any]:
        return {
            "protocolVersion": version,
            "capabilities": capabilities() if tenant is None else self.capabilities(tenant),
            "serverInfo": self.server_info,
            "instructions": self.settings.instructions,
        }

    # -- handlers ----------------------------------------------------------------------------
    async def _ping(self, call: Call, params: dict[str, Any]) -> dict[str, Any]:
        return {}

    async def _server_discover(self, call: Call, params: dict[str, Any]) -> dict[str, Any]:
        return {
            "supportedVersions": list(MODERN_VERSIONS),
            # The resumable-listen extension is 2026-07-28's: the legacy era resumes its GET stream.
            "capabilities": {**self.capabilities(call.principal.tenant), "extensions": dict(self.extensions)},
            "instructions": self.settings.instructions,
            "ttlMs": 300_000,
            # With upstreams its capabilities are the caller's tenant's: not one answer for everyone.
            "cacheScope": "public" if self.upstreams is None else "private",
        }

    async def _resources_list(self, call: Call, params: dict[str, Any]) -> dict[str, Any]:
        cursor = params.get("cursor")
        if cursor is not None and not isinstance(cursor, str):
            raise rpc.RpcError(rpc.INVALID_PARAMS, "params.cursor must be a string")
        try:
            page, next_cursor = await self.resources.list_page(call.principal, cursor, self.settings.page_size)
        except BadCursor as exc:
            raise rpc.RpcError(rpc.INVALID_PARAMS, "Invalid cursor", {"cursor": cursor}) from exc
        result: dict[str, Any] = {"resources": page}
        if next_cursor is not None:
            result["nextCursor"] = next_cursor
        return result

    async def _resources_templates_list(self, call: Call, params: dict[str, Any]) -> dict[str, Any]:
        cursor = params.get("cursor")
        if cursor is not None and not isinstance(cursor, str):
            raise rpc.RpcError(rpc.INVALID_PARAMS, "params.cursor must be a string")
        if self.forwarded is not None and self.forwarded.upstreams.of(call.principal.tenant):
            # The broker's own templates on the first page, then the upstreams', page by page.
            own = [] if cursor is not None else self.resources.templates(call.principal)
            listed = await self.forwarded.list_of(call, params, "resources/templates/list")
            listed["resourceTemplates"] = own + listed["resourceTemplates"]
            return listed
        if cursor is not None:
            # One page holds every template; only a cursor this listing never issues can arrive here.
            raise rpc.RpcError(rpc.INVALID_PARAMS, "Invalid cursor", {"cursor": cursor})
        return {"resourceTemplates": self.resources.templates(call.principal)}

    async def _resources_read(self, call: Call, params: dict[str, Any]) -> dict[str, Any]:
        uri = self.uri_param(params)
        try:
            contents = await self.resources.read(call.principal, uri)
        except NotFound as exc:
            raise self.not_found(call, uri) from exc
        except ResourceRefused as exc:  # too large, not a regular file: it is there, and is not served
            raise rpc.RpcError(rpc.INVALID_PARAMS, exc.message, exc.data) from exc
        return {"contents": contents}

    async def _resources_subscribe(self, call: Call, params: dict[str, Any]) -> dict[str, Any]:
        uri = self.uri_param(params)
        self.check_watch(call, uri)
        session = self._session(call)
        limit = self.settings.max_subscriptions_per_session
        quota = self.quotas.of(session.tenant).subscriptions
        if quota is not None and quota <= limit:
            # The tenant's quota is the tighter bound; 0 allows none (the store reads 0 as no bound).
            await self._add_within(session, uri, quota)
        else:
            await self.subscriptions.add(session.id, session.tenant, uri, limit)  # LimitExceeded past ``limit``
        return {}

    async def _add_within(self, session: SessionRecord, uri: str, quota: int) -> None:
        """Subscribe within the tenant's per-session quota. Raises OverQuota (nothing added)."""
        refused = OverQuota("subscriptions", session.tenant, quota, 5,
                            f"tenant {session.tenant!r} sessions may hold {quota} subscriptions each "
                            "(its quota); unsubscribe one first")
        if quota == 0:
            raise refused
        try:
            await self.subscriptions.add(session.id, session.tenant, uri, quota)
        except LimitExceeded as exc:  # the store's bound is the tenant's quota here
            raise refused from exc

    async def _resources_unsubscribe(self, call: Call, params: dict[str, Any]) -> dict[str, Any]:
        # Not held to the canonical spelling: a subscription made before that rule can still go.
        uri = self.uri_param(params, canonical=False)
        session = self._session(call)
        await self.subscriptions.remove(session.id, session.tenant, uri)
        return {}

    @staticmethod
    def _session(call: Call) -> SessionRecord:
        if call.session is None:
            raise rpc.RpcError(rpc.INVALID_REQUEST, "This method needs an initialized session")
        return call.session

    # -- subscriptions/listen (checks before the ack) -----------------------------------------------
    def listen_filter(self, call: Call, params: dict[str, Any]) -> tuple[list[str], bool, dict[str, Any]]:
        """Validate a listen filter; returns (URIs, resourcesListChanged, the acknowledged filter).

        Raises:
            RpcError: -32602 for a malformed filter, a URI the caller may not read, or too many URIs.
            OverQuota: more URIs than the tenant's ``subscriptions`` quota.
        """
        if SUBSCRIBE not in call.principal.scopes:
            raise forbidden("subscriptions/listen", SUBSCRIBE)
        spec = params.get("notifications")
        if not isinstance(spec, dict):
            raise rpc.RpcError(rpc.INVALID_PARAMS, "params.notifications must be an object", invalid=True)
        for flag in ("toolsListChanged", "promptsListChanged", "resourcesListChanged"):
            if flag in spec and not isinstance(spec[flag], bool):
                raise rpc.RpcError(rpc.INVALID_PARAMS, f"notifications.{flag} must be a boolean", invalid=True)
        uris = self.watched_uris(call, spec.get("resourceSubscriptions", []), "notifications.resourceSubscriptions")
        # A listen's URIs are its subscriptions: a plain listen is held to the quota as a resumable one is.
        quota = self.quotas.of(call.principal.tenant).subscriptions
        if quota is not None and len(uris) > quota:
            raise OverQuota("subscriptions", call.principal.tenant, quota, 5,
                            f"tenant {call.principal.tenant!r} listens may watch {quota} URIs each (its quota)")
        list_changed = spec.get("resourcesListChanged") is True
        # Only what the broker honours: it has no tools or prompts, so those flags are left out.
        ack: dict[str, Any] = {}
        if list_changed:
            ack["resourcesListChanged"] = True
        if "resourceSubscriptions" in spec:
            ack["resourceSubscriptions"] = uris
        return uris, list_changed, ack

    def watched_uris(self, call: Call, uris: Any, name: str) -> list[str]:
        """A list of URIs to watch, held to a listen filter's rules; deduplicated, in order.

        Raises:
            RpcError: -32602 (``invalid``) for a value that is not an array of strings, too many URIs or
                bytes of them, or a URI the caller may not read (``name`` says which param).
        """
        if not isinstance(uris, list) or not all(isinstance(u, str) for u in uris):
            raise rpc.RpcError(rpc.INVALID_PARAMS, f"{name} must be an array of strings", invalid=True)
        unique = list(dict.fromkeys(cast(list[str], uris)))
        if len(unique) > self.settings.max_listen_uris:
            raise rpc.RpcError(rpc.INVALID_PARAMS, f"Too many URIs: at most {self.settings.max_listen_uris} per listen",
                               {"limit": self.settings.max_listen_uris}, invalid=True)
        total = sum(len(uri.encode("utf-8", "surrogatepass")) for uri in unique)
        budget = self.settings.max_listen_filter_bytes
        if total > budget:
            raise rpc.RpcError(rpc.INVALID_PARAMS, f"The filter's URIs are {total} bytes, more than the limit of "
                               f"{budget}", {"limit": budget}, invalid=True)
        for uri in unique:
            self.check_watch(call, uri)
        return unique

    def extend(self, handlers: dict[str, Handler], extensions: dict[str, Any]) -> None:
        """Serve more 2026-07-28 methods (an extension's), and advertise the extension in ``server/discover``."""
        self._handlers.update(handlers)
        self.modern_methods = self.modern_methods | handlers.keys()
        self.extensions.update(extensions)
