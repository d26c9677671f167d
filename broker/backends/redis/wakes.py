"""One pub/sub connection per worker process, multiplexing every channel the process watches.

Session streams subscribe to their session's wake channel while they run and unsubscribe when
they end; the broadcast channel is subscribed while the process has broadcast handlers. A
subscription counts as active only once Redis confirms it, so ``subscribe`` returning means
"every message published from now on reaches this process" (the replay -> live handoff).

The reader task reconnects with backoff after any failure, re-subscribes every channel and
then calls ``on_reconnect`` once Redis has confirmed every one of them: messages published
during the outage are lost on pub/sub, so the backend wakes every stream to re-read its inbox
and tells the broadcast's handlers (listens get the gap rule). Nothing published after that
call is missed.

A connection that dies without an error (a partition that drops packets) is noticed only when
traffic flows again: messages Redis sent meanwhile arrive late but in order, and a connection
Redis closed meanwhile fails at the next read or health-check PING, which is a reconnect like
any other. The Hub ends every stream after ``outage_grace`` of such silence anyway.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from redis import exceptions as rexc
from redis.asyncio.cluster import RedisCluster

from broker.backends.redis.connection import Client, unavailable
from broker.errors import BackendUnavailable, raise_if_cancelled
from broker.metrics import NO_METRICS, Metrics

__all__ = ["WakeBus"]

logger = logging.getLogger(__name__)

Dispatch = Callable[[bytes], None]


class WakeBus:
    """The pub/sub connection of this process; usable once ``start`` said whether pub/sub is sharded."""

    def __init__(self, client: Client, *, cluster: bool, timeout: float,
                 on_reconnect: Callable[[], Awaitable[None]], metrics: Metrics = NO_METRICS) -> None:
        self._client = client
        #: Whether channels are sharded (SSUBSCRIBE, SPUBLISH: Redis >= 7).
        self.sharded = True
        self._started = False
        self._cluster = cluster
        self._timeout = timeout
        self._on_reconnect = on_reconnect
        #: A ``PubSub``, or on Cluster a ``ClusterPubSub``, whose per-node API differs.
        self._pubsub: Any = None
        self._channels: dict[str, Dispatch] = {}
        self._confirm: dict[str, deque[asyncio.Future[None]]] = {}
        self._task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        self._nodes_changed = asyncio.Event()
        self._resubscriber: asyncio.Task[None] | None = None
        self._closed = False
        self.reconnects = 0
        self._reconnects = metrics.counter("mcp_broker_pubsub_reconnects_total")

    def start(self, *, sharded: bool) -> None:
        """Channels are subscribed from now on, sharded or not as the server allows."""
        self.sharded = sharded
        self._started = True

    @property
    def publish_command(self) -> str:
        """How scripts and the backend publish to a channel this bus subscribes."""
        return "SPUBLISH" if self.sharded else "PUBLISH"

    # -- subscriptions ---------------------------------------------------------------------
    async def subscribe(self, channel: str, dispatch: Dispatch) -> None:
        """Deliver every message of ``channel`` to ``dispatch`` from the moment this returns.

        Raises:
            BackendUnavailable: Redis did not confirm the subscription in time.
        """
        await self._ensure_reader()
        self._channels[channel] = dispatch
        try:
            await self._send_subscribe(channel)
        except BaseException:
            self._channels.pop(channel, None)
            raise

    async def unsubscribe(self, channel: str) -> None:
        if self._channels.pop(channel, None) is None or self._pubsub is None:
            return
        try:
            with unavailable("unsubscribe"):
                if self.sharded:
                    await self._pubsub.sunsubscribe(channel)
                else:
                    await self._pubsub.unsubscribe(channel)
        except BackendUnavailable:
            pass  # the reader reconnects and re-subscribes only what is still wanted

    async def _send_subscribe(self, channel: str) -> None:
        pubsub = self._pubsub
        if pubsub is None:
            raise BackendUnavailable("redis pub/sub is not connected")
        # One waiter per (S)SUBSCRIBE sent; Redis confirms a channel's subscriptions in order, so
        # each confirmation resolves the oldest waiter of its channel (even one that gave up).
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._confirm.setdefault(channel, deque()).append(waiter)
        try:
            with unavailable("subscribe"):
                if self.sharded:
                    await pubsub.ssubscribe(channel)
                    self._nodes_changed.set()  # Cluster: maybe a node that needs a reader
                else:
                    await pubsub.subscribe(channel)
        except BaseException:
            # Not sent, as far as this task knows: no confirmation is owed to this waiter, and a
            # later one of the channel must go to the next subscribe's (a stale waiter would
            # take it, and that subscribe would time out).
            pending = self._confirm.get(channel)
            if pending is not None and waiter in pending:
                pending.remove(waiter)
                if not pending:
                    del self._confirm[channel]
            waiter.cancel()
            raise
        try:
            await asyncio.wait_for(waiter, self._timeout)
        except TimeoutError as exc:
            raise BackendUnavailable(f"redis did not confirm the subscription to {channel}") from exc

    # -- the reader ------------------------------------------------------------------------
    async def _ensure_reader(self) -> None:
        if not self._started:
            raise RuntimeError("RedisBackend.start() was not called")
        if self._closed:
            raise BackendUnavailable("the backend is closed")
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="redis-wakes")
        if not self._ready.is_set():
            try:
                await asyncio.wait_for(self._ready.wait(), self._timeout)
            except TimeoutError as exc:
                raise BackendUnavailable("redis pub/sub is not connected") from exc

    async def _connect(self) -> None:
        client = self._client
        if isinstance(client, RedisCluster):
            # The slot map must be known before SSUBSCRIBE can route; ClusterPubSub then
            # connects to each node on its first subscription there.
            with unavailable("pub/sub connect"):
                await client.initialize()
            self._pubsub = client.pubsub()
            return
        pubsub = client.pubsub()
        self._pubsub = pubsub
        with unavailable("pub/sub connect"):
            await pubsub.connect()  # type: ignore[no-untyped-call]

    async def _run(self) -> None:
        backoff = 0.05
        first = True
        while not self._closed:
            try:
                await self._connect()
                self._ready.set()
                if not first:
                    # Confirmations arrive through _read below, so wait for them in another task.
                    self._resubscriber = asyncio.create_task(self._resubscribe(), name="redis-resubscribe")
                first = False
                backoff = 0.05
                await self._read()
            except asyncio.CancelledError:
                raise
            except (BackendUnavailable, rexc.RedisError, OSError) as exc:
                raise_if_cancelled()
                self._ready.clear()
                self._fail_waiters(exc)
                await self._drop()
                if self._closed:
                    return
                logger.warning("redis pub/sub lost (%s); reconnecting in %.2fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)

    async def _resubscribe(self) -> None:
        wanted = list(self._channels)
        results = await asyncio.gather(*(self._send_subscribe(ch) for ch in wanted), return_exceptions=True)
        if any(isinstance(result, BaseException) for result in results):
            # A channel that is not subscribed would leave its stream deaf: start over. Closing
            # the connection makes the reader fail, reconnect and come back here.
            await self._drop()
            return
        self.reconnects += 1
        self._reconnects.inc()
        logger.info("redis pub/sub reconnected; %d channels re-subscribed", len(wanted))
        try:
            await self._on_reconnect()
        except BackendUnavailable:
            logger.warning("redis unavailable right after the pub/sub reconnected")

    async def _read(self) -> None:
        pubsub = self._pubsub
        if self._cluster:
            await self._read_cluster(pubsub)
            return
        while not self._closed:
            _still_connected(pubsub)
            with unavailable("pub/sub read"):
                message = await pubsub.get_message(timeout=1.0)
            if message is not None:
                self._handle(message)

    async def _read_cluster(self, pubsub: Any) -> None:
        """One reader per node connection that holds subscriptions.

        ``ClusterPubSub.get_sharded_message`` without a node polls the nodes one after another,
        each for the whole timeout (a wake-up on the second node waits for the first one's
        timeout), and returns at once while nothing is subscribed (the loop would never yield).
        A node's connection is replaced when its last channel is unsubscribed and a new one
        subscribed, so a reader belongs to one connection object, not to a node name.
        """
        readers: dict[str, tuple[Any, asyncio.Task[None]]] = {}
        try:
            while not self._closed:
                mapping = pubsub.node_pubsub_mapping
                for name, node_pubsub in list(mapping.items()):
                    current = readers.get(name)
                    if current is None or current[0] is not node_pubsub:
                        if current is not None:
                            current[1].cancel()
                        node = pubsub.cluster.get_node(node_name=name)
                        task = asyncio.create_task(self._read_node(pubsub, node, node_pubsub),
                                                   name=f"redis-wakes-{name}")
                        readers[name] = (node_pubsub, task)
                self._nodes_changed.clear()
                changed = asyncio.ensure_future(self._nodes_changed.wait())
                tasks = [task for _, task in readers.values()]
                done, _ = await asyncio.wait([*tasks, changed], timeout=1.0, return_when=asyncio.FIRST_COMPLETED)
                changed.cancel()
                for name, (_, task) in list(readers.items()):
                    if task in done:
                        del readers[name]
                        if not task.cancelled():
                            task.result()  # a failed node connection: reconnect everything
        finally:
            for _, task in readers.values():
                task.cancel()
            for _, task in readers.values():
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task

    async def _read_node(self, pubsub: Any, node: Any, node_pubsub: Any) -> None:
        # get_sharded_message(target_node) reads the node's *current* connection: stop as soon as
        # it is not this one, so two readers never wait on one connection.
        while not self._closed and pubsub.node_pubsub_mapping.get(node.name) is node_pubsub:
            _still_connected(node_pubsub)
            with unavailable("pub/sub read"):
                message = await pubsub.get_sharded_message(timeout=1.0, target_node=node)
            if message is not None:
                self._handle(message)

    def _handle(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        channel = message["channel"]
        name = channel.decode() if isinstance(channel, bytes) else str(channel)
        if kind in ("message", "smessage"):
            dispatch = self._channels.get(name)
            if dispatch is not None:
                try:
                    dispatch(message["data"])
                except Exception:  # a handler's bug must not stop every other stream's wake-ups
                    logger.exception("wake-up handler failed for %s", name)
        elif kind in ("subscribe", "ssubscribe"):
            pending = self._confirm.get(name)
            if pending:
                waiter = pending.popleft()
                if not waiter.done():
                    waiter.set_result(None)
                if not pending:
                    del self._confirm[name]

    def _fail_waiters(self, exc: BaseException) -> None:
        for pending in self._confirm.values():
            for waiter in pending:
                if not waiter.done():
                    waiter.set_exception(BackendUnavailable(f"redis pub/sub lost: {exc}"))
        self._confirm.clear()

    async def _drop(self) -> None:
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            with contextlib.suppress(Exception):
                await pubsub.aclose()

    async def close(self) -> None:
        self._closed = True
        self._ready.clear()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
            self._task = None
        if self._resubscriber is not None:
            self._resubscriber.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._resubscriber
        self._fail_waiters(RuntimeError("closed"))
        await self._drop()


def _still_connected(pubsub: Any) -> None:
    """Raise ``BackendUnavailable`` when the pub/sub connection was dropped between two reads.

    redis-py reconnects a dropped pub/sub connection by itself on the next read, and resubscribes
    its channels, without a word: the reader would never run ``on_reconnect``, and streams would
    not re-read what was published in between (seen after a Sentinel failover, whose check drops
    the connection to the old master). A connection dropped on purpose (``_drop``) has none.
    Failing here sends the reader through its own reconnect instead.
    """
    connection = pubsub.connection
    if connection is None or not connection.is_connected:
        raise BackendUnavailable("redis pub/sub connection dropped")

