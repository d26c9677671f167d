"""Opening a resumable listen (``broker.delivery.resumable``): a new one, or the resumption of one.

A resumable listen is a feed of kind ``listen`` whose filter is the listen's (``Feeds``): a new
one is subscribed to every URI of the filter *before* the stream starts, so that what is
published from the moment its subscriptions exist waits in its inbox: the ack follows that
moment, and nothing after it is missed. A resumption names the feed and a position in the last
event id it received; the same principal with the same filter continues from there (the
session stream's replay, then live), and with another filter keeps its feed, refiltered, and
starts with the gap rule. The refilter records the inbox position it took effect at: an id from
before it gets the gap rule too, even with the filter the listen now has, because what follows it
in the inbox is of the old filter (URIs no longer watched) and lacks the new filter's changes
from before the refilter. An id of a feed that has expired or is another principal's gets a
new listen that starts with the gap rule: the client re-reads what it watches and loses
nothing, and never sees a frame of a feed that is not its own.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from broker.auth import Principal
from broker.delivery.legacy import LegacyServices
from broker.delivery.resumable import LAST_EVENT_ID, ResumableListen
from broker.delivery.stream import StreamMetrics
from broker.feeds.model import Cursor, FeedKind, Filter
from broker.feeds.service import Feeds
from broker.protocol import jsonrpc as rpc
from broker.protocol.jsonrpc import Id

__all__ = ["ResumableListens", "last_event_id"]


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

    def __init__(self, feeds: Feeds, services: LegacyServices, metrics: StreamMetrics,
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
