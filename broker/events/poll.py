"""``events/poll``: the events of a subscription after an opaque cursor, or ``truncated: true``.

``cursor: null`` starts a subscription: a hidden session (``broker.events.state``) and its head
as the cursor, no events. A cursor names that session and a position in its inbox; the same
principal with the same arguments reads what follows it, ``maxEvents`` at most (``hasMore``
says more is waiting), and the read touches the session, which expires ``session_ttl`` after
its last poll. Anything the broker cannot honour (the session expired or is another
principal's or of other arguments, another data generation after Redis lost its data, a
position trimmed from the inbox) is answered ``truncated: true`` with a fresh cursor and the
gap rule: an event for every URI of the arguments. Never silence, never another's events.
"""

from __future__ import annotations

import time
from typing import Any

from broker.backends.base import Inboxes
from broker.backends.types import SessionRecord
from broker.config import Settings
from broker.delivery.resumable import format_listen_id, parse_listen_id
from broker.events.model import gap_events, occurrences
from broker.events.state import EventSessions, wanted
from broker.methods import Call, Methods
from broker.protocol import jsonrpc as rpc

__all__ = ["EventPolls"]


def _count(params: dict[str, Any], name: str, default: int, most: int) -> int:
    value = params.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise rpc.RpcError(rpc.INVALID_PARAMS, f"params.{name} must be a positive integer", invalid=True)
    return min(int(value), most)


class EventPolls:
    def __init__(self, settings: Settings, methods: Methods, state: EventSessions, inboxes: Inboxes) -> None:
        self.settings = settings
        self.methods = methods
        self.state = state
        self.inboxes = inboxes

    async def poll(self, call: Call, params: dict[str, Any]) -> dict[str, Any]:
        """Raises RpcError: -32602 (400) for bad params or a cursor this server never issues."""
        what = wanted(self.methods, call, params, "poll")
        cursor = params.get("cursor")
        if cursor is not None and not isinstance(cursor, str):
            raise rpc.RpcError(rpc.INVALID_PARAMS, "params.cursor must be a string or null", invalid=True)
        limit = _count(params, "maxEvents", self.settings.events_poll_default, self.settings.events_poll_max)
        max_age = params.get("maxAgeMs")
        if max_age is not None and (isinstance(max_age, bool) or not isinstance(max_age, int) or max_age < 0):
            raise rpc.RpcError(rpc.INVALID_PARAMS, "params.maxAgeMs must be a non-negative integer", invalid=True)
        if cursor is None:
            session = await self.state.create(call.principal, what)
            return self._result([], format_listen_id(session.id, session.epoch, 0), truncated=False, more=False)
        parsed = parse_listen_id(cursor)
        if parsed is None:
            raise rpc.RpcError(rpc.INVALID_PARAMS, "params.cursor is not a cursor this server issued", invalid=True)
        session_id, epoch, offset = parsed
        found = await self.state.load(call.principal, session_id, what)
        if found is None:
            return await self._truncated(None, 0, call, what)
        if epoch != found.epoch:
            return await self._truncated(found, (await self.inboxes.read(found.id, found.epoch, 0, 1)).head, call, what)
        read = await self.inboxes.read(found.id, found.epoch, offset, limit)
        if read.gone:
            return await self._truncated(None, 0, call, what)
        if read.gap:
            found.epoch = read.epoch
            return await self._truncated(found, read.head, call, what)
        last = read.frames[-1][0] if read.frames else offset
        events = occurrences(found.id, found.epoch, read.frames, time.time())
        return self._result(events, format_listen_id(found.id, found.epoch, last), truncated=False,
                            more=read.head > last)

    async def _truncated(self, session: SessionRecord | None, head: int, call: Call,
                         what: dict[str, Any]) -> dict[str, Any]:
        """The gap rule from the head of ``session``, or of a new one when None."""
        if session is None:
            session = await self.state.create(call.principal, what)
        cursor = format_listen_id(session.id, session.epoch, head)
        return self._result(gap_events(cursor, what["arguments"]["uris"], time.time()), cursor, truncated=True,
                            more=False)

    def _result(self, events: list[dict[str, Any]], cursor: str, *, truncated: bool, more: bool) -> dict[str, Any]:
        return {"events": events, "cursor": cursor, "truncated": truncated, "hasMore": more,
                "nextPollMs": self.settings.events_next_poll_ms}
