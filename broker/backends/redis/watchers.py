"""The sessions this process watches: wake-up handlers, their channels, and this process's node.

Takeovers and subscription changes (and, on Cluster, frames) come on a session's own channel;
on a single node, frames come on this process's node channel, one message per fan-out batch,
for every session whose record names this node (this process's own fan-out hands them over in
memory instead: ``RedisInboxes.appended``). Everything about the node lives here: which
node a claim or a restore names (``claimant``), and the order that keeps the handoff (the
node's channel is subscribed before a session names the node).
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable

from broker.backends.redis.codec import decode_node_wakes, decode_wakes
from broker.backends.redis.connection import unavailable
from broker.backends.redis.keys import Keys
from broker.backends.redis.scripts import Scripts
from broker.backends.redis.wakes import WakeBus
from broker.backends.types import Handlers, Wake, WakeHandler

__all__ = ["Watchers"]


class Watchers:
    """Wake-up handlers per watched session, and the subscriptions that feed them."""

    def __init__(self, keys: Keys, scripts: Scripts, bus: WakeBus, *, cluster: bool) -> None:
        self.keys = keys
        self.scripts = scripts
        self._bus = bus
        self.cluster = cluster
        #: Per watched session, its handlers; fan-out calls them directly with this process's
        #: own frames (``RedisInboxes.appended``), one wake-up per frame.
        self.handlers: Handlers[str, Wake] = Handlers("wake-up")
        self._watching: dict[str, asyncio.Task[None]] = {}
        #: This process on single-node Redis: sessions it watches name it, fan-out wakes it per batch.
        self.node = secrets.token_hex(6)
        #: ``node`` as the append script replies it.
        self.node_raw = self.node.encode()
        self._node_channel: asyncio.Future[None] | None = None
        #: Unsubscriptions of channels whose watch was given up while it was subscribing.
        self._late: set[asyncio.Task[None]] = set()

    def watches(self, session_id: str) -> bool:
        return session_id in self.handlers

    def claimant(self, session_id: str) -> str:
        """The node a claim (or a restore) of the session names: '' unless a stream watches it here.

        A stream that watches the session here claims it: frames are announced to this node
        from then on. On Cluster no session names a node (frames come on its own channel).
        """
        return self.node if not self.cluster and self.watches(session_id) else ""

    def wake_all(self) -> None:
        """Every watched stream re-reads its inbox (wake-ups may have been lost, e.g. during a reconnect)."""
        for session_id in self.handlers.snapshot():
            self.handlers.call(session_id, Wake("frames", 0))

    def _on_wake_message(self, session_id: str) -> Callable[[bytes], None]:
        def dispatch(payload: bytes) -> None:
            self.handlers.call(session_id, *decode_wakes(payload))

        return dispatch

    def _on_node_message(self, payload: bytes) -> None:
        for session_id, wakes in decode_node_wakes(payload):
            self.handlers.call(session_id, *wakes)

    async def _watch_node(self, session_id: str) -> None:
        """Single node: this process's channel is subscribed, then the session names this process.

        In that order, so a frame appended once the session names the node is always announced
        to a subscribed channel (fan-out publishes after its append).
        """
        pending = self._node_channel
        if pending is None or (pending.done() and (pending.cancelled() or pending.exception() is not None)):
            channel = self.keys.node_wake(self.node)
            pending = self._node_channel = asyncio.ensure_future(self._bus.subscribe(channel, self._on_node_message))
        await asyncio.shield(pending)
        with unavailable("watch"):
            await self.scripts.session_update(keys=[self.keys.session(session_id).meta], args=["node", self.node])

    async def watch(self, session_id: str, handler: WakeHandler) -> Callable[[], Awaitable[None]]:
        """Raises ``BackendUnavailable`` when the subscription cannot be confirmed."""
        self.handlers.add(session_id, handler)
        subscribing = self._watching.get(session_id)
        if subscribing is None:
            # Takeovers and subscription changes (and, on Cluster, frames) come on the session's channel.
            channel = self.keys.session(session_id).wake
            subscribing = asyncio.ensure_future(self._bus.subscribe(channel, self._on_wake_message(session_id)))
            self._watching[session_id] = subscribing
        try:
            await asyncio.shield(subscribing)
            if not self.cluster:
                await self._watch_node(session_id)
        except BaseException:
            await self._unwatch(session_id, handler)
            raise

        async def unwatch() -> None:
            await self._unwatch(session_id, handler)

        return unwatch

    async def _unwatch(self, session_id: str, handler: WakeHandler) -> None:
        if not self.handlers.remove(session_id, handler):
            return  # unknown, or the session still has other handlers
        subscribing = self._watching.pop(session_id, None)
        if subscribing is None:
            return
        if not subscribing.done():
            # Given up mid-subscribe (the request was cancelled): the subscription still lands,
            # so it is undone once it has, unless the session is being watched again by then.
            subscribing.add_done_callback(lambda done: self._unsubscribe_late(session_id, done))
        elif not subscribing.cancelled() and subscribing.exception() is None:
            await self._bus.unsubscribe(self.keys.session(session_id).wake)

    def _unsubscribe_late(self, session_id: str, subscribing: asyncio.Future[None]) -> None:
        if session_id in self._watching or subscribing.cancelled() or subscribing.exception() is not None:
            return
        task = asyncio.ensure_future(self._bus.unsubscribe(self.keys.session(session_id).wake))
        self._late.add(task)
        task.add_done_callback(self._late.discard)
