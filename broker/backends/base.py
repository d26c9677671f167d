"""The Backend seam: everything that outlives one HTTP request lives behind this protocol.

Two implementations exist: ``memory`` (one process, the embedded default and the reference
implementation) and ``redis`` (any number of workers). Both pass the same contract suite in
``tests/contract``. The guarantees every implementation gives:

Sessions
    A session record is created once, bound to the principal and tenant that created it, and
    expires after ``session_ttl`` seconds without a ``touch``. Deleting or expiring a session
    removes its subscriptions from the index and drops its inbox.

Subscriptions
    ``add_subscription`` updates the session's durable subscription set and the
    URI -> subscribers index in one atomic step; so does ``remove_subscription``. Both are
    idempotent, and both wake the session's watcher with the URI (a ``subscribe`` or
    ``unsubscribe`` wake, in the order the changes were made), so an open stream keeps an
    exact copy of the set without reading it again.

Restoring
    ``restore_session`` re-creates a session that the store lost (its data generation, the
    backend ``epoch``, changed) from the copy an open stream holds: the same id, tenant and
    principal, the current epoch, an empty inbox, and the given subscriptions in the index.
    It never overwrites a live session.

Inboxes
    Each session has a bounded inbox of frames with strictly increasing integer offsets.
    ``append_frames`` appends each session's frames and wakes the stream that watches that
    session in one atomic step per session, so a watcher that registered before reading the
    inbox can never miss a frame (the replay -> live handoff, docs/ARCHITECTURE.md). Frames are kept
    while they are among the newest ``inbox_maxlen`` and younger than ``inbox_retention`` seconds.
    Appends are idempotent per change: a frame that names the change behind it
    (``Frame.change``) is skipped when an earlier call already appended to that session a frame
    of the same partition's change at least as new. One consumer at a time fans out a
    partition, in log order, and a redone batch repeats the same changes in the same order, so
    what is skipped is exactly a repeat (or a lapsed holder's late frame, which would otherwise
    cross newer ones). Frames of one call are weighed against what came before the call, so
    the frames of one change to several URIs all land.
    ``read_inbox`` returns frames strictly after a cursor, in offset order, and reports a
    *gap* when the cursor cannot be honoured: another epoch, an offset older than what is
    retained, or an offset beyond the newest frame (data that was lost).

Change log
    ``publish`` appends a change durably and returns its id, or refuses it before appending
    anything: ``QuotaExceeded`` when its tenant has ``changelog_tenant_max`` changes not yet
    fanned out, ``LogFull`` when its partition holds ``changelog_maxlen``; the check, the
    append and the count are one atomic step. A change leaves the log only once it is
    acknowledged: nothing unread or pending is ever dropped to make room. ``read_changes`` hands each
    change to exactly one consumer of the fan-out group; it stays pending until ``ack_changes``.
    Each partition of the log is read by one consumer at a time, the holder of its lease
    (renewed by every read, lapsing ``fanout_claim_idle_ms`` after the last), so changes are
    fanned out in the order they were published; a consumer that takes a partition over first
    gets what the last holder left pending. ``claim_changes`` moves changes that stayed pending
    longer than ``min_idle_ms`` to the caller: delivery is at least once. ``release_changes``
    gives up a consumer's leases (it is stopping), so another takes over at once.

Listen broadcast
    ``broadcast`` delivers a change that fan-out processed to every worker's ``on_broadcast``
    handlers (modern listens live on whichever worker holds their stream). There is no replay
    (a listen stream has none by specification), but no silent loss either: when broadcasts to
    this process may have been lost (on Redis, its pub/sub connection dropped), the ``on_lost``
    callback given to ``on_broadcast`` is called once the broadcast channel is subscribed again,
    so that every broadcast from then on arrives; the caller resynchronises its listens. A
    backend that cannot lose a broadcast (memory) never calls it. Each change is broadcast with
    its id, and a process hands a change to its handlers at most once: one that is not newer
    than the newest it handed on from the same partition is a repeat (a batch redone after its
    broadcast went out) or a lapsed holder's late batch, and is dropped, so listens get no
    duplicate and no crossing either.

Records
    JSON records of the built-in collections. ``write_record`` and ``delete_record`` store the
    record and publish its change in one atomic step, so an acknowledged write is never
    missing from the change log.

Errors
    Every method may raise :class:`broker.errors.BackendUnavailable` when the store cannot be
    reached; nothing else from the underlying client library escapes.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from broker.changes import Change

if TYPE_CHECKING:
    from broker.config import Settings

__all__ = [
    "CLOSE_ALL",
    "Backend",
    "BroadcastFilter",
    "BroadcastHandler",
    "BroadcastLostHandler",
    "Frame",
    "InboxRead",
    "SessionRecord",
    "StreamClaim",
    "StreamStart",
    "Wake",
    "WakeHandler",
    "record_quota_message",
    "change_position",
    "deliver_broadcast",
]

logger = logging.getLogger(__name__)


def record_quota_message(settings: Settings, *, count: bool) -> str:
    """What a write refused by the tenant's record quota is told, from either backend."""
    if count:
        return f"the tenant's record quota is reached: at most {settings.max_records_per_tenant} records"
    return f"the tenant's record quota is reached: at most {settings.max_record_bytes_per_tenant} bytes of records"


