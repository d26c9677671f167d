"""What the backend protocols exchange, and the rules both backends apply the same way. Pure: no I/O.

The data types (``Frame``, ``SessionRecord``, ``InboxRead``, ``Wake``, ...) are what crosses the
seam in ``broker.backends.base``. The rules are written once here and used by every backend:

* ``inbox_gap``: when a cursor into an inbox cannot be honoured (the gap rule's trigger);
* ``change_position`` and ``BroadcastFilter``: how a change's place in the log is compared, so
  that a redone batch reaches no inbox and no listen twice;
* ``Handlers``: the registry of local callbacks (stream wake-ups, broadcast handlers), where
  one handler's failure costs only that handler.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Literal, TypeVar

from broker.changes import Change
from broker.feeds.model import FeedKind, FeedOwner, Filter

if TYPE_CHECKING:
    from broker.config import Settings

__all__ = [
    "CLOSE_ALL",
    "BroadcastBatchHandler",
    "BroadcastFilter",
    "DeadLetter",
    "BroadcastHandler",
    "BroadcastLostHandler",
    "Frame",
    "Handlers",
    "InboxRead",
    "KeyRecord",
    "SessionRecord",
    "StreamClaim",
    "StreamStart",
    "Wake",
    "WakeHandler",
    "WakeKind",
    "WebhookRecord",
    "change_position",
    "generation",
    "inbox_gap",
    "record_quota_message",
]

logger = logging.getLogger(__name__)

#: The generation of a takeover that closes every stream of the session (it was deleted).
CLOSE_ALL: Final = 2**63 - 1


@dataclass(frozen=True, slots=True)
class Frame:
    """One message waiting in a session inbox.

    ``key`` names what the frame is about (``u:<uri>`` for an update, ``l`` for list_changed);
    a slow reader may keep only the newest frame of each key in a batch, because both are
    level triggers. ``data`` is the encoded JSON-RPC notification. ``change`` is the id of the
    change the frame announces (``''`` for frames no change is behind); only ``Inboxes.append``
    reads it, it is not stored, and it takes no part in comparisons.
    """

    key: str
    data: bytes
    change: str = field(default="", compare=False)


@dataclass(slots=True)
class SessionRecord:
    """The durable part of a feed (``broker.feeds``): a 2025 session, or a resumable listen, a poll
    or a webhook subscription, as ``kind`` says; ``filter`` is what a feed other than a session watches."""

    id: str
    tenant: str
    principal: str
    protocol_version: str
    epoch: str
    created_at: float
    client_info: dict[str, Any] = field(default_factory=dict)
    client_capabilities: dict[str, Any] = field(default_factory=dict)
    initialized: bool = False
    kind: FeedKind = FeedKind.SESSION
    filter: Filter | None = None
    #: ``(epoch, offset)``: the inbox position the feed's last change of filter took effect at.
    since: tuple[str, int] | None = None
    #: A 2025 session's own sessions at the MCP servers behind the broker (``broker.upstreams``):
    #: upstream name to ``[its session id, its protocol version]``, so any worker can forward.
    upstreams: dict[str, list[str]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class InboxRead:
    """What ``Inboxes.read`` found after a cursor.

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


WakeKind = Literal["frames", "takeover", "subscribe", "unsubscribe"]


@dataclass(slots=True)  # not frozen: a frozen one sets each field through object.__setattr__ (one per frame)
class Wake:
    """A wake-up for the stream watching a session. Never changed once made.

    ``kind`` is ``frames`` (new frames after ``offset``), ``takeover`` (the stream that
    claimed the session as ``generation`` now holds it; every stream of an older generation
    must close), or ``subscribe`` / ``unsubscribe`` (``uri`` joined or left the session's
    subscriptions).
    """

    kind: WakeKind
    offset: int = 0
    generation: int = 0
    uri: str = ""
    #: The frame at ``offset``, when the backend can carry it (saves the stream a read).
    frame: Frame | None = None


@dataclass(frozen=True, slots=True)
class StreamClaim:
    """The outcome of ``Inboxes.claim_stream``."""

    #: Whether the session had a stream before this claim.
    had_stream: bool
    #: This claim's generation; larger than every earlier claim's of the session.
    generation: int


@dataclass(frozen=True, slots=True)
class StreamStart:
    """The outcome of ``Inboxes.start_stream``."""

    subscriptions: set[str]
    claim: StreamClaim
    read: InboxRead


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """A runtime API key as ``Credentials`` stores it: never the key itself, only its ``digest``.

    Times are Unix seconds; ``expires_at`` None: never expires; ``revoked_at`` None: not revoked.
    """

    id: str
    #: SHA-256 of the key, hex: what a presented key is looked up by.
    digest: str
    tenant: str
    subject: str
    scopes: tuple[str, ...]
    created_at: float
    expires_at: float | None = None
    revoked_at: float | None = None
    #: The key whose holder made this one through the admin API (None: the operator, or an OAuth
    #: token): revoking that key revokes this one too.
    created_by: str | None = None

    def valid(self, now: float) -> bool:
        """Not revoked and not expired at ``now``."""
        return self.revoked_at is None and (self.expires_at is None or now < self.expires_at)


