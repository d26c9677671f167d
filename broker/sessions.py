"""Legacy sessions: creation, lookup bound to the principal, and ending."""

from __future__ import annotations

import secrets
import time
from typing import Any

from broker.auth import Principal
from broker.backends.base import Inboxes, SessionStore
from broker.backends.types import SessionRecord
from broker.errors import LimitExceeded, Reason, SessionNotFound
from broker.metrics import NO_METRICS, Metrics, TenantCounter, TenantLabels
from broker.quotas import TenantQuotas

#: A session, as the transports hold it (the record the backend stores).
__all__ = ["SessionRecord", "Sessions"]

#: Session ids longer than this are never looked up (ours are 32 characters).
MAX_SESSION_ID = 128


class Sessions:
    """The sessions of the handshake era, as the transports see them.

    A session id is a bearer secret bound to the principal that created it: a lookup by any
    other principal is a miss, as if the session did not exist.
    """

    def __init__(self, store: SessionStore, inboxes: Inboxes, max_sessions: int, *,
                 metrics: Metrics = NO_METRICS, tenant_labels: TenantLabels | None = None,
                 quotas: TenantQuotas | None = None, tenant_max: int | None = None) -> None:
        """``quotas``: each tenant's ``sessions`` quota, counted by the store in the create's own step;
        ``tenant_max``: the sessions any one tenant may have, counted the same way (its share of
        ``max_sessions``, ``quotas.tenant_share``), so that one tenant cannot fill them all."""
        self.store = store
        self.quotas = quotas or TenantQuotas()
        self.inboxes = inboxes
        self.max_sessions = max_sessions
        self.tenant_max = tenant_max
        self._created = TenantCounter(metrics, "mcp_broker_tenant_sessions_created_total",
                                      tenant_labels or TenantLabels(0))

    async def create(self, principal: Principal, version: str, client_info: dict[str, Any],
                     capabilities: dict[str, Any]) -> SessionRecord:
        """A new session with a cryptographically random id (visible ASCII only).

        Raises:
            LimitExceeded: ``max_sessions`` live sessions exist already.
            OverQuota: the tenant has as many live sessions as its ``sessions`` quota, or its share.
        """
        if await self.store.count() >= self.max_sessions:
            raise LimitExceeded(f"{self.max_sessions} sessions are live (MCP_BROKER_MAX_SESSIONS)",
                                reason=Reason.SESSIONS, retry_after=5, data={"limit": "sessions"})
        record = SessionRecord(
            id=secrets.token_urlsafe(24),
            tenant=principal.tenant,
            principal=principal.key,
            protocol_version=version,
            epoch=self.store.epoch,
            created_at=time.time(),
            client_info=client_info,
            client_capabilities=capabilities,
        )
        quota = self.quotas.of(record.tenant).sessions
        if self.tenant_max is not None:
            quota = self.tenant_max if quota is None else min(quota, self.tenant_max)
        await self.store.create(record, quota)
        self._created.inc(record.tenant)
        return record

    async def load(self, session_id: str, principal: Principal) -> SessionRecord:
        """The live session, with its idle clock restarted.

        Raises:
            SessionNotFound: unknown, expired or ended, or created by another principal.
        """
        if not session_id or len(session_id) > MAX_SESSION_ID:
            raise SessionNotFound(session_id)
        record = await self.store.get(session_id, touch_as=principal.key)
        # A session of another principal is indistinguishable from one that does not exist
        # (and its idle clock is left alone).
        if record is None or record.principal != principal.key:
            raise SessionNotFound(session_id)
        return record

    async def initialized(self, session_id: str) -> None:
        """The client sent ``notifications/initialized``."""
        await self.store.update(session_id, initialized=True)

    async def end(self, session_id: str) -> None:
        """Delete the session, then close its stream, wherever it is."""
        await self.store.delete(session_id)
        # A claim of a session that no longer exists is a takeover by nobody (``CLOSE_ALL``):
        # every stream of the session ends, on whichever worker holds it.
        await self.inboxes.claim_stream(session_id)
