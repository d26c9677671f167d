"""The in-memory backend: one process, every guarantee of ``base.Backend``.

It is the embedded default and the reference implementation the contract suite is written
against. Everything runs on the event loop, so each method body is atomic by construction:
no method awaits between reading and writing shared state (each store's module says how).

``MemoryBackend`` only assembles the stores, one module each. The session, subscription and
inbox stores share one ``SessionState`` (deleting a session drops its subscriptions, index
entries and inbox; a subscription change wakes the session's watcher); the record store
writes its changes through the change log's ``admit`` and ``append``, in the same step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from broker.backends.base import (
    Backend,
    Broadcast,
    ChangeLog,
    Credentials,
    Demand,
    Frame,
    Inboxes,
    Leases,
    Quotas,
    RecordStore,
    SessionStore,
    SubscriptionIndex,
    Webhooks,
    deliver_in_turn,
)
from broker.backends.memory.broadcast import MemoryBroadcast
from broker.backends.memory.changelog import MemoryChangeLog
from broker.backends.memory.credentials import MemoryCredentials
from broker.backends.memory.demand import MemoryDemand
from broker.backends.memory.inboxes import MemoryInboxes
from broker.backends.memory.leases import MemoryLeases
from broker.backends.memory.quotas import MemoryQuotas
from broker.backends.memory.records import MemoryRecords
from broker.backends.memory.sessions import MemorySessions
from broker.backends.memory.state import SessionState
from broker.backends.memory.subscriptions import MemorySubscriptions
from broker.backends.memory.webhooks import MemoryWebhooks
from broker.changes import Change
from broker.config import Settings
from broker.metrics import NO_METRICS, Metrics

__all__ = ["MemoryBackend"]


class MemoryBackend:
    """Shared state for a single process: the stores of ``base.Backend``."""

    def __init__(self, settings: Settings, metrics: Metrics = NO_METRICS) -> None:
        """``metrics`` gets the change-log and inbox trims."""
        self.settings = settings
        state = SessionState(settings)
        changelog = MemoryChangeLog(settings, metrics)
        # Typed as the protocols: ``Backend``'s attributes are settable, so a conforming type
        # must be exactly theirs (a test may also put a store of its own in one's place).
        self.sessions: SessionStore = MemorySessions(state)
        self.subscriptions: SubscriptionIndex = MemorySubscriptions(state)
        self.inboxes: Inboxes = MemoryInboxes(state, metrics)
        self.changelog: ChangeLog = changelog
        self.broadcast: Broadcast = MemoryBroadcast()
        self.records: RecordStore = MemoryRecords(settings, changelog)
        self.leases: Leases = MemoryLeases()
        self.demand: Demand = MemoryDemand()
        self.credentials: Credentials = MemoryCredentials()
        self.quotas: Quotas = MemoryQuotas()
        self.webhooks: Webhooks = MemoryWebhooks()
        self._changelog = changelog

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        self._changelog.close()

    async def ping(self) -> None:
        return None

    async def deliver(self, frames: Sequence[tuple[str, Frame]], changes: Sequence[tuple[str, Change]],
                      ids: Sequence[str], read_under: str = "") -> list[str]:
        """The three steps one after the other: in one process they cost no round trip.
        ``read_under`` is always the one epoch: this store never loses its data."""
        return await deliver_in_turn(self, frames, changes, ids)


if TYPE_CHECKING:
    def _conforms(settings: Settings) -> Backend:  # mypy checks that MemoryBackend is a Backend
        return MemoryBackend(settings)
