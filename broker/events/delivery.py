"""Webhook deliveries: every worker runs a ``WebhookDelivery``; one worker at a time delivers each subscription.

Every third of ``webhook_lease_ms`` a worker lists the subscriptions. One that lapsed is ended
(record and hidden session), by whichever worker sees it. For each of the others this worker
is not delivering already, it asks for the subscription's lease (``LeasedTask``); the one that
gets it delivers, the others go on. The holder reads the subscription's feed (its view,
``broker.feeds.webhook``: a new frame wakes it) and delivers what follows the stored cursor, in
order, one event at a time: an event is POSTed (``Callbacks.post``) until a 2xx, with
exponential backoff and jitter between attempts (``webhook_retry_initial`` doubling up to
``webhook_retry_max``), and the cursor is stored after it. After ``webhook_max_attempts`` (or a
413, which is never retried) the event goes to the dead letters and delivery goes on: that is where at least once ends.

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
import logging
import os
import random
import secrets
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Any

import orjson

from broker.backends.base import Inboxes, Leases, Webhooks
from broker.backends.types import DeadLetter, WebhookRecord
from broker.config import Settings
from broker.errors import BackendUnavailable, raise_if_cancelled
from broker.events.callbacks import Callbacks
from broker.events.lease import LeasedTask
from broker.events.subscribe import WebhookSubscriptions
from broker.feeds.service import Feeds
from broker.feeds.webhook import Ended, WebhookPush, current

__all__ = ["WebhookDelivery"]

logger = logging.getLogger(__name__)

#: Subscriptions listed per backend call.
PAGE = 200


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

        push = WebhookPush(self.feeds, self.inboxes, self.store, self._send, self.touch, interval=self.interval,
                           limit=self.settings.inbox_batch)
        lease = LeasedTask(self.leases, f"webhook:{subscription_id}", self.owner, self.settings.webhook_lease_ms)
        await lease.run(lambda: push.run(subscription_id, held), renewed)

    async def _send(self, record: WebhookRecord, message_id: str, body: dict[str, Any]) -> None:
        """POST one body until it is acknowledged, or dead-letter it. Raises Ended when the subscription ends."""
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
                raise Ended
            if not outcome.retry or attempt >= settings.webhook_max_attempts:
                logger.warning("webhook subscription %s: %s given up after %d attempts (%s)", record.id, message_id,
                               attempt, error)
                await self.store.dead_letter(DeadLetter(record.id, record.tenant, record.url, message_id,
                                                        data.decode(), attempt, error, time.time()),
                                             settings.webhook_dead_letters)
                return
            pause = min(settings.webhook_retry_initial * 2 ** (attempt - 1), settings.webhook_retry_max)
            await asyncio.sleep(pause * random.uniform(0.5, 1.0))  # jitter: retries of many do not align
            record = await current(self.store, record.id)  # a refresh may bring a new secret; an end stops here
            await self.touch([record.session])
