"""``events/poll``: the events of a subscription after an opaque cursor, or ``truncated: true``.

The method: its parameters, the feed ``Feeds.resume`` finds or makes, and the result's shape.
The page itself is a view of the feed (``broker.feeds.poll``).

``cursor: null`` starts a subscription: a feed of kind ``poll`` (``broker.feeds``) and its head
as the cursor, no events. A cursor names that feed and a position in its inbox; the same
principal with the same arguments reads what follows it, ``maxEvents`` at most (``hasMore``
says more is waiting), and the read touches the session, which expires ``session_ttl`` after
its last poll. Anything the broker cannot honour (the session expired or is another
principal's or of other arguments, another data generation after Redis lost its data, a
position trimmed from the inbox) is answered ``truncated: true`` with a fresh cursor and the
gap rule: an event for every URI of the arguments. Never silence, never another's events.
"""

from __future__ import annotations

from typing import Any

from broker.config import Settings
from broker.events.model import event_filter, wanted
from broker.feeds.model import Cursor, FeedKind
from broker.feeds.poll import PollPage
from broker.feeds.service import Feeds
from broker.methods import Call, Methods
from broker.protocol import jsonrpc as rpc

__all__ = ["EventPolls"]


def _count(params: dict[str, Any], name: str, default: int, most: int) -> int:
    value = params.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise rpc.RpcError(rpc.INVALID_PARAMS, f"params.{name} must be a positive integer", invalid=True)
    return min(int(value), most)


class EventPolls:
    def __init__(self, settings: Settings, methods: Methods, feeds: Feeds) -> None:
        self.settings = settings
        self.methods = methods
        self.feeds = feeds

    async def poll(self, call: Call, params: dict[str, Any]) -> dict[str, Any]:
        """Raises RpcError: -32602 (400) for bad params or a cursor this server never issues. OverQuota,
        LimitExceeded: a subscription is needed and the tenant's or the deployment's are full."""
        what = wanted(self.methods, call, params, "poll")
        cursor = params.get("cursor")
        if cursor is not None and not isinstance(cursor, str):
            raise rpc.RpcError(rpc.INVALID_PARAMS, "params.cursor must be a string or null", invalid=True)
        limit = _count(params, "maxEvents", self.settings.events_poll_default, self.settings.events_poll_max)
        max_age = params.get("maxAgeMs")
        if max_age is not None and (isinstance(max_age, bool) or not isinstance(max_age, int) or max_age < 0):
            raise rpc.RpcError(rpc.INVALID_PARAMS, "params.maxAgeMs must be a non-negative integer", invalid=True)
        parsed = None if cursor is None else Cursor.parse(cursor)
        if cursor is not None and parsed is None:
            raise rpc.RpcError(rpc.INVALID_PARAMS, "params.cursor is not a cursor this server issued", invalid=True)
        return await self._poll(call, what, parsed, limit)

    async def _poll(self, call: Call, what: dict[str, Any], cursor: Cursor | None, limit: int) -> dict[str, Any]:
        feed_filter = event_filter(what)
        position = await self.feeds.resume(call.principal, cursor, FeedKind.POLL, feed_filter)
        found = position.feed
        if cursor is None:
            return self._result([], str(Cursor(found.id, found.epoch, 0)), truncated=False, more=False)
        page = PollPage(call.principal, feed_filter, found, cursor.offset)
        if position.resync:
            await page.resync(found.epoch, 0 if position.new else await self.feeds.reader.head(found))
        else:
            await self.feeds.reader.drain(page, limit, once=True)
        return self._result(page.events, page.cursor, truncated=page.truncated, more=page.more)

    def _result(self, events: list[dict[str, Any]], cursor: str, *, truncated: bool, more: bool) -> dict[str, Any]:
        return {"events": events, "cursor": cursor, "truncated": truncated, "hasMore": more,
                "nextPollMs": self.settings.events_next_poll_ms}
