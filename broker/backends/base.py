"""The backend seam: everything that outlives one HTTP request lives behind these protocols.

A backend is a handful of small stores, one per concern, each its own protocol:

================  =================================================================
``sessions``      ``SessionStore``: session records, their idle clocks, restoring
``subscriptions`` ``SubscriptionIndex``: a session's URIs and URI -> subscribers
``inboxes``       ``Inboxes``: per-session frames, wake-ups, the one live stream
``changelog``     ``ChangeLog``: published changes, read by fan-out under leases
``broadcast``     ``Broadcast``: processed changes to every process's listens
``records``       ``RecordStore``: the built-in JSON records, written with their change
``leases``        ``Leases``: named cluster-wide leases (a change source on one worker)
``credentials``   ``Credentials``: runtime API keys, stored as their digest only
``quotas``        ``Quotas``: per-tenant leases (open streams, listens) and publish token buckets
``webhooks``      ``Webhooks``: webhook subscriptions (events extension) and their dead letters
================  =================================================================

Two implementations exist: ``memory`` (one process, the embedded default and the reference
implementation) and ``redis`` (any number of workers), each split the same way, a module per
store. Both pass the same contract suite in ``tests/contract``. What crosses the seam is in
``broker.backends.types``, with the rules both backends apply alike (the gap decision, the
change positions, the handler registry). The guarantees every implementation gives, store by
store, are in ``docs/BACKENDS.md``; the contract suite holds each implementation to them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Any, Protocol

from broker.backends.types import (
    CLOSE_ALL,
    BroadcastBatchHandler,
    BroadcastHandler,
    BroadcastLostHandler,
    DeadLetter,
    Frame,
    InboxRead,
    KeyRecord,
    SessionRecord,
    StreamClaim,
    StreamStart,
    Wake,
    WakeHandler,
    WebhookRecord,
)
from broker.changes import Change

#: The data types of the seam are re-exported here, beside the protocols that exchange them.
__all__ = [
    "CLOSE_ALL",
    "Backend",
    "Broadcast",
    "BroadcastBatchHandler",
    "BroadcastHandler",
    "BroadcastLostHandler",
    "ChangeLog",
    "Credentials",
    "DeadLetter",
    "Frame",
    "InboxRead",
    "Inboxes",
    "KeyRecord",
    "Leases",
    "Quotas",
    "RecordStore",
    "SessionRecord",
    "SessionStore",
    "StreamClaim",
    "StreamStart",
    "SubscriptionIndex",
    "Wake",
    "WakeHandler",
    "WebhookRecord",
    "Webhooks",
    "deliver_in_turn",
]


class SessionStore(Protocol):
    """Legacy session records: created, read (and touched), ended, expired, restored."""

    @property
    def epoch(self) -> str:
        """Short identifier of the store's data generation; a store that lost its data gets a new one."""

    async def create(self, record: SessionRecord, tenant_limit: int | None = None) -> None:
        """Store a new session (its ``epoch`` is set to the current one) with an empty inbox.

        Raises:
            OverQuota: ``tenant_limit`` is set and the tenant has that many live sessions; the
                count and the add are one atomic step, and ended or expired sessions leave it.
        """

    async def get(self, session_id: str, *, touch_as: str | None = None) -> SessionRecord | None:
        """The session's record, or None. ``touch_as`` (a principal key) also restarts its idle
        clock in the same step, when the session belongs to that principal."""

    async def update(self, session_id: str, **fields: Any) -> None: ...

    async def touch(self, session_ids: Sequence[str]) -> None:
        """Restart the idle clock of each live session (unknown ids are ignored)."""

    async def delete(self, session_id: str) -> bool:
        """End a session: record, subscriptions, index entries and inbox. False if unknown."""

    async def restore(self, record: SessionRecord, subscriptions: Collection[str]) -> bool:
        """Re-create a session the store lost, with ``subscriptions``; sets ``record.epoch`` to the current epoch.

        Returns False, changing nothing, when a session with that id exists (someone restored
        it first, or it was never lost); the caller then reads it with ``get``.
        """

    async def count(self) -> int:
        """Live feeds of every kind: what ``max_sessions`` bounds."""

    async def count_sessions(self) -> int:
        """Live feeds of kind session (2025 sessions), the others left out."""

    async def expire(self) -> int:
        """Remove sessions idle longer than the TTL; returns how many (a no-op where the store expires keys)."""


