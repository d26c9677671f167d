"""The change log on Redis (``base.ChangeLog``): partitioned streams, one consumer group, a lease per partition.

A tenant maps to partition ``crc32(tenant) % partitions``; the partition count is stored in Redis at first start
(``P:partitions``) and the stored value wins over the setting, because a tenant's records live under its partition's
hash tag and must not move. Change ids are ``<partition>:<stream id>``.

Bounds: nothing fan-out has not processed is ever trimmed. An append (``changelog_append.lua``, and the record
scripts) checks, in the same step, that the partition holds fewer than ``changelog_maxlen`` entries and the tenant
fewer than ``changelog_tenant_max`` changes not yet fanned out (a per-tenant count in ``P:{c:<n>}:backlog``, the
partition's hash slot), and refuses the whole call otherwise (``LogFull``, ``QuotaExceeded``) before anything is
acknowledged. The acknowledgement (``changelog_ack.lua``) counts each change out of its tenant's backlog and trims
the partition below its oldest pending entry (or the last delivered one): the one reader of the partition trims, so
trimming never races a read.

Each partition is read by one fan-out consumer at a time, the holder of its lease (``P:{c:<n>}:lease``). Consumers
that read one partition side by side would append a URI's changes to an inbox out of order (a later frame, then an
earlier one; a slow reader keeping the newest frame of a URI would keep the wrong one), and the same on the listen
broadcast. So ordering holds per partition. A holder that stops renewing (it died, or hung on one batch for longer
than its heartbeat lasts) loses the partition to the next consumer that asks, which first takes over what it left
pending (at least once). Reads are fenced by the lease (``fanout_read.lua`` checks the holder and reads in one
step), so a read that reaches Redis after its lease lapsed takes nothing: the changes stay for the holder, never
pending to a consumer nobody sweeps. Each live consumer holds its share of the partitions (the leases and the shares
are ``leases.PartitionLeases``), so fan-out spreads over workers when there are several.

Records are written with their change by ``records.py``, through this log's partitions and bounds.
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from collections.abc import Sequence
from typing import Any

from redis.exceptions import ResponseError

from broker.backends.redis.batch import Batch
from broker.backends.redis.codec import as_text, decode_change, encode_change
from broker.backends.redis.connection import Client, unavailable
from broker.backends.redis.keys import FANOUT_GROUP, Keys
from broker.backends.redis.lag import LagReport
from broker.backends.redis.leases import ConsumerShare, PartitionLeases
from broker.backends.redis.scripts import Scripts
from broker.changes import Change
from broker.config import Settings
from broker.errors import LogFull, PublishRefused, QuotaExceeded
from broker.metrics import NO_METRICS, Metrics

__all__ = ["RedisChangeLog"]

logger = logging.getLogger(__name__)


def _stream_id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


class RedisChangeLog(LagReport):
    """Published changes, read by fan-out under partition leases; each method translates connection errors."""

    def __init__(self, settings: Settings, client: Client, keys: Keys, scripts: Scripts, *, cluster: bool,
                 metrics: Metrics = NO_METRICS) -> None:
        self.settings = settings
        self._trimmed = metrics.counter("mcp_broker_changelog_trimmed_total")
        self.client = client
        self.keys = keys
        self.scripts = scripts
        self.cluster = cluster
        self.leases = PartitionLeases(client, keys, scripts, partitions=max(settings.changelog_partitions, 1),
                                      lease_ms=max(settings.fanout_claim_idle_ms, 30))
        self._rotate = 0
        self._unreadable: list[str] = []
        # Longest single BLOCK: below the socket timeout, so a blocked read is never taken for a dead server.
        self._max_block_ms = max(int(settings.redis_socket_timeout * 1000) - 1000, 100)
        #: Per partition, the changes not yet fanned out when this process last acknowledged
        #: or trimmed: what a store that restarts empty would lose (logged then).
        self.backlog: dict[int, int] = {}
        #: Unreadable entries this process dropped (each is logged with its id).
        self.dropped = 0

    @property
    def partitions(self) -> int:
        """How many partitions the log has: the count stored in Redis at first start wins over the setting."""
        return self.leases.partitions

    async def start(self) -> None:
        """Agree on the partition count and create the fan-out group; the caller translates connection errors."""
        stored = await self.scripts.get_or_set(keys=[self.keys.partitions], args=[self.partitions])
        if int(stored) != self.partitions:
            logger.warning("change log has %s partitions in redis; changelog_partitions=%d is ignored",
                           as_text(stored), self.partitions)
            self.leases.partitions = int(stored)
        await self._create_groups()

    async def _create_groups(self) -> None:
        for partition in range(self.partitions):
            try:
                await self.client.xgroup_create(self.keys.log(partition), FANOUT_GROUP, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    def partition(self, tenant: str) -> int:
        return zlib.crc32(tenant.encode()) % self.partitions

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

        The caller translates connection errors (the record store calls it within its own).

        The group's last delivered id is read before the script looks at what is pending: an
        entry delivered by then and not pending when the script runs was acknowledged.
        """
        key = self.keys.log(partition)
        delivered = ""
        for group in await self.client.xinfo_groups(key):
            if as_text(group["name"]) == FANOUT_GROUP:
                delivered = as_text(group["last-delivered-id"])
        left, trimmed = await self.scripts.changelog_ack(keys=[key, self.keys.backlog(partition)],
                                                         args=[FANOUT_GROUP, delivered])
        self.backlog[partition] = int(left)
        self._trimmed.inc(int(trimmed))
        return int(left)

    async def publish(self, change: Change) -> str:
        """One script call: the bounds are checked and the change counted with the append.

        Raises:
            QuotaExceeded, LogFull: the change was refused, nothing was appended.
        """
        with unavailable("changelog.publish"):
            return (await self._append(self.partition(change.tenant), [change]))[0]

    async def publish_many(self, changes: Sequence[Change]) -> list[str]:
        """One script call per partition, all of its changes or none (a tenant's changes are in
        one partition, in order); on a single node in one pipeline, on Cluster concurrently.
        Every partition finishes before a refusal or an error is raised: a caller told "not
        acknowledged" must not have appends still landing behind its back."""
        with unavailable("changelog.publish_many"):
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
            await self._create_groups()
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
        cursor, claimed = as_text(reply[0]), self._parse(partition, reply[1])
        if claimed and cursor != "0-0" and _stream_id(cursor) <= _stream_id(claimed[-1][0].partition(":")[2]):
            # fakeredis answers the last id it claimed, where Redis answers the next one to scan.
            ms, seq = _stream_id(cursor)
            cursor = f"{ms}-{seq + 1}"
        return cursor, claimed

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
        """Up to ``count`` changes of the partitions ``consumer`` holds, in log order per partition.

        A partition is read by one consumer at a time (its lease, ``fanout_claim_idle_ms``
        long, renewed by every read and, while the caller works, by a heartbeat), so changes
        are fanned out in the order they were published. What was handed out and not
        acknowledged by the next read (the batch failed, or a reply was lost) is handed out
        again first, oldest first, as is what a lapsed holder left pending in a partition taken
        over. Blocks for at most a third of the lease, so a holder that is idle keeps it.
        """
        holding = self.leases.share_of(consumer)
        holding.stop_heartbeat()
        if holding.handed:
            holding.handed.clear()
            for partition in holding.held:
                holding.sweep[partition] = "0-0"
        try:
            with unavailable("changelog.read"):
                found = await self._read(consumer, count, block_ms)
        except BaseException:
            # Whatever the server did: this consumer may now have entries pending it never saw.
            holding.held = []
            raise
        if found:
            holding.handed.update(change_id for change_id, _ in found)
            self.leases.keep_while_working(consumer, holding)
        return found

    async def _read(self, consumer: str, count: int, block_ms: int) -> list[tuple[str, Change]]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(block_ms, 0) / 1000
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
        with unavailable("changelog.ack"):
            by_partition: dict[int, list[str]] = {}
            for change_id in ids:
                number, _, entry_id = change_id.partition(":")
                if number.isdigit() and entry_id:
                    by_partition.setdefault(int(number), []).append(entry_id)
            batch = Batch(self.client)
            for partition, entry_ids in by_partition.items():
                batch.call(self.scripts.changelog_ack, [self.keys.log(partition), self.keys.backlog(partition)],
                           [FANOUT_GROUP, "", *entry_ids])
            for partition, (left, trimmed) in zip(by_partition, await batch.execute(), strict=True):
                self.backlog[partition] = int(left)
                self._trimmed.inc(int(trimmed))
            # Only now: ids whose acknowledgement failed are handed out again at the next read.
            self.leases.acknowledged(ids)

    async def release(self, consumer: str) -> None:
        """Give up the partitions ``consumer`` holds: the next consumer to ask takes them at once."""
        with unavailable("changelog.release"):
            if await self.leases.release(consumer):
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

    def close(self) -> None:
        self.leases.close()
