"""Which change-log partition a change goes to, and changing the partition count on a running deployment.

**The ordering key.** What users rely on is per-URI order: a record's notifications, and its
collection's, leave in the order of its changes. So a change goes to the partition of its
ordering key (``ordering_key``): the tenant and collection of a record or collection URI (a
record change notifies both, and its record is stored under the partition's hash tag, so the
write and its change are one script), the tenant and URI for any other. One tenant's changes
thus spread over every partition, and so over every worker that fans out.

**Layouts and generations.** A layout is a range of partition numbers (``base`` to
``base + count``) and a key scheme (``uri``, or ``tenant`` for a log an older version
partitioned by tenant). The deployment's layouts are one JSON value in Redis
(``P:partitioning``): the one appends go to (``write``), and while a switch drains it, the one
before (``drain``). A new deployment starts with ``changelog_partitions`` (16 unless set); one
that an older version started keeps its ``P:partitions`` count, under the ``tenant`` scheme.

**Drain and switch** (``mcp-broker partitions set N``, ``switch``). Every partition of the old
layout is sealed first (``P:{c:<n>}:sealed``, in the partition's own slot, checked by every
append script in the step that appends), then the new layout is written with the old one as
``drain``. A publisher whose layout is stale meets the seal, reloads the layout and appends
under the new one; so every change a URI got in the old layout precedes, in Redis's own order,
every change it gets in the new one. Fan-out reads only the ``drain`` layout until every one of
its partitions is sealed and empty (processed and trimmed), then drops it (``finish_drain``)
and reads the new one: no change is lost (nothing sealed is dropped unread) and none of a URI's
notifications cross (the new layout's are fanned out only after the old one's). Records move
to the slot of their collection's new partition meanwhile (``move_records``); record writes
answer 503 while they do (``moving``), reads look in the old place first, then the new.
Numbers only grow (the new base is past the old layout's end), so change ids, inbox watermarks
and broadcast filters, all keyed by partition number, never mix two layouts' partitions.

A worker started with an explicit ``changelog_partitions`` that is not the count in Redis stops
with a one-line error (``PartitionMismatch``) rather than running with a layout the others do
not share.
"""

from __future__ import annotations

import asyncio
import json
import logging
import zlib
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import unquote

from broker.backends.redis.codec import as_text
from broker.backends.redis.connection import Client
from broker.backends.redis.keys import FANOUT_GROUP, Keys
from broker.backends.redis.scripts import Scripts
from broker.errors import BrokerError
from broker.uris import parse_record_uri

__all__ = ["DEFAULT_PARTITIONS", "Layout", "PartitionMismatch", "Partitioning", "ordering_key"]

logger = logging.getLogger(__name__)

#: Partitions of a new deployment's change log: enough for a handful of workers to share one tenant's fan-out.
DEFAULT_PARTITIONS = 16
#: Tries of a field change of the layouts that others may change at the same moment.
REPLACE_TRIES = 20


class PartitionMismatch(BrokerError):
    """The settings ask for another partition count than the deployment's, or a switch cannot start."""


def mismatch(wanted: int, count: int) -> str:
    """The one line that says a worker's setting disagrees with the deployment, and what to do."""
    return (f"MCP_BROKER_CHANGELOG_PARTITIONS={wanted}, but the change log in Redis has {count} partitions; "
            f"unset it, or change the count with `mcp-broker partitions set {wanted}`")


def ordering_key(tenant: str, uri: str) -> str:
    """What must keep its order: a record's or collection's collection, or the URI itself (always with its tenant).

    Tenant and collection names hold neither ``/`` nor a space, so the keys are injective.
    """
    ref = parse_record_uri(uri)
    if ref is not None and ref.tenant == tenant:
        return f"{tenant}/{ref.collection}"
    return f"{tenant} {uri}"


@dataclass(frozen=True, slots=True)
class Layout:
    """Partitions ``base`` .. ``base + count - 1``; ``key`` is ``uri`` (ordering keys) or ``tenant`` (older logs)."""

    base: int
    count: int
    key: str = "uri"

    @property
    def numbers(self) -> list[int]:
        return list(range(self.base, self.base + self.count))

    def route(self, tenant: str, uri: str) -> int:
        key = tenant if self.key == "tenant" else ordering_key(tenant, uri)
        return self.base + zlib.crc32(key.encode()) % self.count

    def route_collection(self, tenant: str, collection: str) -> int:
        """The partition of a collection's records (and of their changes)."""
        key = tenant if self.key == "tenant" else f"{tenant}/{collection}"
        return self.base + zlib.crc32(key.encode()) % self.count


