"""Resumable listens: a 2026-07-28 listen that loses nothing when its stream drops, on any worker.

A plain listen has no replay (the specification removed it). A client that asks for the
extension ``RESUMABLE`` (under ``extensions`` in its ``io.modelcontextprotocol/clientCapabilities``)
gets a listen kept the way a legacy session is, because that is what a legacy session already
is: a record bound to the principal, the filter's URIs as its subscriptions, and the inbox that
fan-out appends to, readable by any worker. The stream is a ``SessionStream`` of that feed
(kind ``listen``), written through ``ListenWriter``, which makes each inbox frame the listen's
notification (its ``subscriptionId`` in ``_meta``) and gives it an event id ``<session>:<epoch>-<offset>``.

Over HTTP the id is the SSE ``id:``; a new ``subscriptions/listen`` with the same filter and a
``Last-Event-ID`` header, on any worker, replays every notification after it (coalesced per
URI), then goes live, with no gap at the handoff (the session stream's watch-then-read). On
stdio the id travels in each notification's ``_meta`` under ``EVENT_ID``, and comes back in the
listen request's ``_meta`` under ``LAST_EVENT_ID``. An id the broker cannot honour (the session
expired or was never this principal's, another filter, a position from before the listen's
last change of filter, another data epoch, a position trimmed from the inbox) gets the gap
rule: an ``updated`` for every URI of the filter, and ``list_changed`` if the filter asked for
it; never another principal's frames, nor those of URIs the filter no longer has.

The state expires as a legacy session does, ``session_ttl`` after its stream was last open.

Opening one (``ResumableListens``): a resumable listen is a feed of kind ``listen`` whose filter is
the listen's (``Feeds``): a new one is subscribed to every URI of the filter *before* the stream
starts, so that what is published from the moment its subscriptions exist waits in its inbox: the
ack follows that moment, and nothing after it is missed. A resumption names the feed and a position
in the last event id it received; the same principal with the same filter continues from there (the
session stream's replay, then live), and with another filter keeps its feed, refiltered, and starts
with the gap rule. The refilter records the inbox position it took effect at: an id from before it
gets the gap rule too, even with the filter the listen now has, because what follows it in the inbox
is of the old filter (URIs no longer watched) and lacks the new filter's changes from before the
refilter. An id of a feed that has expired or is another principal's gets a new listen that starts
with the gap rule: the client re-reads what it watches and loses nothing, and never sees a frame of
a feed that is not its own.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Final

from broker.auth import Principal
from broker.backends.types import SessionRecord
from broker.delivery.stream import EndReason, StreamMetrics, Writer
from broker.feeds.model import Cursor, FeedKind, Filter, cursor_of
from broker.feeds.service import Feeds
from broker.feeds.session import SessionServices, SessionStream
from broker.notifications import LIST_CHANGED, ListChanged, decode, encode_list_changed, encode_update
from broker.protocol import jsonrpc as rpc
from broker.protocol import messages
from broker.protocol.jsonrpc import Id

__all__ = ["EVENT_ID", "LAST_EVENT_ID", "RESUMABLE", "RESUMED", "ListenWriter", "ResumableListen",
           "ResumableListens", "last_event_id", "wants_resumable"]


#: The extension's identifier (``server/discover`` ``capabilities.extensions``, and the client's).
RESUMABLE: Final = "dev.mcp-broker/resumable-listen"
#: Where a notification of a resumable listen carries its event id on stdio (``params._meta``).
EVENT_ID: Final = "dev.mcp-broker/eventId"
#: Where a resuming listen request carries the last event id it received on stdio (``params._meta``).
LAST_EVENT_ID: Final = "dev.mcp-broker/lastEventId"
#: In the ack's ``_meta``: True when the listen continues one the broker knew, False when it is new
#: (or starts with the gap rule because the id could not be honoured).
RESUMED: Final = "dev.mcp-broker/resumed"
_CLIENT_CAPABILITIES: Final = "io.modelcontextprotocol/clientCapabilities"


def wants_resumable(params: dict[str, Any]) -> bool:
    """Did the client ask for the extension in this request's ``_meta``?"""
    caps = (params.get("_meta") or {}).get(_CLIENT_CAPABILITIES)
    extensions = caps.get("extensions") if isinstance(caps, dict) else None
    return isinstance(extensions, dict) and isinstance(extensions.get(RESUMABLE), dict)


