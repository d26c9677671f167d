"""Leases on Redis: each fan-out consumer's share of the change-log partitions, and named leases.

Both are ``partition_lease.lua``, a key per lease (on a single server one call holds several):
one holder at a time, for a ttl after its last renewal, taken by the next that asks once it lapses.

Partition leases (``P:{c:<n>}:lease``)
    Each partition of the change log is read by one fan-out consumer at a time, the holder of
    its lease (``changelog`` says why). Each live consumer holds its share of the partitions
    (``PartitionLeases.take_share``), so fan-out spreads over workers when there are several;
    a heartbeat keeps the leases while the consumer works on what it read.

Named leases (``P:lease:<name>``, ``base.Leases``)
    For change sources that must run on one worker. One key per call, so legal on Cluster.
"""

from __future__ import annotations

import asyncio
import logging
import math
import zlib
from collections.abc import Sequence
from typing import Any

from redis.exceptions import RedisError

from broker.backends.redis.batch import Batch
from broker.backends.redis.codec import as_text
from broker.backends.redis.connection import Client, unavailable
from broker.backends.redis.keys import Keys
from broker.backends.redis.scripts import Scripts
from broker.errors import raise_if_cancelled

__all__ = ["HEARTBEAT_LEASES", "ConsumerShare", "PartitionLeases", "RedisLeases"]

logger = logging.getLogger(__name__)

#: How many leases' time a consumer's heartbeat keeps its partitions while it works on one batch.
HEARTBEAT_LEASES = 10
#: A consumer's share is taken again (leases renewed, the registry asked) once this part of a
#: lease has passed since the last time, not at every read: at the targeted benchmark point a
#: fan-out batch holds a few changes, and the two round trips of a hold were a quarter of the
#: batch's. A read is fenced by the lease anyway, and the heartbeat of a batch renews a third
#: of a lease after the last hold, so two thirds of a lease are left at every renewal.
HOLD_EVERY_LEASE = 1 / 6


