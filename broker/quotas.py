"""Per-tenant quotas (``MCP_BROKER_QUOTAS``, docs/QUOTAS.md): what each tenant may hold, and how fast it may publish.

``TenantQuotas`` reads the setting, a JSON map of tenant (or ``default``) to limits, strictly:
every tenant named must be one the settings configure, every limit one of ``LIMITS``, every
value a non-negative integer. A tenant's entry overrides ``default`` limit by limit; a limit
set in neither is unlimited (the global bounds of docs/LIMITS.md still hold).

``Quotas`` enforces the three kinds that are not enforced by a store's own atomic step:

* ``streams`` and ``listens``: leases in the backend (``base.Quotas``), one per open legacy GET
  stream (held by the session id, so a takeover is not a second stream) or listen, renewed by
  the worker that holds it every ``LEASE_TTL_MS / 3``. A worker killed with its streams open
  leaves leases that lapse by themselves after ``LEASE_TTL_MS``.
* ``publish_per_second``: a token bucket per tenant shared by every worker (``base.Quotas.take``),
  of ``publish_burst`` tokens (one second's worth by default).

``sessions`` is counted by the session store itself (``SessionStore.create``),
``subscriptions`` bound per session by the subscription index, and ``webhooks`` by the webhook
store (``Webhooks.create``): each in the same atomic step as the write it limits. Every check
is one backend call per request, only for a tenant that has that quota, and nothing happens per
delivered frame.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import secrets
from dataclasses import dataclass
from typing import Any, Final

from broker.backends.base import Quotas as QuotaStore
from broker.config import Settings
from broker.errors import BackendUnavailable, OverQuota, PublishRateLimited, raise_if_cancelled
from broker.tenants import tenant_problem

__all__ = ["LEASE_TTL_MS", "LIMITS", "Lease", "Limits", "Quotas", "TenantQuotas", "quota_problems",
           "tenant_share"]

logger = logging.getLogger(__name__)

#: The limits a tenant's entry may set.
LIMITS: Final = ("sessions", "subscriptions", "streams", "listens", "publish_per_second", "publish_burst",
                  "webhooks")
#: Milliseconds a stream's or listen's lease lives past its holder's last renewal (every third of it).
LEASE_TTL_MS: Final = 15_000
#: Seconds a client over a count quota is asked to wait: places free up as other sessions or streams end.
COUNT_RETRY: Final = 5
EXAMPLE: Final = '\'{"default": {"sessions": 10000}, "acme": {"sessions": 50000, "publish_per_second": 500}}\''


@dataclass(frozen=True, slots=True)
class Limits:
    """One tenant's effective quotas; None is unlimited."""

    sessions: int | None = None
    subscriptions: int | None = None
    streams: int | None = None
    listens: int | None = None
    publish_per_second: int | None = None
    publish_burst: int | None = None
    #: Webhook subscriptions of the events extension (counted by ``base.Webhooks.create``).
    webhooks: int | None = None

    @property
    def burst(self) -> int:
        """The bucket's capacity: ``publish_burst``, else one second's worth."""
        return self.publish_burst if self.publish_burst is not None else max(self.publish_per_second or 0, 1)


NO_LIMITS: Final = Limits()


