"""Subscriptions on Redis (``base.SubscriptionIndex``): a session's set and the URI -> subscribers index.

The session's set (``P:{s:<sid>}:subs``) is changed by a script that also wakes the session's
watcher (``S+<uri>``, ``S-<uri>`` on its channel), in one step. The index
(``P:{i:<tenant>:<uri>}``) and the tenant sets are cross-slot from the session, so written in a
second step of the same pipeline. A subscription goes into the index before the session's set
(a crash in between can only over-notify); an unsubscription leaves the session's set first.
Both are idempotent, so a retry repairs them; fan-out removes index entries of sessions that
are gone. Every index set has its own expiry, refreshed when a session subscribes and by its
members' due touches (``sessions.Lifetimes``), so a set whose sessions all died expires by itself.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import cast

from broker.backends.redis.batch import Batch
from broker.backends.redis.codec import as_text
from broker.backends.redis.connection import Client, unavailable
from broker.backends.redis.keys import Keys
from broker.backends.redis.scripts import Scripts
from broker.backends.redis.sessions import Lifetimes
from broker.backends.redis.wakes import WakeBus
from broker.config import Settings
from broker.errors import LimitExceeded, Reason

__all__ = ["RedisSubscriptions"]


class RedisSubscriptions:
    """Each session's subscribed URIs and, the other way round, each URI's subscribers."""

    def __init__(self, settings: Settings, client: Client, keys: Keys, scripts: Scripts, bus: WakeBus) -> None:
        self.client = client
        self.keys = keys
        self.scripts = scripts
        self._bus = bus
        self._lifetimes = Lifetimes.of(settings)

    async def add(self, session_id: str, tenant: str, uri: str, limit: int = 0) -> int:
        keys = self.keys.session(session_id)
        index = self.keys.index(tenant, uri)
        with unavailable("subscriptions.add"):
            batch = Batch(self.client)
            batch.pipe.sadd(index, session_id)
            batch.pipe.pexpire(index, self._lifetimes.derived_ms)  # its own expiry: see Lifetimes
            batch.call(self.scripts.subscription_add, [keys.meta, keys.subs, keys.wake],
                       [uri, self._lifetimes.grace_ms, self._bus.publish_command, limit])
            added, _, count = await batch.execute()
            count = int(count)
            if count <= 0 and int(added):
                await self.client.srem(index, session_id)  # gone or refused: undo the new index entry
        if count < 0:
            raise LimitExceeded(f"at most {limit} subscriptions per session", reason=Reason.SUBSCRIPTIONS,
                                data={"limit": limit})
        return count

    async def remove(self, session_id: str, tenant: str, uri: str) -> None:
        keys = self.keys.session(session_id)
        with unavailable("subscriptions.remove"):
            batch = Batch(self.client)
            batch.call(self.scripts.subscription_remove, [keys.subs, keys.wake], [uri, self._bus.publish_command])
            batch.pipe.srem(self.keys.index(tenant, uri), session_id)
            await batch.execute()

    async def of_session(self, session_id: str) -> set[str]:
        keys = self.keys.session(session_id)
        with unavailable("subscriptions.of_session"):
            uris = await self.scripts.subscriptions_get(keys=[keys.meta, keys.subs])
        return {as_text(uri) for uri in uris}

    async def subscribers(self, tenant: str, uris: Sequence[str]) -> dict[str, list[str]]:
        """One ``SMEMBERS`` per URI, in one round trip.

        On a single server each is packed here and its reply taken as the server sent it (a list):
        through redis-py's pipeline a command and its reply's callback (a set) cost some 50,000
        instructions, about 5,000 per frame fanned out at 10 subscribers a URI (bench/NOTES.md).
        """
        with unavailable("subscriptions.subscribers"):
            batch = Batch(self.client)
            if batch.cluster:
                for uri in uris:
                    batch.pipe.smembers(self.keys.index(tenant, uri))
            else:
                index = self.keys.index
                for uri in uris:
                    key = index(tenant, uri).encode()
                    batch.packed(b"*2\r\n$8\r\nSMEMBERS\r\n$%d\r\n%b\r\n" % (len(key), key))
            members = await batch.execute()
        # Decoded by ``map`` (in C): no Python step per subscriber of every change fanned out.
        return {uri: list(map(bytes.decode, sids)) if type(next(iter(sids))) is bytes else list(sids)
                for uri, sids in zip(uris, members, strict=True) if sids}

    async def tenant_sessions(self, tenant: str) -> list[str]:
        with unavailable("subscriptions.tenant_sessions"):
            sids = cast("list[bytes]", await self.client.zrangebyscore(self.keys.tenant_sessions(tenant), time.time(),
                                                                      "+inf"))  # members: no scores asked
        return [as_text(sid) for sid in sids]
