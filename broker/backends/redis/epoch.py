"""The store's data generation, ``P:epoch``, which the session, inbox and broadcast stores share.

``P:epoch`` is created with a random value when missing. A Redis that lost its data has no
such key; the first worker to notice (start, ping, a new session, a pub/sub reconnect, a
read of a vanished session) creates a new one, and every session carries the epoch it was
created under, so old cursors are gaps.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable

from broker.backends.redis.batch import Batch
from broker.backends.redis.codec import as_text
from broker.backends.redis.keys import Keys
from broker.backends.redis.scripts import Scripts
from broker.metrics import NO_METRICS, Metrics

__all__ = ["Epoch"]

logger = logging.getLogger(__name__)


class Epoch:
    """The epoch this process last saw, and what it does when the epoch changes (the data was lost)."""

    def __init__(self, keys: Keys, scripts: Scripts, *, backlog: Callable[[], int],
                 metrics: Metrics = NO_METRICS) -> None:
        self._keys = keys
        self._losses = metrics.counter("mcp_broker_backend_data_losses_total")
        self._scripts = scripts
        #: Changes not yet fanned out when this process last acknowledged (for the data-loss log line).
        self._backlog = backlog
        self._on_loss: list[Callable[[], None]] = []
        #: The epoch as this process last read it ('' before ``start``).
        self.value = ""
        #: Times this process found the store's data lost (a new epoch); see ``observe``.
        self.data_losses = 0

    def on_loss(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` whenever this process finds the store's data lost."""
        self._on_loss.append(callback)

    def read_into(self, batch: Batch) -> None:
        """Add to ``batch`` the read of the epoch, creating it when missing; pass its reply to ``observe``."""
        batch.call(self._scripts.get_or_set, [self._keys.epoch], [secrets.token_hex(4)])

    async def refresh(self) -> str:
        """Read the epoch, creating a new one when Redis lost it."""
        epoch = as_text(await self._scripts.get_or_set(keys=[self._keys.epoch], args=[secrets.token_hex(4)]))
        self.observe(epoch)
        return epoch

    def observe(self, epoch: str) -> bool:
        """Take ``epoch`` as just read from Redis; True when it is not the one seen before.

        A change after the first read means the store lost its data: counted, logged, and
        told to every ``on_loss`` callback (the broadcast filter starts afresh).
        """
        changed = epoch != self.value
        if changed and self.value:
            self._data_lost(epoch)
        self.value = epoch
        return changed

    def _data_lost(self, epoch: str) -> None:
        """Count and log a store that lost its data: changes not yet fanned out went with it."""
        self.data_losses += 1
        self._losses.inc()
        for callback in self._on_loss:
            callback()
        logger.warning("redis epoch changed from %s to %s: its data was lost, with every change not yet fanned "
                       "out (%d when this worker last acknowledged; data losses seen by this worker: %d)",
                       self.value, epoch, self._backlog(), self.data_losses)
