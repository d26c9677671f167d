"""The built-in record collections in memory: ``base.RecordStore``.

A write or a delete checks the tenant's quota, asks the change log to admit its change, stores
the record and appends the change, in one step on the event loop (nothing awaits): an
acknowledged write is never missing from the change log, and a refused one stored nothing.
"""

from __future__ import annotations

import bisect
from dataclasses import replace

from broker.backends.memory.changelog import MemoryChangeLog
from broker.backends.types import record_quota_message
from broker.changes import Change, ChangeKind
from broker.config import Settings
from broker.errors import LimitExceeded, Reason, WriteConflict

__all__ = ["MemoryRecords"]


class MemoryRecords:
    """JSON records by (tenant, collection), each write published to ``changelog`` with it."""

    def __init__(self, settings: Settings, changelog: MemoryChangeLog) -> None:
        self._settings = settings
        self._changelog = changelog
        self._records: dict[tuple[str, str], dict[str, bytes]] = {}
        self._ids: dict[tuple[str, str], list[str]] = {}
        #: Each tenant's collection names, sorted: listing them must not scan every tenant's.
        self._collections: dict[str, list[str]] = {}
        #: Per tenant: [records, bytes of their values], for the tenant's record quota.
        self._usage: dict[str, list[int]] = {}

    async def write(self, tenant: str, collection: str, record_id: str, data: bytes, change: Change,
                    expect: bytes | None = None) -> bool:
        settings = self._settings
        key = (tenant, collection)
        records = self._records.get(key, {})
        old = records.get(record_id)
        if expect is not None and old != expect:
            raise WriteConflict(record_id)
        created = old is None
        usage = self._usage.setdefault(tenant, [0, 0])
        grow = len(data) - (0 if old is None else len(old))
        if created and usage[0] >= settings.max_records_per_tenant:
            raise LimitExceeded(record_quota_message(settings, count=True), reason=Reason.RECORDS)
        if grow > 0 and usage[1] + grow > settings.max_record_bytes_per_tenant:
            raise LimitExceeded(record_quota_message(settings, count=False), reason=Reason.RECORDS)
        self._changelog.admit((change,))
        usage[0] += created
        usage[1] += grow
        records = self._records.setdefault(key, records)
        records[record_id] = data
        if created:
            ids = self._ids.setdefault(key, [])
            if not ids:
                bisect.insort(self._collections.setdefault(tenant, []), collection)
            bisect.insort(ids, record_id)
        self._changelog.append(replace(change, kind=ChangeKind.CREATED) if created else change)
        return created

    async def read(self, tenant: str, collection: str, record_id: str) -> bytes | None:
        return self._records.get((tenant, collection), {}).get(record_id)

    async def delete(self, tenant: str, collection: str, record_id: str, change: Change) -> bool:
        key = (tenant, collection)
        records = self._records.get(key)
        if records is None or record_id not in records:
            return False
        self._changelog.admit((change,))
        usage = self._usage[tenant]
        usage[0] -= 1
        usage[1] -= len(records.pop(record_id))
        ids = self._ids[key]
        del ids[bisect.bisect_left(ids, record_id)]
        if not records:
            del self._records[key]
            del self._ids[key]
            names = self._collections[tenant]
            del names[bisect.bisect_left(names, collection)]
            if not names:
                del self._collections[tenant]
        self._changelog.append(change)
        return True

    async def ids(self, tenant: str, collection: str, after: str, limit: int) -> list[str]:
        ids = self._ids.get((tenant, collection), [])
        start = bisect.bisect_right(ids, after) if after else 0
        return ids[start : start + limit]

    async def collections(self, tenant: str) -> list[str]:
        return list(self._collections.get(tenant, ()))
