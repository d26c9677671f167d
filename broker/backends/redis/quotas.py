"""Per-tenant quota leases and publish buckets on Redis (``base.Quotas``).

Every key is in the tenant's slot (``P:{t:<tenant>}:q:...``, ``keys``), so each script call
touches one Cluster slot. Places are a zset of holder -> expiry and buckets a hash, both timed
by Redis's own clock (``TIME`` in the scripts), so workers whose clocks disagree still share
one count and one refill rate. Lapsed places are dropped by the next acquire of the tenant, and
every key expires by itself once nobody renews it.
"""

from __future__ import annotations

from collections.abc import Sequence

from broker.backends.redis.batch import Batch
from broker.backends.redis.connection import Client, unavailable
from broker.backends.redis.keys import Keys
from broker.backends.redis.scripts import Scripts

__all__ = ["RedisQuotas"]


class RedisQuotas:
    """``quota_acquire.lua``, ``quota_refresh.lua`` and ``quota_take.lua`` on the tenant's keys."""

    def __init__(self, client: Client, keys: Keys, scripts: Scripts) -> None:
        self.client = client
        self.keys = keys
        self.scripts = scripts

    async def acquire(self, tenant: str, kind: str, holder: str, limit: int, ttl_ms: int) -> bool:
        with unavailable("quotas.acquire"):
            return bool(await self.scripts.quota_acquire(keys=[self.keys.quota(tenant, kind)],
                                                         args=[holder, limit, ttl_ms]))

    async def refresh(self, held: Sequence[tuple[str, str, str]], ttl_ms: int) -> None:
        by_key: dict[str, list[str]] = {}
        for tenant, kind, holder in held:
            by_key.setdefault(self.keys.quota(tenant, kind), []).append(holder)
        with unavailable("quotas.refresh"):
            batch = Batch(self.client)
            for key, holders in by_key.items():
                batch.call(self.scripts.quota_refresh, [key], [ttl_ms, *holders])
            await batch.execute()

    async def release(self, tenant: str, kind: str, holder: str) -> None:
        with unavailable("quotas.release"):
            await self.client.zrem(self.keys.quota(tenant, kind), holder)

    async def take(self, tenant: str, count: int, rate: float, burst: int, kind: str = "rate") -> float:
        with unavailable("quotas.take"):
            wait_us = await self.scripts.quota_take(keys=[self.keys.quota(tenant, kind)], args=[count, rate, burst])
        return int(wait_us) / 1_000_000
