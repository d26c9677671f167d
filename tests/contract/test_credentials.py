"""``base.Credentials`` holds for every backend: keys stored by digest, found, listed, revoked once."""

from __future__ import annotations

import asyncio
import hashlib
import re
import secrets
import time

from redis.crc import key_slot

from broker.backends.base import Backend, KeyRecord
from broker.backends.redis.keys import Keys
from broker.backends.redis.scripts import source


def key_record(tenant: str = "acme", subject: str = "alice", *, expires_at: float | None = None,
               key_id: str | None = None) -> KeyRecord:
    digest = hashlib.sha256(secrets.token_bytes(32)).hexdigest()
    return KeyRecord(id=key_id or secrets.token_hex(8), digest=digest, tenant=tenant, subject=subject,
                     scopes=("resources:read", "keys:admin"), created_at=time.time(), expires_at=expires_at)


async def test_a_created_key_is_found_by_its_digest_with_every_field(backend: Backend) -> None:
    record = key_record(expires_at=time.time() + 3600.25)
    assert await backend.credentials.create(record) is True
    assert await backend.credentials.find(record.digest) == record
    assert await backend.credentials.get([record.id]) == {record.id: record}
    assert await backend.credentials.find(hashlib.sha256(b"another").hexdigest()) is None


async def test_a_key_of_an_existing_id_or_digest_is_refused_and_changes_nothing(backend: Backend) -> None:
    record = key_record()
    assert await backend.credentials.create(record)
    same_id = key_record("other", key_id=record.id)
    same_digest = KeyRecord(id=secrets.token_hex(8), digest=record.digest, tenant="other", subject="bob",
                            scopes=(), created_at=time.time())
    assert await backend.credentials.create(same_id) is False
    assert await backend.credentials.create(same_digest) is False
    assert await backend.credentials.find(record.digest) == record
    assert await backend.credentials.find(same_id.digest) is None
    assert await backend.credentials.list("other", "", 10) == []


async def test_revoking_marks_a_key_once_and_keeps_its_record(backend: Backend) -> None:
    record = key_record()
    await backend.credentials.create(record)
    first = time.time()
    assert await backend.credentials.revoke(record.id, first) is True
    assert await backend.credentials.revoke(record.id, first + 10) is False  # the first time stays
    stored = await backend.credentials.find(record.digest)
    assert stored is not None and stored.revoked_at == first and not stored.valid(time.time())
    assert await backend.credentials.revoke("no-such-key", first) is None


async def test_two_revocations_at_once_revoke_a_key_exactly_once(backend: Backend) -> None:
    record = key_record()
    await backend.credentials.create(record)
    outcomes = await asyncio.gather(*(backend.credentials.revoke(record.id, time.time()) for _ in range(8)))
    assert outcomes.count(True) == 1 and outcomes.count(False) == 7


async def test_listing_pages_in_id_order_per_tenant_or_for_every_tenant(backend: Backend) -> None:
    tenant, other = f"t{secrets.token_hex(3)}", f"t{secrets.token_hex(3)}"
    mine = [key_record(tenant, f"user{n}") for n in range(5)]
    theirs = key_record(other)
    for record in [*mine, theirs]:
        await backend.credentials.create(record)
    ids = sorted(r.id for r in mine)
    assert [r.id for r in await backend.credentials.list(tenant, "", 3)] == ids[:3]
    assert [r.id for r in await backend.credentials.list(tenant, ids[2], 3)] == ids[3:]
    assert await backend.credentials.list(tenant, ids[-1], 3) == []
    everyone = [r.id for r in await backend.credentials.list(None, "", 1000)]
    assert set(everyone) >= {*ids, theirs.id} and everyone == sorted(everyone)
    assert await backend.credentials.list(other, "", 10) == [theirs]


async def test_look_alike_tenants_never_list_each_others_keys(backend: Backend) -> None:
    a, ab = key_record("a"), key_record("a:b")
    await backend.credentials.create(a)
    await backend.credentials.create(ab)
    assert [r.id for r in await backend.credentials.list("a", "", 10) if r.id in (a.id, ab.id)] == [a.id]
    assert [r.id for r in await backend.credentials.list("a:b", "", 10)] == [ab.id]


async def test_get_returns_only_the_keys_that_exist(backend: Backend) -> None:
    record = key_record()
    await backend.credentials.create(record)
    assert await backend.credentials.get([record.id, "missing"]) == {record.id: record}
    assert await backend.credentials.get([]) == {}


def test_every_credential_key_shares_one_cluster_slot() -> None:
    keys = Keys("mcpb")
    names = [keys.credential("abc"), keys.credential_digest("00ff"), keys.credential_ids(), keys.credential_ids("t")]
    assert len({key_slot(name.encode()) for name in names}) == 1


def test_the_credential_scripts_touch_only_the_keys_they_declare() -> None:
    for name in ("credential_create", "credential_revoke"):
        calls = re.findall(r"redis\.call\(([^,)]+)(?:,\s*([^,)]+))?", source(name))
        assert calls and all(first.strip().startswith("KEYS[") for _, first in calls), name
