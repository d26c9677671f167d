"""Record collections: JSON records kept in the backend, one resource per record and per collection.

A write stores the record and appends its change in one backend step; the fan-out then
notifies the record's subscribers and its collection's. A record is plain JSON at most
``max_record_depth`` deep and ``max_record_bytes`` encoded, and a tenant keeps at most
``max_records_per_tenant`` records of ``max_record_bytes_per_tenant`` bytes in all (the backend
counts both in the step that writes).
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import itertools
import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import orjson

from broker.auth import Principal
from broker.backends.base import RecordStore
from broker.changes import Change, ChangeKind
from broker.errors import NotFound, WriteConflict
from broker.protocol.jsonbounds import JsonRefused, check_json
from broker.uris import SCHEME, collection_uri, parse_record_uri, record_uri

if TYPE_CHECKING:
    from broker.config import Settings
    from broker.publisher import Publisher

__all__ = ["InvalidRecord", "RecordTooLarge", "Records", "RecordsProvider", "merge_patch"]

Json = dict[str, Any]
#: How many record ids a collection read shows; the full listing is paged by resources/list.
COLLECTION_READ_LIMIT = 1000
#: How long one PATCH keeps retrying its compare-and-set while other workers win, in seconds.
PATCH_PATIENCE = 5.0
#: The first and the largest pause between two attempts; each pause is drawn at random below
#: a ceiling that doubles, so workers that collided once don't collide again in step.
PATCH_BACKOFF = (0.001, 0.05)


class RecordTooLarge(ValueError):
    """A record larger than the configured limit."""


class InvalidRecord(ValueError):
    """A record or a patch that is not JSON the store keeps (too deep, a type JSON lacks)."""


def merge_patch(target: Any, patch: Any, max_depth: int = 64) -> Any:
    """RFC 7386 JSON merge patch.

    Recursion follows the patch's objects only, so a patch at most ``max_depth`` deep is merged
    without exhausting the stack, whatever the target.

    Raises:
        InvalidRecord: ``patch`` nests objects deeper than ``max_depth``.
    """
    if not isinstance(patch, dict):
        return patch
    if max_depth < 1:
        raise InvalidRecord("the patch is nested too deep")
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value, max_depth - 1)
    return result


class _Turn:
    """One record's queue of patches in this worker."""

    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.users = 0


class Records:
    """Reads and writes records for the REST API, the CLI and the demo.

    Each write's change goes through the ``Publisher``: its ``meta`` is checked by the same rules
    as every published change, and its outcome is counted with them.
    """

    def __init__(self, store: RecordStore, settings: Settings, publisher: Publisher) -> None:
        self.store = store
        self.publisher = publisher
        self.max_bytes = settings.max_record_bytes
        self.max_depth = settings.max_record_depth
        # Patches of one record queue here, so within a worker they take turns instead of
        # racing; compare-and-set only arbitrates between workers.
        self._turns: dict[tuple[str, str, str], _Turn] = {}

    @asynccontextmanager
    async def _turn(self, key: tuple[str, str, str]) -> AsyncIterator[None]:
        turn = self._turns.get(key)
        if turn is None:
            turn = self._turns[key] = _Turn()
        turn.users += 1
        try:
            async with turn.lock:
                yield
        finally:
            turn.users -= 1
            if not turn.users:
                del self._turns[key]

    def encode(self, value: Any) -> bytes:
        """A record's stored form. Raises InvalidRecord or RecordTooLarge."""
        try:
            check_json(value, self.max_depth)
            data = orjson.dumps(value)
        except (JsonRefused, TypeError) as exc:  # orjson.JSONEncodeError is a TypeError
            raise InvalidRecord(f"the record is not JSON the store keeps: {exc}") from exc
        if len(data) > self.max_bytes:
            raise RecordTooLarge(self.max_bytes)
        return data

    async def put(self, tenant: str, collection: str, record_id: str, value: Any, meta: Json | None = None) -> bool:
        """Store ``value`` (any JSON) as the record; True when it was created.

        Raises:
            InvalidRecord: ``value`` is not plain JSON or nests deeper than ``max_record_depth``.
            RecordTooLarge: ``value`` encodes to more than ``max_record_bytes``.
            InvalidChange: ``meta`` breaks ``ChangeRules``.
            LimitExceeded: the tenant's record quota (count or bytes) would be exceeded.
        """
        change = self._change(tenant, collection, record_id, ChangeKind.UPDATED, meta)
        data = self.encode(value)
        # The backend publishes it as "created" when the record is new, in the same step.
        return await self.publisher.store(change, lambda c: self.store.write(tenant, collection, record_id, data, c))

    def _change(self, tenant: str, collection: str, record_id: str, kind: ChangeKind, meta: Json | None) -> Change:
        return Change(tenant, record_uri(tenant, collection, record_id), kind, self.publisher.rules.meta(meta))

    async def patch(self, tenant: str, collection: str, record_id: str, patch: Any, meta: Json | None = None) -> Any:
        """Apply an RFC 7386 merge patch; returns the new value.

        Patches of one record take turns within this worker. The write is a compare-and-set
        against the value the patch was merged into; when a writer on another worker got there
        first, the patch is merged again into the newer value after a short random pause, so
        concurrent patches never lose one another.

        Raises:
            NotFound: the record does not exist.
            InvalidRecord: the patch, or the patched record, is not plain JSON within ``max_record_depth``.
            RecordTooLarge: the patched record would exceed ``max_record_bytes``.
            InvalidChange: ``meta`` breaks ``ChangeRules``.
            LimitExceeded: the tenant's record quota in bytes would be exceeded.
            WriteConflict: the record kept changing for ``PATCH_PATIENCE`` seconds.
        """
        try:
            check_json(patch, self.max_depth)
        except JsonRefused as exc:
            raise InvalidRecord(f"the patch is not JSON the store keeps: {exc}") from exc
        change = self._change(tenant, collection, record_id, ChangeKind.UPDATED, meta)
        async with self._turn((tenant, collection, record_id)):
            deadline = time.monotonic() + PATCH_PATIENCE
            ceiling = PATCH_BACKOFF[0]
            while True:
                current = await self.store.read(tenant, collection, record_id)
                if current is None:
                    raise NotFound(change.uri)
                value = merge_patch(orjson.loads(current), patch, self.max_depth)
                data = self.encode(value)
                try:
                    await self.publisher.store(change, functools.partial(self._write_if, tenant, collection,
                                                                         record_id, data, current))
                    return value
                except WriteConflict:
                    if time.monotonic() >= deadline:
                        raise
                await asyncio.sleep(random.uniform(0, ceiling))
                ceiling = min(ceiling * 2, PATCH_BACKOFF[1])

    async def _write_if(self, tenant: str, collection: str, record_id: str, data: bytes, expect: bytes,
                        change: Change) -> bool:
        return await self.store.write(tenant, collection, record_id, data, change, expect=expect)

    async def get(self, tenant: str, collection: str, record_id: str) -> bytes:
        """The record's stored JSON. Raises NotFound."""
        data = await self.store.read(tenant, collection, record_id)
        if data is None:
            raise NotFound(record_uri(tenant, collection, record_id))
        return data

    async def delete(self, tenant: str, collection: str, record_id: str, meta: Json | None = None) -> None:
        """Delete the record. Raises NotFound, or InvalidChange for a ``meta`` that breaks ``ChangeRules``."""
        change = self._change(tenant, collection, record_id, ChangeKind.DELETED, meta)
        if not await self.publisher.store(change, lambda c: self.store.delete(tenant, collection, record_id, c)):
            raise NotFound(change.uri)

    async def ids(self, tenant: str, collection: str, after: str = "", limit: int = 100) -> list[str]:
        return await self.store.ids(tenant, collection, after, limit)

    async def collections(self, tenant: str) -> list[str]:
        return await self.store.collections(tenant)


