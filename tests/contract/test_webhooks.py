"""``base.Webhooks`` holds for every backend: subscriptions created once, updated only while they exist."""

from __future__ import annotations

import asyncio
import re
import secrets
import time

import pytest
from redis.crc import key_slot

from broker.backends.base import Backend, DeadLetter, WebhookRecord
from broker.backends.redis.scripts import source
from broker.errors import LimitExceeded, OverQuota

#: The deployment's bound in the tests that do not test it.
MOST = 1000


def webhook(subscription_id: str | None = None, **fields: object) -> WebhookRecord:
    record = WebhookRecord(id=subscription_id or "sub_" + secrets.token_hex(8), tenant="acme", principal="acme/alice",
                           name="mcp.resource.updated", arguments={"uris": ["mcpb://acme/items/1"]},
                           url="https://hooks.example.com/in", secret="whsec_" + "A" * 32, session="s1", epoch="e1",
                           offset=0, expires_at=time.time() + 60, created_at=time.time())
    return WebhookRecord(**{**{f: getattr(record, f) for f in record.__dataclass_fields__}, **fields})  # type: ignore[arg-type]


async def test_a_created_subscription_reads_back_whole_and_a_second_create_changes_nothing(backend: Backend) -> None:
    record = webhook()
    assert await backend.webhooks.create(record, MOST) is True
    assert await backend.webhooks.get(record.id) == record
    assert await backend.webhooks.create(webhook(record.id, url="https://other.example.com/"), MOST) is False
    assert await backend.webhooks.get(record.id) == record
    assert await backend.webhooks.get("sub_none") is None


async def test_subscriptions_are_listed_in_id_order_in_pages(backend: Backend) -> None:
    ids = sorted(f"sub_{n:02d}{secrets.token_hex(2)}" for n in range(5))
    for subscription_id in reversed(ids):
        await backend.webhooks.create(webhook(subscription_id), MOST)
    first = await backend.webhooks.page("", 3)
    assert [r.id for r in first] == ids[:3]
    assert [r.id for r in await backend.webhooks.page(first[-1].id, 3)] == ids[3:]


async def test_updates_change_only_their_fields_and_never_revive_a_removed_subscription(backend: Backend) -> None:
    record = webhook()
    await backend.webhooks.create(record, MOST)
    assert await backend.webhooks.advance(record.id, ("s1", "e1"), "s2", "e2", 7, None, gap=True)
    assert await backend.webhooks.fail(record.id, "timeout", 100.0)
    assert await backend.webhooks.fail(record.id, "http_5xx", 200.0)  # the first failure's time stays
    assert await backend.webhooks.refresh(record.id, 12345.5, "whsec_" + "B" * 32, "key_2")
    stored = await backend.webhooks.get(record.id)
    assert stored is not None
    assert (stored.session, stored.epoch, stored.offset, stored.delivered_at, stored.gap) == ("s2", "e2", 7, None, True)
    assert (stored.last_error, stored.failed_since) == ("http_5xx", 100.0)
    assert (stored.expires_at, stored.secret, stored.url, stored.credential) == (
        12345.5, "whsec_" + "B" * 32, record.url, "key_2")
    assert await backend.webhooks.advance(record.id, ("s2", "e2"), "s2", "e2", 8, 300.0)  # a delivery clears the error
    stored = await backend.webhooks.get(record.id)
    assert stored is not None and (stored.offset, stored.delivered_at, stored.last_error, stored.failed_since,
                                   stored.gap) == (8, 300.0, None, None, False)
    assert await backend.webhooks.remove(record.id) == "s2"
    assert await backend.webhooks.remove(record.id) is None
    for update in (backend.webhooks.advance(record.id, ("s2", "e2"), "s", "e", 9, 1.0),
                   backend.webhooks.fail(record.id, "x", 1.0),
                   backend.webhooks.refresh(record.id, 1.0, "whsec_x", None)):
        assert await update is False
    assert await backend.webhooks.get(record.id) is None
    assert await backend.webhooks.page("", 10) == []


