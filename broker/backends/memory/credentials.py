"""Runtime API keys in memory: ``base.Credentials``, two dicts (id -> record, digest -> id).

Each method is one step on the event loop (nothing awaits), so a create is all or nothing and
two revocations of one key at once revoke it once.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import replace

from broker.backends.types import KeyRecord

__all__ = ["MemoryCredentials"]


class MemoryCredentials:
    """The keys of one process; lost with it, like every memory store."""

    def __init__(self) -> None:
        self._by_id: dict[str, KeyRecord] = {}
        self._by_digest: dict[str, str] = {}
        #: Every id, sorted, for ordered paging.
        self._ids: list[str] = []

    async def create(self, record: KeyRecord) -> bool | None:
        if record.created_by is not None:
            maker = self._by_id.get(record.created_by)
            if maker is None or maker.revoked_at is not None:
                return None
        if record.id in self._by_id or record.digest in self._by_digest:
            return False
        self._by_id[record.id] = record
        self._by_digest[record.digest] = record.id
        bisect.insort(self._ids, record.id)
        return True

    async def find(self, digest: str) -> KeyRecord | None:
        key_id = self._by_digest.get(digest)
        return None if key_id is None else self._by_id[key_id]

    async def get(self, key_ids: Sequence[str]) -> dict[str, KeyRecord]:
        return {key_id: self._by_id[key_id] for key_id in key_ids if key_id in self._by_id}

    async def list(self, tenant: str | None, after: str, limit: int) -> list[KeyRecord]:
        found: list[KeyRecord] = []
        for key_id in self._ids[bisect.bisect_right(self._ids, after):]:
            record = self._by_id[key_id]
            if tenant is None or record.tenant == tenant:
                found.append(record)
                if len(found) >= limit:
                    break
        return found

    async def revoke(self, key_id: str, at: float) -> bool | None:
        record = self._by_id.get(key_id)
        if record is None:
            return None
        if record.revoked_at is not None:
            return False
        self._by_id[key_id] = replace(record, revoked_at=at)
        return True
