"""The read side of the Redis change log: reads fenced by the partition leases, sweeps of what a lapsed holder left.

Each partition is read by one fan-out consumer at a time, the holder of its lease. Reads are
fenced by it: ``fanout_read.lua`` checks the holder and reads in one step, so a read that
reaches Redis after its lease lapsed takes nothing (the changes stay for the holder, never
pending to a consumer nobody sweeps). A consumer that takes a partition over first sweeps what
the last holder left pending (XAUTOCLAIM), oldest first: delivery is at least once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from redis.exceptions import ResponseError

from broker.backends.redis.batch import Batch
from broker.backends.redis.codec import as_text, decode_change
from broker.backends.redis.connection import Client
from broker.backends.redis.keys import FANOUT_GROUP, Keys
from broker.backends.redis.leases import ConsumerShare, PartitionLeases
from broker.backends.redis.partitioning import Partitioning
from broker.backends.redis.scripts import Scripts
from broker.changes import Change

__all__ = ["FencedReader"]

logger = logging.getLogger(__name__)


class FencedReader:
    """The reads of one process's fan-out consumers, fenced by the partition leases.

    ``ack`` is the change log's acknowledgement: an entry no version of the broker can read is
    acknowledged and dropped, so that it does not hold up its neighbours.
    """

    def __init__(self, client: Client, keys: Keys, scripts: Scripts, leases: PartitionLeases,
                 partitioning: Partitioning, ack: Callable[[Sequence[str]], Awaitable[None]], *, cluster: bool,
                 max_block_ms: int) -> None:
        self.client = client
        self.keys = keys
        self.scripts = scripts
        self.leases = leases
        self.partitioning = partitioning
        self.ack = ack
        self.cluster = cluster
        #: Longest single BLOCK: below the socket timeout, so a blocked read is never taken for a dead server.
        self._max_block_ms = max_block_ms
        self._rotate = 0
        self._unreadable: list[str] = []
        #: Unreadable entries this process dropped (each is logged with its id).
        self.dropped = 0

    def _parse(self, partition: int, entries: Sequence[Any]) -> list[tuple[str, Change]]:
        """Each entry's change, from its fields: a mapping (XAUTOCLAIM's, through redis-py) or the flat
        list a script replies (``fanout_read.lua``), whose one field is usually the change itself."""
        out = []
        for entry_id, fields in entries:
            change_id = f"{partition}:{entry_id.decode()}"
            try:
                if isinstance(fields, list):
                    packed = fields[1] if fields[0] == b"c" else fields[fields.index(b"c") + 1]
                else:
                    packed = fields[b"c"]
                out.append((change_id, decode_change(packed)))
            except (KeyError, TypeError, ValueError, IndexError) as exc:
                # An entry no version of the broker can read must not hold up its neighbours
                # (it would be claimed and fail again forever): it is acknowledged and dropped.
                self.dropped += 1
                logger.error("dropping unreadable change-log entry %s: %r (%d dropped by this process)",
                             change_id, exc, self.dropped)
                self._unreadable.append(change_id)
        return out

    async def _drop_unreadable(self) -> None:
        if self._unreadable:
            ids, self._unreadable = self._unreadable, []
            await self.ack(ids)

    async def _readgroup(self, consumer: str, partitions: Sequence[int], count: int,
                         block_ms: int | None) -> list[tuple[str, Change]]:
        """New changes of ``partitions``, read only while ``consumer`` holds each one's lease.

        The read is a script that checks the lease (``fanout_read.lua``): a plain XREADGROUP sent
        while the lease was held could run after it lapsed and take changes the next holder
        never sees. With nothing new, it waits (``block_ms``) on a plain XREAD after the newest
        entry, which takes nothing, and reads once more through the script.
        """
        found, newest = await self._fenced_read(consumer, partitions, count)
        if found or not block_ms or not newest:
            return found
        if await self.client.xread({self.keys.log(p): last for p, last in newest.items()}, count=1, block=block_ms):
            found, _ = await self._fenced_read(consumer, list(newest), count)
        return found

    async def _fenced_read(self, consumer: str, partitions: Sequence[int],
                           count: int) -> tuple[list[tuple[str, Change]], dict[int, str]]:
        """What ``fanout_read.lua`` took from each partition, and the newest entry id of each one still held."""
        def batch() -> Batch:
            # One script call for every partition on a single server, one per partition on Cluster.
            calls = Batch(self.client)
            groups = [[p] for p in partitions] if self.cluster else [list(partitions)]
            for group in groups:
                keys = [key for p in group for key in (self.keys.lease(p), self.keys.log(p))]
                calls.call(self.scripts.fanout_read, keys, [consumer, FANOUT_GROUP, count])
            return calls

        try:
            replies = [reply for call in await batch().execute() for reply in call]
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            # The store lost the group (it was flushed or restarted empty): recreate and read again.
            await self.partitioning.create_groups()
            replies = [reply for call in await batch().execute() for reply in call]
        out: list[tuple[str, Change]] = []
        newest: dict[int, str] = {}
        for partition, reply in zip(partitions, replies, strict=True):
            if not int(reply[0]):
                # The lease lapsed: the next read holds again, and sweeps if it takes it back.
                self.leases.share_of(consumer).lapse()
                continue
            newest[partition] = as_text(reply[1])
            out += self._parse(partition, reply[2])
        await self._drop_unreadable()
        return out, newest

    async def _autoclaim(self, partition: int, consumer: str, start: str,
                         count: int) -> tuple[str, list[tuple[str, Change]]]:
        """XAUTOCLAIM from ``start``, idle or not: the next cursor (``0-0`` at the end) and what was claimed."""
        try:
            reply = await self.client.xautoclaim(self.keys.log(partition), FANOUT_GROUP, consumer,
                                                 0, start_id=start, count=count)
        except ResponseError as exc:
            if "NOGROUP" in str(exc):
                return "0-0", []
            raise
        return as_text(reply[0]), self._parse(partition, reply[1])

    async def _sweep(self, consumer: str, holding: ConsumerShare, count: int) -> list[tuple[str, Change]]:
        """Changes a lapsed holder of a newly taken partition read and never acknowledged, oldest first."""
        taken: list[tuple[str, Change]] = []
        for partition, cursor in list(holding.sweep.items()):
            while len(taken) < count:
                start = cursor
                cursor, claimed = await self._autoclaim(partition, consumer, start, count - len(taken))
                taken += claimed
                if cursor == "0-0" or (cursor == start and not claimed):
                    del holding.sweep[partition]
                    break
                holding.sweep[partition] = cursor
        await self._drop_unreadable()
        return taken

    async def read(self, consumer: str, count: int, block_ms: int) -> list[tuple[str, Change]]:
        """Up to ``count`` changes of the partitions ``consumer`` holds (it takes its share first), what a
        lapsed holder left pending first; waits up to ``block_ms``. The caller translates connection errors."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(block_ms, 0) / 1000
        retook = False
        while True:
            remaining = int((deadline - loop.time()) * 1000)
            holding = await self.leases.take_share(consumer)
            found = await self._sweep(consumer, holding, count) if holding.sweep else []
            held = holding.held
            chunk = min(remaining, self._max_block_ms, self.leases.lease_ms // 3)
            if found:
                return found
            if not held:
                if chunk <= 0:
                    return []
                await asyncio.sleep(chunk / 1000)  # another consumer holds every partition: stand by
                continue
            if not self.cluster:
                # At most ``count`` in all, the partitions asked in an order that turns with
                # every read, so a busy partition cannot keep the others waiting.
                self._rotate = (self._rotate + 1) % len(held)
                order = held[self._rotate:] + held[:self._rotate]
                found = await self._readgroup(consumer, order, count, chunk if chunk > 0 else None)
            else:
                # A blocking read spans one slot in Cluster: poll every partition, from one that
                # turns with every read (a busy one cannot keep the others waiting), then block on one.
                self._rotate = (self._rotate + 1) % len(held)
                for p in held[self._rotate:] + held[:self._rotate]:
                    found += await self._readgroup(consumer, [p], count - len(found), None)
                    if len(found) >= count:
                        break
                chunk = min(chunk, 100)
                if not found and chunk > 0:
                    self._rotate = (self._rotate + 1) % len(held)
                    found = await self._readgroup(consumer, [held[self._rotate]], count, chunk)
            if not found and holding.lapsed and not retook:
                retook = True  # a lease lapsed since the last hold: hold again now, not at the next read
                continue
            if found or loop.time() >= deadline:
                return found
            if chunk > 0 and loop.time() < deadline - chunk / 1000 + 0.005:
                await asyncio.sleep(0.01)  # the read did not block (no lease left to wait on): never spin
