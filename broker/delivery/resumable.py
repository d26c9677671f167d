"""Resumable listens: a 2026-07-28 listen that loses nothing when its stream drops, on any worker.

A plain listen has no replay (the specification removed it). A client that asks for the
extension ``RESUMABLE`` (under ``extensions`` in its ``io.modelcontextprotocol/clientCapabilities``)
gets a listen kept the way a legacy session is, because that is what a legacy session already
is: a record bound to the principal, the filter's URIs as its subscriptions, and the inbox that
fan-out appends to, readable by any worker. The stream is a ``LegacyStream`` of that session,
written through ``ListenWriter``, which makes each inbox frame the listen's notification (its
``subscriptionId`` in ``_meta``) and gives it an event id ``<session>:<epoch>-<offset>``.

Over HTTP the id is the SSE ``id:``; a new ``subscriptions/listen`` with the same filter and a
``Last-Event-ID`` header, on any worker, replays every notification after it (coalesced per
URI), then goes live, with no gap at the handoff (the legacy stream's watch-then-read). On
stdio the id travels in each notification's ``_meta`` under ``EVENT_ID``, and comes back in the
listen request's ``_meta`` under ``LAST_EVENT_ID``. An id the broker cannot honour (the session
expired or was never this principal's, another filter, a position from before the listen's
last change of filter, another data epoch, a position trimmed from the inbox) gets the gap
rule: an ``updated`` for every URI of the filter, and ``list_changed`` if the filter asked for
it; never another principal's frames, nor those of URIs the filter no longer has.

The state expires as a legacy session does, ``session_ttl`` after its stream was last open.
"""

from __future__ import annotations

from typing import Any, Final

from broker.backends.types import SessionRecord
from broker.delivery.legacy import LegacyServices, LegacyStream
from broker.delivery.stream import EndReason, Writer
from broker.feeds.model import cursor_of
from broker.notifications import LIST_CHANGED, ListChanged, decode, encode_list_changed, encode_update
from broker.protocol import messages
from broker.protocol.jsonrpc import Id

__all__ = ["EVENT_ID", "LAST_EVENT_ID", "RESUMABLE", "RESUMED", "ListenWriter", "ResumableListen",
           "wants_resumable"]

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
    """A legacy stream's writer that speaks as a listen: the ack first, each frame stamped.

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


class ResumableListen(LegacyStream):
    """A resumable listen's stream: its session's legacy stream, spoken as a listen (``ListenWriter``).

    It ends as a listen does: ``complete`` for a graceful end (this worker stops, the credential
    ended), ``retry:`` where the client should come back at once, nothing when the client left;
    in every case the client may resume with the last id it received.
    """

    __slots__ = ("ack", "list_changed", "request_id", "resumed", "server_meta", "stdio")

    def __init__(self, services: LegacyServices, session: SessionRecord, cursor: int | None, *, resync: bool,
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
        streams = self.services.streams
        streams.resumable += 1
        try:
            reason = await super().run(listen_writer)
        finally:
            streams.resumable -= 1
        if not listen_writer.acked and reason is not EndReason.DISCONNECT:
            await listen_writer.send_ack(None)  # ended before its start: the client still learns what it asked
        if reason.completes:
            await writer.send(messages.complete_result(self.request_id, self.server_meta,
                                                       {"io.modelcontextprotocol/subscriptionId": self.request_id}))
        elif reason.reconnect:
            await writer.retry()
        return reason
