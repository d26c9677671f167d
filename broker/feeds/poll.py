"""The poll view: one ``events/poll`` page, one read of the poll's feed through the reader's loop.

The page starts at the client's cursor and reads at most ``maxEvents`` frames after it, made
into events (``events.model.occurrences``). What the loop cannot honour becomes the page's
``truncated: true`` with the gap rule, an event for every URI of the arguments: a gap moves the
page to the head of the same feed, a feed that is gone is replaced by a new one (the reader's
rule for a poll), and so is a cursor ``Feeds.resume`` could not honour.
"""

from __future__ import annotations

import time
from typing import Any

from broker.backends.types import SessionRecord
from broker.events.model import gap_events, occurrences
from broker.feeds.model import Cursor, FeedKind, Filter, Owner
from broker.feeds.reader import Batch, View

__all__ = ["PollPage"]


class PollPage(View):
    """What one poll returns: ``events`` after the cursor, the ``cursor`` to poll from next, whether
    the page is ``truncated`` (the gap rule) and whether ``more`` waits."""

    __slots__ = ("_filter", "_owner", "after", "events", "feed", "more", "truncated", "uris")

    kind = FeedKind.POLL

    def __init__(self, owner: Owner, feed_filter: Filter, feed: SessionRecord, after: int) -> None:
        self._owner = owner
        self._filter = feed_filter
        self.feed = feed
        self.after = after
        self.uris = list(feed_filter.uris)
        self.events: list[dict[str, Any]] = []
        self.truncated = False
        self.more = False

    @property
    def cursor(self) -> str:
        return str(Cursor(self.feed.id, self.feed.epoch, self.after))

    def position(self) -> tuple[str, str, int]:
        return self.feed.id, self.feed.epoch, self.after

    async def send(self, batch: Batch) -> None:
        feed = self.feed
        if batch.frames:
            self.after = batch.frames[-1][0]
        self.events = occurrences(feed.id, feed.epoch, batch.frames, time.time())
        self.more = batch.head > self.after

    async def resync(self, epoch: str, head: int) -> None:
        self.feed.epoch, self.after = epoch, head
        self.truncated, self.more = True, False
        self.events = gap_events(self.cursor, self.uris, time.time())

    def renewal(self) -> tuple[Owner, Filter | None]:
        return self._owner, self._filter

    async def renewed(self, fresh: SessionRecord) -> None:
        self.feed = fresh
        await self.resync(fresh.epoch, 0)
