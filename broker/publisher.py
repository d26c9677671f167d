"""The one way in for changes: every publisher's change is checked, appended and counted here.

``POST /changes``, ``mcp-broker publish``, ``Broker.publish``, change sources and record writes
all go through one ``Publisher``: a change is acknowledged only once it passed ``ChangeRules``
(``broker.changes``) and is in the change log, and every acknowledgement and refusal is counted
in the same place. Record writes store the record with its change in one backend step
(``Publisher.store``): the publisher checks the change and counts the outcome around it.

Changes are per tenant. A provider that serves every tenant (static documents, a shared file
root) publishes one change per tenant it serves, under that tenant: the subscription index,
the change-log bounds and the quotas are all per tenant, and a change "for everyone" would let
one publisher spend every tenant's budget (docs/DESIGN-NOTES.md, "Changes are per tenant").
"""

from __future__ import annotations

import collections
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from broker.backends.base import ChangeLog
from broker.changes import Change, ChangeKind, ChangeRules, InvalidChange
from broker.errors import LogFull, PublishRateLimited, PublishRefused, QuotaExceeded
from broker.metrics import NO_METRICS, Counter, Metrics, TenantCounter, TenantLabels
from broker.ops.tracing import Tracer
from broker.quotas import Quotas
from broker.tenants import tenant_problem

__all__ = ["Publisher", "TooManyChanges"]

T = TypeVar("T")

#: The publishers a tenant's ``publish_per_second`` quota holds back: the HTTP API, record writes,
#: ``Broker.publish``, ``mcp-broker publish`` and direct calls. Change sources (files, PostgreSQL,
#: providers) publish at the pace of their data, and a refusal would only make them retry.
RATE_LIMITED = frozenset({"http", "records", "python", "cli", "api"})


class TooManyChanges(InvalidChange):
    """More changes in one request than a tenant may ever have waiting (``changelog_tenant_max``)."""


