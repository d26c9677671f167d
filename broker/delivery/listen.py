"""2026-07-28 ``subscriptions/listen`` streams, and the index that hands them the changes of this process.

A listen has no replay by specification. Its pending notifications are coalesced per URI, so
its buffer is bounded by the size of its filter. Every worker with listens open receives every
processed change (the backend's broadcast, subscribed by ``delivery.broadcast``) and
``ListenIndex.on_change`` hands it to the listens of this worker whose filter names one of its
targets (``broker.notifications``); a listen is registered, and acknowledged, only once the
broadcast is subscribed (``ready``). When the backend may have lost broadcasts (on Redis, the
worker's pub/sub connection was re-made), every listen gets the gap rule: an ``updated`` for
each URI of its filter, and ``list_changed`` if it asked for those, so its client re-reads
instead of missing a change.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

from broker.changes import Change
from broker.delivery.stream import EndReason, Stream, StreamMetrics, Streams, Writer
from broker.errors import LimitExceeded, OverQuota, Reason
from broker.metrics import TenantCounter, accepted_at
from broker.notifications import LIST_CHANGED_KEY, changes_list, encode_list_changed, encode_update, targets, update_key
from broker.protocol import messages
from broker.protocol.jsonrpc import Id

__all__ = ["SUBSCRIPTION_ID", "Listen", "ListenIndex"]

logger = logging.getLogger(__name__)

SUBSCRIPTION_ID: Final = "io.modelcontextprotocol/subscriptionId"


class Listen(Stream):
    """One ``subscriptions/listen`` stream (2026-07-28), opened by ``ListenIndex.open``.

    ``run`` sends the ack before anything pushed since the listen was opened. It ends on
    ``end``: a reason that ``completes`` sends the ``complete`` result, one that asks to
    ``reconnect`` sends ``retry:``, any other (the client closed the stream, or cancelled it on
    stdio) sends nothing more.
    """

    __slots__ = ("_metrics", "_resync", "_server_meta", "_stamp", "acknowledged", "list_changed", "pending",
                 "probe", "request_id", "tenant", "uris")

    def __init__(self, request_id: Id, tenant: str, uris: list[str], list_changed: bool,
                 acknowledged: dict[str, Any], server_meta: dict[str, Any], metrics: StreamMetrics) -> None:
        """``acknowledged``: the filter as the ack states it (what the broker honours of what was asked)."""
        super().__init__()
        self.request_id = request_id
        self.acknowledged = acknowledged
        self.tenant = tenant
        self.uris = uris
        self.list_changed = list_changed
        # Pending notifications keyed by what they are about: a URI changing twice before the
        # client reads is sent once, so the buffer never holds more than one per watched URI.
        self.pending: dict[str, bytes] = {}
        self._stamp = {SUBSCRIPTION_ID: request_id}
        self._server_meta = server_meta
        self._metrics = metrics
        #: Broadcasts may have been lost: the task owes its client the gap rule.
        self._resync = False
        #: When the change of a sampled broadcast was accepted (Unix seconds), until its frame is
        #: written (``ListenIndex.on_batch``); 0 while there is none.
        self.probe = 0.0

    def push_update(self, uri: str, meta: dict[str, Any] | None = None) -> None:
        """Queue an update of ``uri``; a newer one replaces the pending one in place.

        ``meta`` (the change's) joins the subscription id in ``params._meta``; the id wins a clash.
        """
        if self.ended is None:
            self.pending[update_key(uri)] = encode_update(uri, meta, self._stamp)
            self.active = True
            self._wake()

    def push_list_changed(self) -> None:
        if self.ended is None:
            self.pending[LIST_CHANGED_KEY] = encode_list_changed(self._stamp)
            self.active = True
            self._wake()

    def resync(self) -> None:
        """Changes may have been missed (the backend lost broadcasts): apply the gap rule.

        The listen's own task builds the notifications, so a URI that has one pending costs
        nothing more, and a worker resynchronising thousands of listens does not hold its event
        loop for all of them at once.
        """
        if self.ended is None:
            self._resync = True
            self.active = True
            self._wake()

    def _push_resync(self) -> None:
        self._resync = False
        self._metrics.resyncs.inc()
        for uri in self.uris:
            self.push_update(uri)
        if self.list_changed:
            self.push_list_changed()

    async def run(self, writer: Writer) -> EndReason:
        """Send the ack, then every notification as it comes, until the listen ends; returns why."""
        await writer.send(messages.encode_notification(
            "notifications/subscriptions/acknowledged", {"_meta": self._stamp, "notifications": self.acknowledged}))
        while self.ended is None:
            if self._resync:
                self._push_resync()
            if self.pending:
                pending, self.pending = self.pending, {}
                # One write for all of them, so a cancel cannot land between two notifications.
                await writer.send_many([(data, None) for data in pending.values()])
                metrics = self._metrics
                # Keyed by what they are about: at most one list change among them.
                if LIST_CHANGED_KEY in pending:
                    metrics.sent_lists.inc()
                    metrics.sent.inc(len(pending) - 1)
                else:
                    metrics.sent.inc(len(pending))
                if metrics.traces is not None:
                    metrics.traces.delivered(None, pending.values())
                if self.probe:
                    metrics.latency.observe(max(time.time() - self.probe, 0.0))
                    self.probe = 0.0
            elif self.ping:
                self.ping = False
                await writer.comment()
            else:
                await self._sleep()
        reason = self.ended
        if reason.completes:
            await writer.send(messages.complete_result(self.request_id, self._server_meta, self._stamp))
        elif reason.reconnect:
            await writer.retry()
        return reason


async def _ready() -> None:
    """No Hub: the changes reach ``on_change`` however they are handed on."""


class ListenIndex:
    """The open listens of this process, by what they watch; bounded by ``max_listens``."""

    def __init__(self, streams: Streams, max_listens: int, server_meta: dict[str, Any],
                 metrics: StreamMetrics, subscriptions: TenantCounter | None = None,
                 tenant_max: int | None = None) -> None:
        """``subscriptions`` counts each listen opened, as a subscription of its tenant; ``tenant_max``:
        the listens one tenant may have open here (its share of ``max_listens``, so that one tenant
        cannot fill them for the others); None: no bound but ``max_listens``."""
        self.streams = streams
        self._subscriptions = subscriptions
        self.max_listens = max_listens
        self.tenant_max = tenant_max
        #: Per tenant, its listens open here (while ``tenant_max`` is set).
        self._per_tenant: dict[str, int] = {}
        self.server_meta = server_meta
        self.metrics = metrics
        self._by_uri: dict[tuple[str, str], set[Listen]] = {}
        self._list_changed: dict[str, set[Listen]] = {}
        #: When the changes being handed on were accepted, while they are a sampled batch; else 0.
        self._probe = 0.0
        #: Returns once the changes fanned out from then on reach ``on_change`` (the Hub sets it to
        #: ``ListenBroadcast.ready``); awaited before a listen is registered, with no wait in between.
        self.ready: Callable[[], Awaitable[None]] = _ready

    def __len__(self) -> int:
        return len(self.streams.listens)

    def open(self, request_id: Id, tenant: str, uris: list[str], list_changed: bool,
             acknowledged: dict[str, Any]) -> Listen:
        """A new listen, registered at once: changes from now on wait in it and follow its ack.

        The capacity check and the registration are one step (no await between them), so
        concurrent listens cannot overshoot the limit. A listen opened on a worker that is
        stopping ends at once with the ``complete`` result, after its ack: the client listens
        again elsewhere, without an error.

        Raises:
            LimitExceeded: ``max_listens`` listens are open on this worker.
            OverQuota: ``tenant_max`` listens of the tenant are.
        """
        if len(self.streams.listens) >= self.max_listens:
            raise LimitExceeded(f"at most {self.max_listens} open listens per worker", reason=Reason.LISTENS,
                                data={"limit": self.max_listens})
        if self.tenant_max is not None:
            held = self._per_tenant.get(tenant, 0)
            if held >= self.tenant_max:
                raise OverQuota("listens", tenant, self.tenant_max, 5,
                                f"tenant {tenant!r} has {held} listens open on this worker, its share of "
                                f"{self.max_listens} (MCP_BROKER_TENANT_SHARE); close one or retry later")
            self._per_tenant[tenant] = held + 1
        listen = Listen(request_id, tenant, uris, list_changed, acknowledged, self.server_meta, self.metrics)
        self.streams.listens[listen] = None
        self.metrics.open.inc()
        if self._subscriptions is not None:
            self._subscriptions.inc(tenant)
        for uri in uris:
            self._by_uri.setdefault((tenant, uri), set()).add(listen)
        if list_changed:
            self._list_changed.setdefault(tenant, set()).add(listen)
        if self.streams.closing:
            listen.end(EndReason.SHUTDOWN)
        return listen

    def watched(self) -> list[tuple[str, str]]:
        """Each (tenant, URI) an open listen of this worker watches."""
        return list(self._by_uri)

    def close(self, listen: Listen) -> None:
        """Forget a listen, however it ended (or if it never ran); closing twice is harmless."""
        listen.unbind()
        if listen in self.streams.listens:
            del self.streams.listens[listen]
            if self.tenant_max is not None:
                if (left := self._per_tenant[listen.tenant] - 1) > 0:
                    self._per_tenant[listen.tenant] = left
                else:
                    del self._per_tenant[listen.tenant]
            self.metrics.ended(listen.ended or EndReason.DISCONNECT)
        for uri in listen.uris:
            members = self._by_uri.get((listen.tenant, uri))
            if members is not None:
                members.discard(listen)
                if not members:
                    del self._by_uri[(listen.tenant, uri)]
        if listen.list_changed:
            members = self._list_changed.get(listen.tenant)
            if members is not None:
                members.discard(listen)
                if not members:
                    del self._list_changed[listen.tenant]

    def on_batch(self, change_id: str) -> None:
        """The broadcast is about to hand on changes, the oldest of them ``change_id``: one batch in
        ``SAMPLE_EVERY`` has the listens it reaches measure its publish-to-frame time."""
        self._probe = 0.0
        if self._by_uri or self._list_changed:
            if self.metrics.due():
                self._probe = accepted_at(change_id) or 0.0

    def on_change(self, change: Change) -> None:
        """A processed change, from the backend's broadcast: notify the listens it concerns."""
        if not self._by_uri and not self._list_changed:
            return
        probe = self._probe
        for uri in targets(change):
            for listen in self._by_uri.get((change.tenant, uri), ()):
                listen.push_update(uri, change.meta)
                if probe and not listen.probe:
                    listen.probe = probe
        if changes_list(change):
            for listen in self._list_changed.get(change.tenant, ()):
                listen.push_list_changed()
                if probe and not listen.probe:
                    listen.probe = probe

    def on_lost(self) -> None:
        """The backend may have lost broadcasts (its connection was re-made): every listen gets the gap rule."""
        listens = list(self.streams.listens)
        if listens:
            logger.warning("broadcasts may have been lost; resynchronising %d listens", len(listens))
        for listen in listens:
            if isinstance(listen, Listen):
                listen.resync()
