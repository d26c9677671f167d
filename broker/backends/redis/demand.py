"""``base.Demand`` on Redis: one sorted set per key (``P:{u:<key>}:want``), member to deadline.

Each call touches one key, legal on Cluster. Wanting and dropping are scripts, so that a bound and
a deadline are read and acted on in one step: a drop never removes a member another worker has
just pushed back, and the bound is never passed by two workers adding at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final, cast

from broker.backends.redis.codec import as_text
from broker.backends.redis.connection import Client, unavailable

__all__ = ["RedisDemand"]

#: KEYS[1] the set; ARGV[1] the deadline, ARGV[2] the bound, then the members. Returns those refused.
_WANT: Final = """
local card = redis.call('ZCARD', KEYS[1])
local deadline = tonumber(ARGV[1])
local refused = {}
for i = 3, #ARGV do
  local score = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if score then
    if tonumber(score) < deadline then redis.call('ZADD', KEYS[1], ARGV[1], ARGV[i]) end
  elseif card < tonumber(ARGV[2]) then
    redis.call('ZADD', KEYS[1], ARGV[1], ARGV[i])
    card = card + 1
  else
    refused[#refused + 1] = ARGV[i]
  end
end
return refused
"""
#: KEYS[1] the set; ARGV[1] the time before which a deadline is past, then the members.
_DROP: Final = """
local before = tonumber(ARGV[1])
for i = 2, #ARGV do
  local score = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if score and tonumber(score) < before then redis.call('ZREM', KEYS[1], ARGV[i]) end
end
return 0
"""


class RedisDemand:
    def __init__(self, redis: Client, prefix: str) -> None:
        self.redis = redis
        self.prefix = prefix
        self._want: Any = redis.register_script(_WANT)
        self._drop: Any = redis.register_script(_DROP)

    def key(self, key: str) -> str:
        return f"{self.prefix}:{{u:{key}}}:want"

    async def want(self, key: str, members: Sequence[str], until: float, most: int) -> list[str]:
        if not members:
            return []
        with unavailable("demand.want"):
            refused = await self._want(keys=[self.key(key)], args=[repr(until), most, *members])
        return [as_text(member) for member in refused]

    async def wanted(self, key: str, limit: int) -> dict[str, float]:
        with unavailable("demand.wanted"):
            found = await self.redis.zrevrange(self.key(key), 0, limit - 1, withscores=True)
        return {as_text(member): float(score) for member, score in cast("list[tuple[bytes, float]]", found)}

    async def drop(self, key: str, members: Sequence[str], before: float) -> None:
        if not members:
            return
        with unavailable("demand.drop"):
            await self._drop(keys=[self.key(key)], args=[repr(before), *members])