class ConsumerShare:
    """What one consumer holds: its partitions, the sweeps it owes, and what it was handed last."""

    __slots__ = ("handed", "heartbeat", "held", "held_at", "sweep", "timer", "turn")

    def __init__(self) -> None:
        self.held: list[int] = []
        #: Loop time at which the last successful hold began (its leases run a lease from then);
        #: -inf when the next read must hold at once (none yet, one failed, or a lease lapsed).
        self.held_at = -math.inf
        self.turn = 0
        #: partition -> XAUTOCLAIM cursor of a sweep still to finish
        self.sweep: dict[int, str] = {}
        #: Ids of the last read not acknowledged yet: any left at the next read failed.
        self.handed: set[str] = set()
        #: Renews the leases while the caller works on what it read.
        self.heartbeat: asyncio.Task[None] | None = None
        #: Starts the heartbeat a third of a lease after the last hold (most batches are done by then).
        self.timer: asyncio.TimerHandle | None = None

    @property
    def lapsed(self) -> bool:
        return self.held_at == -math.inf

    def lapse(self) -> None:
        """The next read takes the share again (a fenced read found a lease lapsed, the layout changed)."""
        self.held_at = -math.inf

    def stop_heartbeat(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.heartbeat is not None:
            self.heartbeat.cancel()
            self.heartbeat = None


class PartitionLeases:
    """The partition leases of this process's fan-out consumers, and the registry of live consumers."""

    def __init__(self, client: Client, keys: Keys, scripts: Scripts, *, partitions: list[int], lease_ms: int,
                 cluster: bool = False) -> None:
        self.client = client
        self.cluster = cluster
        self.keys = keys
        self.scripts = scripts
        self._partitions = partitions
        self.lease_ms = lease_ms
        self._shares: dict[str, ConsumerShare] = {}
        #: Live fan-out consumers, as the registry last said.
        self._live = 1

    @property
    def partitions(self) -> list[int]:
        """The numbers of the partitions fan-out reads (the layout ``partitioning`` says, or the one it drains)."""
        return self._partitions

    @partitions.setter
    def partitions(self, numbers: list[int]) -> None:
        # Another layout: every consumer gives the old partitions up and takes its share of the
        # new ones at its next read, not once its last hold has aged (HOLD_EVERY_LEASE).
        self._partitions = numbers
        for share in self._shares.values():
            share.lapse()

    def _lease_calls(self, batch: Batch, partitions: Sequence[int], args: Sequence[Any]) -> list[list[int]]:
        """Adds ``partition_lease`` calls for ``partitions`` to ``batch``: one for them all on a
        single server, one per partition on Cluster (each lease is a slot of its own). Returns
        the partitions of each call, for ``_replies``.

        One call per partition was a script call per partition per fan-out read: with 16
        partitions, about a tenth of a delivered frame's instructions at one change per batch
        (bench/NOTES.md).
        """
        groups = [[p] for p in partitions] if self.cluster or len(partitions) < 2 else [list(partitions)]
        for group in groups:
            batch.call(self.scripts.partition_lease, [self.keys.lease(p) for p in group], args)
        return groups

    @staticmethod
    def _replies(groups: list[list[int]], results: Sequence[Any]) -> dict[int, int]:
        """Per partition, its ``partition_lease`` reply (0 for a call that failed)."""
        replies: dict[int, int] = {}
        for group, result in zip(groups, results, strict=False):
            if isinstance(result, Exception):
                replies.update((p, 0) for p in group)
            elif len(group) == 1:
                replies[group[0]] = int(result)
            else:
                replies.update((p, int(r)) for p, r in zip(group, result, strict=True))
        return replies

    def share_of(self, consumer: str) -> ConsumerShare:
        share = self._shares.get(consumer)
        if share is None:
            share = self._shares[consumer] = ConsumerShare()
        return share

    async def take_share(self, consumer: str) -> ConsumerShare:
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
        holding = self.share_of(consumer)
        began = asyncio.get_running_loop().time()
        if holding.held and not holding.sweep and began < holding.held_at + self.lease_ms * HOLD_EVERY_LEASE / 1000:
            # Held a moment ago (see HOLD_EVERY_LEASE). Not when a sweep is owed: it claims
            # without a fence, so it follows a hold that has just confirmed the leases.
            return holding
        before = holding.held
        holding.held = []  # until this call succeeds: a failure makes every partition new again
        holding.lapse()
        numbers = self.partitions
        count = len(numbers)
        share = count
        if count > 1:
            try:
                self._live = max(int(await self.scripts.fanout_consumers(
                    keys=[self.keys.fanout_consumers], args=[consumer, self.lease_ms])), 1)
            except (RedisError, OSError):
                # Its node is away (a Cluster failover): the partitions elsewhere go on, with
                # the share last seen.
                logger.debug("fan-out consumer registry unreachable", exc_info=True)
            share = -(-count // self._live)
        kept = [p for p in before if p in numbers]
        keep, surplus = kept[:share], kept[share:] + [p for p in before if p not in numbers]
        holding.turn += 1
        start = (zlib.crc32(consumer.encode()) + holding.turn) % count
        free = [p for p in (numbers[(start + i) % count] for i in range(count)) if p not in before]
        asked = keep + (free if len(keep) < share else [])
        batch = Batch(self.client)
        groups = self._lease_calls(batch, asked, [consumer, self.lease_ms])
        self._lease_calls(batch, surplus, [consumer, 0])
        # Per call: on Cluster a partition whose node is away is simply not held this time.
        replies = self._replies(groups, await batch.execute(raise_errors=False))
        got = [partition for partition in asked if replies[partition]]
        if len(got) > share:  # took more free partitions than its share: give the extra back
            got, extra = got[:share], got[share:]
            batch = Batch(self.client)
            self._lease_calls(batch, extra, [consumer, 0])
            await batch.execute()
        held = sorted(got)
        for partition in numbers:
            if partition not in held:
                holding.sweep.pop(partition, None)
            elif partition not in before or replies[partition] == 2:
                # New to it, or retaken after it lapsed unnoticed: sweep it all from the start.
                holding.sweep[partition] = "0-0"
        holding.held = held
        # The leases run a full lease from before this call. Below its share, the consumer asks
        # again with its next hold too: the others give their surplus up at their own.
        holding.held_at = began
        return holding

    def keep_while_working(self, consumer: str, share: ConsumerShare) -> None:
        """Start the heartbeat that renews ``share``'s leases until the consumer's next read.

        A timer first, the task only once it fires: a task created and cancelled per batch cost
        more than the rest of the lease bookkeeping of a read. It fires a third of a lease after
        the last hold (the last renewal), however long the read took, so two thirds of the lease
        are left when it renews.
        """
        def start() -> None:
            share.timer = None
            share.heartbeat = asyncio.create_task(self._heartbeat(consumer, share), name="fanout-lease")

        loop = asyncio.get_running_loop()
        # A share whose lease lapsed (held_at -inf) renews what is left of it at once.
        share.timer = loop.call_later(max(share.held_at + self.lease_ms / 3000 - loop.time(), 0.0), start)

    async def _heartbeat(self, consumer: str, holding: ConsumerShare) -> None:
        """Keep the leases while the caller fans out what it read (a batch may outlast a lease).

        For HEARTBEAT_LEASES leases at most: a consumer that has not come back to read by then
        is taken to be stuck, and its partitions go to another.
        """
        for turn in range(HEARTBEAT_LEASES * 3):
            if turn:
                await asyncio.sleep(self.lease_ms / 3000)
            try:
                held = list(holding.held)
                batch = Batch(self.client)
                # Renew only: a heartbeat never takes a partition.
                groups = self._lease_calls(batch, held, [consumer, self.lease_ms, "renew"])
                if len(self.partitions) > 1:
                    batch.call(self.scripts.fanout_consumers, [self.keys.fanout_consumers], [consumer, self.lease_ms])
                replies = self._replies(groups, await batch.execute())
                # A partition lost meanwhile is new again to the next hold (which sweeps it).
                holding.held = [p for p in held if replies.get(p)]
            except Exception:  # the next read renews, or sweeps what was lost
                raise_if_cancelled()
                logger.debug("fan-out lease heartbeat failed", exc_info=True)

    def acknowledged(self, ids: Sequence[str]) -> None:
        """``ids`` were acknowledged: no consumer's next read hands them out again."""
        for share in self._shares.values():
            share.handed.difference_update(ids)

    async def release(self, consumer: str) -> bool:
        """Give up every partition ``consumer`` may hold, and its place in the registry; False if it held none here."""
        holding = self._shares.pop(consumer, None)
        if holding is None:
            return False
        holding.stop_heartbeat()
        holding.held = []
        # Every partition, not only those of the last successful hold: a read cut short (the
        # consumer is being cancelled) forgets what it held, and the script checks the holder.
        batch = Batch(self.client)
        self._lease_calls(batch, self.partitions, [consumer, 0])
        if len(self.partitions) > 1:
            batch.call(self.scripts.fanout_consumers, [self.keys.fanout_consumers], [consumer, 0])
        await batch.execute()
        return True

    def close(self) -> None:
        for share in self._shares.values():
            share.stop_heartbeat()


class RedisLeases:
    """Named leases (``base.Leases``): one holder per name across the deployment."""

    def __init__(self, client: Client, keys: Keys, scripts: Scripts) -> None:
        self.client = client
        self.keys = keys
        self.scripts = scripts

    async def hold(self, name: str, owner: str, ttl_ms: int) -> bool:
        # A ttl of 0 would release the lease (see the script): a hold always holds for a while.
        with unavailable("leases.hold"):
            taken = await self.scripts.partition_lease(keys=[self.keys.named_lease(name)], args=[owner, max(ttl_ms, 1)])
        return bool(int(taken))

    async def holder(self, name: str) -> str | None:
        with unavailable("leases.holder"):
            owner = await self.client.get(self.keys.named_lease(name))
        return None if owner is None else as_text(owner)

    async def release(self, name: str, owner: str) -> None:
        with unavailable("leases.release"):
            await self.scripts.partition_lease(keys=[self.keys.named_lease(name)], args=[owner, 0])
