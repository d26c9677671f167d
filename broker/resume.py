"""Opening a resumable listen (``broker.delivery.resumable``): a new one, or the resumption of one.

A new resumable listen is a session created for it (bound to the principal, its filter kept in
the record), subscribed to every URI of the filter *before* the stream starts, so that what is
published from the moment its subscriptions exist waits in its inbox: the ack follows that
moment, and nothing after it is missed. A resumption names the session and a position in the
last event id it received; the same principal with the same filter continues from there (the
legacy stream's replay, then live), and with another filter keeps its session, refiltered, and
starts with the gap rule. The refilter records the inbox position it took effect at: an id from
before it gets the gap rule too, even with the filter the listen now has, because what follows it
in the inbox is of the old filter (URIs no longer watched) and lacks the new filter's changes
from before the refilter. An id of a session that has expired or is another principal's gets a
new listen that starts with the gap rule: the client re-reads what it watches and loses
nothing, and never sees a frame of a session that is not its own.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

from broker.auth import Principal
from broker.backends.base import SubscriptionIndex
from broker.backends.types import SessionRecord
from broker.delivery.legacy import LegacyServices
from broker.delivery.resumable import FILTER, LAST_EVENT_ID, ResumableListen, parse_listen_id
from broker.delivery.stream import StreamMetrics
from broker.errors import OverQuota, SessionNotFound
from broker.protocol import jsonrpc as rpc
from broker.protocol.jsonrpc import Id
from broker.quotas import TenantQuotas
from broker.sessions import Sessions

__all__ = ["ResumableListens", "last_event_id"]

#: The protocol version a listen's session records (it is never initialized as a legacy one).
LISTEN_VERSION = "2026-07-28"
#: Where a refiltered listen's record keeps ``[epoch, offset]``, the inbox head once its filter took effect.
SINCE = "dev.mcp-broker/listenSince"
#: Subscriptions of a new listen's session sent at once (each is its own atomic step in the store).
SUBSCRIBE_CHUNK = 64


def last_event_id(params: dict[str, Any], header: str | None) -> str | None:
    """The position a listen request resumes from: the ``Last-Event-ID`` header over HTTP, the
    ``_meta`` key on stdio (where there are no headers).

    Raises:
        RpcError: -32602 (400) for a ``_meta`` value that is not a string.
    """
    if header is not None:
        return header
    value = (params.get("_meta") or {}).get(LAST_EVENT_ID)
    if value is not None and not isinstance(value, str):
        raise rpc.RpcError(rpc.INVALID_PARAMS, f"_meta.{LAST_EVENT_ID} must be a string", invalid=True)
    return value


class ResumableListens:
    """Opens resumable listens on the legacy sessions' stores and streams."""

    def __init__(self, sessions: Sessions, subscriptions: SubscriptionIndex, services: LegacyServices,
                 metrics: StreamMetrics, server_meta: dict[str, Any], quotas: TenantQuotas | None = None) -> None:
        """``metrics``: the listens' (their streams count as 2026-07-28's, not as legacy GET streams).
        ``quotas``: the tenants' ``subscriptions`` quota, which a listen's session is held to."""
        self.sessions = sessions
        self.subscriptions = subscriptions
        self.services = replace(services, metrics=metrics)
        self.server_meta = server_meta
        self.quotas = quotas or TenantQuotas()

    async def open(self, principal: Principal, request_id: Id, uris: list[str], list_changed: bool,
                   ack: dict[str, Any], resume_from: str | None, *, stdio: bool = False) -> ResumableListen:
        """The listen's stream, from ``resume_from`` (an event id it was sent) or new.

        Raises:
            RpcError: -32602 (400) for an id this broker never issues.
            LimitExceeded, OverQuota: a new listen's session is over the sessions' limits, or its
                filter over the tenant's ``subscriptions`` quota (nothing is created then).
        """
        watched = sorted(set(uris))
        wanted: dict[str, Any] = {"uris": watched, "listChanged": list_changed}
        quota = self.quotas.of(principal.tenant).subscriptions
        if quota is not None and len(watched) > quota:
            raise OverQuota("subscriptions", principal.tenant, quota, 5,
                            f"tenant {principal.tenant!r} listens may watch {quota} URIs each (its quota)")
        session: SessionRecord | None = None
        cursor: int | None = None
        resync = False
        if resume_from is not None:
            parsed = parse_listen_id(resume_from)
            if parsed is None:
                raise rpc.RpcError(rpc.INVALID_PARAMS, "Last-Event-ID is not an event id of a resumable listen",
                                   invalid=True)
            session_id, epoch, offset = parsed
            try:
                found: SessionRecord | None = await self.sessions.load(session_id, principal)
            except SessionNotFound:
                found = None  # expired, or another principal's: a new listen, and the gap rule
            if found is not None and FILTER in found.client_capabilities:
                session = found
                if found.client_capabilities[FILTER] != wanted:
                    # The principal's own listen, with another filter: it is kept, refiltered, and
                    # starts with the gap rule, rather than a new session left behind for each change.
                    await self._refilter(found, wanted)
                    resync = True
                else:
                    # A position of another data generation: the gap rule, never "replay everything";
                    # one from before the last refilter: the gap rule, never the old filter's frames.
                    since = found.client_capabilities.get(SINCE) or [epoch, 0]
                    resync = epoch != found.epoch or (since[0] == epoch and offset < since[1])
                cursor = 0 if resync else offset
            else:
                resync = True
        if session is None:
            session = await self.sessions.create(principal, LISTEN_VERSION, {}, {FILTER: wanted})
            await self._subscribe(session, watched)
        listen = ResumableListen(self.services, session, cursor, resync=resync, request_id=request_id, ack=ack,
                                 list_changed=list_changed, server_meta=self.server_meta, stdio=stdio)
        listen.bind(principal.credential, principal.expires_at)
        return listen

    async def _refilter(self, session: SessionRecord, wanted: dict[str, Any]) -> None:
        old = set(session.client_capabilities[FILTER]["uris"])
        new = set(wanted["uris"])
        await asyncio.gather(*(self.subscriptions.remove(session.id, session.tenant, uri) for uri in old - new))
        await self._subscribe(session, sorted(new - old))
        # The record last: a refilter cut short is done again by the client's next attempt. From
        # the head on, the inbox holds the new filter's frames only.
        head = (await self.services.inboxes.read(session.id, session.epoch, 0, 1)).head
        session.client_capabilities = {FILTER: wanted, SINCE: [session.epoch, head]}
        await self.sessions.store.update(session.id, client_capabilities=session.client_capabilities)

    async def _subscribe(self, session: SessionRecord, uris: list[str]) -> None:
        """Subscribe ``session`` to ``uris``, a chunk of them at a time in flight (one round trip each on Redis)."""
        for start in range(0, len(uris), SUBSCRIBE_CHUNK):
            await asyncio.gather(*(self.subscriptions.add(session.id, session.tenant, uri)
                                   for uri in uris[start:start + SUBSCRIBE_CHUNK]))