WakeHandler = Callable[[Wake], None]
BroadcastHandler = Callable[[Change], None]
#: Called with the id of the oldest change of each batch, before its changes are handed on (the
#: metrics' clock: an id tells when its change was accepted).
BroadcastBatchHandler = Callable[[str], None]
#: Called when broadcasts may have been lost; the channel is live again by then.
BroadcastLostHandler = Callable[[], None]


def inbox_gap(cursor_epoch: str, epoch: str, after: int, head: int, oldest: int) -> bool:
    """Whether a cursor ``after`` (of data generation ``cursor_epoch``) cannot be honoured.

    ``epoch`` and ``head`` are the session's; ``oldest`` is the offset of the oldest frame still
    retained (``head + 1`` when none is). A cursor of another generation, one beyond the newest
    frame (data was lost), and one older than what is retained (frames were trimmed or aged
    out) are gaps; the stream then applies the gap rule instead of replaying.
    """
    return cursor_epoch != epoch or after > head or after < oldest - 1


def generation(epoch: str) -> str:
    """The data generation of a session's epoch: the store's epoch when the session was made.

    A session met on a new Redis lineage (a promoted replica, a restarted server) takes the
    epoch ``<generation>r<lineage>`` (``redis/lineage.lua``) with its data generation
    unchanged; whether a vanished session was ended or lost with the store's data is judged by
    the generation alone.
    """
    return epoch.partition("r")[0]


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


K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Handlers(dict[K, list[Callable[[V], None]]]):
    """Local callbacks registered under a key: a session's stream wake-ups, the broadcast's handlers.

    A dict of key -> handlers, so the per-frame question "is anyone watching this session?" is
    a plain ``in`` (C, no Python call). ``call`` hands each value to each handler of the key, in
    registration order; a handler that raises is logged and costs only itself that value, never
    the other handlers nor the rest of the values.
    """

    __slots__ = ("_what",)

    def __init__(self, what: str) -> None:
        super().__init__()
        self._what = what

    def add(self, key: K, handler: Callable[[V], None]) -> bool:
        """Register ``handler``; True when it is the first of its key."""
        handlers = self.setdefault(key, [])
        handlers.append(handler)
        return len(handlers) == 1

    def remove(self, key: K, handler: Callable[[V], None]) -> bool:
        """Unregister ``handler`` (once); True when its key has no handler left. Unknown ones are ignored."""
        handlers = self.get(key)
        if handlers is None or handler not in handlers:
            return False
        handlers.remove(handler)
        if handlers:
            return False
        del self[key]
        return True

    def snapshot(self) -> list[K]:
        """The keys now, safe to iterate while handlers come and go."""
        return list(self)

    def call(self, key: K, *values: V) -> None:
        handlers = self.get(key)
        if not handlers:
            return
        # No copy: handlers come and go in ``watch`` / ``unwatch``, never from inside a call.
        for handler in handlers:
            for value in values:
                try:
                    handler(value)
                except Exception:  # one handler's bug must not cost the others, or the rest of the values
                    logger.exception("a %s handler failed", self._what)


def record_quota_message(settings: Settings, *, count: bool) -> str:
    """What a write refused by the tenant's record quota is told, from either backend."""
    if count:
        return f"the tenant's record quota is reached: at most {settings.max_records_per_tenant} records"
    return f"the tenant's record quota is reached: at most {settings.max_record_bytes_per_tenant} bytes of records"


@dataclass(frozen=True, slots=True)
class WebhookRecord:
    """A webhook subscription of the events extension (``broker.events``), as ``Webhooks`` stores it.

    ``id`` is derived from (principal, url, name, arguments), so a second subscribe of the same
    key finds it. Deliveries read the hidden ``session``'s inbox after ``offset`` (of data
    generation ``epoch``): everything up to it was delivered or dead-lettered. Times are Unix
    seconds; ``secret`` is the client's ``whsec_`` value, needed to sign every delivery.
    """

    id: str
    tenant: str
    principal: str
    name: str
    arguments: dict[str, Any]
    url: str
    secret: str
    session: str
    epoch: str
    offset: int
    expires_at: float
    created_at: float
    delivered_at: float | None = None
    #: A category (``timeout``, ``http_5xx``, ...), never the endpoint's own words.
    last_error: str | None = None
    failed_since: float | None = None
    #: The stored API key the subscriber called with (``Principal.credential``): revoked, the subscription ends.
    credential: str | None = None
    #: A gap notice is owed from ``offset``: stored with the position it starts from, cleared once it was
    #: acknowledged, so a worker that stops halfway leaves it to the next one.
    gap: bool = False

    @property
    def owner(self) -> FeedOwner:
        """Whose the subscription is, as its feed records it: a new feed for it is that principal's."""
        return FeedOwner(self.tenant, self.principal)


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """An event a webhook subscription gave up on, kept (boundedly) for an operator to inspect."""

    subscription: str
    tenant: str
    url: str
    event_id: str
    #: The delivery's JSON body, as it was sent.
    body: str
    attempts: int
    error: str
    at: float
