"""``base.Demand`` in one process: a dict of deadlines per key."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

__all__ = ["MemoryDemand"]


class MemoryDemand:
    def __init__(self) -> None:
        self._wanted: dict[str, dict[str, float]] = {}

    async def want(self, key: str, members: Sequence[str], until: float, most: int) -> list[str]:
        wanted = self._wanted.setdefault(key, {})
        refused = []
        for member in members:
            if member not in wanted and len(wanted) >= most:
                refused.append(member)
            elif wanted.get(member, -1.0) < until:
                wanted[member] = until
        return refused

    async def wanted(self, key: str, limit: int) -> dict[str, float]:
        wanted = self._wanted.get(key, {})
        if len(wanted) <= limit:
            return dict(wanted)
        return dict(heapq.nlargest(limit, wanted.items(), key=lambda item: item[1]))

    async def drop(self, key: str, members: Sequence[str], before: float) -> None:
        wanted = self._wanted.get(key, {})
        for member in members:
            if wanted.get(member, before) < before:
                del wanted[member]
