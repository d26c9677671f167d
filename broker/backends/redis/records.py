"""The record collections on Redis (``base.RecordStore``): JSON records, stored with their change in one script.

A tenant's records live under the hash tag of the change-log partition the tenant maps to
(``{c:<n>}``), so ``record_write.lua`` and ``record_delete.lua`` store or delete a record, count
it in the tenant's quota (``P:{c:<n>}:use:<tenant>``) and append its change to the log, with the
log's bounds checked, in one atomic step: an acknowledged write is never missing from the log,
and a refused one stores nothing.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, cast

from broker.backends.redis.changelog import RedisChangeLog
from broker.backends.redis.codec import as_text, encode_change
from broker.backends.redis.connection import Client, unavailable
from broker.backends.redis.keys import Keys
from broker.backends.redis.scripts import Scripts
from broker.backends.types import record_quota_message
from broker.changes import Change, ChangeKind
from broker.config import Settings
from broker.errors import LimitExceeded, LogFull, QuotaExceeded, WriteConflict

__all__ = ["RedisRecords"]


class RedisRecords:
    """The built-in record collections, each write or delete atomic with its change."""

    def __init__(self, settings: Settings, client: Client, keys: Keys, scripts: Scripts,
                 changelog: RedisChangeLog) -> None:
        self.settings = settings
        self.client = client
        self.keys = keys
        self.scripts = scripts
        self.changelog = changelog

    def _record_keys(self, tenant: str, collection: str) -> list[str]:
        p = self.changelog.partition(tenant)
        keys = self.keys
        return [keys.records(p, tenant, collection), keys.record_ids(p, tenant, collection),
                keys.collections(p, tenant), keys.log(p), keys.record_usage(p, tenant), keys.backlog(p)]

    def _record_refused(self, tenant: str, code: int) -> None:
        """Raise what a record script's -4 or -5 means (the change-log bounds of ``changelog_append.lua``)."""
        if code == -4:
            raise LogFull(self.changelog.partition(tenant), self.settings.changelog_maxlen)
        if code == -5:
            limit = self.settings.changelog_tenant_max
            raise QuotaExceeded(tenant, limit, limit, 1)

    async def write(self, tenant: str, collection: str, record_id: str, data: bytes, change: Change,
                    expect: bytes | None = None) -> bool:
        settings = self.settings
        args: list[Any] = [record_id, data, collection, settings.changelog_maxlen, encode_change(change),
                           encode_change(replace(change, kind=ChangeKind.CREATED)), settings.max_records_per_tenant,
                           settings.max_record_bytes_per_tenant, settings.changelog_tenant_max, tenant]
        if expect is not None:
            args.append(expect)
        keys = self._record_keys(tenant, collection)
        with unavailable("records.write"):
            created = int(await self.scripts.record_write(keys=keys, args=args))
            if created == -4:  # full: trim what was processed and try once more (see RedisChangeLog._append)
                await self.changelog.trim(self.changelog.partition(tenant))
                created = int(await self.scripts.record_write(keys=keys, args=args))
        if created == -1:
            raise WriteConflict(record_id)
        if created in (-2, -3):
            raise LimitExceeded(record_quota_message(settings, count=created == -2))
        self._record_refused(tenant, created)
        return created == 1

    async def read(self, tenant: str, collection: str, record_id: str) -> bytes | None:
        with unavailable("records.read"):
            data = await self.client.hget(self._record_keys(tenant, collection)[0], record_id)
        return cast("bytes | None", data)

    async def delete(self, tenant: str, collection: str, record_id: str, change: Change) -> bool:
        keys = self._record_keys(tenant, collection)
        args: list[Any] = [record_id, collection, self.settings.changelog_maxlen, encode_change(change),
                           self.settings.changelog_tenant_max, tenant]
        with unavailable("records.delete"):
            deleted = int(await self.scripts.record_delete(keys=keys, args=args))
            if deleted == -4:  # full: trim what was processed and try once more (see RedisChangeLog._append)
                await self.changelog.trim(self.changelog.partition(tenant))
                deleted = int(await self.scripts.record_delete(keys=keys, args=args))
        self._record_refused(tenant, deleted)
        return deleted == 1

    async def ids(self, tenant: str, collection: str, after: str, limit: int) -> list[str]:
        if limit <= 0:
            return []
        key = self._record_keys(tenant, collection)[1]
        with unavailable("records.ids"):
            ids = await self.client.zrangebylex(key, f"({after}" if after else "-", "+", start=0, num=limit)
        return [as_text(i) for i in ids]

    async def collections(self, tenant: str) -> list[str]:
        with unavailable("records.collections"):
            key = self.keys.collections(self.changelog.partition(tenant), tenant)
            names = cast("list[bytes]", await self.client.zrange(key, 0, -1))  # members: no scores asked
        return [as_text(n) for n in names]
