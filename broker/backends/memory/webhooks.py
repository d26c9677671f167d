"""Webhook subscriptions in memory: ``base.Webhooks``, a dict by id and a deque of dead letters.

Each method is one step on the event loop (nothing awaits), so a create is all or nothing and
an update never lands on a record that was removed.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import replace

from broker.backends.types import DeadLetter, WebhookRecord
from broker.errors import LimitExceeded, OverQuota, Reason

__all__ = ["MemoryWebhooks"]


class MemoryWebhooks:
    """The webhook subscriptions of one process; lost with it, like every memory store."""

    def __init__(self) -> None:
        self._by_id: dict[str, WebhookRecord] = {}
        #: Every id, sorted, for ordered paging.
        self._ids: list[str] = []
        self._dead: deque[DeadLetter] = deque()

    async def create(self, record: WebhookRecord, most: int, tenant_most: int | None = None) -> bool:
        if record.id in self._by_id:
            return False
        if len(self._by_id) >= most:
            raise LimitExceeded(f"{most} webhook subscriptions exist", reason=Reason.WEBHOOKS, retry_after=60,
                                data={"limit": "subscriptions", "max": most})
        if tenant_most is not None and sum(r.tenant == record.tenant for r in self._by_id.values()) >= tenant_most:
            raise OverQuota("webhooks", record.tenant, tenant_most, 60,
                            f"tenant {record.tenant!r} has {tenant_most} webhook subscriptions (its quota)")
        self._by_id[record.id] = record
        bisect.insort(self._ids, record.id)
        return True

    async def get(self, subscription_id: str) -> WebhookRecord | None:
        return self._by_id.get(subscription_id)

    async def page(self, after: str, limit: int) -> list[WebhookRecord]:
        start = bisect.bisect_right(self._ids, after)
        return [self._by_id[i] for i in self._ids[start:start + limit]]

    async def refresh(self, subscription_id: str, expires_at: float, secret: str, credential: str | None) -> bool:
        return self._update(subscription_id, expires_at=expires_at, secret=secret, credential=credential)

    async def advance(self, subscription_id: str, since: tuple[str, str], session: str, epoch: str, offset: int,
                      delivered_at: float | None, *, gap: bool = False) -> bool:
        record = self._by_id.get(subscription_id)
        if record is None or (record.session, record.epoch) != since:
            return False
        if delivered_at is None:
            return self._update(subscription_id, session=session, epoch=epoch, offset=offset, gap=gap)
        return self._update(subscription_id, session=session, epoch=epoch, offset=offset, gap=gap,
                            delivered_at=delivered_at, last_error=None, failed_since=None)

    async def fail(self, subscription_id: str, error: str, at: float) -> bool:
        record = self._by_id.get(subscription_id)
        since = at if record is None or record.failed_since is None else record.failed_since
        return self._update(subscription_id, last_error=error, failed_since=since)

    async def remove(self, subscription_id: str, *, expired_by: float | None = None,
                     credential: str | None = None) -> str | None:
        record = self._by_id.get(subscription_id)
        if record is None or (expired_by is not None and record.expires_at > expired_by) or (
                credential is not None and record.credential != credential):
            return None
        del self._by_id[subscription_id]
        self._ids.remove(subscription_id)
        return record.session

    async def dead_letter(self, entry: DeadLetter, keep: int) -> None:
        self._dead.appendleft(entry)
        while len(self._dead) > keep:
            self._dead.pop()

    async def dead_letters(self, limit: int) -> list[DeadLetter]:
        return list(self._dead)[:limit]

    def _update(self, subscription_id: str, **fields: object) -> bool:
        record = self._by_id.get(subscription_id)
        if record is None:
            return False
        self._by_id[subscription_id] = replace(record, **fields)  # type: ignore[arg-type]
        return True
