"""The change log on Redis (``base.ChangeLog``): partitioned streams, one consumer group, a lease per partition.

A change goes to the partition of its ordering key (``partitioning``: the tenant and collection
of a record URI, the tenant and URI of any other), so one tenant's changes spread over every
partition while each URI's keep their order. The layout (which partition numbers, how many) is
kept in Redis and can be changed on a running deployment by a drain and switch
(``partitioning``). Change ids are ``<partition>:<stream id>``.

Bounds: nothing fan-out has not processed is ever trimmed. An append (``changelog_append.lua``,
and the record scripts) checks, in the same step, that the partition holds fewer than
``changelog_maxlen`` entries and the tenant fewer than ``changelog_tenant_max`` changes of that
partition not yet fanned out (a per-tenant count in ``P:{c:<n>}:backlog``, the partition's hash
slot, so each script stays in one Cluster slot), and refuses the whole call otherwise
(``LogFull``, ``QuotaExceeded``) before anything is acknowledged. On a single server one call
spans every partition of a list, so a list is appended whole or not at all; on Cluster each
partition's part is one call. The acknowledgement (``changelog_ack.lua``) counts each change out
of its tenant's backlog and trims the partition below its oldest pending entry (or the last
delivered one): the one reader of the partition trims, so trimming never races a read.

Each partition is read by one fan-out consumer at a time, the holder of its lease
(``P:{c:<n>}:lease``). Consumers that read one partition side by side would append a URI's
changes to an inbox out of order (a later frame, then an earlier one), and the same on the
listen broadcast. So ordering holds per partition. A holder that stops renewing (it died, or
hung on one batch for longer than its heartbeat lasts) loses the partition to the next consumer
that asks, which first takes over what it left pending (at least once). Reads are fenced by the
lease (``changelog_read``). Each live consumer holds its share of the partitions (the leases and
the shares are ``leases.PartitionLeases``), so fan-out spreads over the workers.

Records are written with their change by ``records.py``, through this log's partitions and bounds.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from broker.backends.redis.batch import Batch
from broker.backends.redis.changelog_read import FencedReader
from broker.backends.redis.codec import as_text, encode_change
from broker.backends.redis.connection import Client, unavailable
from broker.backends.redis.durable import Durability
from broker.backends.redis.keys import FANOUT_GROUP, Keys
from broker.backends.redis.lag import partition_lag, partition_overview
from broker.backends.redis.leases import PartitionLeases
from broker.backends.redis.partitioning import Partitioning
from broker.backends.redis.scripts import Scripts
from broker.changes import Change
from broker.config import Settings
from broker.errors import BackendUnavailable, LogFull, PublishRefused, QuotaExceeded
from broker.metrics import NO_METRICS, Metrics

__all__ = ["RedisChangeLog"]

logger = logging.getLogger(__name__)

#: Seconds between two looks of a fan-out consumer at the layouts (a switch, or the end of its drain).
LOOK_INTERVAL = 1.0
#: While a switch drains: how often consumers check whether the old layout is empty.
DRAIN_LOOK_INTERVAL = 0.1
#: Tries of an append that meets a sealed partition (a switch is being made): the layout is read again each time.
SEALED_TRIES = 50


class RedisChangeLog:
    """Published changes, read by fan-out under partition leases; each method translates connection errors."""

    def __init__(self, settings: Settings, client: Client, keys: Keys, scripts: Scripts, *, cluster: bool,
                 metrics: Metrics = NO_METRICS) -> None:
        self.settings = settings
        self._trimmed = metrics.counter("mcp_broker_changelog_trimmed_total")
        self.client = client
        self.keys = keys
        self.scripts = scripts
        self.cluster = cluster
        self.durable = Durability.of(settings)
        self.partitioning = Partitioning(client, keys, scripts, settings.changelog_partitions)
        self.leases = PartitionLeases(client, keys, scripts, partitions=self.partitioning.reading.numbers,
                                      lease_ms=max(settings.fanout_claim_idle_ms, 30), cluster=cluster)
        self._next_look = 0.0
        self._reader = FencedReader(client, keys, scripts, self.leases, self.partitioning, self.ack, cluster=cluster,
                                    max_block_ms=max(int(settings.redis_socket_timeout * 1000) - 1000, 100))
        #: Per partition, the changes not yet fanned out when this process last acknowledged
        #: or trimmed: what a store that restarts empty would lose (logged then).
        self.backlog: dict[int, int] = {}

    @property
    def dropped(self) -> int:
        """Unreadable entries this process dropped (each is logged with its id)."""
        return self._reader.dropped

    @property
    def partitions(self) -> int:
        """How many partitions appends go to (the deployment's count, stored in Redis)."""
        return self.partitioning.write.count

    async def start(self) -> None:
        """Agree on the layouts and create the fan-out groups; the caller translates connection errors.

        Raises:
            PartitionMismatch: ``changelog_partitions`` is set and is not the deployment's count.
        """
        await self.partitioning.start()
        self.leases.partitions = self.partitioning.reading.numbers

    def partition(self, tenant: str, uri: str) -> int:
        """The partition a change of ``uri`` goes to now."""
        return self.partitioning.write.route(tenant, uri)

    def _append_call(self, groups: dict[int, list[Change]]) -> tuple[list[str], list[Any]]:
        keys: list[str] = []
        args: list[Any] = [self.settings.changelog_maxlen, self.settings.changelog_tenant_max]
        for place, (partition, changes) in enumerate(groups.items(), start=1):
            keys += [self.keys.log(partition), self.keys.backlog(partition), self.keys.sealed(partition)]
            for change in changes:
                args += [place, change.tenant, encode_change(change)]
        return keys, args

    def _refusal(self, partitions: Sequence[int], reply: Sequence[Any]) -> PublishRefused | None:
        """What refused a ``changelog_append.lua`` call, or None for -3 (sealed) and for an accepted one."""
        status = int(reply[0])
        if status == -2:
            return LogFull(partitions[int(reply[1]) - 1], self.settings.changelog_maxlen)
        if status == -1:
            return QuotaExceeded(as_text(reply[2]), self.settings.changelog_tenant_max, int(reply[3]), int(reply[4]))
        return None

    async def _append_group(self, groups: dict[int, list[Change]]) -> list[str]:
        """One script call for these partitions' changes, all or none: their ids, partition by partition.

        A partition found full is trimmed of what fan-out processed and the call made once more
        (fan-out trims as it acknowledges; a log an older version wrote has no such trimming).
        """
        partitions = list(groups)
        reply = await self.durable.run(self.client, self.scripts.changelog_append, *self._append_call(groups))
        if int(reply[0]) == -2:
            await self.trim(partitions[int(reply[1]) - 1])
            reply = await self.durable.run(self.client, self.scripts.changelog_append, *self._append_call(groups))
        if int(reply[0]) == -3:
            raise _Sealed()
        refused = self._refusal(partitions, reply)
        if refused is not None:
            raise refused
        ids = iter(reply[1:])
        return [f"{partition}:{next(ids).decode()}" for partition, changes in groups.items() for _ in changes]

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
        return (await self.publish_many([change]))[0]

    async def publish_many(self, changes: Sequence[Change]) -> list[str]:
        """Append ``changes`` in order per partition; on a single server in one script call, all or none.

        On Cluster each partition's changes are one call, made concurrently; every call finishes
        before a refusal or an error is raised: a caller told "not acknowledged" must not have
        appends still landing behind its back. An append that meets a sealed partition (a
        switch of layouts) reads the layout again and goes to the new one.
        """
        if not changes:
            return []
        ids: list[str | None] = [None] * len(changes)
        with unavailable("changelog.publish"):
            for _ in range(SEALED_TRIES):
                try:
                    # Only what is not appended yet: on Cluster, the partitions that took their
                    # changes before another met its seal keep them (sent again, they would be
                    # appended twice, under new ids no duplicate check knows).
                    await self._publish(changes, [i for i, found in enumerate(ids) if found is None], ids)
                    return [found or "" for found in ids]
                except _Sealed:
                    await asyncio.sleep(0.02)
                    await self.partitioning.load()
        raise BackendUnavailable("the change log is switching partitions; publish again shortly")

    async def _publish(self, changes: Sequence[Change], todo: list[int], ids: list[str | None]) -> None:
        """Append ``changes[i]`` for each ``i`` of ``todo``, writing each one's id into ``ids``."""
        route = self.partitioning.write.route
        positions: dict[int, list[int]] = {}
        for i in todo:
            positions.setdefault(route(changes[i].tenant, changes[i].uri), []).append(i)
        groups = {partition: [changes[i] for i in at] for partition, at in positions.items()}
        if not self.cluster or len(groups) == 1:
            found = await self._append_group(groups)
            flat = (i for at in positions.values() for i in at)
            for i, change_id in zip(flat, found, strict=True):
                ids[i] = change_id
            return
        results = await asyncio.gather(*(self._append_group({p: group}) for p, group in groups.items()),
                                       return_exceptions=True)
        failure: BaseException | None = None
        for at, result in zip(positions.values(), results, strict=True):
            if isinstance(result, BaseException):
                failure = failure or result
                continue
            for i, change_id in zip(at, result, strict=True):
                ids[i] = change_id
        if failure is not None:
            raise failure

    async def read(self, consumer: str, count: int, block_ms: int) -> list[tuple[str, Change]]:
        """Up to ``count`` changes of the partitions ``consumer`` holds, in log order per partition.

        A partition is read by one consumer at a time (its lease, ``fanout_claim_idle_ms``
        long, renewed by a read once a sixth of it has passed and, while the caller works, by a
        heartbeat), so changes
        are fanned out in the order they were published. What was handed out and not
        acknowledged by the next read (the batch failed, or a reply was lost) is handed out
        again first, oldest first, as is what a lapsed holder left pending in a partition taken
        over. Blocks for at most a third of the lease, so a holder that is idle keeps it.
        """
        with unavailable("changelog.read"):
            await self._follow(consumer)
        holding = self.leases.share_of(consumer)
        holding.stop_heartbeat()
        if holding.handed:
            holding.handed.clear()
            for partition in holding.held:
                holding.sweep[partition] = "0-0"
        try:
            with unavailable("changelog.read"):
                found = await self._reader.read(consumer, count, block_ms)
        except BaseException:
            # Whatever the server did: this consumer may now have entries pending it never saw.
            holding.held = []
            raise
        if found:
            holding.handed.update(change_id for change_id, _ in found)
            self.leases.keep_while_working(consumer, holding)
        return found

    async def _follow(self, consumer: str) -> None:
        """Look at the layouts now and then: a switch, or the end of its drain, moves what fan-out reads.

        While a layout is drained, each consumer checks whether it is empty; the first to see it
        so drops it, and every consumer then gives up its leases of the old partitions and
        takes its share of the new ones.
        """
        loop = asyncio.get_running_loop()
        if loop.time() < self._next_look:
            return
        partitioning = self.partitioning
        await partitioning.load()
        if partitioning.drain is not None:
            await partitioning.finish_drain()
        self._next_look = loop.time() + (DRAIN_LOOK_INTERVAL if partitioning.drain else LOOK_INTERVAL)
        numbers = partitioning.reading.numbers
        if numbers != self.leases.partitions:
            await self.partitioning.create_groups()
            await self.leases.release(consumer)
            self.leases.partitions = numbers

    async def ack(self, ids: Sequence[str]) -> None:
        """Acknowledge, count out of the tenants' backlogs and trim what was processed, per partition.

        Trimmed here, by the partition's one reader, rather than by length at publish: an entry
        leaves the log only once fan-out is done with it, so a flood can be refused but never
        evicts another tenant's unread change.
        """
        with unavailable("changelog.ack"):
            batch = Batch(self.client)
            partitions = self.add_acks(batch, ids)
            self.acknowledged(partitions, await batch.execute(), ids)

    def add_acks(self, batch: Batch, ids: Sequence[str]) -> list[int]:
        """The acknowledgement of ``ids`` in ``batch``, a script call per partition; the partitions, in order."""
        by_partition: dict[int, list[str]] = {}
        for change_id in ids:
            number, _, entry_id = change_id.partition(":")
            if number.isdigit() and entry_id:
                by_partition.setdefault(int(number), []).append(entry_id)
        for partition, entry_ids in by_partition.items():
            batch.call(self.scripts.changelog_ack, [self.keys.log(partition), self.keys.backlog(partition)],
                       [FANOUT_GROUP, "", *entry_ids])
        return list(by_partition)

    def acknowledged(self, partitions: Sequence[int], replies: Sequence[Any], ids: Sequence[str]) -> None:
        """The replies of ``add_acks``' calls (the last ``len(partitions)`` of ``replies``)."""
        for partition, (left, trimmed) in zip(partitions, replies[len(replies) - len(partitions):], strict=True):
            self.backlog[partition] = int(left)
            self._trimmed.inc(int(trimmed))
        # Only now: ids whose acknowledgement failed are handed out again at the next read.
        self.leases.acknowledged(ids)

    async def lag(self, consumer: str) -> dict[int, tuple[int, float]]:
        """For the metrics: per partition ``consumer`` holds, the changes not yet fanned out and the
        age in seconds of the oldest of them (``partition_lag``)."""
        with unavailable("changelog.lag"):
            return await partition_lag(self.client, self.keys, list(self.leases.share_of(consumer).held))

    async def overview(self) -> dict[int, tuple[str | None, int, float]]:
        with unavailable("changelog.overview"):
            return await partition_overview(self.client, self.keys, list(self.leases.partitions))

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
        for partition in self.partitioning.numbers():
            key = self.keys.log(partition)
            if not await self.client.xpending_range(key, FANOUT_GROUP, "-", "+", 1, consumername=consumer):
                await self.client.xgroup_delconsumer(key, FANOUT_GROUP, consumer)

    def close(self) -> None:
        self.leases.close()


class _Sealed(Exception):
    """An append met a sealed partition: the layout this process holds is stale."""