class SubscriptionIndex(Protocol):
    """A session's subscribed URIs and, the other way round, each URI's subscribers."""

    async def add(self, session_id: str, tenant: str, uri: str, limit: int = 0) -> int:
        """Subscribe; returns the session's subscription count after the call (0: the session is gone).

        Raises:
            LimitExceeded: ``uri`` is new and the session already has ``limit`` (when > 0) subscriptions;
                nothing changes then. The check and the add are one atomic step.
        """

    async def remove(self, session_id: str, tenant: str, uri: str) -> None: ...

    async def of_session(self, session_id: str) -> set[str]: ...

    async def subscribers(self, tenant: str, uris: Sequence[str]) -> dict[str, list[str]]:
        """Session ids subscribed to each URI (URIs without subscribers may be left out)."""

    async def tenant_sessions(self, tenant: str) -> list[str]: ...


class Inboxes(Protocol):
    """Each session's frames, the wake-ups of the stream that watches it, and its one live stream."""

    async def append(self, batch: Sequence[tuple[str, Frame]]) -> list[str]:
        """Append ``(session_id, frame)`` pairs; returns the session ids that no longer exist.

        A frame whose ``change`` is not newer than the newest change of its partition that an
        earlier call appended to the session is skipped (docs/BACKENDS.md, "Inboxes"): it takes no
        offset and is not announced (a backend may still wake the stream of a session all of
        whose frames it skipped, to read its inbox).
        """

    async def read(self, session_id: str, epoch: str, after: int, limit: int) -> InboxRead: ...

    async def watch(self, session_id: str, handler: WakeHandler) -> Callable[[], Awaitable[None]]:
        """Call ``handler`` on every wake-up of the session until the returned function is awaited.

        Returns only once the watch is active, so frames appended afterwards are never missed.
        """

    async def claim_stream(self, session_id: str) -> StreamClaim:
        """Make the caller the one live stream of the session: a ``takeover`` wake with a new generation.

        Generations only grow, so of two streams claiming at once exactly the later one stays,
        whichever order their wakes arrive in. For a session that no longer exists the wake
        carries ``CLOSE_ALL``.
        """

    async def start_stream(self, session_id: str, epoch: str, after: int, limit: int) -> StreamStart:
        """What a stream that just began watching needs, in one step: the session's subscriptions,
        its claim (``claim_stream``) and then the first read of its inbox (``read``)."""


class ChangeLog(Protocol):
    """Published changes, waiting for fan-out."""

    @property
    def partitions(self) -> int:
        """How many partitions appends go to; each bounds a tenant's changes waiting there."""
    def partition(self, tenant: str, uri: str) -> int:
        """The partition a change of ``uri`` goes to now."""

    async def publish(self, change: Change) -> str:
        """Append a change; its id.

        Raises:
            QuotaExceeded, LogFull: refused, nothing appended (see the module docstring).
        """

    async def publish_many(self, changes: Sequence[Change]) -> list[str]:
        """Append the changes in as few steps as the backend can; their ids, in order.

        The changes of one tenant are appended in the order given, all or none of them.

        Raises:
            QuotaExceeded, LogFull: the changes of a partition were refused whole; with several
                partitions (several tenants), those of the others may have been appended.
        """

    async def read(self, consumer: str, count: int, block_ms: int) -> list[tuple[str, Change]]:
        """Up to ``count`` changes for ``consumer`` from the partitions it holds, waiting up to ``block_ms``."""

    async def ack(self, ids: Sequence[str]) -> None:
        """Mark changes processed: they leave their tenant's count and may be trimmed from the log."""

    async def release(self, consumer: str) -> None:
        """Give up ``consumer``'s leases: another consumer takes its partitions at once."""

    async def lag(self, consumer: str) -> dict[int, tuple[int, float]]:
        """For the metrics: per partition ``consumer`` holds, the changes not yet fanned out and the age
        in seconds of the oldest of them (a partition it does not hold is not named)."""

    async def overview(self) -> dict[int, tuple[str | None, int, float]]:
        """For the console: per partition fan-out reads now, the consumer holding it (None: nobody now)
        and ``lag``'s two figures, whoever holds it. A few round trips, never one per partition."""


class Broadcast(Protocol):
    """Processed changes, to every process of the deployment (for the listens each one holds)."""

    async def publish(self, changes: Sequence[tuple[str, Change]]) -> None:
        """Hand ``(change id, change)`` pairs, in log order per partition, to every process's handlers."""

    async def subscribe(self, handler: BroadcastHandler, on_lost: BroadcastLostHandler | None = None,
                        on_batch: BroadcastBatchHandler | None = None) -> Callable[[], Awaitable[None]]:
        """Call ``handler`` with every broadcast change until the returned function is awaited.

        Returns once the subscription is active. ``on_lost`` is called whenever broadcasts may
        have been missed since (a reconnect), after the subscription is active again.
        ``on_batch`` (for the metrics) gets the id of the oldest change of each batch handed on,
        just before ``handler`` gets its changes.

        Raises:
            BackendUnavailable: the subscription could not be made active.
        """


