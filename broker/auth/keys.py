"""Runtime API keys: made, listed and revoked while the broker runs, and verified on every request.

A key is ``mcpb_`` and 43 characters of URL-safe base64 (32 random bytes); the prefix lets the
authenticator send a token to ``StoredKeys`` alone. The backend keeps only the key's SHA-256
(``backends.base.Credentials``), so a copy of the store gives nobody a working key, and the key
is shown once, when it is made. A plain hash is enough for 256 random bits: no dictionary
applies and a slow hash would only slow every request down. A presented key is looked up by
its digest, and the digest found is compared again in constant time.

``KeyAdmin`` is what the CLI (the operator: any tenant) and the admin REST API (a tenant's
admin, holding ``keys:admin``: only its tenant, and only scopes it holds itself) share.
``StoredKeys`` is the ``TokenVerifier``: it answers from a lookup at most ``key_cache_seconds``
old, of the key and of each key up its line of makers (``lineage_problem``), so a revocation or
expiry stops new requests on every worker within that time; open
streams end on their credential's expiry (a timer) or, once revoked, at the next check of the
worker's Hub (``credential_check_seconds``, through ``StoredKeys.invalid``). docs/API-KEYS.md.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final

from broker.auth.identity import CONSOLE, SCOPES, Principal, Unauthorized
from broker.auth.scopes import ADMIN
from broker.backends.base import Credentials, KeyRecord
from broker.tenants import tenant_problem

__all__ = ["ADMIN", "GRANTABLE", "MAX_LINEAGE", "PREFIX", "IssuedKey", "KeyAdmin", "KeyRefused", "StoredKeys",
           "digest_of", "key_view", "lineage_problem", "parse_duration"]

#: What every key starts with, and nothing else the broker accepts does.
PREFIX: Final = "mcpb_"
#: What a key may be granted: every data scope, the admin scope and the console's (those two never by default).
GRANTABLE: Final = (*SCOPES, ADMIN, CONSOLE)
#: Longer bearer tokens with the prefix are refused without a lookup (ours are 48 characters).
MAX_KEY_LENGTH: Final = 128
#: Lookups a worker keeps (the least recently fetched go first).
CACHE_ENTRIES: Final = 10_000
#: Keys listed per page at most, and by default.
MAX_PAGE: Final = 1000
PAGE: Final = 100
#: A subject: 1 to 128 visible ASCII characters (it is part of the principal's binding and of log lines).
_SUBJECT: Final = re.compile(r"[!-~]{1,128}")
#: A key id: 16 lower-case hex digits.
KEY_ID: Final = re.compile(r"[0-9a-f]{16}")
_UNITS: Final = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION: Final = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*")
#: The longest lifetime a key may be given: ten years.
MAX_LIFETIME: Final = 10 * 365 * 86400
#: Keys above a key in its line of makers, at most: each is a lookup when the key is checked.
MAX_LINEAGE: Final = 16
REVOKED_MAKER: Final = "a key that made this API key was revoked"


def digest_of(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def parse_duration(text: str | float) -> float:
    """Seconds from ``90``, ``90s``, ``15m``, ``12h`` or ``30d`` (or a number). Raises ValueError."""
    if isinstance(text, int | float) and not isinstance(text, bool):
        seconds = float(text)
    else:
        found = _DURATION.fullmatch(str(text))
        if found is None:
            raise ValueError(f"{text!r} is not a duration; write seconds, or a number with s, m, h or d (e.g. 12h)")
        seconds = float(found.group(1)) * _UNITS[found.group(2)]
    if not 0 < seconds <= MAX_LIFETIME:
        raise ValueError(f"{text!r}: a key's lifetime is more than 0 seconds and at most ten years")
    return seconds


async def lineage_problem(fetch: Callable[[str], Awaitable[KeyRecord | None]], maker: str | None) -> str | None:
    """Why a key made by ``maker`` must not hold; None when it may (``fetch`` finds a key by id).

    Every key up its line of makers must still exist unrevoked. Asked when a key is made and each
    time one is looked up, so a key made by a revoked key stops working whenever it was made, and
    whether or not the revocation's cascade reached it (a cascade cut short by a process that died,
    a key made before makers were checked). Expiry needs no walk: no key outlives its maker.
    """
    for _ in range(MAX_LINEAGE):
        if maker is None:
            return None
        record = await fetch(maker)
        if record is None or record.revoked_at is not None:
            return REVOKED_MAKER
        maker = record.created_by
    return None if maker is None else f"an API key made through more than {MAX_LINEAGE} keys is not accepted"


class KeyRefused(Exception):
    """A key request that cannot be done: ``status`` says why (403, 404, 409, 422)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True, slots=True)
class IssuedKey:
    """A key just made: the key itself (shown this once) and its stored record."""

    key: str
    record: KeyRecord


