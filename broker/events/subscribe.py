"""``events/subscribe`` and ``events/unsubscribe``: webhook subscriptions, leased, keyed on who asks for what.

A subscription is keyed on (principal, callback URL, event name, arguments); its ``id`` is
derived from that key, so a second subscribe of the same key is a refresh (a new lease and
secret, delivery goes on where it was) and returns the same id. The lease granted is the
suggested ``ttlMs`` within [``webhook_min_ttl_ms``, ``webhook_max_ttl_ms``] (a ``ttlMs: null``
asking for no expiry gets the longest, as the draft lets a server do); one not refreshed in
time ends: any worker removes its record and its hidden session. Webhooks need an
authenticated principal (the draft's rule: without one, anyone could unsubscribe anyone), and
last no longer than its credential: the lease never runs past the credential's expiry, and one
made with a stored API key ends once that key is revoked (``delivery``). New subscriptions are
held to the tenant's ``webhooks`` quota and the deployment's ``webhook_max_subscriptions``,
both counted in the backend's create.

A new subscription's callback must pass ``Callbacks.check``, and, unless it is allow-listed,
the draft's verification handshake: a signed ``{"type": "verification", "challenge"}`` POST
whose 2xx answer echoes the challenge, so nobody can make the broker flood a URL that never
asked for it. The handshake is itself such a POST: each is taken from the tenant's bucket of
``webhook_verifications_per_minute`` before it is sent, and goes out in the tenant's share of
the connections.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import secrets
import time
from typing import Any

import orjson

from broker.backends.base import Webhooks
from broker.backends.types import WebhookRecord
from broker.config import Settings
from broker.events.callbacks import CallbackRefused, Callbacks, Target
from broker.events.model import CALLBACK_ERROR, FORBIDDEN, UNSUPPORTED, event_filter, iso, not_found, wanted
from broker.feeds.model import Cursor, FeedKind
from broker.feeds.service import Feeds
from broker.methods import Call, Methods
from broker.protocol import jsonrpc as rpc
from broker.quotas import Quotas, TenantQuotas

__all__ = ["ANONYMOUS", "WebhookSubscriptions", "subscription_id"]

#: The subject of a caller without credentials (``auth.Anonymous``, and stdio's caller).
ANONYMOUS = "anonymous"


def subscription_id(principal: str, url: str, name: str, arguments: dict[str, Any]) -> str:
    key = orjson.dumps([principal, url, name, arguments], option=orjson.OPT_SORT_KEYS)
    return "sub_" + hashlib.sha256(key).hexdigest()[:24]


def _secret(delivery: dict[str, Any]) -> str:
    secret = delivery.get("secret")
    if isinstance(secret, str) and secret.startswith("whsec_") and len(secret) <= 200:
        try:
            if 24 <= len(base64.b64decode(secret[6:], validate=True)) <= 64:
                return secret
        except ValueError:  # binascii.Error, or characters that are not ASCII
            pass
    raise rpc.RpcError(rpc.INVALID_PARAMS, "delivery.secret must be whsec_ followed by the base64 of 24 to 64 "
                       "random bytes (Standard Webhooks)", invalid=True)


class WebhookSubscriptions:
    def __init__(self, settings: Settings, methods: Methods, feeds: Feeds, store: Webhooks, callbacks: Callbacks, *,
                 authenticated: bool, quotas: TenantQuotas | None = None, buckets: Quotas | None = None) -> None:
        """``authenticated``: whether callers bring credentials (the authenticator is not ``Anonymous``).
        ``buckets``: where verifications are counted (none: not counted)."""
        self.settings = settings
        self.methods = methods
        self.feeds = feeds
        self.store = store
        self.callbacks = callbacks
        #: Webhooks need credentials: with anonymous callers, every caller is the same principal.
        self.authenticated = authenticated
        self.quotas = quotas or TenantQuotas()
        self.buckets = buckets

    def _delivery(self, call: Call, params: dict[str, Any]) -> tuple[dict[str, Any], str]:
        if not self.authenticated or call.principal.subject == ANONYMOUS:
            raise rpc.RpcError(FORBIDDEN, "Forbidden: webhooks need an authenticated principal (this server takes "
                               "anonymous callers); use events/poll")
        delivery = params.get("delivery")
        if not isinstance(delivery, dict):
            raise rpc.RpcError(rpc.INVALID_PARAMS, 'params.delivery must be {"mode": "webhook", "url", "secret"}',
                               invalid=True)
        mode = delivery.get("mode", "webhook")
        if mode != "webhook":
            raise rpc.RpcError(UNSUPPORTED, "events/subscribe delivers by webhook only; poll with events/poll",
                               {"feature": "deliveryMode", "value": mode if isinstance(mode, str) else None})
        url = delivery.get("url")
        if not isinstance(url, str):
            raise rpc.RpcError(rpc.INVALID_PARAMS, "delivery.url must be a string", invalid=True)
        return delivery, url

    def _ttl_ms(self, params: dict[str, Any]) -> int:
        if "ttlMs" not in params:
            asked = self.settings.webhook_default_ttl_ms
        elif params["ttlMs"] is None:
            asked = self.settings.webhook_max_ttl_ms  # no expiry asked for: the longest this server grants
        elif isinstance(params["ttlMs"], bool) or not isinstance(params["ttlMs"], int) or params["ttlMs"] < 0:
            raise rpc.RpcError(rpc.INVALID_PARAMS, "params.ttlMs must be a non-negative integer or null", invalid=True)
        else:
            asked = params["ttlMs"]
        return max(self.settings.webhook_min_ttl_ms, min(asked, self.settings.webhook_max_ttl_ms))

    async def _target(self, url: str) -> Target:
        try:
            return await self.callbacks.check(url)
        except CallbackRefused as exc:
            raise rpc.RpcError(rpc.INVALID_PARAMS, f"delivery.url refused: {exc}", invalid=True) from exc

    async def subscribe(self, call: Call, params: dict[str, Any]) -> dict[str, Any]:
        delivery, url = self._delivery(call, params)
        what = wanted(self.methods, call, params, "webhook")
        secret = _secret(delivery)
        ttl = self._ttl_ms(params)
        cursor = params.get("cursor")
        if cursor is not None and not isinstance(cursor, str):
            raise rpc.RpcError(rpc.INVALID_PARAMS, "params.cursor must be a string or null", invalid=True)
        target = await self._target(url)
        sub_id = subscription_id(call.principal.key, url, what["name"], what["arguments"])
        now = time.time()
        expires = now + ttl / 1000
        if call.principal.expires_at is not None:  # never past the credential the subscription was made with
            expires = min(expires, call.principal.expires_at)
        credential = call.principal.credential
        existing = await self.store.get(sub_id)
        if existing is not None and existing.expires_at > now and await self.store.refresh(sub_id, expires, secret,
                                                                                            credential):
            return self._answer(existing, expires, truncated=False, status=True)
        if existing is not None:
            await self.end(existing, expired_by=now)  # lapsed, not yet cleaned up (kept if refreshed meanwhile)
        if not target.allowed:
            await self._verify(url, secret, sub_id, call.principal.tenant)
        session = await self.feeds.create(call.principal, FeedKind.WEBHOOK, event_filter({**what, "id": sub_id}))
        record = WebhookRecord(id=sub_id, tenant=session.tenant, principal=call.principal.key, name=what["name"],
                               arguments=what["arguments"], url=url, secret=secret, session=session.id,
                               epoch=session.epoch, offset=0, expires_at=expires, created_at=now,
                               credential=credential)
        if not await self._create(record):  # another subscribe of the same key won the race
            await self.feeds.end(session.id)
            return await self.subscribe(call, params)
        # A cursor of before this subscription cannot be replayed from: delivery starts now.
        return self._answer(record, expires, truncated=cursor is not None, status=False)

    async def _create(self, record: WebhookRecord) -> bool:
        """Store a new subscription, held to the deployment's bound and the tenant's ``webhooks`` quota.

        Raises:
            OverQuota: over the tenant's ``webhooks`` quota. LimitExceeded: at the deployment's bound
                (``Reason.WEBHOOKS``). Its feed is ended whenever it is not stored.
        """
        try:
            return await self.store.create(record, self.settings.webhook_max_subscriptions,
                                           self.quotas.of(record.tenant).webhooks)
        except BaseException:
            # Not stored (a bound, an outage, a cancellation): the feed made for it goes too, or,
            # should that fail as well, expires after MCP_BROKER_SESSION_TTL.
            with contextlib.suppress(Exception):
                await asyncio.shield(self.feeds.end(record.session))
            raise

    async def _verify(self, url: str, secret: str, sub_id: str, tenant: str) -> None:
        """The draft's endpoint verification, counted against the tenant before it is sent.

        Raises RpcError: -32015 with ``data.reason``; OverQuota once the tenant sent its
        ``webhook_verifications_per_minute`` (each is a signed POST to a URL the caller chose).
        """
        if self.buckets is not None:
            await self.buckets.verification(tenant, self.settings.webhook_verifications_per_minute)
        challenge = secrets.token_urlsafe(24)
        body = orjson.dumps({"type": "verification", "challenge": challenge})
        outcome = await self.callbacks.post(url, secret, f"msg_verification_{secrets.token_hex(8)}", body, sub_id,
                                            tenant)
        reason = outcome.error
        if outcome.ok:
            try:
                echoed = orjson.loads(outcome.body).get("challenge")
            except (orjson.JSONDecodeError, AttributeError):
                echoed = None
            if isinstance(echoed, str) and hmac.compare_digest(echoed, challenge):
                return
            reason = "challenge_failed"
        raise rpc.RpcError(CALLBACK_ERROR, "The callback endpoint did not confirm the subscription",
                           {"reason": reason})

    def _answer(self, record: WebhookRecord, expires: float, *, truncated: bool, status: bool) -> dict[str, Any]:
        result: dict[str, Any] = {"id": record.id, "refreshBefore": iso(expires),
                                  "cursor": str(Cursor(record.session, record.epoch, record.offset)),
                                  "truncated": truncated}
        if status:
            last = None if record.delivered_at is None else iso(record.delivered_at)
            delivery: dict[str, Any] = {"active": True, "lastDeliveryAt": last, "lastError": record.last_error}
            if record.failed_since is not None:
                delivery["failedSince"] = iso(record.failed_since)
            result["deliveryStatus"] = delivery
        return result

    async def unsubscribe(self, call: Call, params: dict[str, Any]) -> dict[str, Any]:
        _, url = self._delivery(call, params)
        what = wanted(self.methods, call, params, "webhook")
        record = await self.store.get(subscription_id(call.principal.key, url, what["name"], what["arguments"]))
        if record is None or record.principal != call.principal.key:
            raise not_found("No such subscription", "subscription")
        await self.end(record)
        return {}

    async def end(self, record: WebhookRecord, *, expired_by: float | None = None,
                  credential: str | None = None) -> None:
        """Remove a subscription and its hidden session (any worker may; doing it twice is harmless).

        ``expired_by``, ``credential``: only while it is still lapsed by then, or still bound to that
        credential (``Webhooks.remove``), so a refresh racing the removal keeps the subscription.
        """
        session = await self.store.remove(record.id, expired_by=expired_by, credential=credential)
        if session is not None:
            await self.feeds.end(session)
