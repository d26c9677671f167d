"""Feeds: creating, loading, resuming and ending one, whatever its kind.

A feed id is a bearer secret bound to the principal that created it, and a feed is of one kind:
a lookup by another principal, or for another kind, is a miss, as if the feed did not exist.
Every bound a feed is held to is checked here, in ``create``: ``max_sessions`` and the tenant's
``sessions`` quota (or its share of ``max_sessions``), counted by the store in the create's own
step, and the tenant's ``subscriptions`` quota against the filter. A feed's filter is subscribed
*before* its first position is handed out, so what is published from then on waits in its inbox.

A cursor the broker cannot honour (the feed expired, is another principal's, of another kind
or filter, of another data epoch, or from before the feed's last change of filter) gets one
rule: the reader starts at the head with the gap rule. Whether the feed behind such a cursor
is kept is the kind's choice: a listen keeps its feed, refiltered; a poll gets a new one.

Errors are the domain's (``OverQuota``, ``LimitExceeded``, ``SessionNotFound``,
``BackendUnavailable``): the transports say them in their own terms.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from dataclasses import dataclass
from typing import Any, Final

from broker.auth import Principal
from broker.backends.base import Inboxes, SessionStore, SubscriptionIndex
from broker.backends.types import SessionRecord
from broker.errors import BackendUnavailable, LimitExceeded, OverQuota, Reason, SessionNotFound
from broker.feeds.model import Cursor, FeedKind, Filter, Owner, valid_id
from broker.feeds.reader import FeedReader
from broker.metrics import NO_METRICS, Metrics, TenantCounter, TenantLabels
from broker.quotas import TenantQuotas

#: A feed's record, as the transports hold it (the record the backend stores).
__all__ = ["FEED_VERSION", "Feeds", "Position", "SessionRecord", "honours"]

#: The protocol version a feed other than a session records (it is never initialized as a 2025 session).
FEED_VERSION: Final = "2026-07-28"
#: Subscriptions of a new feed sent at once (each is its own atomic step in the store).
SUBSCRIBE_CHUNK: Final = 64
#: Seconds a refused creator is asked to wait (the tenant's or the deployment's sessions are full).
RETRY_AFTER: Final = 5


@dataclass(frozen=True, slots=True)
class Position:
    """Where a reader of ``feed`` starts.

    ``after``: the offset it reads after; None to start at the head (a new feed, or the gap rule).
    ``resync``: the cursor could not be honoured, so the reader starts with the gap rule.
    ``new``: the feed was created for this position.
    """

    feed: SessionRecord
    after: int | None
    resync: bool
    new: bool

    @property
    def resumed(self) -> bool:
        """The reader continues from the client's position."""
        return self.after is not None and not self.resync


def honours(feed: SessionRecord, cursor: Cursor) -> bool:
    """Can ``feed`` be read after ``cursor``? Not from another data epoch (the gap rule, never
    "replay everything"), nor from before its last change of filter (never the old filter's frames)."""
    if cursor.epoch != feed.epoch:
        return False
    return feed.since is None or cursor.epoch != feed.since[0] or cursor.offset >= feed.since[1]