class ListenWriter:
    """A session stream's writer that speaks as a listen: the ack first, each frame stamped.

    The stream primes its writer with its starting position (``prime``): that is when the ack is
    sent, carrying the position as its id, so a client cut right after the ack resumes from
    there. A frame the filter did not ask for (``list_changed``) is not sent; its id moves onto
    the last frame sent before it in the same write, or, alone, goes out as an id-only event.
    The stream's own ``retry:`` is held back: ``ResumableListen`` decides how the listen ends.
    """

    __slots__ = ("_ack", "_inner", "_list_changed", "_resumed", "_session_id", "_stamp", "_stdio", "acked")

    def __init__(self, inner: Writer, session_id: str, request_id: Id, ack: dict[str, Any], list_changed: bool, *,
                 resumed: bool, stdio: bool) -> None:
        self._inner = inner
        self._resumed = resumed
        self._session_id = session_id
        self._stamp: dict[str, Any] = {"io.modelcontextprotocol/subscriptionId": request_id}
        self._ack = ack
        self._list_changed = list_changed
        self._stdio = stdio
        self.acked = False

    def _id(self, event_id: str | None) -> str | None:
        return None if event_id is None else cursor_of(self._session_id, event_id)

    def _stamped(self, event_id: str | None) -> dict[str, Any]:
        if self._stdio and event_id is not None:
            return {**self._stamp, EVENT_ID: event_id}
        return self._stamp

    def _frame(self, data: bytes, event_id: str | None) -> bytes:
        decoded = decode(data)
        if isinstance(decoded, ListChanged):
            return encode_list_changed(self._stamped(event_id))
        if decoded is None:
            return data  # the inbox holds nothing else; a frame of another kind is passed on as it is
        return encode_update(decoded.uri, decoded.meta, self._stamped(event_id))

    async def send_ack(self, event_id: str | None) -> None:
        self.acked = True
        stamp = {**self._stamped(event_id), RESUMED: self._resumed}
        await self._inner.send(messages.encode_notification(
            "notifications/subscriptions/acknowledged", {"_meta": stamp, "notifications": self._ack}), event_id)

    async def send(self, message: bytes, event_id: str | None = None) -> None:
        await self.send_many([(message, event_id)])

    async def send_many(self, items: list[tuple[bytes, str | None]]) -> None:
        out: list[tuple[bytes, str | None]] = []
        skipped: str | None = None
        for data, event_id in items:
            full = self._id(event_id)
            if data == LIST_CHANGED.data and not self._list_changed:
                if full is None:
                    continue
                if out:
                    out[-1] = (out[-1][0], full)  # positions only grow: the later id covers the earlier frame
                else:
                    skipped = full
                continue
            out.append((self._frame(data, full), full))
        if out:
            await self._inner.send_many(out)
        elif skipped is not None and not self._stdio:
            await self._inner.prime(skipped)  # an id-only event: the client's position moves on

    async def comment(self) -> None:
        await self._inner.comment()

    async def retry(self) -> None:
        """Held back: the listen's end is ``ResumableListen.run``'s."""

    async def prime(self, event_id: str) -> None:
        await self.send_ack(self._id(event_id))


