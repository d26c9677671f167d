"""Record collections: JSON records kept in the backend, one resource per record and per collection.

A write stores the record and appends its change in one backend step; the fan-out then
notifies the record's subscribers and its collection's.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import orjson

from broker.auth import Principal
from broker.backends.base import Backend
from broker.changes import Change, ChangeKind
from broker.errors import NotFound, WriteConflict
from broker.uris import SCHEME, collection_uri, parse_record_uri, record_uri

__all__ = ["RecordStore", "RecordTooLarge", "RecordsProvider", "merge_patch"]

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


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return patch
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


class _Turn:
    """One record's queue of patches in this worker."""

    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.users = 0


class RecordStore:
    """Reads and writes records for the REST API, the CLI and the demo."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
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

    async def put(self, tenant: str, collection: str, record_id: str, value: Any, meta: Json | None = None) -> bool:
        """Store ``value`` (any JSON) as the record; True when it was created."""
        change = Change(tenant, record_uri(tenant, collection, record_id), ChangeKind.UPDATED, meta)
        # The backend publishes it as "created" when the record is new, in the same step.
        return await self.backend.write_record(tenant, collection, record_id, orjson.dumps(value), change)

    async def patch(self, tenant: str, collection: str, record_id: str, patch: Any, max_bytes: int,
                    meta: Json | None = None) -> Any:
        """Apply an RFC 7386 merge patch; returns the new value.

        Patches of one record take turns within this worker. The write is a compare-and-set
        against the value the patch was merged into; when a writer on another worker got there
        first, the patch is merged again into the newer value after a short random pause, so
        concurrent patches never lose one another.

        Raises:
            NotFound: the record does not exist.
            RecordTooLarge: the patched record would exceed ``max_bytes``.
            WriteConflict: the record kept changing for ``PATCH_PATIENCE`` seconds.
        """
        change = Change(tenant, record_uri(tenant, collection, record_id), ChangeKind.UPDATED, meta)
        async with self._turn((tenant, collection, record_id)):
            deadline = time.monotonic() + PATCH_PATIENCE
            ceiling = PATCH_BACKOFF[0]
            while True:
                current = await self.backend.read_record(tenant, collection, record_id)
                if current is None:
                    raise NotFound(change.uri)
                value = merge_patch(orjson.loads(current), patch)
                data = orjson.dumps(value)
                if len(data) > max_bytes:
                    raise RecordTooLarge(max_bytes)
                try:
                    await self.backend.write_record(tenant, collection, record_id, data, change, expect=current)
                    return value
                except WriteConflict:
                    if time.monotonic() >= deadline:
                        raise
                await asyncio.sleep(random.uniform(0, ceiling))
                ceiling = min(ceiling * 2, PATCH_BACKOFF[1])

    async def get(self, tenant: str, collection: str, record_id: str) -> Any:
        """The record's value. Raises NotFound."""
        data = await self.backend.read_record(tenant, collection, record_id)
        if data is None:
            raise NotFound(record_uri(tenant, collection, record_id))
        return orjson.loads(data)

    async def delete(self, tenant: str, collection: str, record_id: str, meta: Json | None = None) -> None:
        """Delete the record. Raises NotFound."""
        uri = record_uri(tenant, collection, record_id)
        change = Change(tenant, uri, ChangeKind.DELETED, meta)
        if not await self.backend.delete_record(tenant, collection, record_id, change):
            raise NotFound(uri)

    async def ids(self, tenant: str, collection: str, after: str = "", limit: int = 100) -> list[str]:
        return await self.backend.list_records(tenant, collection, after, limit)


class RecordsProvider:
    """Serves ``mcpb://<tenant>/<collection>[/<id>]`` to principals of that tenant."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

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
        names = await self.backend.list_collections(tenant)
        # Resume by bisection, not by walking past every earlier name: a tenant with many
        # collections would otherwise cost each page a pass over all of them.
        for name in itertools.islice(names, bisect.bisect_left(names, resume), None):
            if name != resume:
                items.append(self._collection_item(tenant, name))
                after = ""
            while len(items) < limit:
                ids = await self.backend.list_records(tenant, name, after, limit - len(items))
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
            ids = await self.backend.list_records(ref.tenant, ref.collection, "", COLLECTION_READ_LIMIT + 1)
            if not ids:
                raise NotFound(uri)
            body: Json = {
                "collection": ref.collection,
                "records": [record_uri(ref.tenant, ref.collection, rid) for rid in ids[:COLLECTION_READ_LIMIT]],
                "truncated": len(ids) > COLLECTION_READ_LIMIT,
            }
            return [{"uri": uri, "mimeType": "application/json", "text": orjson.dumps(body).decode()}]
        data = await self.backend.read_record(ref.tenant, ref.collection, ref.record_id)
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