class RecordsProvider:
    """Serves ``mcpb://<tenant>/<collection>[/<id>]`` to principals of that tenant."""

    def __init__(self, store: RecordStore) -> None:
        self.store = store

    def owns(self, uri: str) -> bool:
        return uri.startswith(SCHEME + "://")

    def can_watch(self, principal: Principal, uri: str) -> bool:
        ref = parse_record_uri(uri)
        return ref is not None and ref.tenant == principal.tenant

    async def list_page(self, principal: Principal, state: str | None, limit: int) -> tuple[list[Json], str | None]:
        # Each collection lists as its own resource followed by its records. The state is
        # "<collection>\x00<last record id listed>" ('' when only the collection was listed).
        tenant = principal.tenant
        resume, _, after = state.partition("\x00") if state else ("", "", "")
        items: list[Json] = []
        names = await self.store.collections(tenant)
        # Resume by bisection, not by walking past every earlier name: a tenant with many
        # collections would otherwise cost each page a pass over all of them.
        for name in itertools.islice(names, bisect.bisect_left(names, resume), None):
            if name != resume:
                items.append(self._collection_item(tenant, name))
                after = ""
            while len(items) < limit:
                ids = await self.store.ids(tenant, name, after, limit - len(items))
                if not ids:
                    break
                items.extend(self._record_item(tenant, name, rid) for rid in ids)
                after = ids[-1]
            if len(items) >= limit:
                return items, f"{name}\x00{after}"
        return items, None

    @staticmethod
    def _collection_item(tenant: str, name: str) -> Json:
        return {
            "uri": collection_uri(tenant, name),
            "name": name,
            "title": f"Collection {name}",
            "description": f"The records of collection {name}; notified when any of them changes.",
            "mimeType": "application/json",
        }

    @staticmethod
    def _record_item(tenant: str, collection: str, record_id: str) -> Json:
        return {"uri": record_uri(tenant, collection, record_id), "name": f"{collection}/{record_id}",
                "mimeType": "application/json"}

    async def read(self, principal: Principal, uri: str) -> list[Json]:
        ref = parse_record_uri(uri)
        if ref is None or ref.tenant != principal.tenant:
            raise NotFound(uri)
        if ref.record_id is None:
            ids = await self.store.ids(ref.tenant, ref.collection, "", COLLECTION_READ_LIMIT + 1)
            if not ids:
                raise NotFound(uri)
            body: Json = {
                "collection": ref.collection,
                "records": [record_uri(ref.tenant, ref.collection, rid) for rid in ids[:COLLECTION_READ_LIMIT]],
                "truncated": len(ids) > COLLECTION_READ_LIMIT,
            }
            return [{"uri": uri, "mimeType": "application/json", "text": orjson.dumps(body).decode()}]
        data = await self.store.read(ref.tenant, ref.collection, ref.record_id)
        if data is None:
            raise NotFound(uri)
        return [{"uri": uri, "mimeType": "application/json", "text": data.decode()}]

    def templates(self, principal: Principal) -> list[Json]:
        base = f"{SCHEME}://{principal.tenant}"
        return [
            {"uriTemplate": base + "/{collection}/{id}", "name": "record", "title": "A record of a collection",
             "mimeType": "application/json"},
            {"uriTemplate": base + "/{collection}", "name": "collection", "title": "A whole collection",
             "mimeType": "application/json"},
        ]