class TenantQuotas:
    """The parsed setting: each tenant's ``Limits``, and ``default``'s for the others."""

    def __init__(self, entries: dict[str, Limits] | None = None) -> None:
        self._entries = entries or {}
        self._default = self._entries.get("default", NO_LIMITS)

    def __bool__(self) -> bool:
        return any(limits != NO_LIMITS for limits in self._entries.values())

    def of(self, tenant: str) -> Limits:
        return self._entries.get(tenant, self._default)

    @classmethod
    def from_settings(cls, settings: Settings) -> TenantQuotas:
        """Raises ValueError, one line naming the setting and what to write, for a bad ``MCP_BROKER_QUOTAS``."""
        # Runtime keys and OAuth tokens name tenants no setting lists: any valid name may have a quota.
        dynamic = bool(settings.auth_methods & {"keys", "oauth"})
        return cls.parse(settings.quotas, None if dynamic else configured_tenants(settings))

    @classmethod
    def parse(cls, raw: Any, tenants: set[str] | None) -> TenantQuotas:
        """``tenants``: the only tenants there can be (None: any valid name, as tokens and stored keys bring)."""
        if not isinstance(raw, dict):
            raise ValueError(f"MCP_BROKER_QUOTAS: write a JSON object of tenant to limits, e.g. {EXAMPLE}")
        given: dict[str, dict[str, int]] = {}
        for tenant, limits in raw.items():
            if tenant != "default" and tenants is None and (problem := tenant_problem(tenant)) is not None:
                raise ValueError(f"MCP_BROKER_QUOTAS: {problem}; write a tenant name, or \"default\"")
            if tenant != "default" and tenants is not None and tenant not in tenants:
                known = ", ".join(sorted(tenants)) or "none"
                raise ValueError(f"MCP_BROKER_QUOTAS: {tenant!r} is not a configured tenant (configured: {known}); "
                                 "write one of them, or \"default\" for every tenant without an entry")
            if not isinstance(limits, dict):
                raise ValueError(f"MCP_BROKER_QUOTAS: the entry of {tenant!r} must be an object of limits, "
                                 f'e.g. {{"{tenant}": {{"sessions": 100}}}}')
            for name, value in limits.items():
                if name not in LIMITS:
                    raise ValueError(f"MCP_BROKER_QUOTAS: {name!r} (tenant {tenant!r}) is not a limit; "
                                     f"write one of {', '.join(LIMITS)}")
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ValueError(f"MCP_BROKER_QUOTAS: {tenant}.{name} is {value!r}; write a whole number, "
                                     f"0 or more (leave it out for no limit)")
                if name in ("publish_per_second", "publish_burst") and value == 0:
                    raise ValueError(f"MCP_BROKER_QUOTAS: {tenant}.{name} is 0; write 1 or more "
                                     "(leave it out for no limit)")
            given[tenant] = limits
        defaults = given.get("default", {})
        entries = {tenant: Limits(**{**defaults, **limits}) for tenant, limits in given.items()}
        for tenant, limits in entries.items():
            if limits.publish_burst is not None and limits.publish_per_second is None:
                raise ValueError(f"MCP_BROKER_QUOTAS: {tenant}.publish_burst needs a publish_per_second "
                                 f"(of its own or of \"default\"); write both")
        return cls(entries)


def configured_tenants(settings: Settings) -> set[str]:
    """Every tenant the settings name: API keys' bindings, the default tenant, file roots, PostgreSQL tables."""
    tenants = {binding.partition("/")[0] for binding in settings.api_keys.values()}
    tenants |= {settings.default_tenant, *settings.file_roots, *settings.postgres_tables.values()}
    return tenants


def tenant_share(settings: Settings, capacity: int) -> int | None:
    """The most of ``capacity`` (``max_sessions``, ``max_listens``) one tenant may hold: its
    ``tenant_share``, at least one; None (all of it) without API keys and OAuth, where every
    caller is the default tenant.

    Without it one tenant's sessions or listens, up to the global bound, refuse every other
    tenant's; a deployment whose callers are all of one tenant would only lose capacity to it.
    """
    if settings.tenant_share >= 1 or not settings.auth_methods & {"keys", "oauth"}:
        return None
    return max(int(capacity * settings.tenant_share), 1)


def quota_problems(settings: Settings) -> list[str]:
    """The line that says what is wrong with ``MCP_BROKER_QUOTAS`` (none when it is right)."""
    try:
        TenantQuotas.from_settings(settings)
    except ValueError as exc:
        return [str(exc)]
    return []


@dataclass(frozen=True, slots=True)
class Lease:
    """A place a stream or listen holds in its tenant's count, until ``Quotas.release``."""

    tenant: str
    kind: str
    holder: str


