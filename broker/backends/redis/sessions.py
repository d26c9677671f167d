"""Session records on Redis (``base.SessionStore``): created, read and touched, ended, expired, restored.

A session's record, its subscription set and its inbox share the tag ``{s:<sid>}`` and are
written by one script each; the registry (``P:registry``) and the tenant's session set are
cross-slot, so they are written in a second step of the same pipeline.

Expiry
    Expired sessions are swept by ``expire`` through ``P:registry``; their subscription set
    outlives the record by ``session_index_grace`` so the sweep can still clean the index.
    Correctness does not hang on that sweep keeping up: every index set and tenant set has
    its own expiry, refreshed when a session subscribes and whenever a member session's
    touch is due (every ttl/4, when its registry deadline moves), to 1.25 ttl plus the grace
    (``Lifetimes.derived_ms``). A set whose sessions all died expires by itself; one with live
    members loses its dead ones to fan-out (index) or to the next due touch (tenant set, by
    deadline).
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, cast

from broker.backends.redis.batch import Batch
from broker.backends.redis.codec import as_text, decode_session, encode_session, encode_session_fields
from broker.backends.redis.connection import Client, unavailable
from broker.backends.redis.epoch import Epoch
from broker.backends.redis.keys import Keys
from broker.backends.redis.scripts import Scripts
from broker.backends.redis.watchers import Watchers
from broker.backends.types import SessionRecord
from broker.config import Settings
from broker.errors import OverQuota
from broker.feeds.model import FeedKind

__all__ = ["Lifetimes", "RedisSessions"]

#: Members of a tenant at its session quota looked up per refused ``initialize``, for dead ones.
ADMIT_PRUNE = 200
#: Sessions one touch script call carries on a single node.
TOUCH_SESSIONS_PER_CALL = 64


@dataclass(frozen=True, slots=True)
class Lifetimes:
    """How long a session's keys and the sets derived from sessions live, in milliseconds."""

    ttl_ms: int
    grace_ms: int
    #: How long an index set or tenant set lives past its last refresh: a member session is
    #: refreshed at least every ttl/4 while it lives, so it expires within 1.25 ttl of the
    #: last refresh; the grace covers clock skew between workers. A set whose sessions all
    #: died expires by itself, whether or not the expiry sweep keeps up.
    derived_ms: int

    @classmethod
    def of(cls, settings: Settings) -> Lifetimes:
        ttl_ms = max(int(settings.session_ttl * 1000), 1)
        grace_ms = int(settings.session_index_grace * 1000)
        return cls(ttl_ms, grace_ms, int(ttl_ms * 1.25) + grace_ms)


