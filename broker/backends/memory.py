"""The in-memory backend: one process, every guarantee of ``base.Backend``.

It is the embedded default and the reference implementation the contract suite is written
against. Everything runs on the event loop, so each method body is atomic by construction:
no method awaits between reading and writing shared state.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import secrets
import time
from collections import deque
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import replace
from typing import Any

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
    Wake,
    WakeHandler,
    change_position,
    deliver_broadcast,
    record_quota_message,
)
from broker.changes import Change, ChangeKind
from broker.config import Settings
from broker.errors import LimitExceeded, LogFull, QuotaExceeded, WriteConflict

__all__ = ["MemoryBackend"]


class _Inbox:
    __slots__ = ("entries", "head", "newest")

    def __init__(self) -> None:
        #: (offset, frame, monotonic time of append). Empty until the first frame: a deque
        #: preallocates a block (760 bytes), too much for every session that is only idle.
        self.entries: deque[tuple[int, Frame, float]] | tuple[()] = ()
        self.head = 0
        #: partition -> position of the newest change appended (see ``append_frames``); None until one is.
        self.newest: dict[str, str] | None = None


class MemoryBackend:
    """Shared state for a single process."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.epoch = secrets.token_hex(4)
        self._sessions: dict[str, SessionRecord] = {}
        self._seen: dict[str, float] = {}
        self._subs: dict[str, set[str]] = {}
        self._index: dict[tuple[str, str], set[str]] = {}
        self._by_tenant: dict[str, set[str]] = {}
        self._inboxes: dict[str, _Inbox] = {}
        self._watchers: dict[str, list[WakeHandler]] = {}
        self._generations: dict[str, int] = {}
        self._generation = 0
        self._log_seq = 0
        self._log: deque[tuple[str, Change]] = deque()
        self._pending: dict[str, tuple[str, float, Change]] = {}
        #: Per tenant, changes in the log or pending: not yet fanned out (``changelog_tenant_max``).
        self._backlog: dict[str, int] = {}
        #: The consumer that reads the log now, and until when (see ``_hold``).
        self._holder: tuple[str, float] | None = None
        self._log_ready = asyncio.Event()
        self._broadcast: list[BroadcastHandler] = []
        self._broadcast_filter = BroadcastFilter()
        self._records: dict[tuple[str, str], dict[str, bytes]] = {}
        self._record_ids: dict[tuple[str, str], list[str]] = {}
        #: Each tenant's collection names, sorted: listing them must not scan every tenant's.
        self._collections: dict[str, list[str]] = {}
        #: Per tenant: [records, bytes of their values], for the tenant's record quota.
        self._record_usage: dict[str, list[int]] = {}

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        self._log_ready.set()

    async def ping(self) -> None:
        return None

    # -- sessions -----------------------------------------------------------------------
    async def create_session(self, record: SessionRecord) -> None:
        self._sessions[record.id] = record
        self._seen[record.id] = time.monotonic()
        self._subs[record.id] = set()
        self._by_tenant.setdefault(record.tenant, set()).add(record.id)
        self._inboxes[record.id] = _Inbox()

    async def get_session(self, session_id: str, *, touch_as: str | None = None) -> SessionRecord | None:
        record = self._sessions.get(session_id)
        if record is None or self._expired(session_id):
            return None
        if touch_as is not None and touch_as == record.principal:
            self._seen[session_id] = time.monotonic()
        return replace(record)

    async def update_session(self, session_id: str, **fields: Any) -> None:
        record = self._sessions.get(session_id)
        if record is not None:
            for name, value in fields.items():
                setattr(record, name, value)

    async def touch_sessions(self, session_ids: Sequence[str]) -> None:
        now = time.monotonic()
        for sid in session_ids:
            if sid in self._seen:
                self._seen[sid] = now

    async def delete_session(self, session_id: str) -> bool:
        record = self._sessions.pop(session_id, None)
        if record is None:
            return False
        self._seen.pop(session_id, None)
        for uri in self._subs.pop(session_id, set()):
            self._unindex(record.tenant, uri, session_id)
        tenant = self._by_tenant.get(record.tenant)
        if tenant is not None:
            tenant.discard(session_id)
        self._inboxes.pop(session_id, None)
        self._generations.pop(session_id, None)
        return True

    async def restore_session(self, record: SessionRecord, subscriptions: Collection[str]) -> bool:
        if record.id in self._sessions and not self._expired(record.id):
            return False
        await self.delete_session(record.id)  # an expired record the sweep has not reached yet
        record.epoch = self.epoch
        await self.create_session(replace(record))
        for uri in subscriptions:
            await self.add_subscription(record.id, record.tenant, uri)
        return True

    async def count_sessions(self) -> int:
        return len(self._sessions)

    async def expire_sessions(self) -> int:
        expired = [sid for sid in self._sessions if self._expired(sid)]
        for sid in expired:
            await self.delete_session(sid)
        return len(expired)

    def _expired(self, session_id: str) -> bool:
        return time.monotonic() - self._seen.get(session_id, 0.0) > self.settings.session_ttl

    # -- subscriptions --------------------------------------------------------------------
    async def add_subscription(self, session_id: str, tenant: str, uri: str, limit: int = 0) -> int:
        subs = self._subs.get(session_id)
        if subs is None:
            return 0
        if limit and uri not in subs and len(subs) >= limit:
            raise LimitExceeded(f"at most {limit} subscriptions per session")
        subs.add(uri)
        self._index.setdefault((tenant, uri), set()).add(session_id)
        self._wake(session_id, Wake("subscribe", uri=uri))
        return len(subs)

    async def remove_subscription(self, session_id: str, tenant: str, uri: str) -> None:
        subs = self._subs.get(session_id)
        if subs is not None and uri in subs:
            subs.discard(uri)
            self._unindex(tenant, uri, session_id)
            self._wake(session_id, Wake("unsubscribe", uri=uri))

    def _wake(self, session_id: str, wake: Wake) -> None:
        for handler in list(self._watchers.get(session_id, ())):
            handler(wake)

    def _unindex(self, tenant: str, uri: str, session_id: str) -> None:
        members = self._index.get((tenant, uri))
        if members is not None:
            members.discard(session_id)
            if not members:
                del self._index[(tenant, uri)]

    async def get_subscriptions(self, session_id: str) -> set[str]:
        return set(self._subs.get(session_id, ()))

    async def subscribers(self, tenant: str, uris: Sequence[str]) -> dict[str, list[str]]:
        found: dict[str, list[str]] = {}
        for uri in uris:
            members = self._index.get((tenant, uri))
            if members:
                found[uri] = list(members)
        return found

    async def tenant_sessions(self, tenant: str) -> list[str]:
        return list(self._by_tenant.get(tenant, ()))

    # -- inboxes and wake-ups ------------------------------------------------------------
    async def append_frames(self, batch: Sequence[tuple[str, Frame]]) -> list[str]:
        gone: list[str] = []
        now = time.monotonic()
        maxlen = self.settings.inbox_maxlen
        positions: dict[str, tuple[str, str] | None] = {}
        #: What this call appends is weighed against what came before it, not against itself:
        #: one change's frames for several URIs of a session all land.
        advanced: dict[tuple[_Inbox, str], str] = {}
        for sid, frame in batch:
            inbox = self._inboxes.get(sid)
            if inbox is None:
                gone.append(sid)
                continue
            if frame.change:
                if frame.change in positions:
                    position = positions[frame.change]
                else:
                    position = positions[frame.change] = change_position(frame.change)
                if position is not None:
                    partition, at = position
                    if inbox.newest is not None and at <= inbox.newest.get(partition, ""):
                        continue  # a change this session was given already: a redone batch
                    if at > advanced.get((inbox, partition), ""):
                        advanced[(inbox, partition)] = at
            inbox.head += 1
            entries = inbox.entries
            if not isinstance(entries, deque):
                entries = inbox.entries = deque()
            entries.append((inbox.head, frame, now))
            while len(entries) > maxlen:
                entries.popleft()
            for handler in self._watchers.get(sid, ()):
                handler(Wake("frames", inbox.head, frame=frame))
        for (inbox, partition), at in advanced.items():
            if inbox.newest is None:
                inbox.newest = {}
            inbox.newest[partition] = at
        return gone

    async def read_inbox(self, session_id: str, epoch: str, after: int, limit: int) -> InboxRead:
        inbox = self._inboxes.get(session_id)
        if inbox is None:
            return InboxRead(self.epoch, [], True, 0, gone=True)
        cutoff = time.monotonic() - self.settings.inbox_retention
        entries = inbox.entries
        while isinstance(entries, deque) and entries and entries[0][2] < cutoff:
            entries.popleft()
        earliest = entries[0][0] if entries else inbox.head + 1
        if epoch != self.epoch or after > inbox.head or after < earliest - 1:
            return InboxRead(self.epoch, [], True, inbox.head)
        # Offsets are contiguous, so the first frame after the cursor sits at a known position.
        start = after + 1 - earliest
        frames = [(off, frame) for off, frame, _ in itertools.islice(entries, start, start + limit)]
        return InboxRead(self.epoch, frames, False, inbox.head)

    async def watch(self, session_id: str, handler: WakeHandler) -> Callable[[], Awaitable[None]]:
        handlers = self._watchers.setdefault(session_id, [])
        handlers.append(handler)

        async def unwatch() -> None:
            current = self._watchers.get(session_id)
            if current is not None and handler in current:
                current.remove(handler)
                if not current:
                    del self._watchers[session_id]

        return unwatch

    async def claim_stream(self, session_id: str) -> StreamClaim:
        had = session_id in self._generations
        if session_id in self._sessions:
            self._generation += 1
            generation = self._generations[session_id] = self._generation
        else:
            generation = CLOSE_ALL
        for handler in list(self._watchers.get(session_id, ())):
            handler(Wake("takeover", generation=generation))
        return StreamClaim(had, generation)

    async def start_stream(self, session_id: str, epoch: str, after: int, limit: int) -> StreamStart:
        subscriptions = await self.get_subscriptions(session_id)
        claim = await self.claim_stream(session_id)
        return StreamStart(subscriptions, claim, await self.read_inbox(session_id, epoch, after, limit))

    # -- change log and fan-out ------------------------------------------------------------
    def _admit(self, changes: Sequence[Change]) -> None:
        """Refuse, before anything is appended, what the log cannot keep (as ``changelog_append.lua``).

        Nothing fan-out has not processed is ever dropped: the log holds unread and pending
        changes only, each counted under its tenant until it is acknowledged.
        """
        held = len(self._log) + len(self._pending)
        if held + len(changes) > self.settings.changelog_maxlen:
            raise LogFull(0, self.settings.changelog_maxlen)
        asked: dict[str, int] = {}
        for change in changes:
            asked[change.tenant] = asked.get(change.tenant, 0) + 1
        limit = self.settings.changelog_tenant_max
        for tenant, count in asked.items():
            waiting = self._backlog.get(tenant, 0)
            if waiting + count > limit:
                raise QuotaExceeded(tenant, limit, waiting, count)

    def _append(self, change: Change) -> str:
        self._log_seq += 1
        change_id = f"{self._log_seq}-0"
        self._log.append((change_id, change))
        self._backlog[change.tenant] = self._backlog.get(change.tenant, 0) + 1
        self._log_ready.set()
        return change_id

    async def publish(self, change: Change) -> str:
        self._admit((change,))
        return self._append(change)

    async def publish_many(self, changes: Sequence[Change]) -> list[str]:
        self._admit(changes)
        return [self._append(change) for change in changes]

    def _hold(self, consumer: str) -> bool:
        """The log's lease, as on Redis: one consumer reads at a time, so changes keep their order."""
        now = time.monotonic()
        holder = self._holder
        if holder is not None and holder[0] != consumer and holder[1] > now:
            return False
        self._holder = (consumer, now + self.settings.fanout_claim_idle_ms / 1000)
        return True

    async def read_changes(self, consumer: str, count: int, block_ms: int) -> list[tuple[str, Change]]:
        # At most a third of the lease per wait: an idle holder comes back to renew it.
        wait_ms = min(block_ms, max(self.settings.fanout_claim_idle_ms // 3, 10))
        if not self._hold(consumer):
            await asyncio.sleep(wait_ms / 1000)
            return []
        now = time.monotonic()
        taken: list[tuple[str, Change]] = []
        # While this consumer holds the log, whatever is pending was handed out and never
        # acknowledged (its batch failed, or a lapsed holder's was cut short): that goes first.
        for change_id, (_, _, change) in list(self._pending.items())[:count]:
            self._pending[change_id] = (consumer, now, change)
            taken.append((change_id, change))
        if taken:
            return taken
        if not self._log and block_ms > 0:
            self._log_ready.clear()
            try:
                await asyncio.wait_for(self._log_ready.wait(), wait_ms / 1000)
            except TimeoutError:
                return []
        while self._log and len(taken) < count:
            change_id, change = self._log.popleft()
            self._pending[change_id] = (consumer, now, change)
            taken.append((change_id, change))
        return taken

    async def ack_changes(self, ids: Sequence[str]) -> None:
        for change_id in ids:
            pending = self._pending.pop(change_id, None)
            if pending is not None:
                tenant = pending[2].tenant
                left = self._backlog[tenant] - 1
                if left:
                    self._backlog[tenant] = left
                else:
                    del self._backlog[tenant]

    async def release_changes(self, consumer: str) -> None:
        if self._holder is not None and self._holder[0] == consumer:
            self._holder = None

    async def claim_changes(self, consumer: str, min_idle_ms: int, count: int) -> list[tuple[str, Change]]:
        if not self._hold(consumer):
            return []
        now = time.monotonic()
        claimed: list[tuple[str, Change]] = []
        for change_id, (_, since, change) in list(self._pending.items()):
            if len(claimed) >= count:
                break
            if (now - since) * 1000 >= min_idle_ms:
                self._pending[change_id] = (consumer, now, change)
                claimed.append((change_id, change))
        return claimed

    async def broadcast(self, changes: Sequence[tuple[str, Change]]) -> None:
        deliver_broadcast(self._broadcast, [change for change_id, change in changes
                                            if self._broadcast_filter.fresh(change_id)])

    async def on_broadcast(self, handler: BroadcastHandler,
                           on_lost: BroadcastLostHandler | None = None) -> Callable[[], Awaitable[None]]:
        # ``on_lost`` is never called: a broadcast in one process cannot be lost.
        self._broadcast.append(handler)

        async def remove() -> None:
            if handler in self._broadcast:
                self._broadcast.remove(handler)

        return remove

    # -- records ---------------------------------------------------------------------------
    async def write_record(self, tenant: str, collection: str, record_id: str, data: bytes, change: Change,
                           expect: bytes | None = None) -> bool:
        key = (tenant, collection)
        records = self._records.get(key, {})
        old = records.get(record_id)
        if expect is not None and old != expect:
            raise WriteConflict(record_id)
        created = old is None
        usage = self._record_usage.setdefault(tenant, [0, 0])
        grow = len(data) - (0 if old is None else len(old))
        if created and usage[0] >= self.settings.max_records_per_tenant:
            raise LimitExceeded(record_quota_message(self.settings, count=True))
        if grow > 0 and usage[1] + grow > self.settings.max_record_bytes_per_tenant:
            raise LimitExceeded(record_quota_message(self.settings, count=False))
        self._admit((change,))
        usage[0] += created
        usage[1] += grow
        records = self._records.setdefault(key, records)
        records[record_id] = data
        if created:
            ids = self._record_ids.setdefault(key, [])
            if not ids:
                bisect.insort(self._collections.setdefault(tenant, []), collection)
            bisect.insort(ids, record_id)
        self._append(replace(change, kind=ChangeKind.CREATED) if created else change)
        return created

    async def read_record(self, tenant: str, collection: str, record_id: str) -> bytes | None:
        return self._records.get((tenant, collection), {}).get(record_id)

    async def delete_record(self, tenant: str, collection: str, record_id: str, change: Change) -> bool:
        key = (tenant, collection)
        records = self._records.get(key)
        if records is None or record_id not in records:
            return False
        self._admit((change,))
        usage = self._record_usage[tenant]
        usage[0] -= 1
        usage[1] -= len(records.pop(record_id))
        ids = self._record_ids[key]
        del ids[bisect.bisect_left(ids, record_id)]
        if not records:
            del self._records[key]
            del self._record_ids[key]
            names = self._collections[tenant]
            del names[bisect.bisect_left(names, collection)]
            if not names:
                del self._collections[tenant]
        self._append(change)
        return True

    async def list_records(self, tenant: str, collection: str, after: str, limit: int) -> list[str]:
        ids = self._record_ids.get((tenant, collection), [])
        start = bisect.bisect_right(ids, after) if after else 0
        return ids[start : start + limit]

    async def list_collections(self, tenant: str) -> list[str]:
        return list(self._collections.get(tenant, ()))