async def test_an_advance_from_another_session_or_epoch_changes_nothing(backend: Backend) -> None:
    """A stale worker's position (of the session a resubscribe replaced) never lands on the new record."""
    record = webhook(session="s-new", epoch="e1", offset=3)
    await backend.webhooks.create(record, MOST)
    assert await backend.webhooks.advance(record.id, ("s-old", "e1"), "s-old", "e1", 9, 1.0) is False
    assert await backend.webhooks.advance(record.id, ("s-new", "e0"), "s-new", "e0", 9, 1.0) is False
    assert await backend.webhooks.get(record.id) == record


async def test_a_conditional_remove_keeps_a_refreshed_or_rebound_subscription(backend: Backend) -> None:
    record = webhook(expires_at=100.0, credential="key_1")
    await backend.webhooks.create(record, MOST)
    assert await backend.webhooks.refresh(record.id, 10_000.0, record.secret, "key_2")  # after the scan read it
    assert await backend.webhooks.remove(record.id, expired_by=5000.0) is None
    assert await backend.webhooks.remove(record.id, credential="key_1") is None
    assert await backend.webhooks.get(record.id) is not None
    assert await backend.webhooks.remove(record.id, expired_by=10_000.0, credential="key_2") == record.session


async def test_creates_are_held_to_the_bound_and_the_tenant_quota_atomically(backend: Backend) -> None:
    async def create(tenant: str, most: int = MOST, tenant_most: int | None = 3) -> str:
        try:
            return str(await backend.webhooks.create(webhook(tenant=tenant), most, tenant_most))
        except OverQuota:
            return "quota"
        except LimitExceeded:
            return "full"

    outcomes = await asyncio.gather(*(create("acme") for _ in range(8)))
    assert sorted(outcomes) == ["True"] * 3 + ["quota"] * 5
    assert await create("other") == "True"  # another tenant is not held back by acme's
    assert await create("third", most=4, tenant_most=None) == "full"
    gone = (await backend.webhooks.page("", 10))[0]
    await backend.webhooks.remove(gone.id)  # an ended subscription frees its place
    assert await create(gone.tenant) == "True"


async def test_two_creates_at_once_store_exactly_one(backend: Backend) -> None:
    outcomes = await asyncio.gather(*(backend.webhooks.create(webhook("sub_same", url=f"https://h{n}.example.com/"),
                                                              MOST, 1) for n in range(6)))
    assert sorted(outcomes) == [False] * 5 + [True]
    assert len(await backend.webhooks.page("", 10)) == 1


async def test_dead_letters_keep_only_the_newest_bound_newest_first(backend: Backend) -> None:
    for n in range(7):
        await backend.webhooks.dead_letter(DeadLetter(subscription="sub_1", tenant="acme", url="https://h.example.com/",
                                                      event_id=f"e{n}", body=f'{{"n": {n}}}', attempts=3,
                                                      error="http_5xx", at=float(n)), keep=4)
    letters = await backend.webhooks.dead_letters(10)
    assert [d.event_id for d in letters] == ["e6", "e5", "e4", "e3"]
    assert letters[0].body == '{"n": 6}' and letters[0].attempts == 3
    assert [d.event_id for d in await backend.webhooks.dead_letters(2)] == ["e6", "e5"]


@pytest.mark.parametrize("name", ["webhook_create", "webhook_update", "webhook_remove", "webhook_dead"])
def test_webhook_scripts_touch_only_the_keys_they_declare(name: str) -> None:
    calls = re.findall(r"redis\.call\(([^,)]+)(?:,\s*([^,)]+))?", source(name))
    assert calls
    for _command, first in calls:
        assert first.strip().startswith("KEYS["), f"{name}: {first}"


def test_every_webhook_key_is_in_one_cluster_slot() -> None:
    from broker.backends.redis.webhooks import RedisWebhooks

    class _Client:
        def register_script(self, text: str) -> object:
            return object()

    store = RedisWebhooks(_Client(), "mcpb")  # type: ignore[arg-type]
    keys = [store._key("sub_a"), store._key("sub_b"), store._ids, store._dead, store._tenants]
    assert len({key_slot(key.encode()) for key in keys}) == 1