class ResumableListen(SessionStream):
    """A resumable listen's stream: its feed's session stream, spoken as a listen (``ListenWriter``).

    It ends as a listen does: ``complete`` for a graceful end (this worker stops, the credential
    ended), ``retry:`` where the client should come back at once, nothing when the client left;
    in every case the client may resume with the last id it received.
    """

    __slots__ = ("ack", "list_changed", "request_id", "resumed", "server_meta", "stdio")

    kind = FeedKind.LISTEN

    def __init__(self, services: SessionServices, session: SessionRecord, cursor: int | None, *, resync: bool,
                 request_id: Id, ack: dict[str, Any], list_changed: bool, server_meta: dict[str, Any],
                 stdio: bool) -> None:
        super().__init__(services, session, cursor, resync=resync, priming=True)
        #: It continues a listen the broker knew, from the client's position (its ack says so).
        self.resumed = cursor is not None and not resync
        self.request_id = request_id
        self.ack = ack
        self.list_changed = list_changed
        self.server_meta = server_meta
        self.stdio = stdio

    async def run(self, writer: Writer) -> EndReason:
        listen_writer = ListenWriter(writer, self.session.id, self.request_id, self.ack, self.list_changed,
                                     resumed=self.resumed, stdio=self.stdio)
        reason = await super().run(listen_writer)
        if not listen_writer.acked and reason is not EndReason.DISCONNECT:
            await listen_writer.send_ack(None)  # ended before its start: the client still learns what it asked
        if reason.completes:
            await writer.send(messages.complete_result(self.request_id, self.server_meta,
                                                       {"io.modelcontextprotocol/subscriptionId": self.request_id}))
        elif reason.reconnect:
            await writer.retry()
        return reason



def last_event_id(params: dict[str, Any], header: str | None) -> str | None:
    """The position a listen request resumes from: the ``Last-Event-ID`` header over HTTP, the
    ``_meta`` key on stdio (where there are no headers).

    Raises:
        RpcError: -32602 (400) for a ``_meta`` value that is not a string.
    """
    if header is not None:
        return header
    value = (params.get("_meta") or {}).get(LAST_EVENT_ID)
    if value is not None and not isinstance(value, str):
        raise rpc.RpcError(rpc.INVALID_PARAMS, f"_meta.{LAST_EVENT_ID} must be a string", invalid=True)
    return value


class ResumableListens:
    """Opens resumable listens on feeds and their streams."""

    def __init__(self, feeds: Feeds, services: SessionServices, metrics: StreamMetrics,
                 server_meta: dict[str, Any]) -> None:
        """``metrics``: the listens' (their streams count as 2026-07-28's, not as 2025 GET streams)."""
        self.feeds = feeds
        self.services = replace(services, metrics=metrics)
        self.server_meta = server_meta

    async def open(self, principal: Principal, request_id: Id, uris: list[str], list_changed: bool,
                   ack: dict[str, Any], resume_from: str | None, *, stdio: bool = False) -> ResumableListen:
        """The listen's stream, from ``resume_from`` (an event id it was sent) or new.

        Raises:
            RpcError: -32602 (400) for an id this broker never issues.
            LimitExceeded, OverQuota: a new listen's feed is over the sessions' limits, or its
                filter over the tenant's ``subscriptions`` quota (nothing is created then).
        """
        cursor: Cursor | None = None
        if resume_from is not None:
            cursor = Cursor.parse(resume_from)
            if cursor is None:
                raise rpc.RpcError(rpc.INVALID_PARAMS, "Last-Event-ID is not an event id of a resumable listen",
                                   invalid=True)
        position = await self.feeds.resume(principal, cursor, FeedKind.LISTEN, Filter.of(uris, list_changed))
        # A listen resumed with the gap rule starts from the head, a new one from its (empty) inbox's start.
        after = 0 if position.resync and not position.new else position.after
        listen = ResumableListen(self.services, position.feed, after, resync=position.resync, request_id=request_id,
                                 ack=ack, list_changed=list_changed, server_meta=self.server_meta, stdio=stdio)
        listen.bind(principal.credential, principal.expires_at)
        return listen
