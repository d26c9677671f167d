"""The Redis backend: sessions, subscriptions, inboxes, wake-ups, change log and records.

Guarantees are those of ``broker.backends.base``; how they are kept on Redis:

Offsets and gap detection
    A session's ``head`` (a field of its hash) counts every frame ever appended; frame *n* is
    stored as stream entry ``<n>-0``, so an offset is the millisecond part of its entry id and
    offsets are contiguous. A cursor ``after`` is honoured iff the session's epoch matches,
    ``after <= head``, ``after >= head - inbox_maxlen`` and (when ``after < head``) entry
    ``after + 1`` is still stored and younger than ``inbox_retention``. Since nothing but
    trimming removes entries, that test is exact, on every server and on fakeredis (no need
    for ``XINFO STREAM`` max-deleted-entry-id). ``MAXLEN ~`` trims whole stream nodes lazily;
    the logical bound above makes retention exact anyway; time-based trimming happens in the
    append script, a bounded number of entries per call.

Atomic append and wake-up
    ``inbox_append.lua`` increments ``head``, XADDs every frame and publishes one wake-up that
    carries the offsets and the frames, atomically per session (one call carries many sessions
    on a single node, one in a Cluster). A watcher whose (S)SUBSCRIBE
    Redis confirmed before it read the inbox therefore sees every later frame, in the read or
    in a wake-up.

Wake-ups
    SPUBLISH/SSUBSCRIBE on ``P:{s:<sid>}:wake`` when the server has sharded pub/sub (Redis 7,
    and fakeredis), PUBLISH/SUBSCRIBE otherwise; one pub/sub connection per process
    (``wakes.WakeBus``). After a reconnect every watched stream gets a frames wake without a
    frame and re-reads its inbox.

Epoch
    ``P:epoch`` is created with a random value when missing. A Redis that lost its data has no
    such key; the first worker to notice (start, ping, a new session, a pub/sub reconnect, a
    read of a vanished session) creates a new one, and every session carries the epoch it was
    created under, so old cursors are gaps.

Index and tenant sets
    Cross-slot from the session, so written in a second step of the same pipeline. A
    subscription goes into the index before the session's set (a crash in between can only
    over-notify); an unsubscription leaves the session's set first. Both are idempotent, so a
    retry repairs them; fan-out removes index entries of sessions that are gone. Expired
    sessions are swept by ``expire_sessions`` through ``P:registry``; their subscription set
    outlives the record by ``session_index_grace`` so the sweep can still clean the index.
    Correctness does not hang on that sweep keeping up: every index set and tenant set has
    its own expiry, refreshed when a session subscribes and whenever a member session's
    touch is due (every ttl/4, when its registry deadline moves), to 1.25 ttl plus the grace.
    A set whose sessions all died expires by itself; one with live members loses its dead
    ones to fan-out (index) or to the next due touch (tenant set, by deadline).

Measured (loopback redis-server 7.0.15, 2 vCPU shared with the client, redis-py 8.1 + hiredis,
asyncio loop; 10,000 frames of 110 bytes, ``append_frames`` in batches, then ``read_inbox`` 256 at
a time; noisy, +-30%):
    one session, batches of 256:        append ~100k frames/s (~10 us/frame), read ~90-125k frames/s
    100 sessions, batches of 256:       append ~30-60k frames/s, read ~60-95k frames/s
    1,000 sessions, batches of 256:     append ~13-24k frames/s (one script call per session)
    one frame per call (no batching):   append ~2-3.5k frames/s (an awaited round trip each)
The Python client dominates (~40 us per script call in a pipeline, ~250 us per awaited call);
batch on the way in, as fan-out does.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Any, cast

from redis.exceptions import ResponseError

from broker.backends.base import (
    CLOSE_ALL,
    BroadcastFilter,
    BroadcastHandler,
    BroadcastLostHandler,
    Frame,
    InboxRead,
    SessionRecord,
    StreamClaim,
    StreamStart,
    WakeHandler,
    deliver_broadcast,
)
from broker.backends.redis.batch import Batch
from broker.backends.redis.changelog import ChangeLog
from broker.backends.redis.codec import (
    NodeWake,
    as_text,
    decode_changes,
    decode_entry,
    decode_session,
    encode_changes,
    encode_frame,
    encode_mark,
    encode_session,
    encode_session_fields,
    entry_offset,
    split_node_wakes,
)
from broker.backends.redis.connection import ClientFactory, open_clients, unavailable
from broker.backends.redis.keys import Keys
from broker.backends.redis.records import Records
from broker.backends.redis.scripts import Scripts
from broker.backends.redis.wakes import WakeBus
from broker.backends.redis.watchers import Watchers
from broker.changes import Change
from broker.config import Settings
from broker.errors import LimitExceeded

__all__ = ["RedisBackend"]

logger = logging.getLogger(__name__)

#: Sessions per ``inbox_append`` call on a single node: few enough that one call stays short.
APPEND_SESSIONS_PER_CALL = 64


class RedisBackend:
    """Shared state in Redis, for any number of workers. See the module docstring."""

    def __init__(self, settings: Settings, *, client_factory: ClientFactory | None = None) -> None:
        self.settings = settings
        self.keys = Keys(settings.redis_prefix)
        clients = open_clients(settings, client_factory)
        self.redis: Any = clients.commands
        self._pubsub_client: Any = clients.pubsub
        self.cluster = clients.cluster
        self.scripts = Scripts(self.redis)
        self.changelog = ChangeLog(settings, self.redis, self.keys, self.scripts, cluster=self.cluster)
        self.records = Records(settings, self.redis, self.keys, self.scripts, self.changelog)
        self.epoch = ""
        #: Times this process found the store's data lost (a new epoch); see ``_data_lost``.
        self.data_losses = 0
        self.sharded = True
        self.publish_command = "SPUBLISH"
        self._bus: WakeBus | None = None
        self.watchers = Watchers(self.keys, self.scripts, self._bus_or_fail, cluster=self.cluster)
        self._broadcast: list[BroadcastHandler] = []
        self._broadcast_filter = BroadcastFilter()
        self._broadcast_lost: dict[BroadcastHandler, BroadcastLostHandler] = {}
        self._broadcasting: asyncio.Task[None] | None = None
        ttl_ms = int(settings.session_ttl * 1000)
        self._ttl_ms = max(ttl_ms, 1)
        self._grace_ms = int(settings.session_index_grace * 1000)
        #: How long an index set or tenant set lives past its last refresh: a member session is
        #: refreshed at least every ttl/4 while it lives, so it expires within 1.25 ttl of the
        #: last refresh; the grace covers clock skew between workers. A set whose sessions all
        #: died expires by itself, whether or not the expiry sweep keeps up.
        self._derived_ms = int(self._ttl_ms * 1.25) + self._grace_ms

    # -- lifecycle -------------------------------------------------------------------------
    async def start(self) -> None:
        """Connect, agree on the epoch, create the fan-out group, detect sharded pub/sub.

        Raises:
            BackendUnavailable: Redis cannot be reached.
        """
        with unavailable("start"):
            await self.redis.ping()
            await self.refresh_epoch()
            await self.changelog.start()
            self.sharded = await self._has_sharded_pubsub()
        self.publish_command = "SPUBLISH" if self.sharded else "PUBLISH"
        self._bus = WakeBus(self._pubsub_client, sharded=self.sharded, cluster=self.cluster,
                            timeout=self.settings.redis_socket_timeout, on_reconnect=self._on_reconnect)

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
        self.changelog.close()
        if self._bus is not None:
            await self._bus.close()
        for client in (self.redis, self._pubsub_client):
            try:
                await (client.aclose() if self.cluster else client.aclose(close_connection_pool=True))
            except Exception:  # closing a client of a dead server must not fail shutdown
                logger.debug("closing a redis client failed", exc_info=True)

    async def ping(self) -> None:
        with unavailable("ping"):
            await self.redis.ping()
            await self.refresh_epoch()

    async def refresh_epoch(self) -> str:
        """Read the epoch, creating a new one when Redis lost it; updates ``self.epoch``."""
        epoch = as_text(await self.scripts.get_or_set(keys=[self.keys.epoch], args=[secrets.token_hex(4)]))
        if self.epoch and epoch != self.epoch:
            self._data_lost(epoch)
        self.epoch = epoch
        return epoch

    def _data_lost(self, epoch: str) -> None:
        """Count and log a store that lost its data: changes not yet fanned out went with it.

        The broadcast filter starts afresh: a new log's ids owe nothing to the old one's (a
        server whose clock is behind would issue lower ones, which the filter would drop).
        """
        self.data_losses += 1
        self._broadcast_filter = BroadcastFilter()
        backlog = sum(self.changelog.backlog.values())
        logger.warning("redis epoch changed from %s to %s: its data was lost, with every change not yet fanned "
                       "out (%d when this worker last acknowledged; data losses seen by this worker: %d)",
                       self.epoch, epoch, backlog, self.data_losses)

    def _bus_or_fail(self) -> WakeBus:
        if self._bus is None:
            raise RuntimeError("RedisBackend.start() was not called")
        return self._bus

    async def _on_reconnect(self) -> None:
        """Every channel is subscribed again: what was published while the connection was down is
        lost, what is published from now on arrives. Streams re-read their inboxes; listens,
        which have none, are told broadcasts may have been lost."""
        try:
            with unavailable("epoch check"):
                await self.refresh_epoch()
        finally:
            self.watchers.wake_all()
            for lost in list(self._broadcast_lost.values()):
                try:
                    lost()
                except Exception:  # one handler's bug must not keep the others from their resync
                    logger.exception("broadcast-lost handler failed")

    # -- sessions -----------------------------------------------------------------------
    def _registry_deadline(self, now: float) -> float:
        # Touches refresh the registry at most every ttl/4, so this deadline is never early.
        return now + self.settings.session_ttl * 1.25

    async def create_session(self, record: SessionRecord) -> None:
        keys = self.keys.session(record.id)
        now = time.time()
        record.epoch = self.epoch
        fields = [*encode_session(record), "head", "0", "reg", int(now * 1000)]
        deadline = self._registry_deadline(now)
        with unavailable("create_session"):
            batch = Batch(self.redis)
            batch.call(self.scripts.get_or_set, [self.keys.epoch], [secrets.token_hex(4)])
            batch.call(self.scripts.session_create, [keys.meta, keys.subs, keys.inbox], [self._ttl_ms, *fields])
            batch.pipe.zadd(self.keys.registry, {f"{record.id} {record.tenant}": deadline})
            batch.pipe.zadd(self.keys.tenant_sessions(record.tenant), {record.id: deadline})
            batch.pipe.pexpire(self.keys.tenant_sessions(record.tenant), self._derived_ms)
            epoch = as_text((await batch.execute())[0])
            if epoch != self.epoch:
                self._data_lost(epoch)
                self.epoch = record.epoch = epoch
                await self.redis.hset(keys.meta, "epoch", epoch)

    async def get_session(self, session_id: str, *, touch_as: str | None = None) -> SessionRecord | None:
        """With ``touch_as``, the read and the touch go in one round trip."""
        keys = self.keys.session(session_id)
        with unavailable("get_session"):
            if touch_as is None:
                raw = await self.redis.hgetall(keys.meta)
            else:
                now = time.time()
                batch = Batch(self.redis)
                batch.pipe.hgetall(keys.meta)
                batch.call(self.scripts.session_touch, [keys.meta, keys.subs, keys.inbox],
                           [*self._touch_args(now), touch_as])
                raw, touched = await batch.execute()
                await self._register_touched([session_id], [touched], now)
        return decode_session(session_id, raw)

    def _touch_args(self, now: float) -> list[int | str]:
        return [self._ttl_ms, self._grace_ms, int(now * 1000), self._ttl_ms // 4]

    async def _register_touched(self, session_ids: Sequence[str], results: Sequence[Any], now: float) -> None:
        """For the touched sessions whose touch says it is due (the reply is their tenant and
        URIs): move their registry deadline and refresh the expiry of their tenant set and of
        the index sets they are in, which then outlive only live sessions (see ``_derived_ms``)."""
        due = Batch(self.redis)
        deadline = self._registry_deadline(now)
        tenants: set[str] = set()
        for sid, result in zip(session_ids, results, strict=True):
            if isinstance(result, list) and result:
                tenant = as_text(result[0])
                due.pipe.zadd(self.keys.registry, {f"{sid} {tenant}": deadline})
                due.pipe.zadd(self.keys.tenant_sessions(tenant), {sid: deadline})
                tenants.add(tenant)
                for uri in result[1:]:
                    due.pipe.pexpire(self.keys.index(tenant, as_text(uri)), self._derived_ms)
        for tenant in tenants:
            key = self.keys.tenant_sessions(tenant)
            due.pipe.pexpire(key, self._derived_ms)
            # Deadlines are upper bounds of expiry: members past theirs are dead, sweep or not.
            due.pipe.zremrangebyscore(key, "-inf", now - self.settings.session_index_grace)
        await due.execute()

    async def update_session(self, session_id: str, **fields: Any) -> None:
        if not fields:
            return
        pairs = encode_session_fields(fields)
        with unavailable("update_session"):
            await self.scripts.session_update(keys=[self.keys.session(session_id).meta], args=pairs)

    async def touch_sessions(self, session_ids: Sequence[str]) -> None:
        if not session_ids:
            return
        now = time.time()
        args = self._touch_args(now)
        with unavailable("touch_sessions"):
            batch = Batch(self.redis)
            for sid in session_ids:
                keys = self.keys.session(sid)
                batch.call(self.scripts.session_touch, [keys.meta, keys.subs, keys.inbox], args)
            await self._register_touched(session_ids, await batch.execute(), now)

    async def delete_session(self, session_id: str) -> bool:
        keys = self.keys.session(session_id)
        with unavailable("delete_session"):
            ended = await self.scripts.session_delete(keys=[keys.meta, keys.subs, keys.inbox])
            if not ended:
                return False
            tenant = as_text(ended[0])
            await self._unindex(session_id, tenant, [as_text(uri) for uri in ended[1:]])
        return True

    async def restore_session(self, record: SessionRecord, subscriptions: Collection[str]) -> bool:
        """Index entries go in first (a crash in between can only over-notify), then one script
        re-creates the record, the set and an empty inbox unless the session exists."""
        keys = self.keys.session(record.id)
        uris = sorted(subscriptions)
        now = time.time()
        deadline = self._registry_deadline(now)
        with unavailable("restore_session"):
            record.epoch = await self.refresh_epoch()
            fields = [*encode_session(record), "head", "0", "reg", int(now * 1000)]
            if not self.cluster and self.watchers.watches(record.id):
                fields += ["node", self.watchers.node]  # the restoring stream watches it here
            batch = Batch(self.redis)
            for uri in uris:
                batch.pipe.sadd(self.keys.index(record.tenant, uri), record.id)
                batch.pipe.pexpire(self.keys.index(record.tenant, uri), self._derived_ms)
            batch.call(self.scripts.session_restore, [keys.meta, keys.subs, keys.inbox],
                       [self._ttl_ms, self._grace_ms, len(uris), *uris, *fields])
            restored = bool((await batch.execute())[-1])
            if not restored:
                live = await self.get_subscriptions(record.id)
                stray = Batch(self.redis)
                for uri in uris:
                    if uri not in live:
                        stray.pipe.srem(self.keys.index(record.tenant, uri), record.id)
                await stray.execute()
                return False
            registered = Batch(self.redis)
            registered.pipe.zadd(self.keys.registry, {f"{record.id} {record.tenant}": deadline})
            registered.pipe.zadd(self.keys.tenant_sessions(record.tenant), {record.id: deadline})
            registered.pipe.pexpire(self.keys.tenant_sessions(record.tenant), self._derived_ms)
            await registered.execute()
        return True

    async def _unindex(self, session_id: str, tenant: str, uris: Sequence[str]) -> None:
        batch = Batch(self.redis)
        for uri in uris:
            batch.pipe.srem(self.keys.index(tenant, uri), session_id)
        batch.pipe.zrem(self.keys.tenant_sessions(tenant), session_id)
        batch.pipe.zrem(self.keys.registry, f"{session_id} {tenant}")
        await batch.execute()

    async def count_sessions(self) -> int:
        with unavailable("count_sessions"):
            return int(await self.redis.zcount(self.keys.registry, time.time(), "+inf"))

    async def expire_sessions(self) -> int:
        """Clean the index and tenant sets of sessions whose record expired; returns how many.

        Registry deadlines run up to ttl/4 late (touches refresh them that rarely), so the sweep
        looks that far ahead and checks each candidate's record.
        """
        now = time.time()
        horizon = now + self.settings.session_ttl / 4 + 1.0
        with unavailable("expire_sessions"):
            candidates = await self.redis.zrangebyscore(self.keys.registry, "-inf", horizon, start=0, num=500)
            if not candidates:
                return 0
            members = [as_text(m).partition(" ") for m in candidates]
            probe = Batch(self.redis)
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
                await self.redis.delete(keys.subs, keys.inbox)
                gone += 1
        return gone

    # -- subscriptions --------------------------------------------------------------------
    async def add_subscription(self, session_id: str, tenant: str, uri: str, limit: int = 0) -> int:
        keys = self.keys.session(session_id)
        index = self.keys.index(tenant, uri)
        with unavailable("add_subscription"):
            batch = Batch(self.redis)
            batch.pipe.sadd(index, session_id)
            batch.pipe.pexpire(index, self._derived_ms)  # its own expiry: see _derived_ms
            batch.call(self.scripts.subscription_add, [keys.meta, keys.subs, keys.wake],
                       [uri, self._grace_ms, self.publish_command, limit])
            added, _, count = await batch.execute()
            count = int(count)
            if count <= 0 and int(added):
                await self.redis.srem(index, session_id)  # gone or refused: undo the new index entry
        if count < 0:
            raise LimitExceeded(f"at most {limit} subscriptions per session")
        return count

    async def remove_subscription(self, session_id: str, tenant: str, uri: str) -> None:
        keys = self.keys.session(session_id)
        with unavailable("remove_subscription"):
            batch = Batch(self.redis)
            batch.call(self.scripts.subscription_remove, [keys.subs, keys.wake], [uri, self.publish_command])
            batch.pipe.srem(self.keys.index(tenant, uri), session_id)
            await batch.execute()

    async def get_subscriptions(self, session_id: str) -> set[str]:
        keys = self.keys.session(session_id)
        with unavailable("get_subscriptions"):
            uris = await self.scripts.subscriptions_get(keys=[keys.meta, keys.subs])
        return {as_text(uri) for uri in uris}

    async def subscribers(self, tenant: str, uris: Sequence[str]) -> dict[str, list[str]]:
        with unavailable("subscribers"):
            batch = Batch(self.redis)
            for uri in uris:
                batch.pipe.smembers(self.keys.index(tenant, uri))
            members = await batch.execute()
        return {uri: [as_text(sid) for sid in sids] for uri, sids in zip(uris, members, strict=True) if sids}

    async def tenant_sessions(self, tenant: str) -> list[str]:
        with unavailable("tenant_sessions"):
            sids = await self.redis.zrangebyscore(self.keys.tenant_sessions(tenant), time.time(), "+inf")
        return [as_text(sid) for sid in sids]

    # -- inboxes and wake-ups ------------------------------------------------------------
    async def append_frames(self, batch: Sequence[tuple[str, Frame]]) -> list[str]:
        """Per frame the script gets its change's mark (see ``inbox_append.lua``) and the packed frame."""
        per_session: dict[str, list[bytes | str]] = {}
        packed: dict[int, tuple[str, bytes]] = {}  # fan-out shares one Frame among its subscribers: pack it once
        for sid, frame in batch:
            pair = packed.get(id(frame))
            if pair is None:
                pair = packed[id(frame)] = (encode_mark(frame.change), encode_frame(frame))
            per_session.setdefault(sid, []).extend(pair)
        if not per_session:
            return []
        now_ms = int(time.time() * 1000)
        cutoff_ms = now_ms - int(self.settings.inbox_retention * 1000)
        # One script call per session costs the client ~40 us to pack and parse; on a single
        # node a call carries up to APPEND_SESSIONS_PER_CALL sessions instead, and the wake-ups
        # go out afterwards, one message per watching worker (see _publish_wakes). In a Cluster
        # a script may only touch one slot, so each session is its own call, publishing itself.
        per_call = 1 if self.cluster else APPEND_SESSIONS_PER_CALL
        frame_max = min(self.settings.wake_frame_max_bytes, self.settings.wake_message_max_bytes // 2)
        head = [self.publish_command if self.cluster else "", self.settings.inbox_maxlen, now_ms, cutoff_ms, frame_max]
        sids = list(per_session)
        with unavailable("append_frames"):
            calls = Batch(self.redis)
            for start in range(0, len(sids), per_call):
                keys: list[str] = []
                args: list[Any] = list(head)
                for sid in sids[start : start + per_call]:
                    session_keys = self.keys.session(sid)
                    keys += [session_keys.meta, session_keys.inbox, session_keys.wake]
                    marked = per_session[sid]
                    args.append(len(marked) // 2)
                    args += marked
                calls.call(self.scripts.inbox_append, keys, args)
            results = await calls.execute()
            replies = [value for result in results for value in result]
            heads = [int(h) for h in replies[0::3]]
            if not self.cluster:
                await self._publish_wakes(sids, heads, [as_text(node) for node in replies[1::3]],
                                          per_session, replies[2::3])
        return [sid for sid, h in zip(sids, heads, strict=True) if h < 0]

    async def _publish_wakes(self, sids: list[str], heads: list[int], nodes: list[str],
                             marked: dict[str, list[bytes | str]], skipped: list[list[int]]) -> None:
        """The wake-ups of a whole batch, per worker node, in messages of bounded size, after the appends.

        Publishing after the append script (rather than inside it) keeps the handoff: a stream
        registers its node before it reads the inbox, so a frame appended later is either in
        that read or announced to the node afterwards. Frames the script skipped (repeats) are
        not announced. A session whose frames are larger than ``wake_frame_max_bytes`` gets a
        frameless wake and reads them from its inbox: one large change watched by many streams
        on a worker must not reach Redis's pub/sub buffer limit, which drops the worker's
        connection and makes every stream of it re-read.
        """
        settings = self.settings
        frame_max = min(settings.wake_frame_max_bytes, settings.wake_message_max_bytes // 2)
        by_node: dict[str, list[NodeWake]] = {}
        for sid, head, node, skips in zip(sids, heads, nodes, skipped, strict=True):
            if head >= 0 and node:
                frames = cast("list[bytes]", marked[sid][1::2])
                if skips:
                    left_out = {int(i) - 1 for i in skips}
                    frames = [data for i, data in enumerate(frames) if i not in left_out]
                if not frames:
                    continue
                packed = b"".join(frames)
                entry: NodeWake = (sid, head, None) if len(packed) > frame_max else (
                    sid, head - len(frames) + 1, packed)
                by_node.setdefault(node, []).append(entry)
        if by_node:
            batch = Batch(self.redis)
            for node, entries in by_node.items():
                channel = self.keys.node_wake(node)
                for message in split_node_wakes(entries, settings.wake_message_max_bytes):
                    batch.pipe.execute_command(self.publish_command, channel, message)
            await batch.execute()

    async def read_inbox(self, session_id: str, epoch: str, after: int, limit: int) -> InboxRead:
        keys = self.keys.session(session_id)
        with unavailable("read_inbox"):
            found = await self.scripts.inbox_read(keys=[keys.meta, keys.inbox], args=[after + 1, max(limit, 1)])
            return await self._inbox_read(found, epoch, after, limit)

    async def _inbox_read(self, found: Any, epoch: str, after: int, limit: int) -> InboxRead:
        """An ``inbox_read.lua`` reply as an ``InboxRead``."""
        if not found:
            # A vanished session: maybe Redis lost everything, so agree on the epoch again.
            return InboxRead(await self.refresh_epoch(), [], True, 0, gone=True)
        session_epoch, head, entries = as_text(found[0]), int(found[1]), found[2]
        gap = InboxRead(session_epoch, [], True, head)
        if epoch != session_epoch or after > head or after < head - self.settings.inbox_maxlen:
            return gap
        if after == head:
            return InboxRead(session_epoch, [], False, head)
        if not entries or entry_offset(entries[0][0]) != after + 1:
            return gap  # trimmed
        fields = entries[0][1]
        if int(fields[fields.index(b"t") + 1]) < (time.time() - self.settings.inbox_retention) * 1000:
            return gap  # older than the retention window
        frames = [(entry_offset(entry_id), decode_entry(fields)) for entry_id, fields in entries[:limit]]
        return InboxRead(session_epoch, frames, False, head)

    async def watch(self, session_id: str, handler: WakeHandler) -> Callable[[], Awaitable[None]]:
        """Raises ``BackendUnavailable`` when the subscription cannot be confirmed."""
        return await self.watchers.watch(session_id, handler)

    async def claim_stream(self, session_id: str) -> StreamClaim:
        keys = self.keys.session(session_id)
        with unavailable("claim_stream"):
            reply = await self.scripts.stream_claim(keys=[keys.meta, keys.wake], args=self._claim_args(session_id))
        return self._claim(reply)

    def _claim_args(self, session_id: str) -> list[str]:
        # A stream that watches the session here claims it: frames are announced to this node now.
        node = self.watchers.node if not self.cluster and self.watchers.watches(session_id) else ""
        return [self.publish_command, node]

    @staticmethod
    def _claim(reply: Any) -> StreamClaim:
        """A ``stream_claim.lua`` reply as a ``StreamClaim``."""
        had, generation = reply
        return StreamClaim(bool(had), int(generation) if generation else CLOSE_ALL)

    async def start_stream(self, session_id: str, epoch: str, after: int, limit: int) -> StreamStart:
        """One round trip on a single node, in this order; on Cluster the three run concurrently
        (the stream's channel is subscribed already, so a frame the read misses still wakes it)."""
        keys = self.keys.session(session_id)
        with unavailable("start_stream"):
            batch = Batch(self.redis)
            batch.call(self.scripts.subscriptions_get, [keys.meta, keys.subs], [])
            batch.call(self.scripts.stream_claim, [keys.meta, keys.wake], self._claim_args(session_id))
            batch.call(self.scripts.inbox_read, [keys.meta, keys.inbox], [after + 1, max(limit, 1)])
            uris, claimed, found = await batch.execute()
            read = await self._inbox_read(found, epoch, after, limit)
        return StreamStart({as_text(uri) for uri in uris}, self._claim(claimed), read)

    # -- change log and fan-out ------------------------------------------------------------
    async def publish(self, change: Change) -> str:
        with unavailable("publish"):
            return await self.changelog.publish(change)

    async def publish_many(self, changes: Sequence[Change]) -> list[str]:
        with unavailable("publish"):
            return await self.changelog.publish_many(changes)

    async def read_changes(self, consumer: str, count: int, block_ms: int) -> list[tuple[str, Change]]:
        with unavailable("read_changes"):
            return await self.changelog.read(consumer, count, block_ms)

    async def ack_changes(self, ids: Sequence[str]) -> None:
        with unavailable("ack_changes"):
            await self.changelog.ack(ids)

    async def claim_changes(self, consumer: str, min_idle_ms: int, count: int) -> list[tuple[str, Change]]:
        with unavailable("claim_changes"):
            return await self.changelog.claim(consumer, min_idle_ms, count)

    async def release_changes(self, consumer: str) -> None:
        with unavailable("release_changes"):
            await self.changelog.release(consumer)

    async def broadcast(self, changes: Sequence[tuple[str, Change]]) -> None:
        """One message per ``wake_message_max_bytes`` of changes: every worker's pub/sub connection
        receives each one, and a batch of large ``meta`` in one message could pass Redis's output
        buffer limit for subscribers and drop them all."""
        if not changes:
            return
        with unavailable("broadcast"):
            messages = encode_changes(changes, self.settings.wake_message_max_bytes)
            if len(messages) == 1:
                await self.redis.execute_command(self.publish_command, self.keys.broadcast, messages[0])
                return
            batch = Batch(self.redis)
            for message in messages:
                batch.pipe.execute_command(self.publish_command, self.keys.broadcast, message)
            await batch.execute()

    def _on_broadcast_message(self, payload: bytes) -> None:
        changes = [change for change_id, change in decode_changes(payload) if self._broadcast_filter.fresh(change_id)]
        deliver_broadcast(self._broadcast, changes)

    async def on_broadcast(self, handler: BroadcastHandler,
                           on_lost: BroadcastLostHandler | None = None) -> Callable[[], Awaitable[None]]:
        """``on_lost`` is called from ``_on_reconnect``, once the broadcast channel is subscribed again."""
        bus = self._bus_or_fail()
        self._broadcast.append(handler)
        if on_lost is not None:
            self._broadcast_lost[handler] = on_lost
        if self._broadcasting is None:
            self._broadcasting = asyncio.ensure_future(bus.subscribe(self.keys.broadcast, self._on_broadcast_message))
        try:
            await asyncio.shield(self._broadcasting)
        except BaseException:
            self._broadcast_lost.pop(handler, None)
            await self._remove_broadcast(handler)
            raise

        async def remove() -> None:
            self._broadcast_lost.pop(handler, None)
            await self._remove_broadcast(handler)

        return remove

    async def _remove_broadcast(self, handler: BroadcastHandler) -> None:
        if handler in self._broadcast:
            self._broadcast.remove(handler)
        if not self._broadcast and self._broadcasting is not None:
            subscribing, self._broadcasting = self._broadcasting, None
            if subscribing.done() and not subscribing.cancelled() and subscribing.exception() is None:
                await self._bus_or_fail().unsubscribe(self.keys.broadcast)

    # -- records ---------------------------------------------------------------------------
    async def write_record(self, tenant: str, collection: str, record_id: str, data: bytes, change: Change,
                           expect: bytes | None = None) -> bool:
        with unavailable("write_record"):
            return await self.records.write_record(tenant, collection, record_id, data, change, expect)

    async def read_record(self, tenant: str, collection: str, record_id: str) -> bytes | None:
        with unavailable("read_record"):
            return await self.records.read_record(tenant, collection, record_id)

    async def delete_record(self, tenant: str, collection: str, record_id: str, change: Change) -> bool:
        with unavailable("delete_record"):
            return await self.records.delete_record(tenant, collection, record_id, change)

    async def list_records(self, tenant: str, collection: str, after: str, limit: int) -> list[str]:
        with unavailable("list_records"):
            return await self.records.list_records(tenant, collection, after, limit)

    async def list_collections(self, tenant: str) -> list[str]:
        with unavailable("list_collections"):
            return await self.records.list_collections(tenant)
