"""The listen broadcast in memory: ``base.Broadcast``, within the one process there is.

A broadcast in one process cannot be lost, so ``on_lost`` is never called. Each method is one
step on the event loop (nothing awaits).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Final

from broker.backends.types import BroadcastFilter, BroadcastHandler, BroadcastLostHandler, Handlers
from broker.changes import Change

__all__ = ["MemoryBroadcast"]

#: The handlers' one key: every handler hears every change.
_ALL: Final = "all"


class MemoryBroadcast:
    """Processed changes to this process's handlers, each change once."""

    def __init__(self) -> None:
        self._handlers: Handlers[str, Change] = Handlers("broadcast")
        self._filter = BroadcastFilter()

    async def publish(self, changes: Sequence[tuple[str, Change]]) -> None:
        self._handlers.call(_ALL, *[change for change_id, change in changes if self._filter.fresh(change_id)])

    async def subscribe(self, handler: BroadcastHandler,
                        on_lost: BroadcastLostHandler | None = None) -> Callable[[], Awaitable[None]]:
        # ``on_lost`` is never called: a broadcast in one process cannot be lost.
        handlers = self._handlers
        handlers.add(_ALL, handler)

        async def remove() -> None:
            handlers.remove(_ALL, handler)

        return remove