@dataclass(frozen=True, slots=True)
class Frame:
    """One message waiting in a session inbox.

    ``key`` names what the frame is about (``u:<uri>`` for an update, ``l`` for list_changed);
    a slow reader may keep only the newest frame of each key in a batch, because both are
    level triggers. ``data`` is the encoded JSON-RPC notification. ``change`` is the id of the
    change the frame announces (``''`` for frames no change is behind); only ``append_frames``
    reads it, it is not stored, and it takes no part in comparisons.
    """

    key: str
    data: bytes
    change: str = field(default="", compare=False)


def change_position(change_id: str) -> tuple[str, str] | None:
    """A change id as (partition, position): positions of one partition compare as strings in log order.

    Ids are ``[<partition>:]<ms>-<seq>`` (a Redis stream id; the memory backend has no
    partition). The position is both numbers zero-padded to 20 digits, digits only, so a Lua
    script compares it exactly, without numbers (doubles) and whatever the server's collation.
    None for an id of another form: such a frame is appended unconditionally.
    """
    partition, _, entry = change_id.rpartition(":")
    ms, _, seq = entry.partition("-")
    if not (entry.isascii() and ms.isdigit() and seq.isdigit() and len(ms) <= 20 and len(seq) <= 20):
        return None
    return partition, ms.rjust(20, "0") + seq.rjust(20, "0")


def deliver_broadcast(handlers: Sequence[BroadcastHandler], changes: Sequence[Change]) -> None:
    """Hand each change to each handler; one that fails costs that change and that handler alone."""
    for handler in list(handlers):
        for change in changes:
            try:
                handler(change)
            except Exception:  # a handler's bug must not cost every other listen the rest of the batch
                logger.exception("a broadcast handler failed on a change of %s", change.uri)


class BroadcastFilter:
    """Which broadcast changes a process has not handed on yet: the newest position per partition.

    Fan-out broadcasts a partition's changes in log order (one holder at a time), so a change
    whose position is not beyond the newest one seen from its partition was handed on already
    (a redone batch) or is older than one that was (a lapsed holder's late batch). Changes
    with an id of another form always pass. A dict entry per partition: nothing per change.
    """

    __slots__ = ("_newest",)

    def __init__(self) -> None:
        self._newest: dict[str, str] = {}

    def fresh(self, change_id: str) -> bool:
        position = change_position(change_id)
        if position is None:
            return True
        partition, at = position
        if at <= self._newest.get(partition, ""):
            return False
        self._newest[partition] = at
        return True



@dataclass(slots=True)
class SessionRecord:
    """The durable part of a legacy (handshake-era) session."""

    id: str
    tenant: str
    principal: str
    protocol_version: str
    epoch: str
    created_at: float
    client_info: dict[str, Any] = field(default_factory=dict)
    client_capabilities: dict[str, Any] = field(default_factory=dict)
    initialized: bool = False


@dataclass(frozen=True, slots=True)
class InboxRead:
    """What ``read_inbox`` found after a cursor.

    ``head`` is the newest offset in the inbox (0 when it never held a frame); on a gap,
    ``frames`` is empty and the caller resynchronises, then continues from ``head``.
    ``gone``: the session no longer exists (ended, expired, or lost with the store's data;
    ``epoch`` is then the store's current one, so a caller can tell loss from an ending).
    """

    epoch: str
    frames: list[tuple[int, Frame]]
    gap: bool
    head: int
    gone: bool = False


@dataclass(frozen=True, slots=True)
class Wake:
    """A wake-up for the stream watching a session.

    ``kind`` is ``frames`` (new frames after ``offset``), ``takeover`` (the stream that
    claimed the session as ``generation`` now holds it; every stream of an older generation
    must close), or ``subscribe`` / ``unsubscribe`` (``uri`` joined or left the session's
    subscriptions).
    """

    kind: str
    offset: int = 0
    generation: int = 0
    uri: str = ""
    #: The frame at ``offset``, when the backend can carry it (saves the stream a read).
    frame: Frame | None = None


#: The generation of a takeover that closes every stream of the session (it was deleted).
CLOSE_ALL = 2**63 - 1


@dataclass(frozen=True, slots=True)
class StreamClaim:
    """The outcome of ``claim_stream``."""

    #: Whether the session had a stream before this claim.
    had_stream: bool
    #: This claim's generation; larger than every earlier claim's of the session.
    generation: int


@dataclass(frozen=True, slots=True)
class StreamStart:
    """The outcome of ``start_stream``."""

    subscriptions: set[str]
    claim: StreamClaim
    read: InboxRead