class RedisSessions:
    """Session records, their idle clocks (touches) and their entries in the registry and tenant sets."""

    def __init__(self, settings: Settings, client: Client, keys: Keys, scripts: Scripts, epoch: Epoch,
                 watchers: Watchers) -> None:
        self.settings = settings
        self.client = client
        self.keys = keys
        self.scripts = scripts
        self._epoch = epoch
        self._watchers = watchers
        self._lifetimes = Lifetimes.of(settings)

    @property
    def epoch(self) -> str:
        return self._epoch.value

    def _registry_deadline(self, now: float) -> float:
        # Touches refresh the registry at most every ttl/4, so this deadline is never early.
        return now + self.settings.session_ttl * 1.25

    async def create(self, record: SessionRecord, tenant_limit: int | None = None) -> None:
        keys = self.keys.session(record.id)
        now = time.time()
        record.epoch = self._epoch.value
        fields = [*encode_session(record), "head", "0", "reg", int(now * 1000)]
        deadline = self._registry_deadline(now)
        life = self._lifetimes
        with unavailable("sessions.create"):
            if tenant_limit is not None:
                await self._admit(record, tenant_limit, now, deadline)
            batch = Batch(self.client)
            self._epoch.read_into(batch)
            batch.call(self.scripts.session_create, [keys.meta, keys.subs, keys.inbox], [life.ttl_ms, *fields])
            batch.pipe.zadd(self.keys.registry, {f"{record.id} {record.tenant}": deadline})
            if record.kind is FeedKind.SESSION:
                batch.pipe.zadd(self.keys.session_registry, {record.id: deadline})
            batch.pipe.zadd(self.keys.tenant_sessions(record.tenant), {record.id: deadline})
            batch.pipe.pexpire(self.keys.tenant_sessions(record.tenant), life.derived_ms)
            epoch = as_text((await batch.execute())[0])
            if self._epoch.observe(epoch):
                record.epoch = epoch
                await self.client.hset(keys.meta, "epoch", epoch)

    async def _admit(self, record: SessionRecord, limit: int, now: float, deadline: float) -> None:
        """Take a place in the tenant's session set (``session_admit.lua``), or raise OverQuota.

        At the limit, members whose deadline is close enough that they may have expired
        (``Lifetimes``: a live one's is more than ttl/4 ahead) are looked up, and the dead ones
        leave the set before the one retry; an ended session left it when it ended.
        """
        key = self.keys.tenant_sessions(record.tenant)
        args: list[str | int | float] = [repr(now), limit, record.id, deadline, self._lifetimes.derived_ms]
        if int(await self.scripts.session_admit(keys=[key], args=args)) < 0:
            return
        maybe_dead = [as_text(sid) for sid in cast("list[bytes]", await self.client.zrangebyscore(
            key, now, now + self.settings.session_ttl / 4 + 1.0, start=0, num=ADMIT_PRUNE))]
        if maybe_dead:
            probe = Batch(self.client)
            for sid in maybe_dead:
                probe.pipe.exists(self.keys.session(sid).meta)
            dead = [sid for sid, alive in zip(maybe_dead, await probe.execute(), strict=True) if not alive]
            if dead:
                await self.client.zrem(key, *dead)
                if int(await self.scripts.session_admit(keys=[key], args=args)) < 0:
                    return
        raise OverQuota("sessions", record.tenant, limit, 5,
                        f"tenant {record.tenant!r} has {limit} live sessions (its quota); end one or retry later")

    async def get(self, session_id: str, *, touch_as: str | None = None) -> SessionRecord | None:
        """With ``touch_as``, the read and the touch go in one round trip."""
        keys = self.keys.session(session_id)
        with unavailable("sessions.get"):
            if touch_as is None:
                raw = await self.client.hgetall(keys.meta)
            else:
                now = time.time()
                batch = Batch(self.client)
                batch.pipe.hgetall(keys.meta)
                batch.call(self.scripts.session_touch, [keys.meta, keys.subs, keys.inbox],
                           [*self._touch_args(now), touch_as])
                raw, touched = await batch.execute()
                await self._register_touched([session_id], touched, now)
        return decode_session(session_id, cast("dict[bytes, bytes]", raw))

    def _touch_args(self, now: float) -> list[int | str]:
        life = self._lifetimes
        return [life.ttl_ms, life.grace_ms, int(now * 1000), life.ttl_ms // 4]

    async def _register_touched(self, session_ids: Sequence[str], results: Sequence[Any], now: float) -> None:
        """For the touched sessions whose touch says it is due (the reply is their tenant and
        URIs): move their registry deadline and refresh the expiry of their tenant set and of
        the index sets they are in, which then outlive only live sessions (see ``Lifetimes``)."""
        due = Batch(self.client)
        deadline = self._registry_deadline(now)
        derived_ms = self._lifetimes.derived_ms
        tenants: set[str] = set()
        for sid, result in zip(session_ids, results, strict=True):
            if isinstance(result, list) and result:
                tenant = as_text(result[0])
                due.pipe.zadd(self.keys.registry, {f"{sid} {tenant}": deadline})
                due.pipe.zadd(self.keys.session_registry, {sid: deadline}, xx=True)  # a session's, if it is one
                due.pipe.zadd(self.keys.tenant_sessions(tenant), {sid: deadline})
                tenants.add(tenant)
                for uri in result[1:]:
                    due.pipe.pexpire(self.keys.index(tenant, as_text(uri)), derived_ms)
        for tenant in tenants:
            key = self.keys.tenant_sessions(tenant)
            due.pipe.pexpire(key, derived_ms)
            # Deadlines are upper bounds of expiry: members past theirs are dead, sweep or not.
            due.pipe.zremrangebyscore(key, "-inf", now - self.settings.session_index_grace)
        await due.execute()

    async def update(self, session_id: str, **fields: Any) -> None:
        if not fields:
            return
        pairs = encode_session_fields(fields)
        with unavailable("sessions.update"):
            await self.scripts.session_update(keys=[self.keys.session(session_id).meta], args=pairs)

    async def touch(self, session_ids: Sequence[str]) -> None:
        """One script call per ``TOUCH_SESSIONS_PER_CALL`` sessions on a single node (a call costs
        the client ~40 µs to pack and parse, whatever it carries); in Redis Cluster one per session."""
        if not session_ids:
            return
        now = time.time()
        args = self._touch_args(now)
        per_call = 1 if self._watchers.cluster else TOUCH_SESSIONS_PER_CALL
        with unavailable("sessions.touch"):
            batch = Batch(self.client)
            for start in range(0, len(session_ids), per_call):
                keys: list[str] = []
                for sid in session_ids[start:start + per_call]:
                    session = self.keys.session(sid)
                    keys += (session.meta, session.subs, session.inbox)
                batch.call(self.scripts.session_touch, keys, args)
            touched = [result for results in await batch.execute() for result in results]
            await self._register_touched(session_ids, touched, now)

    async def delete(self, session_id: str) -> bool:
        keys = self.keys.session(session_id)
        with unavailable("sessions.delete"):
            ended = await self.scripts.session_delete(keys=[keys.meta, keys.subs, keys.inbox])
            if not ended:
                return False
            tenant = as_text(ended[0])
            await self._unindex(session_id, tenant, [as_text(uri) for uri in ended[1:]])
        return True

    async def restore(self, record: SessionRecord, subscriptions: Collection[str]) -> bool:
        """Index entries go in first (a crash in between can only over-notify), then one script
        re-creates the record, the set and an empty inbox unless the session exists."""
        keys = self.keys.session(record.id)
        uris = sorted(subscriptions)
        now = time.time()
        deadline = self._registry_deadline(now)
        life = self._lifetimes
        with unavailable("sessions.restore"):
            record.epoch = await self._epoch.refresh()
            fields = [*encode_session(record), "head", "0", "reg", int(now * 1000)]
            if node := self._watchers.claimant(record.id):
                fields += ["node", node]  # the restoring stream watches it here
            batch = Batch(self.client)
            for uri in uris:
                batch.pipe.sadd(self.keys.index(record.tenant, uri), record.id)
                batch.pipe.pexpire(self.keys.index(record.tenant, uri), life.derived_ms)
            batch.call(self.scripts.session_restore, [keys.meta, keys.subs, keys.inbox],
                       [life.ttl_ms, life.grace_ms, len(uris), *uris, *fields])
            restored = bool((await batch.execute())[-1])
            if not restored:
                live = {as_text(uri) for uri in await self.scripts.subscriptions_get(keys=[keys.meta, keys.subs])}
                stray = Batch(self.client)
                for uri in uris:
                    if uri not in live:
                        stray.pipe.srem(self.keys.index(record.tenant, uri), record.id)
                await stray.execute()
                return False
            registered = Batch(self.client)
            registered.pipe.zadd(self.keys.registry, {f"{record.id} {record.tenant}": deadline})
            if record.kind is FeedKind.SESSION:
                registered.pipe.zadd(self.keys.session_registry, {record.id: deadline})
            registered.pipe.zadd(self.keys.tenant_sessions(record.tenant), {record.id: deadline})
            registered.pipe.pexpire(self.keys.tenant_sessions(record.tenant), life.derived_ms)
            await registered.execute()
        return True

    async def _unindex(self, session_id: str, tenant: str, uris: Sequence[str]) -> None:
        batch = Batch(self.client)
        for uri in uris:
            batch.pipe.srem(self.keys.index(tenant, uri), session_id)
        batch.pipe.zrem(self.keys.tenant_sessions(tenant), session_id)
        batch.pipe.zrem(self.keys.registry, f"{session_id} {tenant}")
        batch.pipe.zrem(self.keys.session_registry, session_id)
        await batch.execute()

    async def count(self) -> int:
        with unavailable("sessions.count"):
            return int(await self.client.zcount(self.keys.registry, time.time(), "+inf"))

    async def count_sessions(self) -> int:
        """From ``P:registry:sessions``, which a feed of another kind never enters (a session's deadline
        is moved there as in the registry; ``expire`` removes it with the session)."""
        with unavailable("sessions.count_sessions"):
            return int(await self.client.zcount(self.keys.session_registry, time.time(), "+inf"))

    async def expire(self) -> int:
        """Clean the index and tenant sets of sessions whose record expired; returns how many.

        Registry deadlines run up to ttl/4 late (touches refresh them that rarely), so the sweep
        looks that far ahead and checks each candidate's record.
        """
        now = time.time()
        horizon = now + self.settings.session_ttl / 4 + 1.0
        with unavailable("sessions.expire"):
            candidates = cast("list[bytes]", await self.client.zrangebyscore(  # members: no scores asked
                self.keys.registry, "-inf", horizon, start=0, num=500))
            if not candidates:
                return 0
            members = [as_text(m).partition(" ") for m in candidates]
            probe = Batch(self.client)
            for sid, _, _ in members:
                keys = self.keys.session(sid)
                probe.pipe.exists(keys.meta)
                probe.pipe.smembers(keys.subs)
            found = await probe.execute()
            gone = 0
            for i, (sid, _, tenant) in enumerate(members):
                if found[2 * i]:
                    continue  # alive: its deadline is an upper bound, not the expiry
                keys = self.keys.session(sid)
                await self._unindex(sid, tenant, [as_text(u) for u in found[2 * i + 1]])
                await self.client.delete(keys.subs, keys.inbox)
                gone += 1
        return gone