class Feeds:
    """Every feed of the broker: sessions, resumable listens, poll and webhook subscriptions."""

    def __init__(self, store: SessionStore, inboxes: Inboxes, subscriptions: SubscriptionIndex, max_sessions: int, *,
                 metrics: Metrics = NO_METRICS, tenant_labels: TenantLabels | None = None,
                 quotas: TenantQuotas | None = None, tenant_max: int | None = None) -> None:
        """``quotas``: each tenant's ``sessions`` and ``subscriptions`` quotas; ``tenant_max``: the feeds any one
        tenant may have (its share of ``max_sessions``, ``quotas.tenant_share``), so one cannot fill them all."""
        self.store = store
        self.inboxes = inboxes
        self.subscriptions = subscriptions
        self.quotas = quotas or TenantQuotas()
        self.max_sessions = max_sessions
        self.tenant_max = tenant_max
        #: The one reader of feeds' inboxes; a poll's or webhook's feed that is gone is renewed here.
        self.reader = FeedReader(inboxes, self.create)
        self._created = TenantCounter(metrics, "mcp_broker_tenant_sessions_created_total",
                                      tenant_labels or TenantLabels(0))

    async def create(self, principal: Owner, kind: FeedKind, feed_filter: Filter | None = None, *,
                     version: str = FEED_VERSION, client_info: dict[str, Any] | None = None,
                     capabilities: dict[str, Any] | None = None) -> SessionRecord:
        """A new feed of ``kind`` with a cryptographically random id (visible ASCII only), subscribed to its
        filter; one that cannot be completed is removed again.

        Raises:
            OverQuota: the filter has more URIs than the tenant's ``subscriptions`` quota; the tenant has
                as many live feeds as its ``sessions`` quota, or its share (nothing is created then).
            LimitExceeded: ``max_sessions`` live feeds exist already.
            BackendUnavailable: the store could not be reached.
        """
        tenant = principal.tenant
        if feed_filter is not None:
            self._check_filter(tenant, feed_filter)
        if await self.store.count() >= self.max_sessions:
            raise LimitExceeded(f"{self.max_sessions} sessions are live (MCP_BROKER_MAX_SESSIONS)",
                                reason=Reason.SESSIONS, retry_after=RETRY_AFTER, data={"limit": "sessions"})
        record = SessionRecord(
            id=secrets.token_urlsafe(24),
            tenant=tenant,
            principal=principal.key,
            protocol_version=version,
            epoch=self.store.epoch,
            created_at=time.time(),
            client_info=client_info or {},
            client_capabilities=capabilities or {},
            kind=kind,
            filter=feed_filter,
        )
        quota = self.quotas.of(tenant).sessions
        if self.tenant_max is not None:
            quota = self.tenant_max if quota is None else min(quota, self.tenant_max)
        await self.store.create(record, quota)
        self._created.inc(tenant)
        if feed_filter is not None:
            try:
                await self._subscribe(record, feed_filter.uris)
            except BaseException:
                # Half subscribed, it would serve part of its filter: it goes, and the caller retries.
                with contextlib.suppress(BackendUnavailable):
                    await asyncio.shield(self.end(record.id))
                raise
        return record

    async def load(self, feed_id: str, principal: Principal, kind: FeedKind) -> SessionRecord:
        """The live feed of ``kind``, with its idle clock restarted.

        Raises:
            SessionNotFound: unknown, expired or ended, created by another principal, or of another kind.
        """
        if not valid_id(feed_id):
            raise SessionNotFound(feed_id)
        record = await self.store.get(feed_id, touch_as=principal.key)
        # Another principal's feed is indistinguishable from one that does not exist (and its idle
        # clock is left alone); so is one of another kind: a listen's or a poll's id, which every
        # one of their cursors carries, never takes a session's GET stream or its subscriptions.
        if record is None or record.principal != principal.key or record.kind is not kind:
            raise SessionNotFound(feed_id)
        return record

    async def resume(self, principal: Principal, cursor: Cursor | None, kind: FeedKind,
                     feed_filter: Filter) -> Position:
        """Where a reader of the principal's feed of ``kind`` and ``feed_filter`` starts, from ``cursor``
        (None: a new feed). A cursor it cannot honour starts at the head with the gap rule; its feed is
        kept refiltered (a listen) or replaced (any other kind).

        Raises:
            OverQuota, LimitExceeded: a feed was needed and could not be created (as ``create``).
        """
        self._check_filter(principal.tenant, feed_filter)
        if cursor is None:
            return Position(await self.create(principal, kind, feed_filter), None, False, True)
        try:
            found = await self.load(cursor.feed, principal, kind)
        except SessionNotFound:
            return Position(await self.create(principal, kind, feed_filter), None, True, True)
        if found.filter != feed_filter:
            if kind is not FeedKind.LISTEN:
                return Position(await self.create(principal, kind, feed_filter), None, True, True)
            # The principal's own listen, with another filter: kept, refiltered, rather than a new
            # feed left behind for each change.
            await self._refilter(found, feed_filter)
            return Position(found, None, True, False)
        if not honours(found, cursor):
            return Position(found, None, True, False)
        return Position(found, cursor.offset, False, False)

    async def initialized(self, feed_id: str) -> None:
        """The 2025 client sent ``notifications/initialized``."""
        await self.store.update(feed_id, initialized=True)

    async def end(self, feed_id: str) -> None:
        """Delete the feed, then close its stream, wherever it is."""
        await self.store.delete(feed_id)
        # A claim of a feed that no longer exists is a takeover by nobody (``CLOSE_ALL``): every
        # stream of it ends, on whichever worker holds it.
        await self.inboxes.claim_stream(feed_id)

    def _check_filter(self, tenant: str, feed_filter: Filter) -> None:
        """Raises OverQuota when ``feed_filter`` has more URIs than the tenant's ``subscriptions`` quota."""
        limit = self.quotas.of(tenant).subscriptions
        if limit is not None and len(feed_filter.uris) > limit:
            raise OverQuota("subscriptions", tenant, limit, RETRY_AFTER,
                            f"tenant {tenant!r} may watch {limit} URIs per subscription or listen (its quota)")

    async def _refilter(self, feed: SessionRecord, wanted: Filter) -> None:
        """Subscribe ``feed`` to ``wanted`` instead of its filter; what its inbox holds from the head on is
        the new filter's, and the head is recorded (``since``) so no older position is replayed."""
        old = set(feed.filter.uris if feed.filter is not None else ())
        new = set(wanted.uris)
        await asyncio.gather(*(self.subscriptions.remove(feed.id, feed.tenant, uri) for uri in old - new))
        await self._subscribe(feed, sorted(new - old))
        # The record last: a refilter cut short is done again by the client's next attempt.
        head = (await self.inboxes.read(feed.id, feed.epoch, 0, 1)).head
        feed.filter, feed.since = wanted, (feed.epoch, head)
        # The kind too: a record an older version wrote has none, and would be read by its
        # capabilities again, with the old filter (legacy_kind).
        await self.store.update(feed.id, kind=feed.kind, filter=wanted, since=feed.since)

    async def _subscribe(self, feed: SessionRecord, uris: tuple[str, ...] | list[str]) -> None:
        """A chunk of ``uris`` at a time in flight (one round trip each on Redis)."""
        for start in range(0, len(uris), SUBSCRIBE_CHUNK):
            await asyncio.gather(*(self.subscriptions.add(feed.id, feed.tenant, uri)
                                   for uri in uris[start:start + SUBSCRIBE_CHUNK]))
