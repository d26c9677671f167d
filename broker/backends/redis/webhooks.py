"""Webhook subscriptions on Redis (``base.Webhooks``): a hash per subscription, an id index, dead letters.

Every key lives under the hash tag ``{wh}``, so each script runs in one slot of a Cluster
(subscriptions are few next to sessions, and each is written a few times per delivered event):

=========================  ======  ===========================================================
``P:{wh}:sub:<id>``        hash    the record: one field per attribute, each a JSON value
``P:{wh}:ids``             zset    every subscription's id, score 0, for ordered paging
``P:{wh}:tenants``         hash    each tenant's count of subscriptions (its ``webhooks`` quota)
``P:{wh}:dead``            list    dead letters, newest first, trimmed to the bound
=========================  ======  ===========================================================

``webhook_create.lua`` counts the deployment's and the tenant's subscriptions in the step that
adds one. ``webhook_update.lua`` changes fields of a record only while it exists (an advance only
while it is at the session and epoch the worker read), so an update racing an
``events/unsubscribe`` or an expiry never brings the record back; ``webhook_remove.lua`` checks
its conditions (still expired, still bound to a credential) in the step that removes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import orjson
from redis.commands.core import AsyncScript

from broker.backends.redis.codec import as_text
from broker.backends.redis.connection import Client, unavailable
from broker.backends.redis.scripts import source
from broker.backends.types import DeadLetter, WebhookRecord
from broker.errors import LimitExceeded, OverQuota, Reason

__all__ = ["RedisWebhooks"]

_FIELDS = tuple(f.name for f in dataclasses.fields(WebhookRecord))


def _pairs(**values: Any) -> list[str | bytes]:
    out: list[str | bytes] = []
    for name, value in values.items():
        out += [name, orjson.dumps(value)]
    return out


def _record(raw: Mapping[Any, Any]) -> WebhookRecord | None:
    if not raw:
        return None
    fields = {as_text(k): orjson.loads(v) for k, v in raw.items()}
    try:
        return WebhookRecord(**{name: fields[name] for name in _FIELDS if name in fields})
    except TypeError:  # a record missing a field (written by hand, or half-removed): treated as gone
        return None


class RedisWebhooks:
    """Webhook subscriptions shared by every worker of the deployment."""

    def __init__(self, client: Client, prefix: str) -> None:
        self.client = client
        self._base = f"{prefix}:{{wh}}"
        self._ids = f"{self._base}:ids"
        self._dead = f"{self._base}:dead"
        self._tenants = f"{self._base}:tenants"
        self._create: AsyncScript = client.register_script(source("webhook_create"))
        self._update: AsyncScript = client.register_script(source("webhook_update"))
        self._remove: AsyncScript = client.register_script(source("webhook_remove"))
        self._append: AsyncScript = client.register_script(source("webhook_dead"))

    def _key(self, subscription_id: str) -> str:
        return f"{self._base}:sub:{subscription_id}"

    async def create(self, record: WebhookRecord, most: int, tenant_most: int | None = None) -> bool:
        with unavailable("webhooks.create"):
            created = int(await self._create(
                keys=[self._key(record.id), self._ids, self._tenants],
                args=[record.id, orjson.dumps(record.tenant), most, "" if tenant_most is None else tenant_most,
                      *_pairs(**dataclasses.asdict(record))]))
        if created == -1:
            raise LimitExceeded(f"{most} webhook subscriptions exist", reason=Reason.WEBHOOKS, retry_after=60,
                                data={"limit": "subscriptions", "max": most})
        if created == -2:
            assert tenant_most is not None
            raise OverQuota("webhooks", record.tenant, tenant_most, 60,
                            f"tenant {record.tenant!r} has {tenant_most} webhook subscriptions (its quota)")
        return created == 1

    async def get(self, subscription_id: str) -> WebhookRecord | None:
        with unavailable("webhooks.get"):
            return _record(await self.client.hgetall(self._key(subscription_id)))

    async def page(self, after: str, limit: int) -> list[WebhookRecord]:
        start = f"({after}" if after else "-"
        with unavailable("webhooks.list"):
            ids = [as_text(i) for i in await self.client.zrangebylex(self._ids, start, "+", start=0, num=limit)]
            if not ids:
                return []
            pipe = self.client.pipeline(transaction=False)
            for subscription_id in ids:
                pipe.hgetall(self._key(subscription_id))
            raws: Sequence[Any] = await pipe.execute()
        return [record for raw in raws if (record := _record(raw)) is not None]

    async def refresh(self, subscription_id: str, expires_at: float, secret: str, credential: str | None) -> bool:
        return await self._set(subscription_id, ["set", *_pairs(expires_at=expires_at, secret=secret,
                                                                  credential=credential)])

    async def advance(self, subscription_id: str, since: tuple[str, str], session: str, epoch: str, offset: int,
                      delivered_at: float | None, *, gap: bool = False) -> bool:
        pairs = _pairs(session=session, epoch=epoch, offset=offset, gap=gap)
        if delivered_at is not None:
            pairs += _pairs(delivered_at=delivered_at, last_error=None, failed_since=None)
        return await self._set(subscription_id, ["advance", orjson.dumps(since[0]), orjson.dumps(since[1]), *pairs])

    async def fail(self, subscription_id: str, error: str, at: float) -> bool:
        return await self._set(subscription_id, ["fail", *_pairs(last_error=error, failed_since=at)])

    async def _set(self, subscription_id: str, args: list[str | bytes]) -> bool:
        with unavailable("webhooks.update"):
            return bool(int(await self._update(keys=[self._key(subscription_id)], args=args)))

    async def remove(self, subscription_id: str, *, expired_by: float | None = None,
                     credential: str | None = None) -> str | None:
        conditions = ["" if expired_by is None else repr(expired_by),
                      "" if credential is None else orjson.dumps(credential)]
        with unavailable("webhooks.remove"):
            session = await self._remove(keys=[self._key(subscription_id), self._ids, self._tenants],
                                         args=[subscription_id, *conditions])
        return None if session is None else str(orjson.loads(session))

    async def dead_letter(self, entry: DeadLetter, keep: int) -> None:
        with unavailable("webhooks.dead_letter"):
            await self._append(keys=[self._dead], args=[orjson.dumps(dataclasses.asdict(entry)), max(keep, 1)])

    async def dead_letters(self, limit: int) -> list[DeadLetter]:
        with unavailable("webhooks.dead_letters"):
            raws = await self.client.lrange(self._dead, 0, max(limit, 1) - 1)
        return [DeadLetter(**orjson.loads(raw)) for raw in raws]
