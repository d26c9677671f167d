"""The Redis backend: the stores of ``base.Backend`` on one Redis (single node, Sentinel, Cluster).

Guarantees are those of ``broker.backends.base``; how each store keeps them on Redis is told in
its module:

=================  ==================  ===========================================================
store              module              what
=================  ==================  ===========================================================
``sessions``       ``sessions``        session records, touches, the registry, expiry, restoring
``subscriptions``  ``subscriptions``   a session's set and the URI index, in that order
``inboxes``        ``inboxes``         offsets, the gap test, atomic append and wake-up, the claim
``changelog``      ``changelog``       partitioned streams, their bounds, fenced reads
``broadcast``      ``broadcast``       processed changes to every worker with listens, each at most once
``records``        ``records``         records written with their change in one script
``leases``         ``leases``          named leases; also each fan-out consumer's partition share
``quotas``         ``quotas``          per-tenant places (streams, listens) and publish buckets
``credentials``    ``credentials``     runtime API keys: records by id, found by digest
``webhooks``       ``webhooks``        webhook subscriptions (events extension), dead letters
=================  ==================  ===========================================================

Beside them: ``keys`` (every key and channel), ``epoch`` (the data generation the session,
inbox and broadcast stores share), ``watchers`` and ``wakes`` (this process's wake-up
handlers and its one pub/sub connection), ``connection`` (clients, and the translation of
connection errors that every store applies itself), ``pool`` (a single server's connections),
``batch``, ``codec``, ``scripts``.

``RedisBackend`` only assembles them: the clients, the shared epoch, the lifecycle, and what a
pub/sub reconnect means (every watched stream re-reads its inbox; the broadcast's handlers are
told broadcasts may have been lost). Figures measured on this backend are in ``bench/NOTES.md``.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence
from typing import TYPE_CHECKING

from redis.asyncio import Redis
from redis.exceptions import ResponseError

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
)
from broker.backends.redis.batch import Batch
from broker.backends.redis.broadcast import RedisBroadcast
from broker.backends.redis.changelog import RedisChangeLog
from broker.backends.redis.connection import Client, ClientFactory, open_clients, unavailable
from broker.backends.redis.credentials import RedisCredentials
from broker.backends.redis.demand import RedisDemand
from broker.backends.redis.durable import Durability
from broker.backends.redis.epoch import Epoch
from broker.backends.redis.inboxes import RedisInboxes
from broker.backends.redis.keys import Keys
from broker.backends.redis.leases import RedisLeases
from broker.backends.redis.quotas import RedisQuotas
from broker.backends.redis.records import RedisRecords
from broker.backends.redis.scripts import Scripts
from broker.backends.redis.sessions import RedisSessions
from broker.backends.redis.subscriptions import RedisSubscriptions
from broker.backends.redis.wakes import WakeBus
from broker.backends.redis.watchers import Watchers
from broker.backends.redis.webhooks import RedisWebhooks
from broker.changes import Change
from broker.config import Settings
from broker.metrics import NO_METRICS, Metrics

__all__ = ["RedisBackend"]

logger = logging.getLogger(__name__)


class RedisBackend:
    """Shared state in Redis, for any number of workers. See the module docstring."""

    def __init__(self, settings: Settings, *, client_factory: ClientFactory | None = None,
                 metrics: Metrics = NO_METRICS) -> None:
        """``metrics`` gets the pub/sub reconnects, the data losses this process sees, and the trims."""
        self.settings = settings
        self.keys = Keys(settings.redis_prefix)
        clients = open_clients(settings, client_factory)
        self.redis: Client = clients.commands
        self._pubsub_client: Client = clients.pubsub
        self.cluster = clients.cluster
        self.scripts = scripts = Scripts(self.redis)
        #: This process's pub/sub connection; ``start`` tells it whether channels are sharded.
        self.bus = WakeBus(clients.pubsub, cluster=self.cluster, timeout=settings.redis_socket_timeout,
                           on_reconnect=self._on_reconnect, metrics=metrics)
        self.watchers = Watchers(self.keys, scripts, self.bus, cluster=self.cluster)
        self._changelog = RedisChangeLog(settings, self.redis, self.keys, scripts, cluster=self.cluster,
                                         metrics=metrics)
        self._epoch = Epoch(self.keys, scripts, backlog=lambda: sum(self._changelog.backlog.values()), metrics=metrics)
        self._broadcast = RedisBroadcast(settings, self.redis, self.keys, self.bus, self._epoch)
        # Typed as the protocols: ``Backend``'s attributes are settable, so a conforming type
        # must be exactly theirs. The concrete stores the backend itself drives are kept aside.
        self.sessions: SessionStore = RedisSessions(settings, self.redis, self.keys, scripts, self._epoch,
                                                    self.watchers)
        self.subscriptions: SubscriptionIndex = RedisSubscriptions(settings, self.redis, self.keys, scripts, self.bus)
        self._inboxes = RedisInboxes(settings, self.redis, self.keys, scripts, epoch=self._epoch, bus=self.bus,
                                     watchers=self.watchers, cluster=self.cluster, metrics=metrics)
        self.inboxes: Inboxes = self._inboxes
        self.changelog: ChangeLog = self._changelog
        self.broadcast: Broadcast = self._broadcast
        self.records: RecordStore = RedisRecords(settings, self.redis, self.keys, scripts, self._changelog)
        self.leases: Leases = RedisLeases(self.redis, self.keys, scripts)
        self.demand: Demand = RedisDemand(self.redis, settings.redis_prefix)
        self.credentials: Credentials = RedisCredentials(self.redis, self.keys, Durability.of(settings))
        self.quotas: Quotas = RedisQuotas(self.redis, self.keys, scripts)
        self.webhooks: Webhooks = RedisWebhooks(self.redis, settings.redis_prefix)

    async def start(self) -> None:
        """Connect, agree on the epoch, create the fan-out group, detect sharded pub/sub.

        Raises:
            BackendUnavailable: Redis cannot be reached.
        """
        with unavailable("start"):
            await self.redis.ping()
            await self._epoch.refresh()
            await self._changelog.start()
            sharded = await self._has_sharded_pubsub()
        self.bus.start(sharded=sharded)

    async def _has_sharded_pubsub(self) -> bool:
        """Whether scripts may SPUBLISH (Redis >= 7); probed on a throwaway session's channel."""
        probe = self.keys.session(f"probe-{secrets.token_hex(4)}")
        try:
            await self.scripts.stream_claim(keys=[probe.meta, probe.wake], args=["SPUBLISH", ""])
        except ResponseError:
            logger.info("redis has no sharded pub/sub; wake-ups use PUBLISH")
            return False
        return True

    async def close(self) -> None:
        self._changelog.close()
        await self.bus.close()
        for client in (self.redis, self._pubsub_client):
            try:
                await (client.aclose(close_connection_pool=True) if isinstance(client, Redis) else client.aclose())
            except Exception:  # closing a client of a dead server must not fail shutdown
                logger.debug("closing a redis client failed", exc_info=True)

    async def ping(self) -> None:
        with unavailable("ping"):
            await self.redis.ping()
            await self._epoch.refresh()

    async def deliver(self, frames: Sequence[tuple[str, Frame]], changes: Sequence[tuple[str, Change]],
                      ids: Sequence[str], read_under: str = "") -> list[str]:
        """Two round trips on a single node: the appends with the broadcast, then the wake-ups of
        other workers with the acknowledgement (each in order on the server; this process's own
        streams get their frames in memory, in between). The broadcast may go out before the
        appends ran: a redone batch broadcasts again, and every process hands a change on at most once.

        In a Cluster the three steps run one after the other: a batch there runs its calls
        concurrently, so an acknowledgement sent along could overtake the appends. (The stores
        used are the backend's own, whatever is set on ``self.inboxes`` and the others.)

        ``read_under`` goes with each session's append, in its own slot: ``inbox_append.lua``
        compares it with the session's epoch and, for a session made after the data was lost,
        the change's stream id with the session's ``born``.
        """
        if self.cluster:
            gone = await self._inboxes.append(frames, read_under=read_under) if frames else []
            await self._broadcast.publish(changes)
            await self._changelog.ack(ids)
            return gone
        inboxes = self._inboxes
        with unavailable("fanout.deliver"):
            appends = inboxes.appends(frames, read_under)
            first = Batch(self.redis)
            if appends is not None:
                appends.add_to(first)
            calls = len(first)
            self._broadcast.add_to(first, changes)
            replies = await first.execute()
            gone, wakes = inboxes.appended(appends, replies[:calls]) if appends is not None else ([], {})
            second = Batch(self.redis)
            inboxes.add_wakes(second, wakes)
            partitions = self._changelog.add_acks(second, ids)
            self._changelog.acknowledged(partitions, await second.execute(), ids)
        return gone

    async def _on_reconnect(self) -> None:
        """Every channel is subscribed again: what was published while the connection was down is
        lost, what is published from now on arrives. Streams re-read their inboxes; listens,
        which have none, are told broadcasts may have been lost."""
        try:
            with unavailable("epoch check"):
                await self._epoch.refresh()
        finally:
            self.watchers.wake_all()
            self._broadcast.lost()


if TYPE_CHECKING:
    def _conforms(settings: Settings) -> Backend:  # mypy checks that RedisBackend is a Backend
        return RedisBackend(settings)
