"""Runtime API keys on Redis (``base.Credentials``): a hash per key, found by its digest.

Every key lives under the hash tag ``{k}`` (``keys.py``), so ``credential_create.lua`` stores the
record, the digest -> id entry and both id indexes in one atomic step, after checking that the
key's maker (if any) exists unrevoked (a Cluster runs it in one slot: keys are few, written by
hand, and read once per worker per cache period), and ``credential_revoke.lua`` revokes a key
once. Fields: ``h`` digest, ``t`` tenant, ``s`` subject, ``sc`` scopes (space separated), ``c``
created, ``e`` expires (absent: never), ``r`` revoked (absent: not revoked), ``b`` the id of the
key that made it (absent: the operator); times as ``repr`` of their float, so they read back
exactly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from redis.commands.core import AsyncScript

from broker.backends.redis.codec import as_text
from broker.backends.redis.connection import Client, unavailable
from broker.backends.redis.durable import Durability
from broker.backends.redis.keys import Keys
from broker.backends.redis.scripts import source
from broker.backends.types import KeyRecord

__all__ = ["RedisCredentials"]


def _fields(record: KeyRecord) -> list[str]:
    fields = ["t", record.tenant, "s", record.subject, "sc", " ".join(record.scopes), "c", repr(record.created_at)]
    if record.expires_at is not None:
        fields += ["e", repr(record.expires_at)]
    if record.revoked_at is not None:
        fields += ["r", repr(record.revoked_at)]
    if record.created_by is not None:
        fields += ["b", record.created_by]
    return fields


def _record(key_id: str, raw: Mapping[Any, Any]) -> KeyRecord | None:
    """The record of a hash as HGETALL returns it; None for an empty (missing) one."""
    if not raw:
        return None
    fields = {as_text(k): as_text(v) for k, v in raw.items()}
    expires, revoked = fields.get("e"), fields.get("r")
    return KeyRecord(id=key_id, digest=fields["h"], tenant=fields["t"], subject=fields["s"],
                     scopes=tuple(fields["sc"].split()), created_at=float(fields["c"]),
                     expires_at=None if expires is None else float(expires),
                     revoked_at=None if revoked is None else float(revoked), created_by=fields.get("b"))


class RedisCredentials:
    """Runtime API keys shared by every worker of the deployment."""

    def __init__(self, client: Client, keys: Keys, durable: Durability | None = None) -> None:
        self.client = client
        self.keys = keys
        self._durable = durable or Durability()
        self._create: AsyncScript = client.register_script(source("credential_create"))
        self._revoke: AsyncScript = client.register_script(source("credential_revoke"))

    async def create(self, record: KeyRecord) -> bool | None:
        keys = self.keys
        maker = [] if record.created_by is None else [keys.credential(record.created_by)]
        with unavailable("credentials.create"):
            created = int(await self._durable.run(
                self.client, self._create,
                [keys.credential(record.id), keys.credential_digest(record.digest), keys.credential_ids(),
                 keys.credential_ids(record.tenant), *maker],
                [record.id, record.digest, *_fields(record)]))
        return None if created < 0 else bool(created)

    async def find(self, digest: str) -> KeyRecord | None:
        with unavailable("credentials.find"):
            key_id = await self.client.get(self.keys.credential_digest(digest))
            if key_id is None:
                return None
            key_id = as_text(key_id)
            return _record(key_id, await self.client.hgetall(self.keys.credential(key_id)))

    async def get(self, key_ids: Sequence[str]) -> dict[str, KeyRecord]:
        if not key_ids:
            return {}
        with unavailable("credentials.get"):
            pipe = self.client.pipeline(transaction=False)
            for key_id in key_ids:
                pipe.hgetall(self.keys.credential(key_id))
            raws = await pipe.execute()
        found = {key_id: _record(key_id, raw) for key_id, raw in zip(key_ids, raws, strict=True)}
        return {key_id: record for key_id, record in found.items() if record is not None}

    async def list(self, tenant: str | None, after: str, limit: int) -> list[KeyRecord]:
        start = f"({after}" if after else "-"
        with unavailable("credentials.list"):
            ids = await self.client.zrangebylex(self.keys.credential_ids(tenant), start, "+", start=0, num=limit)
        names = [as_text(key_id) for key_id in ids]
        found = await self.get(names)
        return [found[key_id] for key_id in names if key_id in found]

    async def revoke(self, key_id: str, at: float) -> bool | None:
        with unavailable("credentials.revoke"):
            outcome = int(await self._durable.run(self.client, self._revoke, [self.keys.credential(key_id)],
                                                  [repr(at)]))
        return None if outcome < 0 else bool(outcome)
