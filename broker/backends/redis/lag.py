"""How far fan-out is behind on change-log partitions, for the metrics (``RedisChangeLog.lag`` asks it) and
the console (``RedisChangeLog.overview``: every partition, with the consumer holding its lease)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from broker.backends.redis.batch import Batch
from broker.backends.redis.codec import as_text
from broker.backends.redis.connection import Client
from broker.backends.redis.keys import Keys
from broker.metrics import accepted_at

__all__ = ["partition_lag", "partition_overview"]


async def partition_lag(client: Client, keys: Keys, partitions: Sequence[int]) -> dict[int, tuple[int, float]]:
    """Per partition, the changes not yet fanned out and the age in seconds of the oldest of them.

    The count is the sum of the partition's per-tenant backlog (what the bounds count); the oldest
    is the partition's first entry, since every acknowledgement trims what lies before the oldest
    pending one, and its id's milliseconds are when it was accepted. One round trip (per Cluster
    node); the caller translates connection errors.
    """
    if not partitions:
        return {}
    batch = Batch(client)
    for partition in partitions:
        batch.pipe.hvals(keys.backlog(partition))
        batch.pipe.xrange(keys.log(partition), "-", "+", count=1)
    replies = await batch.execute()
    now = time.time()
    lag: dict[int, tuple[int, float]] = {}
    for i, partition in enumerate(partitions):
        counts, first = replies[2 * i], replies[2 * i + 1]
        entries = sum(int(count) for count in counts)
        accepted = accepted_at(as_text(first[0][0])) if first and entries else None
        lag[partition] = (entries, max(now - accepted, 0.0) if accepted is not None else 0.0)
    return lag


async def partition_overview(client: Client, keys: Keys,
                             partitions: Sequence[int]) -> dict[int, tuple[str | None, int, float]]:
    """Per partition, the consumer holding its lease (None: nobody) and ``partition_lag``'s figures.

    Two round trips (per Cluster node) whatever the number of partitions; the caller translates
    connection errors.
    """
    if not partitions:
        return {}
    batch = Batch(client)
    for partition in partitions:
        batch.pipe.get(keys.lease(partition))
    holders = await batch.execute()
    lag = await partition_lag(client, keys, partitions)
    return {partition: (as_text(holder) if holder is not None else None, *lag[partition])
            for partition, holder in zip(partitions, holders, strict=True)}
