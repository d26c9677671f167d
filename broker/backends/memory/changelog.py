"""The change log in memory: ``base.ChangeLog``.

Changes wait in ``_log`` until a consumer reads them, then in ``_pending`` until they are
acknowledged; each is counted under its tenant (``_backlog``) the whole time. One consumer at
a time reads, the holder of the log's single lease (there is one partition).

Everything runs on the event loop. No method awaits between reading and writing shared state:
``read`` waits only before it looks at the log (and looks again after waiting), and
``admit`` then ``append`` (which the record store takes too, to write a record and its change
in one step) never await at all.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Sequence

from broker.changes import Change
from broker.config import Settings
from broker.errors import LogFull, QuotaExceeded
from broker.metrics import NO_METRICS, Metrics, accepted_at

__all__ = ["MemoryChangeLog"]


class MemoryChangeLog:
    """Published changes, waiting for fan-out."""

    def __init__(self, settings: Settings, metrics: Metrics = NO_METRICS) -> None:
        self._settings = settings
        #: The newest id's parts: ids are ``<ms>-<seq>`` like a Redis stream's, the wall clock's
        #: milliseconds (never going back) and a sequence within one millisecond, so an id tells
        #: when its change was accepted (``metrics.accepted_at``), and ids still grow in log order.
        self._ms = 0
        self._seq = 0
        self._trimmed = metrics.counter("mcp_broker_changelog_trimmed_total")
        self._log: deque[tuple[str, Change]] = deque()
        #: Handed out and not yet acknowledged, in the order they were handed out.
        self._pending: dict[str, Change] = {}
        #: Per tenant, changes in the log or pending: not yet fanned out (``changelog_tenant_max``).
        self._backlog: dict[str, int] = {}
        #: The consumer that reads the log now, and until when (see ``_hold``).
        self._holder: tuple[str, float] | None = None
        self._ready = asyncio.Event()

    #: One log: every change goes to partition 0.
    partitions = 1

    def partition(self, tenant: str, uri: str) -> int:
        return 0

    def close(self) -> None:
        """Wake a blocked ``read``: the backend is closing."""
        self._ready.set()

    def admit(self, changes: Sequence[Change]) -> None:
        """Refuse, before anything is appended, what the log cannot keep (as ``changelog_append.lua``).

        Nothing fan-out has not processed is ever dropped: the log holds unread and pending
        changes only, each counted under its tenant until it is acknowledged.
        """
        settings = self._settings
        held = len(self._log) + len(self._pending)
        if held + len(changes) > settings.changelog_maxlen:
            raise LogFull(0, settings.changelog_maxlen)
        asked: dict[str, int] = {}
        for change in changes:
            asked[change.tenant] = asked.get(change.tenant, 0) + 1
        limit = settings.changelog_tenant_max
        for tenant, count in asked.items():
            waiting = self._backlog.get(tenant, 0)
            if waiting + count > limit:
                raise QuotaExceeded(tenant, limit, waiting, count)

    def append(self, change: Change) -> str:
        """Append a change ``admit`` let through, in the same step; its id."""
        now = int(time.time() * 1000)
        if now > self._ms:
            self._ms, self._seq = now, 0
        else:
            self._seq += 1
        change_id = f"{self._ms}-{self._seq}"
        self._log.append((change_id, change))
        self._backlog[change.tenant] = self._backlog.get(change.tenant, 0) + 1
        self._ready.set()
        return change_id

    async def publish(self, change: Change) -> str:
        self.admit((change,))
        return self.append(change)

    async def publish_many(self, changes: Sequence[Change]) -> list[str]:
        self.admit(changes)
        return [self.append(change) for change in changes]

    async def read(self, consumer: str, count: int, block_ms: int) -> list[tuple[str, Change]]:
        # At most a third of the lease per wait: an idle holder comes back to renew it.
        wait_ms = min(block_ms, max(self._settings.fanout_claim_idle_ms // 3, 10))
        if not self._hold(consumer):
            await asyncio.sleep(wait_ms / 1000)
            return []
        # While this consumer holds the log, whatever is pending was handed out and never
        # acknowledged (its batch failed, or a lapsed holder's was cut short): that goes first.
        taken = list(itertools.islice(self._pending.items(), count))
        if taken:
            return taken
        if not self._log and block_ms > 0:
            self._ready.clear()
            try:
                await asyncio.wait_for(self._ready.wait(), wait_ms / 1000)
            except TimeoutError:
                return []
        while self._log and len(taken) < count:
            change_id, change = self._log.popleft()
            self._pending[change_id] = change
            taken.append((change_id, change))
        return taken

    async def ack(self, ids: Sequence[str]) -> None:
        trimmed = 0
        for change_id in ids:
            change = self._pending.pop(change_id, None)
            if change is not None:
                trimmed += 1  # an acknowledged change leaves the log at once
                tenant = change.tenant
                left = self._backlog[tenant] - 1
                if left:
                    self._backlog[tenant] = left
                else:
                    del self._backlog[tenant]
        if trimmed:
            self._trimmed.inc(trimmed)

    async def lag(self, consumer: str) -> dict[int, tuple[int, float]]:
        """For the metrics: per partition ``consumer`` holds (the one, 0, or none), the changes not yet
        fanned out and the age in seconds of the oldest of them."""
        holder = self._holder
        if holder is None or holder[0] != consumer or holder[1] <= time.monotonic():
            return {}
        oldest = next(iter(self._pending), None) or (self._log[0][0] if self._log else None)
        accepted = accepted_at(oldest) if oldest is not None else None
        age = max(time.time() - accepted, 0.0) if accepted is not None else 0.0
        return {0: (len(self._log) + len(self._pending), age)}

    async def overview(self) -> dict[int, tuple[str | None, int, float]]:
        holder = self._holder
        owner = holder[0] if holder is not None and holder[1] > time.monotonic() else None
        lag = await self.lag(owner) if owner is not None else {}
        return {0: (owner, *lag.get(0, (len(self._log) + len(self._pending), 0.0)))}

    async def release(self, consumer: str) -> None:
        if self._holder is not None and self._holder[0] == consumer:
            self._holder = None

    def _hold(self, consumer: str) -> bool:
        """The log's lease, as on Redis: one consumer reads at a time, so changes keep their order."""
        now = time.monotonic()
        holder = self._holder
        if holder is not None and holder[0] != consumer and holder[1] > now:
            return False
        self._holder = (consumer, now + self._settings.fanout_claim_idle_ms / 1000)
        return True