class RecordStore(Protocol):
    """The built-in record collections: each write or delete lands with its change, atomically."""

    async def write(self, tenant: str, collection: str, record_id: str, data: bytes, change: Change,
                    expect: bytes | None = None) -> bool:
        """Store a record and publish its change atomically; True when the record is new.

        ``change`` is published as given for a record that existed, and with kind ``created``
        for a new one: the store, not the caller, knows which. With ``expect``, the write
        happens only if the stored value is exactly ``expect`` (a compare-and-set).

        The tenant's quota (``max_records_per_tenant`` records, ``max_record_bytes_per_tenant``
        bytes of values) is checked and counted in the same atomic step; a write that does not
        grow the tenant's bytes passes even over a quota that was lowered.

        Raises:
            WriteConflict: ``expect`` was given and the stored value differs, or is gone.
            LimitExceeded: the write would pass the tenant's quota (message: ``record_quota_message``).
            QuotaExceeded, LogFull: the change log refused the change; nothing was stored.
        """

    async def read(self, tenant: str, collection: str, record_id: str) -> bytes | None: ...

    async def delete(self, tenant: str, collection: str, record_id: str, change: Change) -> bool:
        """Delete a record and publish its change atomically, freeing its share of the tenant's quota."""

    async def ids(self, tenant: str, collection: str, after: str, limit: int) -> list[str]:
        """Record ids of a collection in ascending order, strictly after ``after`` ('' for the start)."""

    async def collections(self, tenant: str) -> list[str]: ...


class Leases(Protocol):
    """Named leases, one holder at a time across the deployment."""

    async def hold(self, name: str, owner: str, ttl_ms: int) -> bool:
        """Take the lease, or renew it when ``owner`` holds it, for ``ttl_ms``; False when another holds it."""

    async def release(self, name: str, owner: str) -> None:
        """Give the lease up when ``owner`` holds it."""

    async def holder(self, name: str) -> str | None:
        """For the console: who holds the lease now; None when nobody does (or it lapsed)."""


class Demand(Protocol):
    """What the deployment wants watched, by key (an upstream's name): members (URIs), each with a
    deadline its wanters keep pushing back. A member stays past its deadline until ``drop``: the one
    reading it (``broker.upstreams.demand``) decides whether it is still wanted."""

    async def want(self, key: str, members: Sequence[str], until: float, most: int) -> list[str]:
        """Want ``members`` until ``until`` (Unix seconds) at least: a later deadline already set stays.
        A member not yet wanted is taken only while fewer than ``most`` are; those refused are returned."""

    async def wanted(self, key: str, limit: int) -> dict[str, float]:
        """The members wanted, each with its deadline (at most ``limit``: the latest deadlines)."""

    async def drop(self, key: str, members: Sequence[str], before: float) -> None:
        """Forget ``members`` whose deadline is before ``before`` (a wanter's later one keeps them)."""


class Credentials(Protocol):
    """Runtime API keys, by id and by the digest of the key (docs/BACKENDS.md, "Credentials")."""

    async def create(self, record: KeyRecord) -> bool | None:
        """Store a new key; False, storing nothing, when a key with its id or digest exists; None,
        storing nothing, when the key ``record.created_by`` names is gone or revoked (checked in the
        same step, so no key made after its maker's revocation escapes the revocation's cascade)."""

    async def find(self, digest: str) -> KeyRecord | None:
        """The key whose digest this is, revoked and expired ones included; None when there is none."""

    async def get(self, key_ids: Sequence[str]) -> dict[str, KeyRecord]:
        """The keys of these ids that exist, by id (one round trip however many)."""

    async def list(self, tenant: str | None, after: str, limit: int) -> list[KeyRecord]:
        """Up to ``limit`` keys of ``tenant`` (None: every tenant), in ascending id order, after ``after``."""

    async def revoke(self, key_id: str, at: float) -> bool | None:
        """Mark the key revoked at ``at``: True; False when it was revoked already (unchanged); None when unknown."""


class Quotas(Protocol):
    """Per-tenant counts held by leases, and per-tenant token buckets (``broker.quotas``)."""

    async def acquire(self, tenant: str, kind: str, holder: str, limit: int, ttl_ms: int) -> bool:
        """Hold a place of ``kind`` for ``ttl_ms``, or renew ``holder``'s; False when ``tenant`` holds
        ``limit`` live places of that kind already (lapsed ones do not count). Check and add are one step."""

    async def refresh(self, held: Sequence[tuple[str, str, str]], ttl_ms: int) -> None:
        """Renew ``(tenant, kind, holder)`` places for ``ttl_ms`` (re-adding any that lapsed)."""

    async def release(self, tenant: str, kind: str, holder: str) -> None: ...

    async def take(self, tenant: str, count: int, rate: float, burst: int, kind: str = "rate") -> float:
        """Take ``count`` tokens from the tenant's bucket of ``kind`` (``burst`` tokens, refilled at
        ``rate`` a second, one clock for every worker); 0 when taken, else the seconds until they
        would be there, nothing taken. ``rate``: publishing; ``verify``: webhook verifications."""


