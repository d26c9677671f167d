"""What a feed is: its kind, its filter, and a position in its inbox. Pure: no I/O.

The record of a feed is ``backends.types.SessionRecord``; its ``kind`` and ``filter`` are
fields of their own, written by whoever creates the feed, never by a client: a 2025 client's
``initialize`` capabilities are kept as they came and mean nothing to the broker.

Records written before the kind was a field said it in ``client_capabilities`` (a resumable
listen under ``LEGACY_LISTEN``, a poll or webhook subscription under ``LEGACY_EVENTS``);
``legacy_kind`` reads them once, when such a record is loaded, until they expire
(``MCP_BROKER_SESSION_TTL`` after their last use).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final, Protocol

__all__ = ["LEGACY_FEED_VERSION", "MAX_FEED_ID", "Cursor", "FeedKind", "FeedOwner", "Filter", "Owner", "cursor_of",
           "format_event_id", "legacy_kind", "parse_event_id", "valid_id"]

#: Feed ids longer than this are never looked up (the broker's are 32 characters).
MAX_FEED_ID: Final = 128
#: Where a record of an older version kept a resumable listen's filter (``{"uris", "listChanged"}``).
LEGACY_LISTEN: Final = "dev.mcp-broker/listen"
#: Where it kept the inbox position a listen's last change of filter took effect at.
LEGACY_SINCE: Final = "dev.mcp-broker/listenSince"
#: Where it kept what a poll or webhook subscription serves (``{"name", "arguments", "mode", "id"?}``).
LEGACY_EVENTS: Final = "dev.mcp-broker/events"


class FeedKind(StrEnum):
    SESSION = "session"  # a 2025 session: Mcp-Session-Id, its GET stream, resources/subscribe
    LISTEN = "listen"  # a resumable 2026-07-28 listen
    POLL = "poll"  # events/poll
    WEBHOOK = "webhook"  # events/subscribe


class Owner(Protocol):
    """Whose a feed is: the tenant and the principal's key (``<tenant>/<subject>``) its record holds."""

    @property
    def tenant(self) -> str: ...

    @property
    def key(self) -> str: ...


@dataclass(frozen=True, slots=True)
class FeedOwner:
    """An ``Owner`` as a record keeps it (a webhook subscription's), rather than as a request authenticated it."""

    tenant: str
    key: str


@dataclass(frozen=True, slots=True)
class Filter:
    """What a feed other than a session watches; two filters are the same filter when equal."""

    uris: tuple[str, ...]
    list_changed: bool = False
    #: The event type (poll, webhook).
    event: str | None = None
    #: The webhook subscription it serves.
    subscription: str | None = None

    @classmethod
    def of(cls, uris: Any, list_changed: bool = False, event: str | None = None,
           subscription: str | None = None) -> Filter:
        """A filter with its URIs sorted and deduplicated."""
        return cls(tuple(sorted(set(uris))), list_changed, event, subscription)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"uris": list(self.uris), "listChanged": self.list_changed}
        if self.event is not None:
            out["event"] = self.event
        if self.subscription is not None:
            out["subscription"] = self.subscription
        return out

    @classmethod
    def from_dict(cls, value: dict[str, Any]) -> Filter:
        return cls.of(value.get("uris") or (), bool(value.get("listChanged")), value.get("event"),
                      value.get("subscription"))


def valid_id(value: str) -> bool:
    """Could ``value`` be a feed id the broker made (the bound, visible ASCII letters, digits, ``-``, ``_``)?"""
    if not value or len(value) > MAX_FEED_ID or not value.isascii():
        return False
    return all(c.isalnum() or c in "-_" for c in value)


def format_event_id(epoch: str, offset: int) -> str:
    """A position with its feed implied (a 2025 GET stream's SSE ``id``): ``<epoch>-<offset>``."""
    return f"{epoch}-{offset}"


def parse_event_id(value: str) -> tuple[str, int] | None:
    """``<epoch>-<offset>`` as issued by this broker; None for anything else."""
    epoch, sep, offset = value.strip().rpartition("-")
    # isascii(): str.isdigit() also accepts digits such as "²" that int() then refuses.
    if not sep or not epoch or not epoch.isascii() or not epoch.isalnum() or len(epoch) > 32:
        return None
    if not offset.isascii() or not offset.isdigit() or len(offset) > 19:
        return None
    return epoch, int(offset)


@dataclass(frozen=True, slots=True)
class Cursor:
    """A position in a feed's inbox: ``<feed>:<epoch>-<offset>``, opaque to clients.

    A resumable listen's event id, an events cursor and an event's ``eventId`` are cursors; a
    2025 GET stream's event id is the ``event_id`` part, its feed the stream's session.
    """

    feed: str
    epoch: str
    offset: int

    @classmethod
    def parse(cls, value: str) -> Cursor | None:
        """The cursor ``value`` spells, when the broker could have issued it; None for anything else."""
        feed, sep, rest = value.strip().partition(":")
        if not sep or not valid_id(feed):
            return None
        parsed = parse_event_id(rest)
        return None if parsed is None else cls(feed, *parsed)

    @property
    def event_id(self) -> str:
        return format_event_id(self.epoch, self.offset)

    def __str__(self) -> str:
        return cursor_of(self.feed, self.event_id)


def cursor_of(feed: str, event_id: str) -> str:
    """The cursor of the position ``event_id`` (``<epoch>-<offset>``) in ``feed``."""
    return f"{feed}:{event_id}"


#: The protocol version an older version wrote on every feed that was not a 2025 session.
LEGACY_FEED_VERSION = "2026-07-28"


def legacy_kind(capabilities: dict[str, Any]) -> tuple[FeedKind, Filter | None, tuple[str, int] | None]:
    """The kind, filter and refilter position of a record written before they were fields of their own."""
    listen = capabilities.get(LEGACY_LISTEN)
    if isinstance(listen, dict):
        since = capabilities.get(LEGACY_SINCE)
        position = (str(since[0]), int(since[1])) if isinstance(since, list | tuple) and len(since) == 2 else None
        return FeedKind.LISTEN, Filter.of(listen.get("uris") or (), bool(listen.get("listChanged"))), position
    events = capabilities.get(LEGACY_EVENTS)
    if isinstance(events, dict):
        kind = FeedKind.WEBHOOK if events.get("mode") == "webhook" else FeedKind.POLL
        uris = (events.get("arguments") or {}).get("uris") or ()
        return kind, Filter.of(uris, event=events.get("name"), subscription=events.get("id")), None
    return FeedKind.SESSION, None, None
