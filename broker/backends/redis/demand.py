"""``base.Demand`` on Redis: one sorted set per key (``P:{u:<key>}:want``), member to deadline.

``ZADD GT`` keeps the latest deadline of all the workers that want a member, so no script is
needed: each call touches one key, legal on Cluster.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from broker.backends.redis.codec import as_text
from broker.backends.redis.connection import Client, unavailable

__all__ = ["RedisDemand"]


class RedisDemand:
    def __init__(self, redis: Client, prefix: str) -> None:
        self.redis = redis
        self.prefix = prefix

    def key(self, key: str) -> str:
        return f"{self.prefix}:{{u:{key}}}:want"

    async def want(self, key: str, members: Sequence[str], until: float) -> None:
        if not members:
            return
        with unavailable("demand.want"):
            await self.redis.zadd(self.key(key), dict.fromkeys(members, until), gt=True)

    async def wanted(self, key: str, limit: int) -> dict[str, float]:
        with unavailable("demand.wanted"):
            found = await self.redis.zrevrange(self.key(key), 0, limit - 1, withscores=True)
        return {as_text(member): float(score) for member, score in cast("list[tuple[bytes, float]]", found)}

    async def drop(self, key: str, members: Sequence[str], before: float) -> None:
        if not members:
            return
        name = self.key(key)
        with unavailable("demand.drop"):
            # Only those no wanter pushed past ``before`` since they were read: one script-free
            # round trip reads the deadlines, the removal is of those still due.
            scores = await self.redis.zmscore(name, list(members))
            due = [member for member, score in zip(members, scores, strict=True)
                   if score is not None and score < before]
            if due:
                await self.redis.zrem(name, *due)
