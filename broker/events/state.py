"""The state behind a poll or a webhook subscription: a hidden session, as a resumable listen keeps.

The session is created bound to the principal, with what it serves (``wanted``: the event name,
its canonical arguments, the mode) in its record, and subscribed to every URI of the arguments
before its first cursor is handed out, so fan-out fills its inbox from that moment on with no
code of its own. It expires like a legacy session, ``session_ttl`` after it was last touched.
Its URIs are held to the tenant's ``subscriptions`` quota as a resumable listen's filter is
(``broker.resume``), before anything is made.
"""

from __future__ import annotations

from typing import Any

from broker.auth import Principal
from broker.backends.base import SubscriptionIndex
from broker.backends.types import SessionRecord
from broker.errors import OverQuota, SessionNotFound
from broker.events.model import RESOURCE_UPDATED, STATE, not_found
from broker.methods import Call, Methods
from broker.protocol import jsonrpc as rpc
from broker.quotas import TenantQuotas
from broker.resume import LISTEN_VERSION
from broker.sessions import Sessions

__all__ = ["EventSessions", "wanted"]


def wanted(methods: Methods, call: Call, params: dict[str, Any], mode: str) -> dict[str, Any]:
    """What a request subscribes to, canonical: ``{"name", "arguments": {"uris": sorted}, "mode"}``.

    Raises:
        RpcError: -32602 (``invalid``) for a bad name or arguments (the URIs held to a listen
            filter's rules); -32011 for an event type the server does not have.
    """
    name = params.get("name")
    if not isinstance(name, str):
        raise rpc.RpcError(rpc.INVALID_PARAMS, "params.name must be a string", invalid=True)
    if name != RESOURCE_UPDATED:
        raise not_found(f"Unknown event: {name[:100]!r}; events/list names the one this server has", "event")
    arguments = params.get("arguments")
    if not isinstance(arguments, dict):
        raise rpc.RpcError(rpc.INVALID_PARAMS, 'params.arguments must be an object: {"uris": [...]}', invalid=True)
    if unknown := sorted(set(arguments) - {"uris"}):
        raise rpc.RpcError(rpc.INVALID_PARAMS, f"Unknown arguments: {', '.join(unknown)[:200]}; known: uris",
                           invalid=True)
    uris = methods.watched_uris(call, arguments.get("uris"), "arguments.uris")
    if not uris:
        raise rpc.RpcError(rpc.INVALID_PARAMS, "arguments.uris must name at least one resource", invalid=True)
    return {"name": name, "arguments": {"uris": sorted(uris)}, "mode": mode}


class EventSessions:
    """Creates and finds the hidden sessions of polls and webhook subscriptions."""

    def __init__(self, sessions: Sessions, subscriptions: SubscriptionIndex,
                 quotas: TenantQuotas | None = None) -> None:
        self.sessions = sessions
        self.subscriptions = subscriptions
        self.quotas = quotas or TenantQuotas()

    async def create(self, principal: Principal, what: dict[str, Any]) -> SessionRecord:
        """A new session serving ``what``, subscribed to its URIs.

        Raises:
            OverQuota: over the tenant's ``sessions`` quota, or with more URIs than its ``subscriptions`` quota.
            LimitExceeded: ``max_sessions`` sessions are live.
        """
        quota = self.quotas.of(principal.tenant).subscriptions
        if quota is not None and len(what["arguments"]["uris"]) > quota:
            raise OverQuota("subscriptions", principal.tenant, quota, 5,
                            f"tenant {principal.tenant!r} may watch {quota} URIs per subscription (its quota)")
        session = await self.sessions.create(principal, LISTEN_VERSION, {}, {STATE: what})
        for uri in what["arguments"]["uris"]:
            await self.subscriptions.add(session.id, session.tenant, uri)
        return session

    async def load(self, principal: Principal, session_id: str, what: dict[str, Any]) -> SessionRecord | None:
        """The principal's live session serving ``what`` (its idle clock restarted); None for any other."""
        try:
            found = await self.sessions.load(session_id, principal)
        except SessionNotFound:
            return None
        return found if found.client_capabilities.get(STATE) == what else None
