"""An authorization server as a resource server sees it: its metadata and its signing keys, fetched and kept.

``IssuerKeys`` discovers the server's metadata from its issuer identifier (RFC 8414
``/.well-known/oauth-authorization-server``, then OpenID Connect's
``/.well-known/openid-configuration``; for an issuer with a path, the well-known part goes
between host and path, and OpenID's is also tried appended to the path) and keeps its key set
(``jwks_uri``). Nothing is fetched per request once the keys are in hand:

* a token signed by a key id the set does not have makes the set be fetched again, at most once
  per ``refresh_interval`` seconds (a stream of forged key ids cannot make the broker hammer the
  server), so a key rotation is picked up by the first token signed with the new key;
* a set older than ``MAX_AGE`` is fetched again when next used, so a key the server removed stops
  being accepted (if that fetch fails, the old set is kept: an outage must not lock everyone out);
* while the metadata or the keys cannot be had at all (the server is down at start), every
  check raises ``AuthUnavailable`` (a 503 with ``Retry-After``) and the next one tries again,
  at most once per ``FAILED_RETRY`` seconds; concurrent checks share one fetch.

Each fetch has a total deadline (``fetch_timeout``), not only one per read: a server that sends
a byte every few seconds never trips a read timeout, and would hold every check waiting for its
keys. Past the deadline the fetch has failed like any other. A check waits for a fetch under way
only when it needs what that fetch brings: not while the keys in hand have the token's key (a
refresh of an old set), nor during an outage already seen (503 at once; one check at a time
tries again).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, NoReturn
from urllib.parse import urlsplit

import httpx
import orjson
from jwt import PyJWK, PyJWTError

from broker.auth.identity import AuthUnavailable

__all__ = ["ALGORITHMS", "FAILED_RETRY", "MAX_AGE", "IssuerKeys", "ServerMetadata", "discovery_urls"]

logger = logging.getLogger(__name__)

#: Signature algorithms accepted: asymmetric only. Never ``none``, never an HMAC (``HS*``), whose
#: "key" would be the server's public key, known to anyone.
ALGORITHMS: Final = frozenset({"RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512",
                               "EdDSA"})
#: The key type (and curve) each algorithm's key must have.
_KEY_TYPES: Final = {**dict.fromkeys(("RS256", "RS384", "RS512", "PS256", "PS384", "PS512"), ("RSA", None)),
                     "ES256": ("EC", "P-256"), "ES384": ("EC", "P-384"), "ES512": ("EC", "P-521"),
                     "EdDSA": ("OKP", None)}
#: Seconds after which a key set is fetched again when next used.
MAX_AGE: Final = 3600.0
#: Seconds between two attempts while the metadata or keys cannot be had.
FAILED_RETRY: Final = 1.0
#: Bytes of a metadata document or key set; a larger one is refused.
MAX_DOCUMENT_BYTES: Final = 1_048_576


@dataclass(frozen=True, slots=True)
class ServerMetadata:
    """What the broker uses of an authorization server's metadata."""

    issuer: str
    jwks_uri: str | None
    introspection_endpoint: str | None


def discovery_urls(issuer: str) -> list[str]:
    """Where the metadata of ``issuer`` may be, in the order tried (RFC 8414 §3.1 and §5, OpenID Discovery §4)."""
    parts = urlsplit(issuer)
    origin = f"{parts.scheme}://{parts.netloc}"
    path = parts.path.rstrip("/")
    urls = [f"{origin}/.well-known/oauth-authorization-server{path}",
            f"{origin}{path}/.well-known/openid-configuration"]
    if path:
        urls.append(f"{origin}/.well-known/openid-configuration{path}")
    return urls


class _Unreachable(Exception):
    """One document could not be had (the reason is logged, never shown to a client)."""


