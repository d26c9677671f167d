"""The webhook view: one subscription's deliveries, read from its feed while this worker holds its lease.

It watches the feed's inbox, so a new frame wakes it, and runs the reader's loop one batch at
a time: each frame becomes an event (``events.model.occurrences``), POSTed in order by ``post``
(``events.delivery``: retries, dead letters), and the stored position advances past it. A gap,
or a feed that is gone (the reader's rule for a webhook: a new feed of the subscription's
owner and filter), is owed: stored with the position it starts from in one update, then told
as the draft's ``{"type": "gap", "cursor"}`` envelope and an event for every URI, and cleared
once it was sent, so a holder that stops halfway leaves it to the next one.

Every position is stored only while the record is still at the feed and epoch it was read
from, so a worker that lagged behind an unsubscribe and a resubscribe of the same key cannot
write its old feed into the new record.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from broker.backends.base import Inboxes, Webhooks
from broker.backends.types import SessionRecord, Wake, WebhookRecord
from broker.errors import BackendUnavailable
from broker.events.model import event_filter, gap_events, occurrences
from broker.feeds.model import Cursor, FeedKind, Filter, Owner
from broker.feeds.reader import Batch, View
from broker.feeds.service import Feeds

__all__ = ["Ended", "Post", "WebhookPush", "current"]

logger = logging.getLogger(__name__)


class Ended(Exception):
    """The subscription was removed or lapsed while its events were being delivered."""


#: POST one body (the subscription, its ``webhook-id``, the body) until acknowledged or dead-lettered.
#: Raises Ended when the subscription ends meanwhile.
Post = Callable[[WebhookRecord, str, dict[str, Any]], Awaitable[None]]


async def current(store: Webhooks, subscription_id: str) -> WebhookRecord:
    """The subscription as stored now. Raises Ended when it is gone or lapsed."""
    record = await store.get(subscription_id)
    if record is None or record.expires_at <= time.time():
        raise Ended
    return record


class WebhookPush(View):
    """One subscription's deliveries (``run``), a ``View`` of its feed at the stored position."""

    __slots__ = ("feeds", "inboxes", "interval", "limit", "post", "record", "store", "touch")

    kind = FeedKind.WEBHOOK

    def __init__(self, feeds: Feeds, inboxes: Inboxes, store: Webhooks, post: Post,
                 touch: Callable[[Sequence[str]], Awaitable[None]], *, interval: float, limit: int) -> None:
        """``interval``: the longest wait for a wake-up before the record is read again; ``limit``: frames per read."""
        self.feeds = feeds
        self.inboxes = inboxes
        self.store = store
        self.post = post
        self.touch = touch
        self.interval = interval
        self.limit = limit
        self.record: WebhookRecord | None = None

    async def run(self, subscription_id: str, held: list[str]) -> None:
        """Deliver until the subscription ends or this task is cancelled (the lease went); ``held`` gets each
        feed read, for the lease's renewals to keep alive."""
        woken = asyncio.Event()

        def wake(event: Wake) -> None:
            if event.kind == "frames":
                woken.set()

        watching: str | None = None
        unwatch: Callable[[], Awaitable[None]] | None = None
        try:
            while True:
                record = self.record = await current(self.store, subscription_id)
                if record.session != watching:
                    if unwatch is not None:
                        await unwatch()
                    unwatch, watching = await self.inboxes.watch(record.session, wake), record.session
                    held.append(record.session)
                    await self.touch([record.session])
                woken.clear()
                if record.gap:
                    await self._send_gap(record)
                    continue
                await self.feeds.reader.drain(self, self.limit, once=True)
                if self.record is record:  # nothing read, nothing owed: wait for a frame
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(woken.wait(), self.interval)
        except Ended:
            return
        finally:
            if unwatch is not None:
                with contextlib.suppress(BackendUnavailable):
                    await unwatch()

    def _now(self) -> WebhookRecord:
        if self.record is None:
            raise RuntimeError("a webhook is read only while it runs")
        return self.record

    # The View: the loop's reading of the subscription's feed.

    def position(self) -> tuple[str, str, int]:
        record = self._now()
        return record.session, record.epoch, record.offset

    async def send(self, batch: Batch) -> None:
        record = self._now()
        if not batch.frames:
            return
        self.record = None  # read the record again: it moved on
        since = (record.session, record.epoch)
        for offset, frame in batch.frames:
            cursor = str(Cursor(record.session, record.epoch, offset))
            delivered = None
            for event in occurrences(record.session, record.epoch, [(offset, frame)], time.time()):
                event["cursor"] = cursor  # the safe watermark: every event before it was acknowledged or given up
                await self.post(record, event["eventId"], event)
                delivered = time.time()
            if not await self.store.advance(record.id, since, record.session, record.epoch, offset, delivered):
                return  # the record moved on or is gone: read it again

    async def resync(self, epoch: str, head: int) -> None:
        """Owe the gap rule from the head, in the update that moves there."""
        record = self._now()
        self.record = None
        await self.store.advance(record.id, (record.session, record.epoch), record.session, epoch, head, None,
                                 gap=True)

    def renewal(self) -> tuple[Owner, Filter | None]:
        record = self._now()
        return record.owner, event_filter({"name": record.name, "arguments": record.arguments, "id": record.id})

    async def renewed(self, fresh: SessionRecord) -> None:
        """Owe the gap rule from the start of ``fresh``, in the update that moves there."""
        record = self._now()
        self.record = None
        if not await self.store.advance(record.id, (record.session, record.epoch), fresh.id, fresh.epoch, 0, None,
                                        gap=True):
            await self.feeds.end(fresh.id)  # the record moved on meanwhile: this feed serves nobody

    async def _send_gap(self, record: WebhookRecord) -> None:
        """The owed gap rule: a ``gap`` envelope, then an event for every URI; cleared once sent."""
        cursor = str(Cursor(record.session, record.epoch, record.offset))
        logger.warning("webhook subscription %s met a gap; sending the gap rule from %s", record.id, cursor)
        await self.post(record, f"{cursor}~gap", {"type": "gap", "cursor": cursor})
        for event in gap_events(cursor, record.arguments["uris"], time.time()):
            await self.post(record, event["eventId"], {**event, "cursor": cursor})
        await self.store.advance(record.id, (record.session, record.epoch), record.session, record.epoch,
                                 record.offset, time.time())