class Webhooks(Protocol):
    """Webhook subscriptions (``broker.events``) by id, and a bounded list of dead letters.

    Updates of an existing record (``refresh``, ``advance``, ``fail``) change only their own
    fields, in one step, and do nothing for a record that is gone: a refresh never puts back a
    cursor the delivering worker moved on, and a delivery never revives a removed subscription.
    """

    async def create(self, record: WebhookRecord, most: int, tenant_most: int | None = None) -> bool:
        """Store a new subscription; False, changing nothing, when one with its id exists.

        Raises:
            LimitExceeded: ``most`` subscriptions exist (the deployment's bound).
            OverQuota: ``tenant_most`` (when not None) of ``record.tenant``'s exist (its ``webhooks`` quota).
            Both are counted in the same atomic step as the create; nothing changes then.
        """

    async def get(self, subscription_id: str) -> WebhookRecord | None: ...

    async def page(self, after: str, limit: int) -> list[WebhookRecord]:
        """Up to ``limit`` subscriptions in ascending id order, strictly after ``after`` ('' for the start)."""

    async def refresh(self, subscription_id: str, expires_at: float, secret: str, credential: str | None) -> bool:
        """A new lease, secret and credential; False when the subscription is gone."""

    async def advance(self, subscription_id: str, since: tuple[str, str], session: str, epoch: str, offset: int,
                      delivered_at: float | None, *, gap: bool = False) -> bool:
        """Store the delivery position and whether a gap notice is owed from it, only while the record is
        still at ``since`` (session, epoch): False, changing nothing, for one that moved on or is gone.
        With ``delivered_at``, also the last delivery, clearing the last error."""

    async def fail(self, subscription_id: str, error: str, at: float) -> bool:
        """Record a failed attempt: its category, and since when deliveries fail (the first failure's time stays)."""

    async def remove(self, subscription_id: str, *, expired_by: float | None = None,
                     credential: str | None = None) -> str | None:
        """Forget a subscription; the hidden session it had, or None when unknown (or a condition failed).

        ``expired_by``: only if its lease expires at or before then; ``credential``: only if it is
        still bound to that credential. Both are checked in the step that removes it, so a refresh
        that came in since the caller read the record keeps it.
        """

    async def dead_letter(self, entry: DeadLetter, keep: int) -> None:
        """Add an entry, keeping only the newest ``keep``."""

    async def dead_letters(self, limit: int) -> list[DeadLetter]:
        """The newest ``limit`` entries, newest first."""


class Backend(Protocol):
    """One backend: its stores, and the lifecycle they share (one connection pool, one epoch)."""

    sessions: SessionStore
    subscriptions: SubscriptionIndex
    inboxes: Inboxes
    changelog: ChangeLog
    broadcast: Broadcast
    records: RecordStore
    leases: Leases
    demand: Demand
    credentials: Credentials
    quotas: Quotas
    webhooks: Webhooks

    async def start(self) -> None:
        """Connect and agree on the data generation. Raises ``BackendUnavailable``."""

    async def close(self) -> None: ...

    async def ping(self) -> None:
        """Raise ``BackendUnavailable`` when the store cannot be reached."""

    async def deliver(self, frames: Sequence[tuple[str, Frame]], changes: Sequence[tuple[str, Change]],
                      ids: Sequence[str], read_under: str = "") -> list[str]:
        """One fan-out batch's effects: ``inboxes.append(frames)``, ``broadcast.publish(changes)`` and
        ``changelog.ack(ids)``; returns the sessions that no longer exist (as ``append``). A backend may merge
        the three into fewer round trips, but nothing is acknowledged before its frames are appended and its
        changes broadcast: when this raises, the batch is redone, and the appends and the broadcast skip what
        they already had. ``read_under``, ``sessions.epoch`` before the read, keeps a batch that outlived
        the store's data out of the sessions made since (docs/BACKENDS.md, "A fan-out batch's effects").
        """


async def deliver_in_turn(backend: Backend, frames: Sequence[tuple[str, Frame]],
                          changes: Sequence[tuple[str, Change]], ids: Sequence[str]) -> list[str]:
    """``Backend.deliver`` as its three steps, one after the other, through the backend's attributes."""
    gone = await backend.inboxes.append(frames) if frames else []
    await backend.broadcast.publish(changes)
    await backend.changelog.ack(ids)
    return gone