class IssuerKeys:
    """The metadata and signing keys of one authorization server, fetched lazily and kept."""

    def __init__(self, issuer: str, http: httpx.AsyncClient, *, refresh_interval: float = 30.0,
                 fetch_timeout: float = 5.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.issuer = issuer
        self.http = http
        self.refresh_interval = refresh_interval
        self.fetch_timeout = fetch_timeout
        self._clock = clock
        self._metadata: ServerMetadata | None = None
        self._keys: list[dict[str, Any]] | None = None
        self._parsed: dict[tuple[int, str], PyJWK] = {}
        self._fetched_at = -float("inf")  # when the key set was last fetched (or tried)
        self._failed_at = -float("inf")  # when the last fetch of anything failed
        self._lock = asyncio.Lock()
        #: Fetches of the key set so far (tests read it).
        self.fetches = 0

    async def metadata(self) -> ServerMetadata:
        """The server's metadata, discovered on first use.

        Raises:
            AuthUnavailable: it cannot be had (now, or within the last ``FAILED_RETRY`` seconds).
        """
        if self._metadata is None:
            self._unless_failing()
            async with self._lock:
                return await self._metadata_locked()
        return self._metadata

    async def prefetch(self) -> None:
        """Discover the metadata and fetch the keys now (at start), so the first token waits for
        neither; a failure is logged, and the first check tries again."""
        try:
            if (await self.metadata()).jwks_uri is not None:
                await self.candidates(None, "RS256")
        except AuthUnavailable:
            pass

    async def candidates(self, kid: str | None, alg: str) -> list[PyJWK]:
        """The keys that may have signed a token with this header's ``kid`` and ``alg``; empty when none.

        A ``kid`` the set does not have makes it be fetched again (at most once per
        ``refresh_interval``); a token without a ``kid`` may be signed by any key of the set that
        fits ``alg``.

        Raises:
            AuthUnavailable: no key set can be had.
        """
        keys = self._keys
        since = self._clock() - self._fetched_at
        unknown = keys is not None and kid is not None and not any(key.get("kid") == kid for key in keys)
        if keys is None or since >= MAX_AGE or (unknown and since >= self.refresh_interval):
            if keys is None or unknown or not self._lock.locked():
                await self._refresh()
            # else: an old set is being fetched again, and the one in hand has this token's key
        return [parsed for key in self._keys or () if (parsed := self._fit(key, kid, alg)) is not None]

    async def _metadata_locked(self) -> ServerMetadata:
        metadata = self._metadata
        if metadata is None:
            self._backoff()
            try:
                metadata = self._metadata = await self._discover()
            except _Unreachable as exc:
                self._failed(f"discovering the metadata of {self.issuer} failed: {exc}")
        return metadata

    async def _refresh(self) -> None:
        if self._keys is None:
            self._unless_failing()
        async with self._lock:
            if self._keys is not None and self._clock() - self._fetched_at < self.refresh_interval:
                return  # another check fetched them meanwhile
            if self._keys is None:
                self._backoff()
            metadata = await self._metadata_locked()
            if metadata.jwks_uri is None:
                raise AuthUnavailable("the authorization server publishes no key set (jwks_uri)", 60)
            self._fetched_at = self._clock()
            self.fetches += 1
            try:
                document = await self._get(metadata.jwks_uri)
                keys = document.get("keys")
                if not isinstance(keys, list):
                    raise _Unreachable("the document has no 'keys' list")
            except _Unreachable as exc:
                if self._keys is None:
                    self._failed(f"fetching the key set {metadata.jwks_uri} failed: {exc}")
                logger.warning("fetching the key set %s failed: %s; the keys fetched before stay in use",
                               metadata.jwks_uri, exc)
                return
            self._keys = [key for key in keys if isinstance(key, dict)]
            self._parsed.clear()

    def _fit(self, key: dict[str, Any], kid: str | None, alg: str) -> PyJWK | None:
        """``key`` parsed for ``alg``, or None when it cannot have signed such a token."""
        if (kid is not None and key.get("kid") != kid) or key.get("use", "sig") != "sig" \
                or key.get("alg", alg) != alg:
            return None
        kty, crv = _KEY_TYPES[alg]
        if key.get("kty") != kty or (crv is not None and key.get("crv") != crv):
            return None
        slot = (id(key), alg)
        parsed = self._parsed.get(slot)
        if parsed is None:
            try:
                parsed = self._parsed[slot] = PyJWK(key, algorithm=alg)
            except PyJWTError as exc:
                logger.warning("a key of %s's set (kid %r) cannot be used: %s", self.issuer, key.get("kid"), exc)
                return None
        return parsed

    def _unless_failing(self) -> None:
        """Raise at once while another check retries after a failure: during an outage, one waits for it."""
        if self._lock.locked() and self._failed_at > -float("inf"):
            raise AuthUnavailable("the authorization server cannot be reached to check the token",
                                  round(FAILED_RETRY))

    def _backoff(self) -> None:
        """Raise at once while the last failure is recent: an outage costs the server one request a second."""
        wait = FAILED_RETRY - (self._clock() - self._failed_at)
        if wait > 0:
            raise AuthUnavailable("the authorization server cannot be reached to check the token", round(wait + 0.5))

    def _failed(self, message: str) -> NoReturn:
        self._failed_at = self._clock()
        logger.warning(message)
        raise AuthUnavailable("the authorization server cannot be reached to check the token", round(FAILED_RETRY))

    async def _discover(self) -> ServerMetadata:
        problems = []
        for url in discovery_urls(self.issuer):
            try:
                document = await self._get(url)
            except _Unreachable as exc:
                problems.append(f"{url}: {exc}")
                continue
            if document.get("issuer") != self.issuer:  # RFC 8414 §3.3: a mismatch is not this server's metadata
                problems.append(f"{url}: names the issuer {document.get('issuer')!r}")
                continue
            jwks, introspection = document.get("jwks_uri"), document.get("introspection_endpoint")
            return ServerMetadata(self.issuer, jwks if isinstance(jwks, str) else None,
                                  introspection if isinstance(introspection, str) else None)
        raise _Unreachable("; ".join(problems))

    async def _get(self, url: str) -> dict[str, Any]:
        """A JSON object from ``url`` (no redirects followed, at most ``MAX_DOCUMENT_BYTES``, all of it
        within ``fetch_timeout`` seconds)."""
        try:
            async with asyncio.timeout(self.fetch_timeout), \
                    self.http.stream("GET", url, headers={"accept": "application/json"}) as response:
                if response.status_code != 200:
                    raise _Unreachable(f"HTTP {response.status_code}")
                body = bytearray()
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) > MAX_DOCUMENT_BYTES:
                        raise _Unreachable(f"larger than {MAX_DOCUMENT_BYTES} bytes")
        except TimeoutError:
            raise _Unreachable(f"no complete answer within {self.fetch_timeout:g} s") from None
        except httpx.HTTPError as exc:
            raise _Unreachable(f"{type(exc).__name__}: {exc}") from exc
        try:
            document = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise _Unreachable("not JSON") from exc
        if not isinstance(document, dict):
            raise _Unreachable("not a JSON object")
        return document
