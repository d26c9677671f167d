"""Per-tenant quota leases and publish buckets in memory: ``base.Quotas``, for one process.

Each method is one step on the event loop (nothing awaits), so a check and its add cannot be
split by another caller. Lapsed places are dropped whenever their tenant's count is looked at.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

__all__ = ["MemoryQuotas"]


class MemoryQuotas:
    """(tenant, kind) -> holder -> monotonic deadline; (tenant, kind) -> (tokens, monotonic time of the last take)."""

    def __init__(self) -> None:
        self._places: dict[tuple[str, str], dict[str, float]] = {}
        self._buckets: dict[tuple[str, str], tuple[float, float]] = {}

    async def acquire(self, tenant: str, kind: str, holder: str, limit: int, ttl_ms: int) -> bool:
        now = time.monotonic()
        places = self._places.setdefault((tenant, kind), {})
        if holder not in places:
            for other in [h for h, deadline in places.items() if deadline <= now]:
                del places[other]
            if len(places) >= limit:
                return False
        places[holder] = now + ttl_ms / 1000
        return True

    async def refresh(self, held: Sequence[tuple[str, str, str]], ttl_ms: int) -> None:
        deadline = time.monotonic() + ttl_ms / 1000
        for tenant, kind, holder in held:
            self._places.setdefault((tenant, kind), {})[holder] = deadline

    async def release(self, tenant: str, kind: str, holder: str) -> None:
        places = self._places.get((tenant, kind))
        if places is not None:
            places.pop(holder, None)
            if not places:
                del self._places[(tenant, kind)]

    async def take(self, tenant: str, count: int, rate: float, burst: int, kind: str = "rate") -> float:
        now = time.monotonic()
        tokens, then = self._buckets.get((tenant, kind), (float(burst), now))
        tokens = min(float(burst), tokens + (now - then) * rate)
        if tokens < count:
            self._buckets[(tenant, kind)] = (tokens, now)
            return (count - tokens) / rate
        self._buckets[(tenant, kind)] = (tokens - count, now)
        return 0.0