class Publisher:
    """Checks, appends and counts changes. ``source`` names who published, for the counters."""

    def __init__(self, changelog: ChangeLog, rules: ChangeRules, *, default_tenant: str, max_waiting: int,
                 metrics: Metrics = NO_METRICS, tenant_labels: TenantLabels | None = None,
                 quotas: Quotas | None = None, tracer: Tracer | None = None) -> None:
        """``quotas``: the tenants' ``publish_per_second`` buckets (``broker.quotas``); None: no such quota.
        ``tracer``: a span per change published, whose context the change carries on (None: tracing is off)."""
        self.tracer = tracer
        self.changelog = changelog
        self.quotas = quotas
        self.rules = rules
        self.default_tenant = default_tenant
        self.max_waiting = max_waiting
        self._metrics = metrics
        #: By source: the instrument of each, made at its first publish.
        self._published: dict[str, Counter] = {}
        #: Changes this process accepted into the change log since it started (the console's rate).
        self.accepted = 0
        self._per_tenant = TenantCounter(metrics, "mcp_broker_tenant_publishes_total",
                                         tenant_labels or TenantLabels(0))

    def change(self, tenant: str, uri: Any, kind: Any = ChangeKind.UPDATED, meta: Any = None) -> Change:
        """A change of ``tenant`` that fan-out can deliver. Raises ``InvalidChange`` (``ForeignNamespace``)."""
        if (problem := tenant_problem(tenant)) is not None:
            raise InvalidChange(problem)
        return self.rules.change(tenant, uri, kind, meta)

    async def publish(self, uri: str, kind: ChangeKind | str = ChangeKind.UPDATED, *, tenant: str | None = None,
                      meta: dict[str, Any] | None = None, source: str = "api") -> str:
        """Append one change (of the default tenant unless ``tenant`` is given); returns its id.

        Raises:
            InvalidChange: the change breaks ``ChangeRules`` (a URI or ``meta`` that could not be
                delivered, a record URI of another tenant, a tenant name that is not one).
            QuotaExceeded: the tenant has ``changelog_tenant_max`` changes not yet fanned out.
            PublishRateLimited: the tenant publishes faster than its ``publish_per_second`` quota.
            LogFull: its partition of the change log holds ``changelog_maxlen`` changes not yet fanned out.
            BackendUnavailable: the change could not be stored (it was not accepted).
        """
        change = self.change(self.default_tenant if tenant is None else tenant, uri, kind, meta)
        return (await self._append([change], source))[0]

    async def publish_items(self, tenant: str, items: Any, source: str = "api") -> list[str]:
        """Append changes given as JSON (one object, or a list of them); their ids, in order.

        Each item is ``{"uri": ..., "kind": ..., "meta": ...}``. One bad item refuses them all,
        before anything is appended; the message says which (``change <i>: ...``).

        Raises:
            TooManyChanges: more changes of the list go to one partition of the change log than
                ``changelog_tenant_max`` (the whole list, on a log of one partition).
            InvalidChange: an item is not a deliverable change (``ForeignNamespace``: of another tenant).
            QuotaExceeded, LogFull, BackendUnavailable: as ``publish``.
        """
        if not isinstance(items, list):
            return await self._append([self._item(tenant, items, "")], source)
        if not items:
            raise InvalidChange("no changes given")
        if len(items) > self.max_waiting * self.changelog.partitions:
            # Refused before each change is checked: more than the tenant may ever have waiting.
            raise TooManyChanges(f"{len(items)} changes in one request; at most {self.max_waiting} "
                                 "(MCP_BROKER_CHANGELOG_TENANT_MAX) may wait for fan-out at once")
        changes = [self._item(tenant, item, f"change {i}: ") for i, item in enumerate(items)]
        if len(changes) > self.max_waiting:
            # The bound is per partition: a list spread over partitions may be longer than it.
            route = self.changelog.partition
            most = max(collections.Counter(route(change.tenant, change.uri) for change in changes).values())
            if most > self.max_waiting:
                raise TooManyChanges(f"{most} changes to one partition of the change log in one request; at most "
                                     f"{self.max_waiting} (MCP_BROKER_CHANGELOG_TENANT_MAX) may wait there at once")
        return await self._append(changes, source)

    async def store(self, change: Change, write: Callable[[Change], Awaitable[T]], source: str = "records") -> T:
        """Run ``write``, a backend step that stores something together with ``change`` (a record write).

        Raises whatever ``write`` raises; a refusal by the change log is counted as one.
        """
        finish = None
        if self.tracer is not None:
            [change], finish = self.tracer.publishing([change], source, self.rules.max_meta_bytes)
        try:
            await self._take(change.tenant, 1, source)
            result = await write(change)
        except BaseException as exc:
            if isinstance(exc, PublishRefused):
                self._refused(exc)
            if finish is not None:
                finish(None, exc)
            raise
        if finish is not None:
            finish(None, None)
        self._count(source, 1)
        self._per_tenant.inc(change.tenant)
        return result

    def _item(self, tenant: str, item: Any, where: str) -> Change:
        if not isinstance(item, dict):
            raise InvalidChange(where + "each change must be an object")
        try:
            return self.change(tenant, item.get("uri"), item.get("kind", "updated"), item.get("meta"))
        except InvalidChange as exc:
            raise type(exc)(where + str(exc)) from exc

    async def _take(self, tenant: str, count: int, source: str) -> None:
        """Tokens of the tenant's publish bucket, before anything is appended. Raises PublishRateLimited.

        Raises TooManyChanges for more changes at once than the bucket ever holds (``publish_burst``).
        """
        if self.quotas is None or source not in RATE_LIMITED:
            return
        limits = self.quotas.limits(tenant)
        if limits.publish_per_second is not None and count > limits.burst:
            raise TooManyChanges(f"{count} changes in one request; tenant {tenant!r} may publish at most "
                                 f"{limits.burst} at once (its publish_burst quota)")
        await self.quotas.take(tenant, count)

    async def _append(self, changes: list[Change], source: str) -> list[str]:
        finish = None
        if self.tracer is not None:  # the change log keeps each change's publish span as its context
            changes, finish = self.tracer.publishing(changes, source, self.rules.max_meta_bytes)
        try:
            if changes:
                await self._take(changes[0].tenant, len(changes), source)
            ids = await self.changelog.publish_many(changes)
        except BaseException as exc:
            if isinstance(exc, PublishRefused):
                self._refused(exc)
            if finish is not None:
                finish(None, exc)
            raise
        if finish is not None:
            finish(ids, None)
        self._count(source, len(ids))
        tenant = changes[0].tenant if changes else ""
        if all(change.tenant == tenant for change in changes):  # one request is one tenant's
            self._per_tenant.inc(tenant, len(changes))
        else:
            for change in changes:
                self._per_tenant.inc(change.tenant)
        return ids

    def _count(self, source: str, n: int) -> None:
        self.accepted += n
        counter = self._published.get(source)
        if counter is None:
            counter = self._published[source] = self._metrics.counter("mcp_broker_changes_published_total",
                                                                      source=source)
        counter.inc(n)

    def _refused(self, exc: PublishRefused) -> None:
        self._metrics.counter("mcp_broker_changes_refused_total", reason=_reason(exc)).inc()


def _reason(exc: PublishRefused) -> str:
    if isinstance(exc, PublishRateLimited):
        return "publish_rate"
    if isinstance(exc, QuotaExceeded):
        return "tenant_quota"
    if isinstance(exc, LogFull):
        return "log_full"
    return "refused"