def key_view(record: KeyRecord, now: float | None = None) -> dict[str, Any]:
    """What a listing shows of a key: everything but the digest (and never the key)."""
    now = time.time() if now is None else now
    state = "revoked" if record.revoked_at is not None else ("active" if record.valid(now) else "expired")
    return {"id": record.id, "tenant": record.tenant, "subject": record.subject, "scopes": list(record.scopes),
            "created_at": record.created_at, "expires_at": record.expires_at, "revoked_at": record.revoked_at,
            "created_by": record.created_by, "state": state}


class KeyAdmin:
    """Make, list and revoke keys; ``tenant`` None is the operator (every tenant), else the only tenant allowed."""

    def __init__(self, store: Credentials, clock: Callable[[], float] = time.time) -> None:
        self.store = store
        self.clock = clock

    async def create(self, tenant: str, subject: str, scopes: Sequence[str] | None = None,
                     expires_in: float | None = None, *, by: Principal | None = None) -> IssuedKey:
        """A new key of ``tenant``/``subject`` with ``scopes`` (None: every data scope, never the admin's).

        ``by`` is the tenant admin asking (None: the operator): it may make keys of its own
        tenant only, with scopes it holds itself (by default, the data scopes it holds), that
        expire no later than its own credential; a key made with a stored key is revoked with it,
        and none is made once that key (or one of its makers) is revoked.

        Raises:
            KeyRefused: 422 for a bad tenant, subject, scope or lifetime; 403 for another tenant,
                a scope ``by`` does not hold, or a revoked maker.
        """
        if (problem := tenant_problem(tenant)) is not None:
            raise KeyRefused(422, problem)
        if not isinstance(subject, str) or not _SUBJECT.fullmatch(subject):
            raise KeyRefused(422, "subject: 1 to 128 visible ASCII characters, no spaces")
        if scopes is None:
            scopes = [s for s in SCOPES if by is None or s in by.scopes]
        granted = tuple(dict.fromkeys(scopes))
        unknown = [s for s in granted if s not in GRANTABLE]
        if unknown or not granted:
            raise KeyRefused(422, f"scopes: {', '.join(map(str, unknown)) or 'none given'}; "
                                  f"choose among {', '.join(GRANTABLE)}")
        if by is not None:
            if by.tenant != tenant:
                raise KeyRefused(403, f"a key of tenant {by.tenant!r} manages only that tenant's keys")
            if missing := [s for s in granted if s not in by.scopes]:
                raise KeyRefused(403, f"cannot grant scopes this key does not hold: {', '.join(missing)}")
        now = self.clock()
        if expires_in is not None:
            try:
                expires_in = parse_duration(expires_in)
            except ValueError as exc:
                raise KeyRefused(422, f"expires_in: {exc}") from exc
        while True:  # a clash of 64-bit ids or 256-bit keys does not happen; if it did, draw again
            key = PREFIX + secrets.token_urlsafe(32)
            expires_at = None if expires_in is None else now + expires_in
            if by is not None and by.expires_at is not None:
                # Never outlive the credential that made it (a short-lived token, an expiring key).
                expires_at = by.expires_at if expires_at is None else min(expires_at, by.expires_at)
            record = KeyRecord(id=secrets.token_hex(8), digest=digest_of(key), tenant=tenant, subject=subject,
                               scopes=granted, created_at=now, expires_at=expires_at,
                               created_by=None if by is None else by.credential)
            if await self._stored(record):
                return IssuedKey(key, record)

    async def _stored(self, record: KeyRecord) -> bool:
        """Store a new key; False when its id or digest is taken (draw again).

        Its makers are asked of the store, not of a cache: the caller's own key may have been
        revoked a moment ago. The store checks the direct maker again in the step that stores, so
        a key is either made before its maker's revocation (and the cascade, which lists keys
        after it revokes, finds it) or not at all.
        """
        if (problem := await lineage_problem(self._by_id, record.created_by)) is not None:
            raise KeyRefused(403, f"no key can be made with this key: {problem}")
        created = await self.store.create(record)
        if created is None:
            raise KeyRefused(403, f"no key can be made with this key: {REVOKED_MAKER}")
        return created

    async def _by_id(self, key_id: str) -> KeyRecord | None:
        return (await self.store.get([key_id])).get(key_id)

    async def list(self, tenant: str | None, after: str = "", limit: int = PAGE) -> list[KeyRecord]:
        # One more than a page may be asked for: it says whether another page follows.
        return await self.store.list(tenant, after, max(1, min(limit, MAX_PAGE + 1)))

    async def get(self, key_id: str, tenant: str | None) -> KeyRecord:
        """The key, when it exists and (for a tenant admin) is its tenant's. Raises ``KeyRefused`` 404."""
        found = (await self.store.get([key_id])).get(key_id) if KEY_ID.fullmatch(key_id) else None
        if found is None or (tenant is not None and found.tenant != tenant):
            raise KeyRefused(404, f"no key {key_id!r}" + ("" if tenant is None else f" in tenant {tenant!r}"))
        return found

    async def revoke(self, key_id: str, tenant: str | None) -> KeyRecord:
        """Revoke the key, and every key made with it (at any depth); its record as now stored.

        Raises:
            KeyRefused: 404 unknown, 409 revoked already.
        """
        record = await self.get(key_id, tenant)
        at = self.clock()
        outcome = await self.store.revoke(key_id, at)
        if outcome is None:
            raise KeyRefused(404, f"no key {key_id!r}")
        if outcome is False:
            raise KeyRefused(409, f"key {key_id} was revoked already")
        await self._revoke_made_by(record.tenant, key_id, at)
        return replace(record, revoked_at=at)

    async def _revoke_made_by(self, tenant: str, key_id: str, at: float) -> None:
        """Revoke the keys ``key_id`` made, and theirs: a holder cannot keep access by minting a child first."""
        parents = {key_id}
        while parents:
            children: list[str] = []
            after = ""
            while page := await self.store.list(tenant, after, MAX_PAGE):
                children += [k.id for k in page if k.created_by in parents and k.revoked_at is None]
                after = page[-1].id
            for child in children:
                await self.store.revoke(child, at)
            parents = set(children)


