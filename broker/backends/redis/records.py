"""The record collections on Redis (``base.RecordStore``): JSON records, stored with their change in one script.

A collection's records live under the hash tag of the change-log partition the collection maps
to (``{c:<n>}``, ``partitioning``), so ``record_write.lua`` and ``record_delete.lua`` store or
delete a record, count it in the tenant's usage (``P:{c:<n>}:use:<tenant>``, one hash per
partition) and append its change to the log, with the log's bounds checked, in one atomic step:
an acknowledged write is never missing from the log, and a refused one stores nothing.

The tenant's record quota is checked against its usage in every partition: on a single server
the script reads all of them, so the quota is exact. On Cluster a script may touch one slot
only, so each partition holds the tenant's quota divided by the partition count (rounded up).

While a switch of layouts moves records (``partitioning.move_records``), writes answer 503 and
reads look where the collection was first, then where it goes.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any, cast

from broker.backends.redis.batch import Batch
from broker.backends.redis.changelog import RedisChangeLog
from broker.backends.redis.codec import as_text, encode_change
from broker.backends.redis.connection import Client, unavailable
from broker.backends.redis.keys import Keys
from broker.backends.redis.partitioning import Layout
from broker.backends.redis.scripts import Scripts
from broker.backends.types import record_quota_message
from broker.changes import Change, ChangeKind
from broker.config import Settings
from broker.errors import BackendUnavailable, LimitExceeded, LogFull, QuotaExceeded, Reason, WriteConflict

#: Tries of a record write that meets a sealed partition (a switch is being made).
SEALED_TRIES = 50

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

    @property
    def _layout(self) -> Layout:
        return self.changelog.partitioning.write

    def _record_keys(self, tenant: str, collection: str, layout: Layout | None = None) -> list[str]:
        """The keys of a record script: the collection's, its partition's, the tenant's usage elsewhere."""
        layout = layout or self._layout
        p = layout.route_collection(tenant, collection)
        keys = self.keys
        found = [keys.records(p, tenant, collection), keys.record_ids(p, tenant, collection),
                 keys.collections(p, tenant), keys.log(p), keys.record_usage(p, tenant), keys.backlog(p),
                 keys.sealed(p)]
        if not self.changelog.cluster:
            found += [keys.record_usage(other, tenant) for other in layout.numbers if other != p]
        return found

    def _quotas(self) -> tuple[int, int]:
        """The tenant's record quotas (count, bytes) as one script may check them: on Cluster, a partition's share."""
        settings = self.settings
        if not self.changelog.cluster:
            return settings.max_records_per_tenant, settings.max_record_bytes_per_tenant
        count = self._layout.count
        return -(-settings.max_records_per_tenant // count), -(-settings.max_record_bytes_per_tenant // count)

    def _record_refused(self, tenant: str, collection: str, code: int) -> None:
        """Raise what a record script's -4 or -5 means (the change-log bounds of ``changelog_append.lua``)."""
        if code == -4:
            raise LogFull(self._layout.route_collection(tenant, collection), self.settings.changelog_maxlen)
        if code == -5:
            limit = self.settings.changelog_tenant_max
            raise QuotaExceeded(tenant, limit, limit, 1)

    async def _run(self, script: Any, tenant: str, collection: str, args: list[Any]) -> int:
        """Run a record script under the current layout: a full partition is trimmed and tried once more
        (see ``RedisChangeLog._append_group``), a sealed one sends it to the new layout."""
        partitioning = self.changelog.partitioning
        for _ in range(SEALED_TRIES):
            if partitioning.moving:
                await partitioning.load()
                if partitioning.moving:
                    raise BackendUnavailable("records are moving to new change-log partitions; write again shortly")
            keys = self._record_keys(tenant, collection)
            code = int(await self.changelog.durable.run(self.client, script, keys, args))
            if code == -4:
                await self.changelog.trim(self._layout.route_collection(tenant, collection))
                code = int(await self.changelog.durable.run(self.client, script, keys, args))
            if code != -6:
                return code
            await asyncio.sleep(0.02)
            await partitioning.load()
        raise BackendUnavailable("the change log is switching partitions; write again shortly")

    async def write(self, tenant: str, collection: str, record_id: str, data: bytes, change: Change,
                    expect: bytes | None = None) -> bool:
        settings = self.settings
        max_records, max_bytes = self._quotas()
        args: list[Any] = [record_id, data, collection, settings.changelog_maxlen, encode_change(change),
                           encode_change(replace(change, kind=ChangeKind.CREATED)), max_records,
                           max_bytes, settings.changelog_tenant_max, tenant]
        if expect is not None:
            args.append(expect)
        with unavailable("records.write"):
            created = await self._run(self.scripts.record_write, tenant, collection, args)
        if created == -1:
            raise WriteConflict(record_id)
        if created in (-2, -3):
            raise LimitExceeded(record_quota_message(settings, count=created == -2), reason=Reason.RECORDS)
        self._record_refused(tenant, collection, created)
        return created == 1

    def _places(self) -> list[Layout]:
        """Where records are: the current layout, and while they move, the old one first."""
        partitioning = self.changelog.partitioning
        if partitioning.moving and partitioning.drain is not None:
            return [partitioning.drain, partitioning.write]
        return [partitioning.write]

    async def read(self, tenant: str, collection: str, record_id: str) -> bytes | None:
        """The record; a miss reads the layouts again first (a switch may have moved it where this
        process does not look yet: a worker that neither publishes nor fans out learns of it here)."""
        with unavailable("records.read"):
            for attempt in range(2):
                for layout in self._places():
                    data = await self.client.hget(self._record_keys(tenant, collection, layout)[0], record_id)
                    if data is not None:
                        return cast("bytes", data)
                if attempt or not await self.changelog.partitioning.load():
                    break
        return None

    async def delete(self, tenant: str, collection: str, record_id: str, change: Change) -> bool:
        args: list[Any] = [record_id, collection, self.settings.changelog_maxlen, encode_change(change),
                           self.settings.changelog_tenant_max, tenant]
        with unavailable("records.delete"):
            deleted = await self._run(self.scripts.record_delete, tenant, collection, args)
        self._record_refused(tenant, collection, deleted)
        return deleted == 1

    async def ids(self, tenant: str, collection: str, after: str, limit: int) -> list[str]:
        if limit <= 0:
            return []
        found: set[str] = set()
        with unavailable("records.ids"):
            await self.changelog.partitioning.load()  # a listing never from a layout a switch left behind
            for layout in self._places():
                key = self._record_keys(tenant, collection, layout)[1]
                ids = await self.client.zrangebylex(key, f"({after}" if after else "-", "+", start=0, num=limit)
                found.update(as_text(i) for i in ids)
        return sorted(found)[:limit]

    async def collections(self, tenant: str) -> list[str]:
        """The tenant's non-empty collections, from each partition of the layout (one round trip)."""
        with unavailable("records.collections"):
            await self.changelog.partitioning.load()  # as ``ids``: never from a layout a switch left behind
        batch = Batch(self.client)
        for layout in self._places():
            for partition in layout.numbers:
                batch.pipe.zrange(self.keys.collections(partition, tenant), 0, -1)  # members: no scores asked
        with unavailable("records.collections"):
            replies = await batch.execute()
        return sorted({as_text(name) for names in replies for name in cast("list[bytes]", names)})