class Quotas:
    """Checks the quotas of streams, listens and publishing against the backend (see the module docstring)."""

    def __init__(self, store: QuotaStore, quotas: TenantQuotas) -> None:
        self.store = store
        self.quotas = quotas
        #: The leases this worker holds, renewed together by ``run``, with how many of its streams
        #: hold each (a session's stream and the one taking it over, both here for a moment).
        self.held: dict[Lease, int] = {}
        #: Places a stream that was not taken over let go of, while another of this worker held them too.
        self._given_up: set[Lease] = set()
        self._node = secrets.token_hex(4)
        self._ids = itertools.count()
        self._tasks: set[asyncio.Task[None]] = set()

    def limits(self, tenant: str) -> Limits:
        return self.quotas.of(tenant)

    async def acquire(self, kind: str, tenant: str, holder: str | None = None) -> Lease | None:
        """A place in ``tenant``'s count of ``kind`` (None: the tenant has no such quota).

        ``holder`` names the place (a legacy stream's session id: its takeover holds the same
        one); by default a new one. Raises OverQuota when the tenant holds its quota already.
        """
        quota = getattr(self.quotas.of(tenant), kind)
        if quota is None:
            return None
        lease = Lease(tenant, kind, holder or f"{self._node}-{next(self._ids)}")
        if not await self.store.acquire(tenant, kind, lease.holder, quota, LEASE_TTL_MS):
            raise OverQuota(kind, tenant, quota, COUNT_RETRY,
                            f"tenant {tenant!r} has {quota} open {kind} (its quota); close one or retry later")
        self.held[lease] = self.held.get(lease, 0) + 1
        return lease

    def release(self, lease: Lease | None, *, keep: bool = False) -> None:
        """Give a place back, in the background (a stream ends without waiting for the backend).

        ``keep``: forget it here but leave the backend's entry to whoever holds it now (a legacy
        stream that another took over: the same session's newer stream holds the place).
        """
        if lease is None or lease not in self.held:
            return
        self.held[lease] -= 1
        if not keep:
            # A stream that was not taken over ended: once this worker holds the place no more,
            # it goes back, even when the last to let it go here is the stream taken over (the
            # two end in either order).
            self._given_up.add(lease)
        if self.held[lease] > 0:
            return  # another stream of this worker holds the same place
        del self.held[lease]
        given_up = lease in self._given_up
        self._given_up.discard(lease)
        if given_up:
            task = asyncio.get_running_loop().create_task(self._release(lease))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _release(self, lease: Lease) -> None:
        try:
            await self.store.release(lease.tenant, lease.kind, lease.holder)
        except BackendUnavailable:
            pass  # the lease lapses by itself within LEASE_TTL_MS

    async def take(self, tenant: str, count: int) -> None:
        """Take ``count`` tokens of the tenant's publish bucket. Raises PublishRateLimited (nothing taken)."""
        limits = self.quotas.of(tenant)
        rate = limits.publish_per_second
        if rate is None:
            return
        wait = await self.store.take(tenant, count, rate, limits.burst)
        if wait > 0:
            raise PublishRateLimited(tenant, rate, max(math.ceil(wait), 1))

    async def verification(self, tenant: str, per_minute: int) -> None:
        """Take one of the tenant's webhook verifications (a bucket of a minute's worth, all workers).

        Raises OverQuota (``webhook_verifications``) when the tenant sent its share already.
        """
        wait = await self.store.take(tenant, 1, per_minute / 60, per_minute, kind="verify")
        if wait > 0:
            raise OverQuota("webhook_verifications", tenant, per_minute, max(math.ceil(wait), 1),
                            f"tenant {tenant!r} made the broker send {per_minute} webhook verifications in the last "
                            "minute (MCP_BROKER_WEBHOOK_VERIFICATIONS_PER_MINUTE); retry later")

    async def run(self) -> None:
        """Renew this worker's leases every third of their life, until cancelled."""
        while True:
            await asyncio.sleep(LEASE_TTL_MS / 3000)
            held = [(lease.tenant, lease.kind, lease.holder) for lease in self.held]
            if not held:
                continue
            try:
                await self.store.refresh(held, LEASE_TTL_MS)
            except Exception as exc:  # the loop's boundary: renewing must go on after any one failure
                raise_if_cancelled()
                if not isinstance(exc, BackendUnavailable):
                    logger.exception("renewing %d quota leases failed", len(held))