class StoredKeys:
    """The ``TokenVerifier`` of runtime keys: tokens with ``PREFIX`` are its, every other one is not."""

    def __init__(self, store: Credentials, cache_seconds: float, *, clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.cache_seconds = cache_seconds
        self.clock = clock
        self.monotonic = monotonic
        #: digest -> (monotonic time of the lookup, the record found). Only found keys are kept:
        #: a key made a moment ago on another worker works here at once.
        self._cache: dict[str, tuple[float, KeyRecord]] = {}
        #: The same for the makers of keys, by id (``lineage_problem``).
        self._makers: dict[str, tuple[float, KeyRecord]] = {}

    async def verify(self, token: str) -> Principal | None:
        """The key's principal; None for a token that is not a runtime key.

        Raises:
            Unauthorized: a runtime key that is unknown, revoked or expired, or made by a revoked key.
            BackendUnavailable: the store could not be asked.
        """
        if not token.startswith(PREFIX):
            return None
        if len(token) > MAX_KEY_LENGTH:
            raise Unauthorized("unknown API key")
        digest = digest_of(token)
        record = await self._lookup(digest)
        if record is None or not hmac.compare_digest(record.digest, digest):
            raise Unauthorized("unknown API key")
        if record.revoked_at is not None:
            raise Unauthorized("the API key was revoked")
        if not record.valid(self.clock()):
            raise Unauthorized("the API key has expired")
        if (problem := await lineage_problem(self._maker, record.created_by)) is not None:
            raise Unauthorized(problem)
        return Principal(record.tenant, record.subject, frozenset(record.scopes), record.expires_at, record.id)

    async def invalid(self, key_ids: Collection[str]) -> set[str]:
        """Which of these stored keys no longer hold (revoked, expired, gone, or made by a revoked key):
        the Hub's check of the keys behind this worker's open streams, one store round trip (and the
        lookups of their makers, cached as for requests).

        What it finds also refreshes the cached lookups, so once a stream of a revoked key ends
        here its client's reconnect is refused here too, not answered from the cache. Credentials
        that are not key ids are none of this store's business and never listed.
        """
        ours = [key_id for key_id in key_ids if KEY_ID.fullmatch(key_id)]
        found = await self.store.get(ours)
        now, fetched = self.clock(), self.monotonic()
        for record in found.values():
            if record.digest in self._cache:
                self._cache[record.digest] = (fetched, record)
            if record.id in self._makers:
                self._makers[record.id] = (fetched, record)
        return {key_id for key_id in ours if key_id not in found or not found[key_id].valid(now)
                or await lineage_problem(self._maker, found[key_id].created_by) is not None}

    async def _lookup(self, digest: str) -> KeyRecord | None:
        return await self._cached(self._cache, digest, self.store.find)

    async def _maker(self, key_id: str) -> KeyRecord | None:
        return await self._cached(self._makers, key_id, self._by_id)

    async def _by_id(self, key_id: str) -> KeyRecord | None:
        return (await self.store.get([key_id])).get(key_id)

    async def _cached(self, cache: dict[str, tuple[float, KeyRecord]], name: str,
                      fetch: Callable[[str], Awaitable[KeyRecord | None]]) -> KeyRecord | None:
        """The record ``fetch`` finds for ``name``, from a lookup at most ``cache_seconds`` old."""
        now = self.monotonic()
        cached = cache.get(name)
        if cached is not None and now - cached[0] < self.cache_seconds:
            return cached[1]
        record = await fetch(name)
        cache.pop(name, None)
        if record is not None and self.cache_seconds > 0:
            if len(cache) >= CACHE_ENTRIES:
                del cache[next(iter(cache))]
            cache[name] = (now, record)
        return record
