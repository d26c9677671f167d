"""Session records in memory: ``base.SessionStore``.

Every method runs on the event loop without awaiting, so each is one atomic step. Deleting,
expiring and restoring go through the shared ``SessionState``, so a session's subscriptions,
index entries and inbox go (and come back) with its record.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import replace
from typing import Any

from broker.backends.memory.state import Inbox, SessionState
from broker.backends.types import SessionRecord
from broker.errors import OverQuota
from broker.feeds.model import FeedKind

__all__ = ["MemorySessions"]


class MemorySessions:
    """Legacy session records, their idle clocks, restoring."""

    def __init__(self, state: SessionState) -> None:
        self._state = state

    @property
    def epoch(self) -> str:
        return self._state.epoch

    async def create(self, record: SessionRecord, tenant_limit: int | None = None) -> None:
        if tenant_limit is not None:
            self._admit(record.tenant, tenant_limit)
        self._create(record)

    def _admit(self, tenant: str, limit: int) -> None:
        """Refuse a session beyond the tenant's quota; at the limit, its expired sessions go first
        (the sweep may not have reached them), so the count is of live sessions only."""
        members = self._state.by_tenant.get(tenant, set())
        if len(members) >= limit:
            for sid in [sid for sid in members if self._state.expired(sid)]:
                self._delete(sid)
            if len(members) >= limit:
                raise OverQuota("sessions", tenant, limit, 5,
                                f"tenant {tenant!r} has {limit} live sessions (its quota); end one or retry later")

    async def get(self, session_id: str, *, touch_as: str | None = None) -> SessionRecord | None:
        state = self._state
        record = state.records.get(session_id)
        if record is None or state.expired(session_id):
            return None
        if touch_as is not None and touch_as == record.principal:
            state.seen[session_id] = time.monotonic()
        return replace(record)

    async def update(self, session_id: str, **fields: Any) -> None:
        record = self._state.records.get(session_id)
        if record is not None:
            for name, value in fields.items():
                setattr(record, name, value)

    async def touch(self, session_ids: Sequence[str]) -> None:
        now = time.monotonic()
        seen = self._state.seen
        for sid in session_ids:
            if sid in seen:
                seen[sid] = now

    async def delete(self, session_id: str) -> bool:
        return self._delete(session_id)

    async def restore(self, record: SessionRecord, subscriptions: Collection[str]) -> bool:
        state = self._state
        if record.id in state.records and not state.expired(record.id):
            return False
        self._delete(record.id)  # an expired record the sweep has not reached yet
        record.epoch = state.epoch
        self._create(replace(record))
        for uri in subscriptions:
            state.subscribe(record.id, record.tenant, uri)
        return True

    async def count(self) -> int:
        return len(self._state.records)

    async def count_sessions(self) -> int:
        return self._state.sessions

    async def expire(self) -> int:
        expired = [sid for sid in self._state.records if self._state.expired(sid)]
        for sid in expired:
            self._delete(sid)
        return len(expired)

    def _create(self, record: SessionRecord) -> None:
        state = self._state
        record.epoch = state.epoch
        state.records[record.id] = record
        state.sessions += record.kind is FeedKind.SESSION
        state.seen[record.id] = time.monotonic()
        state.subs[record.id] = set()
        state.by_tenant.setdefault(record.tenant, set()).add(record.id)
        state.inboxes[record.id] = Inbox()

    def _delete(self, session_id: str) -> bool:
        state = self._state
        record = state.records.pop(session_id, None)
        if record is None:
            return False
        state.sessions -= record.kind is FeedKind.SESSION
        state.seen.pop(session_id, None)
        for uri in state.subs.pop(session_id, set()):
            state.unindex(record.tenant, uri, session_id)
        tenant = state.by_tenant.get(record.tenant)
        if tenant is not None:
            tenant.discard(session_id)
        state.inboxes.pop(session_id, None)
        state.generations.pop(session_id, None)
        return True
