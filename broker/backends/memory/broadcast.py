"""The listen broadcast in memory: ``base.Broadcast``, within the one process there is.

A broadcast in one process cannot be lost, so ``on_lost`` is never called. Each method is one
step on the event loop (nothing awaits).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Final

from broker.backends.types import (
    BroadcastBatchHandler,
    BroadcastFilter,
    BroadcastHandler,
    BroadcastLostHandler,
    Handlers,
)
from broker.changes import Change

__all__ = ["MemoryBroadcast"]

#: The handlers' one key: every handler hears every change.
_ALL: Final = "all"


class MemoryBroadcast:
    """Processed changes to this process's handlers, each change once."""

    def __init__(self) -> None:
        self._handlers: Handlers[str, Change] = Handlers("broadcast")
        self._batches: Handlers[str, str] = Handlers("broadcast-batch")
        self._filter = BroadcastFilter()

    async def publish(self, changes: Sequence[tuple[str, Change]]) -> None:
        fresh = [(change_id, change) for change_id, change in changes if self._filter.fresh(change_id)]
        if fresh:
            self._batches.call(_ALL, fresh[0][0])
            self._handlers.call(_ALL, *[change for _, change in fresh])

    async def subscribe(self, handler: BroadcastHandler, on_lost: BroadcastLostHandler | None = None,
                        on_batch: BroadcastBatchHandler | None = None) -> Callable[[], Awaitable[None]]:
        # ``on_lost`` is never called: a broadcast in one process cannot be lost.
        handlers, batches = self._handlers, self._batches
        handlers.add(_ALL, handler)
        if on_batch is not None:
            batches.add(_ALL, on_batch)

        async def remove() -> None:
            handlers.remove(_ALL, handler)
            if on_batch is not None:
                batches.remove(_ALL, on_batch)

        return remove
