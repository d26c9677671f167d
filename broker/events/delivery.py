"""Webhook deliveries: every worker runs a ``WebhookDelivery``; one worker at a time delivers each subscription.

Every third of ``webhook_lease_ms`` a worker lists the subscriptions. One that lapsed is ended
(record and hidden session), by whichever worker sees it. For each of the others this worker
is not delivering already, it asks for the subscription's lease (``LeasedTask``); the one that
gets it delivers, the others go on. The holder watches the hidden session's inbox, so a new
frame wakes it, and delivers what follows the stored cursor, in order, one event at a time: an
event is POSTed (``Callbacks.post``) until a 2xx, with exponential backoff and jitter between
attempts (``webhook_retry_initial`` doubling up to ``webhook_retry_max``), and the cursor is
stored after it. After ``webhook_max_attempts`` (or a 413, which is never retried) the event
goes to the dead letters and delivery goes on: that is where at least once ends.

A holder killed with ``kill -9`` stops renewing; its lease lapses and the next worker to ask
continues from the stored cursor, so the event in flight may be delivered twice (same
``eventId`` and ``webhook-id``: the receiver deduplicates), and none is skipped. A gap (the
inbox trimmed past the cursor, or the hidden session expired while no worker could deliver)
is told with the draft's ``{"type": "gap", "cursor"}`` envelope, then the gap rule: an event
for every URI of the arguments. That it is owed is stored with the position it starts from (a
new session's, when the old one is gone) in one update, and cleared only once it was sent, so a
holder that stops halfway leaves it to the next one.

Every position is stored only while the record is still at the session and epoch it was read
from, so a worker that lagged behind an unsubscribe and a resubscribe of the same key cannot
write its old session into the new record. A lapsed subscription is removed only if it is still
lapsed when the backend removes it (a refresh in between keeps it), and one whose stored API key
was revoked or expired ends at the next check (every ``credential_check_seconds``), through the
lookup the Hub uses for open streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import secrets
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Any

import orjson

from broker.auth import Principal
from broker.backends.base import Inboxes, Leases, Webhooks
from broker.backends.types import DeadLetter, Wake, WebhookRecord
from broker.config import Settings
from broker.errors import BackendUnavailable, raise_if_cancelled
from broker.events.callbacks import Callbacks
from broker.events.lease import LeasedTask
from broker.events.model import event_filter, gap_events, occurrences
from broker.events.subscribe import WebhookSubscriptions
from broker.feeds.model import Cursor, FeedKind
from broker.feeds.reader import Batch, FeedReader
from broker.feeds.service import Feeds

__all__ = ["WebhookDelivery"]

logger = logging.getLogger(__name__)

#: Subscriptions listed per backend call.
PAGE = 200


class _Ended(Exception):
    """The subscription was removed or lapsed while its events were being delivered."""


#: Which of these stored keys no longer hold (``StoredKeys.invalid``).
Revoked = Callable[[Collection[str]], Awaitable[set[str]]]


class WebhookDelivery:
    def __init__(self, settings: Settings, store: Webhooks, leases: Leases, inboxes: Inboxes, feeds: Feeds,
                 subscriptions: WebhookSubscriptions, callbacks: Callbacks,
                 touch: Callable[[Sequence[str]], Awaitable[None]], revoked: Revoked | None = None) -> None:
        self.settings = settings
        self.store = store
        self.leases = leases
        self.inboxes = inboxes
        self.reader = FeedReader(inboxes)
        self.feeds = feeds
        self.subscriptions = subscriptions
        self.callbacks = callbacks
        self.touch = touch
        self.revoked = revoked
        self._checked = 0.0  # when the credentials were last checked (monotonic)
        #: The lease owner names the process, so an operator can tell which worker delivers what.
        self.owner = f"webhooks-{os.getpid()}-{secrets.token_hex(4)}"
        self.interval = settings.webhook_lease_ms / 3000
        self._tasks: dict[str, asyncio.Task[None]] = {}

    async def run(self) -> None:
        """Until cancelled: find subscriptions, deliver those whose lease this worker gets."""
        try:
            while True:
                try:
                    await self._scan()
                except Exception as exc:  # the loop's boundary: scanning goes on after any one failure
                    raise_if_cancelled()
                    if not isinstance(exc, BackendUnavailable):
                        logger.exception("listing webhook subscriptions failed")
                await asyncio.sleep(self.interval)
        finally:
            for task in self._tasks.values():
                task.cancel()
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)
            await self.callbacks.aclose()

    async def _scan(self) -> None:
        after = ""
        check = self.revoked is not None and time.monotonic() - self._checked >= self.settings.credential_check_seconds
        if check:
            self._checked = time.monotonic()
        while True:
            page = await self.store.page(after, PAGE)
            now = time.time()
            invalid = await self._invalid(page) if check else set()
            for record in page:
                if record.credential in invalid:
                    logger.info("webhook subscription %s: its API key was revoked or expired; ending it", record.id)
                    await self.subscriptions.end(record, credential=record.credential)
                elif record.expires_at <= now:
                    if record.id not in self._tasks:
                        logger.info("webhook subscription %s lapsed; ending it", record.id)
                        await self.subscriptions.end(record, expired_by=now)
                elif record.id not in self._tasks:
                    task = asyncio.create_task(self._lease(record.id), name=f"webhook-{record.id}")
                    self._tasks[record.id] = task
                    task.add_done_callback(self._forget)
            if len(page) < PAGE:
                return
            after = page[-1].id

    async def _invalid(self, page: list[WebhookRecord]) -> set[str]:
        """The stored keys of ``page`` that no longer hold: one lookup for the page."""
        keys = {record.credential for record in page if record.credential is not None}
        return await self.revoked(keys) if keys and self.revoked is not None else set()

    def _forget(self, task: asyncio.Task[None]) -> None:
        self._tasks.pop(task.get_name().removeprefix("webhook-"), None)

    async def _lease(self, subscription_id: str) -> None:
        held: list[str] = []  # the session to touch at each renewal, once known

        async def renewed() -> None:
            if held:
                await self.touch(held[-1:])

        lease = LeasedTask(self.leases, f"webhook:{subscription_id}", self.owner, self.settings.webhook_lease_ms)
        await lease.run(lambda: self._deliver(subscription_id, held), renewed)

    async def _current(self, subscription_id: str) -> WebhookRecord:
        record = await self.store.get(subscription_id)
        if record is None or record.expires_at <= time.time():
            raise _Ended
        return record

    async def _deliver(self, subscription_id: str, held: list[str]) -> None:
        """Deliver the subscription's events until it ends or this task is cancelled (the lease went)."""
        woken = asyncio.Event()

        def wake(event: Wake) -> None:
            if event.kind == "frames":
                woken.set()

        watching: str | None = None
        unwatch: Callable[[], Awaitable[None]] | None = None
        try:
            while True:
                record = await self._current(subscription_id)
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
                read = await self.reader.next(record.session, record.epoch, record.offset, self.settings.inbox_batch)
                if read.gone is not None or read.resync:
                    await self._resync(record, read)
                elif read.frames:
                    await self._send_frames(record, read)
                else:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(woken.wait(), self.interval)
        except _Ended:
            return
        finally:
            if unwatch is not None:
                with contextlib.suppress(BackendUnavailable):
                    await unwatch()

    async def _send_frames(self, record: WebhookRecord, read: Batch) -> None:
        since = (record.session, record.epoch)
        for offset, frame in read.frames:
            cursor = str(Cursor(record.session, record.epoch, offset))
            delivered = None
            for event in occurrences(record.session, record.epoch, [(offset, frame)], time.time()):
                event["cursor"] = cursor  # the safe watermark: every event before it was acknowledged or given up
                await self._send(record, event["eventId"], event)
                delivered = time.time()
            if not await self.store.advance(record.id, since, record.session, record.epoch, offset, delivered):
                return  # the record moved on or is gone: read it again

    async def _resync(self, record: WebhookRecord, read: Batch) -> None:
        """Owe the gap rule from the head (of a new feed if the old one is gone), in the update
        that moves there."""
        session, epoch, head = record.session, read.epoch, read.head
        if read.gone is not None:
            subject = record.principal.partition("/")[2]
            what = {"name": record.name, "arguments": record.arguments, "id": record.id}
            fresh = await self.feeds.create(Principal(record.tenant, subject), FeedKind.WEBHOOK, event_filter(what))
            session, epoch, head = fresh.id, fresh.epoch, 0
        if not await self.store.advance(record.id, (record.session, record.epoch), session, epoch, head, None,
                                        gap=True) and read.gone is not None:
            await self.feeds.end(session)  # the record moved on meanwhile: this session serves nobody

    async def _send_gap(self, record: WebhookRecord) -> None:
        """The owed gap rule: a ``gap`` envelope, then an event for every URI; cleared once sent."""
        cursor = str(Cursor(record.session, record.epoch, record.offset))
        logger.warning("webhook subscription %s met a gap; sending the gap rule from %s", record.id, cursor)
        await self._send(record, f"{cursor}~gap", {"type": "gap", "cursor": cursor})
        for event in gap_events(cursor, record.arguments["uris"], time.time()):
            await self._send(record, event["eventId"], {**event, "cursor": cursor})
        await self.store.advance(record.id, (record.session, record.epoch), record.session, record.epoch,
                                 record.offset, time.time())

    async def _send(self, record: WebhookRecord, message_id: str, body: dict[str, Any]) -> None:
        """POST one body until it is acknowledged, or dead-letter it. Raises _Ended when the subscription ends."""
        data = orjson.dumps(body)
        settings = self.settings
        attempt = 0
        while True:
            attempt += 1
            outcome = await self.callbacks.post(record.url, record.secret, message_id, data, record.id, record.tenant)
            if outcome.ok:
                return
            error = outcome.error or "connection_refused"
            if not await self.store.fail(record.id, error, time.time()):
                raise _Ended
            if not outcome.retry or attempt >= settings.webhook_max_attempts:
                logger.warning("webhook subscription %s: %s given up after %d attempts (%s)", record.id, message_id,
                               attempt, error)
                await self.store.dead_letter(DeadLetter(record.id, record.tenant, record.url, message_id,
                                                        data.decode(), attempt, error, time.time()),
                                             settings.webhook_dead_letters)
                return
            pause = min(settings.webhook_retry_initial * 2 ** (attempt - 1), settings.webhook_retry_max)
            await asyncio.sleep(pause * random.uniform(0.5, 1.0))  # jitter: retries of many do not align
            record = await self._current(record.id)  # a refresh may bring a new secret; an end stops here
            await self.touch([record.session])