WakeHandler = Callable[[Wake], None]
BroadcastHandler = Callable[[Change], None]
#: Called when broadcasts may have been lost; the channel is live again by then.
BroadcastLostHandler = Callable[[], None]


class Backend(Protocol):
    """Shared state of the broker. See the module docstring for the guarantees."""

    #: Short identifier of this backend's data generation; a store that lost its data gets a new one.
    epoch: str

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def ping(self) -> None:
        """Raise ``BackendUnavailable`` when the store cannot be reached."""

    # -- sessions -----------------------------------------------------------------------
    async def create_session(self, record: SessionRecord) -> None: ...

    async def get_session(self, session_id: str, *, touch_as: str | None = None) -> SessionRecord | None:
        """The session's record, or None. ``touch_as`` (a principal key) also restarts its idle
        clock in the same step, when the session belongs to that principal."""

    async def update_session(self, session_id: str, **fields: Any) -> None: ...

    async def touch_sessions(self, session_ids: Sequence[str]) -> None:
        """Restart the idle clock of each live session (unknown ids are ignored)."""

    async def delete_session(self, session_id: str) -> bool:
        """End a session: record, subscriptions, index entries and inbox. False if unknown."""

    async def restore_session(self, record: SessionRecord, subscriptions: Collection[str]) -> bool:
        """Re-create a session the store lost, with ``subscriptions``; sets ``record.epoch`` to the current epoch.

        Returns False, changing nothing, when a session with that id exists (someone restored
        it first, or it was never lost); the caller then reads it with ``get_session``.
        """

    async def count_sessions(self) -> int: ...

    async def expire_sessions(self) -> int:
        """Remove sessions idle longer than the TTL; returns how many (a no-op where the store expires keys)."""

    # -- subscriptions --------------------------------------------------------------------
    async def add_subscription(self, session_id: str, tenant: str, uri: str, limit: int = 0) -> int:
        """Subscribe; returns the session's subscription count after the call (0: the session is gone).

        Raises:
            LimitExceeded: ``uri`` is new and the session already has ``limit`` (when > 0) subscriptions;
                nothing changes then. The check and the add are one atomic step.
        """

    async def remove_subscription(self, session_id: str, tenant: str, uri: str) -> None: ...

    async def get_subscriptions(self, session_id: str) -> set[str]: ...

    async def subscribers(self, tenant: str, uris: Sequence[str]) -> dict[str, list[str]]:
        """Session ids subscribed to each URI (URIs without subscribers may be left out)."""

    async def tenant_sessions(self, tenant: str) -> list[str]: ...

    # -- inboxes and wake-ups ------------------------------------------------------------
    async def append_frames(self, batch: Sequence[tuple[str, Frame]]) -> list[str]:
        """Append ``(session_id, frame)`` pairs; returns the session ids that no longer exist.

        A frame whose ``change`` is not newer than the newest change of its partition that an
        earlier call appended to the session is skipped (see "Inboxes" above): it takes no
        offset and wakes nobody.
        """

    async def read_inbox(self, session_id: str, epoch: str, after: int, limit: int) -> InboxRead: ...

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
        its claim (``claim_stream``) and then the first read of its inbox (``read_inbox``)."""

    # -- change log and fan-out ------------------------------------------------------------
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

    async def read_changes(self, consumer: str, count: int, block_ms: int) -> list[tuple[str, Change]]: ...

    async def ack_changes(self, ids: Sequence[str]) -> None:
        """Mark changes processed: they leave their tenant's count and may be trimmed from the log."""

    async def claim_changes(self, consumer: str, min_idle_ms: int, count: int) -> list[tuple[str, Change]]: ...

    async def release_changes(self, consumer: str) -> None: ...

    async def broadcast(self, changes: Sequence[tuple[str, Change]]) -> None:
        """Hand ``(change id, change)`` pairs, in log order per partition, to every process's handlers."""

    async def on_broadcast(self, handler: BroadcastHandler,
                           on_lost: BroadcastLostHandler | None = None) -> Callable[[], Awaitable[None]]:
        """Call ``handler`` with every broadcast change until the returned function is awaited.

        Returns once the subscription is active. ``on_lost`` is called whenever broadcasts may
        have been missed since (a reconnect), after the subscription is active again.

        Raises:
            BackendUnavailable: the subscription could not be made active.
        """

    # -- records ---------------------------------------------------------------------------
    async def write_record(self, tenant: str, collection: str, record_id: str, data: bytes, change: Change,
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
        """

    async def read_record(self, tenant: str, collection: str, record_id: str) -> bytes | None: ...

    async def delete_record(self, tenant: str, collection: str, record_id: str, change: Change) -> bool:
        """Delete a record and publish its change atomically, freeing its share of the tenant's quota."""

    async def list_records(self, tenant: str, collection: str, after: str, limit: int) -> list[str]:
        """Record ids of a collection in ascending order, strictly after ``after`` ('' for the start)."""

    async def list_collections(self, tenant: str) -> list[str]: ...
