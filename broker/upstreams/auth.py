"""The broker's own credentials at an upstream (``AuthSpec``): never a client's, which stay with the broker.

``bearer``: a token read from a file or a variable of the environment, read when first needed and
again after the upstream refused it (a 401: ``invalidate``), so a file rotated in place is picked
up without a restart. ``client_credentials`` (OAuth 2.1, RFC 6749 §4.4): a token from the
authorization server's token endpoint for the upstream as ``resource`` (RFC 8707), kept until a
margin before it expires; one fetch at a time, concurrent callers waiting for it. Without a
``token_url`` the endpoint is discovered: the upstream's protected resource metadata (RFC 9728,
the ``resource_metadata`` of a 401's ``WWW-Authenticate`` or the well-known place), its first
authorization server, and that server's metadata (RFC 8414, or OpenID Connect's).

A credential that cannot be had raises ``UpstreamUnavailable`` naming the upstream and what failed;
a secret or a token never appears in a message or a log.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

import httpx
import orjson

from broker.auth.jwks import discovery_urls
from broker.upstreams.errors import UpstreamUnavailable
from broker.upstreams.spec import AuthSpec

__all__ = ["UpstreamAuth", "resource_metadata_urls"]

#: Bytes of a metadata document or a token answer; a larger one is refused.
MAX_DOCUMENT_BYTES: Final = 1_048_576
#: A token is renewed this share of its lifetime before it expires, at most ``MAX_MARGIN`` seconds before.
MARGIN_SHARE: Final = 0.1
MAX_MARGIN: Final = 60.0
#: The lifetime assumed of a token whose answer gives no ``expires_in``.
DEFAULT_LIFETIME: Final = 300.0
#: Seconds a failed fetch is answered from memory: requests waiting in line do not each ask again.
FAILED_RETRY: Final = 1.0
_RESOURCE_METADATA: Final = re.compile(r'resource_metadata="([^"]+)"')


def resource_metadata_urls(resource: str) -> list[str]:
    """Where the protected resource metadata of ``resource`` may be (RFC 9728 §3.1: the well-known part
    between host and path; then at the host's root)."""
    parts = urlsplit(resource)
    origin = f"{parts.scheme}://{parts.netloc}"
    path = parts.path.rstrip("/")
    urls = [f"{origin}/.well-known/oauth-protected-resource{path}"]
    if path:
        urls.append(f"{origin}/.well-known/oauth-protected-resource")
    return urls


class UpstreamAuth:
    """The ``Authorization`` header of one upstream's requests, as ``spec`` says to get it."""

    def __init__(self, spec: AuthSpec, upstream_url: str | None, http: httpx.AsyncClient, timeout: float, *,
                 upstream: str | None = None) -> None:
        """``http``: the client the fetches go through; ``timeout``: seconds one fetch (discovery included) may
        take; ``upstream``: its name, for messages (by default its URL)."""
        self.spec = spec
        self.upstream_url = upstream_url
        self.http = http
        self.timeout = timeout
        self.upstream = upstream or upstream_url or "upstream"
        self._token: str | None = None
        self._expires = 0.0
        self._token_url: str | None = spec.token_url
        self._challenge: str | None = None
        self._lock = asyncio.Lock()
        self._failed: tuple[float, UpstreamUnavailable] | None = None
        #: Tokens fetched from the token endpoint so far (tests and metrics read it).
        self.fetches = 0

    async def headers(self) -> dict[str, str]:
        """``{"Authorization": "Bearer …"}``, or nothing for ``none``.

        Raises:
            UpstreamUnavailable: no token can be had now.
        """
        if self.spec.type == "none":
            return {}
        if self.spec.type == "bearer":
            if self._token is None:
                self._token = self._read(self.spec.token_file, self.spec.token_env, "bearer token")
            return {"Authorization": f"Bearer {self._token}"}
        if self._token is None or time.monotonic() >= self._expires:
            async with self._lock:
                if self._token is None or time.monotonic() >= self._expires:
                    await self._fetch_once()
        assert self._token is not None
        return {"Authorization": f"Bearer {self._token}"}

    async def _fetch_once(self) -> None:
        """Fetch a token, unless a fetch failed within ``FAILED_RETRY`` seconds (then its failure again)."""
        if self._failed is not None and time.monotonic() - self._failed[0] < FAILED_RETRY:
            raise self._failed[1]
        try:
            async with asyncio.timeout(self.timeout):
                await self._fetch()
        except TimeoutError:
            self._failed = (time.monotonic(), self._fail(f"no token within {self.timeout:g} s"))
            raise self._failed[1] from None
        except UpstreamUnavailable as exc:
            self._failed = (time.monotonic(), exc)
            raise
        self._failed = None

    def invalidate(self, challenge: str | None = None) -> None:
        """The upstream refused the token: the next ``headers`` rereads or fetches it. ``challenge``: the 401's
        ``WWW-Authenticate``, whose ``resource_metadata`` is where discovery looks first."""
        self._token = None
        found = _RESOURCE_METADATA.search(challenge or "")
        if found is not None and found.group(1) != self._challenge:
            self._challenge = found.group(1)
            self._token_url = self.spec.token_url  # found elsewhere than it says now: discovered again

    def _fail(self, what: str) -> UpstreamUnavailable:
        return UpstreamUnavailable(self.upstream, f"the broker's credentials for it cannot be had: {what}")

    def _read(self, file: str | None, env: str | None, what: str) -> str:
        """A secret from its file (stripped) or variable; its value never appears in an error."""
        if file is not None:
            try:
                value = Path(file).read_text(encoding="utf-8").strip()
            except (OSError, UnicodeDecodeError) as exc:
                raise self._fail(f"the {what} file {file} cannot be read ({type(exc).__name__})") from None
            if not value:
                raise self._fail(f"the {what} file {file} is empty")
            return value
        value = os.environ.get(env or "", "").strip()
        if not value:
            raise self._fail(f"the {what} variable {env} is not set")
        return value

    async def _fetch(self) -> None:
        """A token for the client credentials grant, kept until a margin before its expiry."""
        token_url = self._token_url or await self._discover()
        form = {"grant_type": "client_credentials", "client_id": self.spec.client_id or "",
                "client_secret": self._read(self.spec.client_secret_file, self.spec.client_secret_env,
                                            "client secret"),
                "resource": self.spec.resource or self.upstream_url or ""}
        if self.spec.scope:
            form["scope"] = self.spec.scope
        try:
            async with self.http.stream("POST", token_url, data=form, headers={"Accept": "application/json"}) as answer:
                status, body = answer.status_code, await _document(answer)
        except httpx.HTTPError as exc:
            raise self._fail(f"the token endpoint {token_url} cannot be reached ({type(exc).__name__})") from None
        token, lifetime = body.get("access_token") if body else None, body.get("expires_in") if body else None
        if status != 200 or not isinstance(token, str) or not token:
            error = body.get("error") if body else None
            said = f" ({error})" if isinstance(error, str) and error.isprintable() and len(error) < 100 else ""
            raise self._fail(f"the token endpoint {token_url} answered HTTP {status}{said}")
        seconds = float(lifetime) if isinstance(lifetime, int | float) and lifetime > 0 else DEFAULT_LIFETIME
        self._token = token
        self._expires = time.monotonic() + seconds - min(MAX_MARGIN, seconds * MARGIN_SHARE)
        self._token_url = token_url
        self.fetches += 1

    async def _discover(self) -> str:
        """The token endpoint: the upstream's resource metadata, its first authorization server, its metadata."""
        if self.upstream_url is None:
            raise self._fail("no token_url, and no upstream URL to discover one from")
        places = ([self._challenge] if self._challenge else []) + resource_metadata_urls(self.upstream_url)
        metadata = await self._first(places, "authorization_servers")
        if metadata is None and self._challenge is None:
            # Not at the well-known places: a request without credentials is answered with where it is.
            await self._ask_for_challenge()
            if self._challenge is not None:
                metadata = await self._first([self._challenge], "authorization_servers")
        servers = metadata.get("authorization_servers") if metadata else None
        if not isinstance(servers, list) or not servers or not isinstance(servers[0], str):
            raise self._fail("its protected resource metadata (RFC 9728) names no authorization server; "
                             'write "token_url" in its "auth"')
        found = await self._first(discovery_urls(servers[0]), "token_endpoint")
        token_url = found.get("token_endpoint") if found else None
        if not isinstance(token_url, str):
            raise self._fail(f"the authorization server {servers[0]} publishes no token endpoint; "
                             'write "token_url" in its "auth"')
        return token_url

    async def _ask_for_challenge(self) -> None:
        assert self.upstream_url is not None
        try:
            response = await self.http.get(self.upstream_url, headers={"Accept": "text/event-stream"})
            await response.aclose()
        except httpx.HTTPError:
            return
        found = _RESOURCE_METADATA.search(response.headers.get("www-authenticate", ""))
        if response.status_code == 401 and found is not None:
            self._challenge = found.group(1)

    async def _first(self, urls: list[str], key: str) -> dict[str, Any] | None:
        """The first of these JSON documents that has ``key``; None when none does."""
        for url in urls:
            try:
                async with self.http.stream("GET", url, headers={"Accept": "application/json"}) as response:
                    found = await _document(response) if response.status_code == 200 else None
            except httpx.HTTPError:
                continue
            if found is not None and key in found:
                return found
        return None


async def _document(response: httpx.Response) -> dict[str, Any] | None:
    """A JSON object of at most ``MAX_DOCUMENT_BYTES``, read as it comes; None for anything else."""
    data = bytearray()
    async for chunk in response.aiter_bytes():
        data += chunk
        if len(data) > MAX_DOCUMENT_BYTES:
            return None
    try:
        found = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    return found if isinstance(found, dict) else None
