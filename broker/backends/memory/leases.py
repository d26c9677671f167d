"""Named leases in memory: ``base.Leases``, a dict of name -> (owner, deadline).

Each method is one step on the event loop (nothing awaits), so two owners asking at once get
the lease one after the other: the first takes it, the second is refused.
"""

from __future__ import annotations

import time

__all__ = ["MemoryLeases"]


class MemoryLeases:
    """One holder per name, for ``ttl_ms`` after its last ``hold``."""

    def __init__(self) -> None:
        #: name -> (owner, monotonic deadline); a lapsed entry stays until someone takes or releases it.
        self._held: dict[str, tuple[str, float]] = {}

    async def hold(self, name: str, owner: str, ttl_ms: int) -> bool:
        now = time.monotonic()
        held = self._held.get(name)
        if held is not None and held[0] != owner and held[1] > now:
            return False
        self._held[name] = (owner, now + ttl_ms / 1000)
        return True

    async def holder(self, name: str) -> str | None:
        held = self._held.get(name)
        return held[0] if held is not None and held[1] > time.monotonic() else None

    async def release(self, name: str, owner: str) -> None:
        held = self._held.get(name)
        if held is not None and held[0] == owner:
            del self._held[name]