def _layout(raw: Any) -> Layout | None:
    return None if raw is None else Layout(int(raw["base"]), int(raw["count"]), str(raw.get("key", "uri")))


class Partitioning:
    """This process's copy of the deployment's layouts; ``load`` refreshes it from Redis."""

    def __init__(self, client: Client, keys: Keys, scripts: Scripts, wanted: int | None) -> None:
        self.client = client
        self.keys = keys
        self.scripts = scripts
        #: The count the settings ask for (None: the deployment's, or DEFAULT_PARTITIONS for a new one).
        self.wanted = wanted
        self.write = Layout(0, wanted or DEFAULT_PARTITIONS)
        self.drain: Layout | None = None
        self.moving = False
        self._raw = ""

    @property
    def reading(self) -> Layout:
        """The layout fan-out reads: the one being drained, while there is one."""
        return self.drain or self.write

    def numbers(self) -> list[int]:
        """Every partition number in use (both layouts during a switch)."""
        return (self.drain.numbers if self.drain else []) + self.write.numbers

    async def start(self) -> None:
        """Agree on the layouts: create them for a new deployment, adopt an older version's count.

        Raises:
            PartitionMismatch: ``changelog_partitions`` is set and is not the deployment's count.
        """
        legacy = await self.client.get(self.keys.partitions)
        first = (Layout(0, int(legacy), "tenant" if int(legacy) > 1 else "uri") if legacy is not None
                 else Layout(0, self.wanted or DEFAULT_PARTITIONS))
        await self.scripts.get_or_set(keys=[self.keys.partitions], args=[first.count])
        initial = json.dumps({"write": asdict(first), "drain": None, "moving": False})
        self._adopt(as_text(await self.scripts.get_or_set(keys=[self.keys.partitioning], args=[initial])))
        if self.wanted is not None and self.wanted != self.write.count:
            raise PartitionMismatch(mismatch(self.wanted, self.write.count))
        await self.create_groups()

    async def stored_count(self) -> int | None:
        """The deployment's partition count as Redis holds it, read without creating anything (None: none yet)."""
        raw = await self.client.get(self.keys.partitioning)
        if raw is not None:
            return int(json.loads(as_text(raw))["write"]["count"])
        legacy = await self.client.get(self.keys.partitions)
        return None if legacy is None else int(legacy)

    async def load(self) -> bool:
        """Read the layouts again; True when they changed.

        When Redis has lost them (it restarted empty), this process's copy is put back rather
        than kept in silence: a worker starting on the empty store would otherwise make a
        first layout of its own, and the others would go on appending where nobody reads.
        """
        raw = await self.client.get(self.keys.partitioning)
        if raw is None and self._raw:
            raw = await self.scripts.get_or_set(keys=[self.keys.partitioning], args=[self._raw])
        if raw is None or as_text(raw) == self._raw:
            return False
        self._adopt(as_text(raw))
        return True

    def _adopt(self, raw: str) -> None:
        value = json.loads(raw)
        self._raw = raw
        self.write = _layout(value["write"]) or self.write
        self.drain = _layout(value.get("drain"))
        self.moving = bool(value.get("moving"))

    async def _replace(self, *, again: bool = False, **changes: Any) -> bool:
        """Compare-and-set the layouts against the copy this process holds; True when it won.

        ``again``: when another process changed them meanwhile (a drain ended while records
        moved), read them again and make the change on what is there now, until it lands. A
        switch does not: a layout changed under it means another switch, which it must not undo.
        """
        for _ in range(REPLACE_TRIES if again else 1):
            value = json.loads(self._raw)
            value.update(changes)
            new = json.dumps(value)
            won = int(await self.scripts.compare_and_set(keys=[self.keys.partitioning], args=[self._raw, new]))
            await self.load()
            if won:
                return True
        return False

    async def create_groups(self) -> None:
        from redis.exceptions import ResponseError

        for partition in self.numbers():
            try:
                await self.client.xgroup_create(self.keys.log(partition), FANOUT_GROUP, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    # -- the switch --------------------------------------------------------------------------

    async def switch(self, count: int) -> Layout:
        """Seal every partition of the current layout, then make a new one of ``count`` partitions current.

        Raises:
            PartitionMismatch: a switch is still draining, or ``count`` is the current count.
        """
        await self.load()
        if self.drain is not None or self.moving:
            raise PartitionMismatch("a partition switch is still in progress; wait for it (mcp-broker partitions)")
        old = self.write
        if count == old.count and old.key == "uri":
            raise PartitionMismatch(f"the change log has {count} partitions already")
        new = Layout(old.base + old.count, count)
        for partition in old.numbers:  # each in its own slot: one command each
            await self.client.set(self.keys.sealed(partition), "1")
        self.write, self.drain = new, old
        await self.create_groups()
        if not await self._replace(write=asdict(new), drain=asdict(old), moving=True):
            raise PartitionMismatch("the layouts changed meanwhile; run the command again")
        await self.client.set(self.keys.partitions, count)
        return new

    async def finish_drain(self) -> bool:
        """Drop the drained layout once each of its partitions is sealed and empty; True when the drain is over."""
        drain = self.drain
        if drain is None:
            return True
        if self.moving:
            return False  # records still move from it: it stays readable until they are all moved
        for partition in drain.numbers:
            if not await self.client.exists(self.keys.sealed(partition)):
                return False
            if await self.client.xlen(self.keys.log(partition)) and not await self._trim_processed(partition):
                return False
        await self._replace(again=True, drain=None)
        if self.drain is None:
            logger.info("change log drained: %d partitions from number %d now", self.write.count, self.write.base)
        return self.drain is None

    async def _trim_processed(self, partition: int) -> bool:
        """Trim a sealed partition of what fan-out has read and acknowledged; True when it is then empty.

        Fan-out trims as it acknowledges, up to what that acknowledgement covers; an entry it
        dropped as unreadable, or a log an older version wrote, can stay behind, and nothing new
        comes to a sealed partition to trim it: its drain would never end.
        """
        key = self.keys.log(partition)
        groups = {as_text(g["name"]): g for g in await self.client.xinfo_groups(key)}
        group = groups.get(FANOUT_GROUP)
        if group is None or int(group["pending"]):
            return False  # still being fanned out
        ms, _, seq = as_text(group["last-delivered-id"]).partition("-")
        await self.client.xtrim(key, minid=f"{ms}-{int(seq or 0) + 1}", approximate=False)
        return not await self.client.xlen(key)

    async def move_records(self) -> int:
        """Move every record collection of the drained layout to its partition in the new one; how many moved.

        Record writes are refused meanwhile (``moving``), so each collection is copied, then
        deleted where it was; a move cut short is simply run again (the copy is idempotent).
        """
        drain = self.drain
        if drain is None:
            return 0
        moved = 0
        prefix = self.keys.prefix
        for partition in drain.numbers:
            tag = f"{prefix}:{{c:{partition}}}"
            async for raw in self.client.scan_iter(match=f"{tag}:rec:*", count=500):
                escaped, _, collection = as_text(raw)[len(tag) + 5:].partition("/")
                tenant = unquote(escaped)
                await self._move_collection(partition, tenant, collection)
                moved += 1
            for pattern in (f"{tag}:cols:*", f"{tag}:use:*"):
                async for raw in self.client.scan_iter(match=pattern, count=500):
                    await self.client.delete(raw)
        if not await self._replace(again=True, moving=False):
            raise PartitionMismatch("the layouts kept changing while the records moved; run the command again")
        return moved

    async def _move_collection(self, old: int, tenant: str, collection: str) -> None:
        keys = self.keys
        new = self.write.route_collection(tenant, collection)
        records = await self.client.hgetall(keys.records(old, tenant, collection))
        pairs: list[Any] = []
        for record_id, data in records.items():
            pairs += [record_id, data]
        for start in range(0, len(pairs), 512):
            await self.scripts.record_import(
                keys=[keys.records(new, tenant, collection), keys.record_ids(new, tenant, collection),
                      keys.collections(new, tenant), keys.record_usage(new, tenant)],
                args=[collection, *pairs[start:start + 512]])
        await self.client.delete(keys.records(old, tenant, collection))
        await self.client.delete(keys.record_ids(old, tenant, collection))

    async def wait_drained(self, timeout: float) -> bool:
        """Poll until the fan-out workers have drained the old layout (or ``timeout`` seconds passed)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            await self.load()
            if self.drain is None:
                return True
            await asyncio.sleep(0.2)
        return False
