"""The listen broadcast on Redis (``base.Broadcast``): processed changes to every worker with listens, on ``P:bcast``.

A worker subscribes the one channel while it has handlers (while it has listens open:
``delivery.broadcast``), on its pub/sub connection (``wakes.WakeBus``). Pub/sub keeps nothing for a
connection that was down, so after a reconnect the handlers' ``on_lost`` callbacks are called
(``lost``), once the channel is subscribed again. Each change carries its id, and
``types.BroadcastFilter`` hands a change to the handlers at most once; the filter starts afresh
when the store's data was lost (``epoch``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence

from redis.asyncio.cluster import RedisCluster

from broker.backends.redis.batch import Batch
from broker.backends.redis.codec import decode_changes, encode_changes
from broker.backends.redis.connection import Client, unavailable
from broker.backends.redis.epoch import Epoch
from broker.backends.redis.keys import Keys
from broker.backends.redis.wakes import WakeBus
from broker.backends.types import (
    BroadcastBatchHandler,
    BroadcastFilter,
    BroadcastHandler,
    BroadcastLostHandler,
    Handlers,
)
from broker.changes import Change
from broker.config import Settings

__all__ = ["RedisBroadcast"]


class RedisBroadcast:
    """Changes fan-out processed, to the handlers of every process."""

    def __init__(self, settings: Settings, client: Client, keys: Keys, bus: WakeBus, epoch: Epoch) -> None:
        self.settings = settings
        self.client = client
        self._channel = keys.broadcast
        self._bus = bus
        #: The handlers, all under the channel's name (the one key).
        self._handlers: Handlers[str, Change] = Handlers("broadcast")
        #: Their ``on_lost`` callbacks, under the same key (each called with None).
        self._lost: Handlers[str, None] = Handlers("broadcast-lost")
        #: Their ``on_batch`` callbacks, under the same key.
        self._batches: Handlers[str, str] = Handlers("broadcast-batch")
        self._filter = BroadcastFilter()
        self._subscribing: asyncio.Future[None] | None = None
        epoch.on_loss(self._forget_positions)

    def _forget_positions(self) -> None:
        """A new log's ids owe nothing to the old one's (a server whose clock is behind would
        issue lower ones, which the filter would drop): the filter starts afresh."""
        self._filter = BroadcastFilter()

    async def publish(self, changes: Sequence[tuple[str, Change]]) -> None:
        if not changes:
            return
        with unavailable("broadcast.publish"):
            if isinstance(self.client, RedisCluster):
                # One after another: a Cluster batch runs its calls concurrently, and a later
                # message arriving first would make the filter drop the earlier one's changes.
                for message in encode_changes(changes, self.settings.wake_message_max_bytes):
                    await self.client.execute_command(self._bus.publish_command, self._channel, message)
                return
            batch = Batch(self.client)
            self.add_to(batch, changes)
            await batch.execute()

    def add_to(self, batch: Batch, changes: Sequence[tuple[str, Change]]) -> None:
        """Publish ``changes`` in ``batch``: one message per ``wake_message_max_bytes`` of changes,
        since every listening worker's pub/sub connection receives each one, and a batch of large ``meta``
        in one message could pass Redis's output buffer limit for subscribers and drop them all."""
        if changes:
            for message in encode_changes(changes, self.settings.wake_message_max_bytes):
                batch.pipe.execute_command(self._bus.publish_command, self._channel, message)

    def _on_message(self, payload: bytes) -> None:
        fresh = [(change_id, change) for change_id, change in decode_changes(payload) if self._filter.fresh(change_id)]
        if fresh:
            self._batches.call(self._channel, fresh[0][0])
            self._handlers.call(self._channel, *[change for _, change in fresh])

    def lost(self) -> None:
        """Broadcasts may have been lost (the pub/sub connection was down); the channel is subscribed again."""
        self._lost.call(self._channel, None)

    async def subscribe(self, handler: BroadcastHandler, on_lost: BroadcastLostHandler | None = None,
                        on_batch: BroadcastBatchHandler | None = None) -> Callable[[], Awaitable[None]]:
        """``on_lost`` is called from ``lost``, once the broadcast channel is subscribed again."""
        self._handlers.add(self._channel, handler)
        if on_batch is not None:
            self._batches.add(self._channel, on_batch)
        lost: Callable[[None], None] | None = None
        if on_lost is not None:
            lost = lambda _: on_lost()  # noqa: E731 (a Handlers callback takes a value)
            self._lost.add(self._channel, lost)
        if self._subscribing is None:
            self._subscribing = asyncio.ensure_future(self._bus.subscribe(self._channel, self._on_message))
        try:
            await asyncio.shield(self._subscribing)
        except BaseException:
            await self._remove(handler, lost, on_batch)
            raise

        async def remove() -> None:
            await self._remove(handler, lost, on_batch)

        return remove

    async def _remove(self, handler: BroadcastHandler, lost: Callable[[None], None] | None,
                      on_batch: BroadcastBatchHandler | None = None) -> None:
        if on_batch is not None:
            self._batches.remove(self._channel, on_batch)
        if lost is not None:
            self._lost.remove(self._channel, lost)
        self._handlers.remove(self._channel, handler)
        if not self._handlers and self._subscribing is not None:
            subscribing, self._subscribing = self._subscribing, None
            if subscribing.done() and not subscribing.cancelled() and subscribing.exception() is None:
                await self._bus.unsubscribe(self._channel)
