"""The change log: partitioned streams, one consumer group, a lease per partition (records: ``records.py``).

A tenant maps to partition ``crc32(tenant) % partitions``; the partition count is stored in
Redis at first start (``P:partitions``) and the stored value wins over the setting, because a
tenant's records live under its partition's hash tag and must not move. Change ids are
``<partition>:<stream id>``.

Bounds: nothing fan-out has not processed is ever trimmed. An append (``changelog_append.lua``,
and the record scripts) checks, in the same step, that the partition holds fewer than
``changelog_maxlen`` entries and the tenant fewer than ``changelog_tenant_max`` changes not yet
fanned out (a per-tenant count in ``P:{c:<n>}:backlog``, the partition's hash slot), and refuses
the whole call otherwise (``LogFull``, ``QuotaExceeded``) before anything is acknowledged. The
acknowledgement (``changelog_ack.lua``) counts each change out of its tenant's backlog and
trims the partition below its oldest pending entry (or the last delivered one): the one reader
of the partition trims, so trimming never races a read.

Each partition is read by one fan-out consumer at a time, the holder of its lease
(``P:{c:<n>}:lease``). Consumers that read one partition side by side would append a URI's
changes to an inbox out of order (a later frame, then an earlier one; a slow reader keeping the
newest frame of a URI would keep the wrong one), and the same on the listen broadcast. So
ordering holds per partition. A holder that stops renewing (it died, or hung on one batch for
longer than its heartbeat lasts) loses the partition to the next consumer that asks, which
first takes over what it left pending (at least once). Reads are fenced by the lease
(``fanout_read.lua`` checks the holder and reads in one step), so a read that reaches Redis
after its lease lapsed takes nothing: the changes stay for the holder, never pending to a
consumer nobody sweeps. Each live consumer holds its share of the partitions (see ``_hold``),
so fan-out spreads over workers when there are several.
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from collections.abc import Sequence
from typing import Any

from redis.exceptions import RedisError, ResponseError

from broker.backends.redis.batch import Batch
from broker.backends.redis.codec import as_text, decode_change, encode_change
from broker.backends.redis.keys import FANOUT_GROUP, Keys
from broker.backends.redis.scripts import Scripts
from broker.changes import Change
from broker.config import Settings
from broker.errors import LogFull, PublishRefused, QuotaExceeded, raise_if_cancelled

__all__ = ["ChangeLog"]

logger = logging.getLogger(__name__)


def _stream_id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


#: How many leases' time a consumer's heartbeat keeps its partitions while it works on one batch.
HEARTBEAT_LEASES = 10


class _Holding:
    """What one consumer holds: its partitions, the sweeps it owes, and what it was handed last."""

    __slots__ = ("handed", "heartbeat", "held", "sweep", "turn")

    def __init__(self) -> None:
        self.held: list[int] = []
        self.turn = 0
        #: partition -> XAUTOCLAIM cursor of a sweep still to finish
        self.sweep: dict[int, str] = {}
        #: Ids of the last read not acknowledged yet: any left at the next read failed.
        self.handed: set[str] = set()
        #: Renews the leases while the caller works on what it read.
        self.heartbeat: asyncio.Task[None] | None = None

    def stop_heartbeat(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.cancel()
            self.heartbeat = None


class ChangeLog:
    """Change-log and record operations; the caller translates connection errors."""

    def __init__(self, settings: Settings, client: Any, keys: Keys, scripts: Scripts, *, cluster: bool) -> None:
        self.settings = settings
        self.client = client
        self.keys = keys
        self.scripts = scripts
        self.cluster = cluster
        self.partitions = max(settings.changelog_partitions, 1)
        self._rotate = 0
        self._unreadable: list[str] = []
        # Longest single BLOCK: below the socket timeout, so a blocked read is never taken for a dead server.
        self._max_block_ms = max(int(settings.redis_socket_timeout * 1000) - 1000, 100)
        self._lease_ms = max(settings.fanout_claim_idle_ms, 30)
        self._holding: dict[str, _Holding] = {}
        #: Live fan-out consumers, as the registry last said.
        self._live = 1
        #: Per partition, the changes not yet fanned out when this process last acknowledged
        #: or trimmed: what a store that restarts empty would lose (logged then).
        self.backlog: dict[int, int] = {}
        #: Unreadable entries this process dropped (each is logged with its id).
        self.dropped = 0

    async def start(self) -> None:
        stored = await self.scripts.get_or_set(keys=[self.keys.partitions], args=[self.partitions])
        if int(stored) != self.partitions:
            logger.warning("change log has %s partitions in redis; changelog_partitions=%d is ignored",
                           as_text(stored), self.partitions)
            self.partitions = int(stored)
        await self.create_groups()

    async def create_groups(self) -> None:
        for partition in range(self.partitions):
            try:
                await self.client.xgroup_create(self.keys.log(partition), FANOUT_GROUP, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    def partition(self, tenant: str) -> int:
        return zlib.crc32(tenant.encode()) % self.partitions

    # -- change log ------------------------------------------------------------------------
    def _append_args(self, changes: Sequence[Change]) -> list[Any]:
        args: list[Any] = [self.settings.changelog_maxlen, self.settings.changelog_tenant_max]
        for change in changes:
            args += [change.tenant, encode_change(change)]
        return args

    def _appended(self, partition: int, reply: Sequence[Any]) -> list[str]:
        """The change ids of a ``changelog_append.lua`` reply; raises what refused them."""
        status = int(reply[0])
        if status == -2:
            raise LogFull(partition, self.settings.changelog_maxlen)
        if status == -1:
            raise QuotaExceeded(as_text(reply[1]), self.settings.changelog_tenant_max, int(reply[2]), int(reply[3]))
        return [f"{partition}:{as_text(entry_id)}" for entry_id in reply[1:]]

    async def _append(self, partition: int, changes: Sequence[Change]) -> list[str]:
        keys = [self.keys.log(partition), self.keys.backlog(partition)]
        args = self._append_args(changes)
        reply = await self.scripts.changelog_append(keys=keys, args=args)
        if int(reply[0]) == -2:
            reply = await self._retry_trimmed(partition, changes)
        return self._appended(partition, reply)

    async def _retry_trimmed(self, partition: int, changes: Sequence[Change]) -> Any:
        """A partition was full, perhaps of entries fan-out processed and nobody trimmed yet (fan-out
        trims as it acknowledges; a log an older version wrote has no such trimming): trim what was
        processed and try once more. Only on this path, so a refusal costs two calls and an
        accepted publish one."""
        await self.trim(partition)
        return await self.scripts.changelog_append(keys=[self.keys.log(partition), self.keys.backlog(partition)],
                                                   args=self._append_args(changes))

    async def trim(self, partition: int) -> int:
        """Trim what fan-out processed from a partition; returns the entries left (not yet processed).

        The group's last delivered id is read before the script looks at what is pending: an
        entry delivered by then and not pending when the script runs was acknowledged.
        """
        key = self.keys.log(partition)
        delivered = ""
        for group in await self.client.xinfo_groups(key):
            if as_text(group["name"]) == FANOUT_GROUP:
                delivered = as_text(group["last-delivered-id"])
        left = int(await self.scripts.changelog_ack(keys=[key, self.keys.backlog(partition)],
                                                    args=[FANOUT_GROUP, delivered]))
        self.backlog[partition] = left
        return left

    async def publish(self, change: Change) -> str:
        """One script call: the bounds are checked and the change counted with the append.

        Raises:
            QuotaExceeded, LogFull: the change was refused, nothing was appended.
        """
        return (await self._append(self.partition(change.tenant), [change]))[0]

    async def publish_many(self, changes: Sequence[Change]) -> list[str]:
        """One script call per partition, all of its changes or none (a tenant's changes are in
        one partition, in order); on a single node in one pipeline, on Cluster concurrently.
        Every partition finishes before a refusal or an error is raised: a caller told "not
        acknowledged" must not have appends still landing behind its back."""
        by_partition: dict[int, list[int]] = {}
        for i, change in enumerate(changes):
            by_partition.setdefault(self.partition(change.tenant), []).append(i)
        if len(by_partition) <= 1:
            return await self._append(self.partition(changes[0].tenant), changes) if changes else []
        batch = Batch(self.client)
        for partition, positions in by_partition.items():
            batch.call(self.scripts.changelog_append, [self.keys.log(partition), self.keys.backlog(partition)],
                       self._append_args([changes[i] for i in positions]))
        replies = await batch.execute()
        ids: list[str] = [""] * len(changes)
        refused: PublishRefused | None = None
        for (partition, positions), reply in zip(by_partition.items(), replies, strict=True):
            if int(reply[0]) == -2:  # full, perhaps of processed entries: as _append does
                reply = await self._retry_trimmed(partition, [changes[i] for i in positions])
            try:
                for i, change_id in zip(positions, self._appended(partition, reply), strict=True):
                    ids[i] = change_id
            except PublishRefused as exc:
                refused = refused or exc
        if refused is not None:
            raise refused
        return ids

    def _parse(self, partition: int, entries: Sequence[Any]) -> list[tuple[str, Change]]:
        out = []
        for entry_id, fields in entries:
            change_id = f"{partition}:{as_text(entry_id)}"
            try:
                out.append((change_id, decode_change(fields[b"c"])))
            except (KeyError, TypeError, ValueError) as exc:
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
            calls = Batch(self.client)
            for p in partitions:
                calls.call(self.scripts.fanout_read, [self.keys.lease(p), self.keys.log(p)],
                           [consumer, FANOUT_GROUP, count])
            return calls

        try:
            replies = await batch().execute()
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            # The store lost the group (it was flushed or restarted empty): recreate and read again.
            await self.create_groups()
            replies = await batch().execute()
        out: list[tuple[str, Change]] = []
        newest: dict[int, str] = {}
        for partition, reply in zip(partitions, replies, strict=True):
            if not int(reply[0]):
                continue  # the lease lapsed: the next hold finds out, and sweeps if it takes it back
            newest[partition] = as_text(reply[1])
            entries = [(entry_id, dict(zip(fields[0::2], fields[1::2], strict=True))) for entry_id, fields in reply[2]]
            out += self._parse(partition, entries)
        await self._drop_unreadable()
        return out, newest

    def _holding_of(self, consumer: str) -> _Holding:
        holding = self._holding.get(consumer)
        if holding is None:
            holding = self._holding[consumer] = _Holding()
        return holding

    async def _hold(self, consumer: str) -> _Holding:
        """Keep the partitions this consumer holds and take free ones, up to its share.

        The share is the partition count divided among the live consumers (a registry each
        hold renews), so with several partitions fan-out spreads over the workers: a consumer
        above its share gives the surplus up, one below it asks for every partition it does not
        hold, from a place that moves with every call, and gives back what it got beyond its
        share. One round trip for a single partition, two or three otherwise.

        A partition this consumer did not hold after its last successful call is swept before
        it is read: whoever held it last (or this consumer, before a failure) may have left
        changes pending. The decision is made here, not from the script's "just taken" reply,
        which a lost reply or a retried call would hide.
        """
        holding = self._holding_of(consumer)
        before = holding.held
        holding.held = []  # until this call succeeds: a failure makes every partition new again
        count = self.partitions
        share = count
        if count > 1:
            try:
                self._live = max(int(await self.scripts.fanout_consumers(
                    keys=[self.keys.fanout_consumers], args=[consumer, self._lease_ms])), 1)
            except (RedisError, OSError):
                # Its node is away (a Cluster failover): the partitions elsewhere go on, with
                # the share last seen.
                logger.debug("fan-out consumer registry unreachable", exc_info=True)
            share = -(-count // self._live)
        keep, surplus = before[:share], before[share:]
        holding.turn += 1
        start = (zlib.crc32(consumer.encode()) + holding.turn) % count
        free = [p for p in ((start + i) % count for i in range(count)) if p not in before]
        asked = keep + (free if len(keep) < share else [])
        batch = Batch(self.client)
        for partition in asked:
            batch.call(self.scripts.partition_lease, [self.keys.lease(partition)], [consumer, self._lease_ms])
        for partition in surplus:
            batch.call(self.scripts.partition_lease, [self.keys.lease(partition)], [consumer, 0])
        # Per call: on Cluster a partition whose node is away is simply not held this time.
        results = await batch.execute(raise_errors=False)
        replies = {p: (0 if isinstance(r, Exception) else int(r)) for p, r in zip(asked, results, strict=False)}
        got = [partition for partition in asked if replies[partition]]
        if len(got) > share:  # took more free partitions than its share: give the extra back
            got, extra = got[:share], got[share:]
            batch = Batch(self.client)
            for partition in extra:
                batch.call(self.scripts.partition_lease, [self.keys.lease(partition)], [consumer, 0])
            await batch.execute()
        held = sorted(got)
        for partition in range(count):
            if partition not in held:
                holding.sweep.pop(partition, None)
            elif partition not in before or replies[partition] == 2:
                # New to it, or retaken after it lapsed unnoticed: sweep it all from the start.
                holding.sweep[partition] = "0-0"
        holding.held = held
        return holding

    async def _beat(self, consumer: str, holding: _Holding) -> None:
        """Keep the leases while the caller fans out what it read (a batch may outlast a lease).

        For HEARTBEAT_LEASES leases at most: a consumer that has not come back to read by then
        is taken to be stuck, and its partitions go to another.
        """
        for _ in range(HEARTBEAT_LEASES * 3):
            await asyncio.sleep(self._lease_ms / 3000)
            try:
                held = list(holding.held)
                batch = Batch(self.client)
                for partition in held:  # renew only: a heartbeat never takes a partition
                    batch.call(self.scripts.partition_lease, [self.keys.lease(partition)],
                               [consumer, self._lease_ms, "renew"])
                if self.partitions > 1:
                    batch.call(self.scripts.fanout_consumers, [self.keys.fanout_consumers], [consumer, self._lease_ms])
                results = await batch.execute()
                # A partition lost meanwhile is new again to the next hold (which sweeps it).
                holding.held = [p for p, result in zip(held, results, strict=False) if int(result)]
            except Exception:  # the next read renews, or sweeps what was lost
                raise_if_cancelled()
                logger.debug("fan-out lease heartbeat failed", exc_info=True)

    async def _autoclaim(self, partition: int, consumer: str, min_idle_ms: int, start: str,
                         count: int) -> tuple[str, list[tuple[str, Change]]]:
        """XAUTOCLAIM from ``start``: the next cursor (``0-0`` at the end) and what was claimed."""
        try:
            reply = await self.client.xautoclaim(self.keys.log(partition), FANOUT_GROUP, consumer,
                                                 min_idle_ms, start_id=start, count=count)
        except ResponseError as exc:
            if "NOGROUP" in str(exc):
                return "0-0", []
            raise
        cursor, claimed = as_text(reply[0]), self._parse(partition, reply[1])
        if claimed and cursor != "0-0" and _stream_id(cursor) <= _stream_id(claimed[-1][0].partition(":")[2]):
            # fakeredis answers the last id it claimed, where Redis answers the next one to scan.
            ms, seq = _stream_id(cursor)
            cursor = f"{ms}-{seq + 1}"
        return cursor, claimed

    async def _sweep(self, consumer: str, holding: _Holding, count: int) -> list[tuple[str, Change]]:
        """Changes a lapsed holder of a newly taken partition read and never acknowledged, oldest first."""
        taken: list[tuple[str, Change]] = []
        for partition, cursor in list(holding.sweep.items()):
            while len(taken) < count:
                start = cursor
                cursor, claimed = await self._autoclaim(partition, consumer, 0, start, count - len(taken))
                taken += claimed
                if cursor == "0-0" or (cursor == start and not claimed):
                    del holding.sweep[partition]
                    break
                holding.sweep[partition] = cursor
        await self._drop_unreadable()
        return taken

    async def read(self, consumer: str, count: int, block_ms: int) -> list[tuple[str, Change]]:
        """Up to ``count`` changes of the partitions ``consumer`` holds, in log order per partition.

        A partition is read by one consumer at a time (its lease, ``fanout_claim_idle_ms``
        long, renewed by every read and, while the caller works, by a heartbeat), so changes
        are fanned out in the order they were published. What was handed out and not
        acknowledged by the next read (the batch failed, or a reply was lost) is handed out
        again first, oldest first, as is what a lapsed holder left pending in a partition taken
        over. Blocks for at most a third of the lease, so a holder that is idle keeps it.
        """
        holding = self._holding_of(consumer)
        holding.stop_heartbeat()
        if holding.handed:
            holding.handed.clear()
            for partition in holding.held:
                holding.sweep[partition] = "0-0"
        try:
            found = await self._read(consumer, count, block_ms)
        except BaseException:
            # Whatever the server did: this consumer may now have entries pending it never saw.
            holding.held = []
            raise
        if found:
            holding.handed.update(change_id for change_id, _ in found)
            holding.heartbeat = asyncio.create_task(self._beat(consumer, holding), name="fanout-lease")
        return found

    async def _read(self, consumer: str, count: int, block_ms: int) -> list[tuple[str, Change]]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(block_ms, 0) / 1000
        while True:
            remaining = int((deadline - loop.time()) * 1000)
            holding = await self._hold(consumer)
            found = await self._sweep(consumer, holding, count) if holding.sweep else []
            held = holding.held
            chunk = min(remaining, self._max_block_ms, self._lease_ms // 3)
            if found:
                return found
            if not held:
                if chunk <= 0:
                    return []
                await asyncio.sleep(chunk / 1000)  # another consumer holds every partition: stand by
                continue
            if not self.cluster:
                found = await self._readgroup(consumer, held, count, chunk if chunk > 0 else None)
            else:
                # A blocking read spans one slot in Cluster: poll every partition, then block on one.
                for p in held:
                    found += await self._readgroup(consumer, [p], count - len(found), None)
                    if len(found) >= count:
                        break
                chunk = min(chunk, 100)
                if not found and chunk > 0:
                    self._rotate = (self._rotate + 1) % len(held)
                    found = await self._readgroup(consumer, [held[self._rotate]], count, chunk)
            if found or loop.time() >= deadline:
                return found
            if chunk > 0 and loop.time() < deadline - chunk / 1000 + 0.005:
                await asyncio.sleep(0.01)  # the server did not block (fakeredis): poll instead

    async def ack(self, ids: Sequence[str]) -> None:
        """Acknowledge, count out of the tenants' backlogs and trim what was processed, per partition.

        Trimmed here, by the partition's one reader, rather than by length at publish: an entry
        leaves the log only once fan-out is done with it, so a flood can be refused but never
        evicts another tenant's unread change.
        """
        by_partition: dict[int, list[str]] = {}
        for change_id in ids:
            number, _, entry_id = change_id.partition(":")
            if number.isdigit() and entry_id:
                by_partition.setdefault(int(number), []).append(entry_id)
        batch = Batch(self.client)
        for partition, entry_ids in by_partition.items():
            batch.call(self.scripts.changelog_ack, [self.keys.log(partition), self.keys.backlog(partition)],
                       [FANOUT_GROUP, "", *entry_ids])
        for partition, left in zip(by_partition, await batch.execute(), strict=True):
            self.backlog[partition] = int(left)
        # Only now: ids whose acknowledgement failed are handed out again at the next read.
        for holding in self._holding.values():
            holding.handed.difference_update(ids)

    async def release(self, consumer: str) -> None:
        """Give up the partitions ``consumer`` holds: the next consumer to ask takes them at once."""
        holding = self._holding.pop(consumer, None)
        if holding is None:
            return
        holding.stop_heartbeat()
        holding.held = []
        # Every partition, not only those of the last successful hold: a read cut short (the
        # consumer is being cancelled) forgets what it held, and the script checks the holder.
        batch = Batch(self.client)
        for partition in range(self.partitions):
            batch.call(self.scripts.partition_lease, [self.keys.lease(partition)], [consumer, 0])
        if self.partitions > 1:
            batch.call(self.scripts.fanout_consumers, [self.keys.fanout_consumers], [consumer, 0])
        await batch.execute()
        await self._forget(consumer)

    async def _forget(self, consumer: str) -> None:
        """Remove a stopping consumer from the group where it has nothing pending.

        Consumer names are new with every process, so the group would otherwise keep one per
        restart, and each acknowledgement's trim (an XPENDING summary) walks them all. One with
        changes pending stays, or they would be stranded; it reads no more (its leases are
        given up, and reads are fenced by them), so nothing becomes pending between the check
        and the removal.
        """
        for partition in range(self.partitions):
            key = self.keys.log(partition)
            if not await self.client.xpending_range(key, FANOUT_GROUP, "-", "+", 1, consumername=consumer):
                await self.client.xgroup_delconsumer(key, FANOUT_GROUP, consumer)

    async def claim(self, consumer: str, min_idle_ms: int, count: int) -> list[tuple[str, Change]]:
        """Changes pending longer than ``min_idle_ms`` in the partitions ``consumer`` holds or can take."""
        holding = await self._hold(consumer)
        claimed: list[tuple[str, Change]] = []  # (a sweep owed is left to the next read)
        for partition in holding.held:
            if len(claimed) >= count:
                break
            claimed += (await self._autoclaim(partition, consumer, min_idle_ms, "0-0", count - len(claimed)))[1]
        await self._drop_unreadable()
        return claimed

    def close(self) -> None:
        for holding in self._holding.values():
            holding.stop_heartbeat()
