"""OAuth 2.1 access tokens, as the MCP authorization specification has a resource server check them.

``OAuthTokens`` is a ``TokenVerifier`` (``broker.auth``) for the tokens of one authorization
server (``MCP_BROKER_OAUTH_ISSUER``):

* a JWT is checked here, against the keys the server publishes (``broker.auth.jwks``): an asymmetric
  signature by one of them, ``iss`` equal to the issuer, ``aud`` naming this server
  (``MCP_BROKER_OAUTH_AUDIENCE``: a token the server issued for another resource is refused, so
  it cannot be replayed here), ``exp`` present and not past, ``nbf`` and ``iat`` not ahead, each
  within ``MCP_BROKER_OAUTH_LEEWAY`` seconds of clock skew;
* any other token is asked of the server's introspection endpoint (RFC 7662) when introspection
  is configured: ``active`` must be true, and the answer passes the same ``iss``, ``aud`` and
  ``exp`` checks; answers are kept for at most ``INTROSPECTION_TTL`` seconds (never past the
  token's ``exp``), at most ``INTROSPECTION_CACHE`` of them. A refusal is kept too, for
  ``REFUSAL_TTL`` seconds, requests about one token share one question, and at most
  ``INTROSPECTION_CONCURRENCY`` questions are in flight per worker. A made-up token cannot be
  told from a valid one not seen yet without asking, so what it costs is charged to its sender:
  a peer (``broker.auth.identity.PEER``: the client's address) whose token was refused in the last
  ``REFUSAL_TTL`` seconds asks through a small pool of its own (``refused_peer_concurrency``),
  and a flood of made-up tokens waits on itself while everyone else's questions go on. A token
  that is not a bearer token at all (RFC 6750's characters) is refused without a question.

Every request to the authorization server has a total deadline (``fetch_timeout``): a server
that answers a byte at a time costs a 503, not a request that hangs.

The claims become the ``Principal``: the tenant from the claim ``MCP_BROKER_OAUTH_TENANT_CLAIM``
(a valid tenant name, ``broker.tenants``), the subject from ``sub``, the scopes from ``scope`` (a
space-separated string) or ``scp`` (a list or a string), ``expires_at`` from ``exp`` plus the
leeway (when the broker stops accepting the token, and so when its streams end). Tenants
are not a configured list anywhere in the broker (an API key may name any valid tenant name,
and so may the authorization server): a tenant the broker has not seen starts empty.

A token refused is ``Unauthorized`` (401); a token that cannot be checked because the server
or its keys cannot be reached is ``AuthUnavailable`` (503), never an acceptance.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any, Final
from urllib.parse import urlsplit

import httpx
import jwt
import orjson

from broker.auth.identity import PEER, AuthUnavailable, Principal, Unauthorized
from broker.auth.jwks import ALGORITHMS, IssuerKeys
from broker.config import Settings
from broker.tenants import TENANT_RULE, tenant_problem

__all__ = ["INTROSPECTION_CACHE", "INTROSPECTION_TTL", "WELL_KNOWN", "OAuthTokens", "metadata_paths", "metadata_url"]

logger = logging.getLogger(__name__)

#: Where protected resource metadata is served (RFC 9728 §3).
WELL_KNOWN: Final = "/.well-known/oauth-protected-resource"
#: Seconds an introspection answer is kept, and how many are.
INTROSPECTION_TTL: Final = 60.0
INTROSPECTION_CACHE: Final = 10_000
#: Seconds a refused token's answer is kept; questions to the introspection endpoint in flight at once.
REFUSAL_TTL: Final = 10.0
INTROSPECTION_CONCURRENCY: Final = 16
#: Peers whose token was refused that a worker remembers (the least recently refused go first).
REFUSED_PEERS: Final = 10_000
#: What a bearer token may be (RFC 6750 §2.1, ``b64token``): anything else is no token of any server.
_B64TOKEN: Final = re.compile(r"[A-Za-z0-9\-._~+/]+=*")
#: The latest ``exp`` a token may carry (Unix seconds, year 5138): beyond it, not a time.
MAX_EXP: Final = 1e11
#: Seconds a request to the authorization server may take in all (``MCP_BROKER_OAUTH_FETCH_TIMEOUT``).
HTTP_TIMEOUT: Final = 5.0
#: The broker's own stored API keys start with this: never an OAuth token, never sent to the server.
STORED_KEY_PREFIX: Final = "mcpb_"
#: Characters of a subject a principal may carry (it is part of every session's binding).
MAX_SUBJECT: Final = 256


def metadata_url(resource: str) -> str:
    """The absolute URL of the protected resource metadata of ``resource`` (RFC 9728 §3.1: the well-known
    path between its host and its path). Built from the setting, never from a request's ``Host``."""
    parts = urlsplit(resource)
    return f"{parts.scheme}://{parts.netloc}{WELL_KNOWN}{parts.path.rstrip('/')}"


def metadata_paths(resource: str) -> tuple[str, ...]:
    """The paths the metadata is served at: the root form, the form for ``/mcp``, and the form for
    the resource's own path when that differs (a broker behind a path prefix)."""
    own = WELL_KNOWN + urlsplit(resource).path.rstrip("/")
    return tuple(dict.fromkeys((WELL_KNOWN, WELL_KNOWN + "/mcp", own)))


class OAuthTokens:
    """Access tokens of one authorization server: JWTs verified locally, opaque ones introspected."""

    def __init__(self, issuer: str, audience: str, *, tenant_claim: str = "tenant", leeway: float = 30.0,
                 refresh_interval: float = 30.0, introspection_url: str | None = None, introspect: bool = False,
                 client_id: str = "", client_secret: str = "", http: httpx.AsyncClient | None = None,
                 fetch_timeout: float = HTTP_TIMEOUT, refused_peer_concurrency: int = 2,
                 clock: Callable[[], float] = time.time) -> None:
        self.issuer = issuer
        self.audience = audience
        self.tenant_claim = tenant_claim
        self.leeway = leeway
        self.introspection_url = introspection_url or None
        self.introspects = introspect or self.introspection_url is not None
        self._client_auth = (client_id, client_secret) if client_id else None
        self.fetch_timeout = fetch_timeout
        self._owns_http = http is None
        self.http = http or self._new_http()
        self.keys = IssuerKeys(issuer, self.http, refresh_interval=refresh_interval, fetch_timeout=fetch_timeout)
        self._clock = clock
        self._cache: OrderedDict[str, tuple[Principal | str, float]] = OrderedDict()
        self._asking: dict[str, asyncio.Task[Principal]] = {}
        self._questions = asyncio.Semaphore(INTROSPECTION_CONCURRENCY)
        #: The pool of the questions of refused peers, and until when each peer is one.
        self._refused_questions = asyncio.Semaphore(refused_peer_concurrency)
        self._refused_peers: OrderedDict[str, float] = OrderedDict()
        self._prefetch: asyncio.Task[None] | None = None

    @classmethod
    def from_settings(cls, settings: Settings, http: httpx.AsyncClient | None = None) -> OAuthTokens:
        return cls(settings.oauth_issuer, settings.oauth_audience, tenant_claim=settings.oauth_tenant_claim,
                   leeway=settings.oauth_leeway, refresh_interval=settings.oauth_jwks_refresh_interval,
                   introspection_url=settings.oauth_introspection_url, introspect=settings.oauth_introspection,
                   client_id=settings.oauth_client_id, client_secret=settings.oauth_client_secret, http=http,
                   fetch_timeout=settings.oauth_fetch_timeout,
                   refused_peer_concurrency=settings.oauth_refused_peer_concurrency)

    async def start(self) -> None:
        """Fetch the server's metadata and keys in the background: the broker starts whether it answers or not."""
        self._prefetch = asyncio.create_task(self.keys.prefetch(), name="oauth-prefetch")

    async def close(self) -> None:
        if self._prefetch is not None:
            self._prefetch.cancel()
            await asyncio.gather(self._prefetch, return_exceptions=True)
        if self._owns_http:  # a client of its own, again, should the broker start again
            http, self.http = self.http, self._new_http()
            self.keys.http = self.http
            await http.aclose()

    def _new_http(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(timeout=self.fetch_timeout, follow_redirects=False)

    async def verify(self, token: str) -> Principal | None:
        if token.startswith(STORED_KEY_PREFIX):
            return None
        header = _jwt_header(token)
        if header is not None and (not self.introspects or (await self.keys.metadata()).jwks_uri is not None):
            return await self._verify_jwt(token, header)
        if self.introspects:
            if not _B64TOKEN.fullmatch(token):
                raise Unauthorized("the bearer token has characters no token has (RFC 6750)")
            return await self._introspect(token)
        return None  # not a JWT, and nothing to ask about it: some other verifier's, or nobody's

    async def _verify_jwt(self, token: str, header: Mapping[str, Any]) -> Principal:
        alg, kid = header.get("alg"), header.get("kid")
        if not isinstance(alg, str) or alg not in ALGORITHMS:
            raise Unauthorized(f"tokens signed with {alg!r} are not accepted")
        if kid is not None and not isinstance(kid, str):
            raise Unauthorized("the token's kid is not a string")
        keys = await self.keys.candidates(kid, alg)
        if not keys:
            raise Unauthorized("the token is signed by a key the authorization server does not publish")
        for key in keys:
            try:
                claims = jwt.decode(token, key, algorithms=[alg], audience=self.audience, issuer=self.issuer,
                                    leeway=self.leeway, options={"require": ["exp", "iss", "aud"]})
            except jwt.InvalidSignatureError:
                continue  # a token without a kid: the next key of the set may have signed it
            except jwt.PyJWTError as exc:
                raise Unauthorized(_reason(exc)) from None
            return self.principal(claims)
        raise Unauthorized("the token's signature does not verify")

    def principal(self, claims: Mapping[str, Any]) -> Principal:
        """The principal of a token's verified claims (``exp`` already checked).

        Raises:
            Unauthorized: they name no subject, or no valid tenant.
        """
        subject = claims.get("sub")
        if not isinstance(subject, str) or not subject or len(subject) > MAX_SUBJECT or not subject.isprintable():
            raise Unauthorized("the token names no subject (sub)")
        tenant = claims.get(self.tenant_claim)
        if not isinstance(tenant, str) or not tenant:
            raise Unauthorized(f"the token names no tenant (claim {self.tenant_claim})")
        if tenant_problem(tenant) is not None:
            raise Unauthorized(f"the token's {self.tenant_claim} claim is not a tenant name ({TENANT_RULE})")
        return Principal(tenant, subject, _scopes(claims), expires_at=_expiry(claims) + self.leeway)

    async def _introspect(self, token: str) -> Principal:
        digest = hashlib.sha256(token.encode()).hexdigest()  # the cache keeps no token itself
        now, peer = self._clock(), PEER.get()
        hit = self._cache.get(digest)
        if hit is not None:
            if now < hit[1]:
                if isinstance(hit[0], str):
                    self._refused(peer)
                    raise Unauthorized(hit[0])
                return hit[0]
            del self._cache[digest]
        asking = self._asking.get(digest)
        if asking is None:
            # One question per token, in a task of its own: requests about the same token share
            # it, and a request that goes away does not cancel it for the others.
            refused = peer is not None and self._refused_peers.get(peer, -1.0) > now
            pool = self._refused_questions if refused else self._questions
            asking = asyncio.get_running_loop().create_task(self._introspect_now(token, digest, pool))
            self._asking[digest] = asking
            asking.add_done_callback(lambda task: self._asked(digest, task))
        try:
            return await asyncio.shield(asking)
        except Unauthorized:
            self._refused(peer)
            raise

    def _refused(self, peer: str | None) -> None:
        """``peer`` sent a refused token: its next questions, for ``REFUSAL_TTL`` seconds, go to its pool."""
        if peer is not None:
            self._refused_peers[peer] = self._clock() + REFUSAL_TTL
            self._refused_peers.move_to_end(peer)
            while len(self._refused_peers) > REFUSED_PEERS:
                self._refused_peers.popitem(last=False)

    def _asked(self, digest: str, task: asyncio.Task[Principal]) -> None:
        self._asking.pop(digest, None)
        if not task.cancelled():
            task.exception()  # seen here, should every request that waited for it have gone away

    async def _introspect_now(self, token: str, digest: str, pool: asyncio.Semaphore) -> Principal:
        url = self.introspection_url or (await self.keys.metadata()).introspection_endpoint
        if url is None:
            raise AuthUnavailable("the authorization server names no introspection endpoint", 60)
        async with pool:
            claims = await self._ask(url, token)
        now = self._clock()
        try:
            if claims.get("active") is not True:
                raise Unauthorized("the token is not active")
            self._check(claims, now)
            principal = self.principal(claims)
        except Unauthorized as exc:
            self._remember(digest, str(exc), now + REFUSAL_TTL)
            raise
        self._remember(digest, principal, min(_expiry(claims) + self.leeway, now + INTROSPECTION_TTL))
        return principal

    def _remember(self, digest: str, answer: Principal | str, until: float) -> None:
        self._cache[digest] = (answer, until)
        while len(self._cache) > INTROSPECTION_CACHE:
            self._cache.popitem(last=False)

    async def _ask(self, url: str, token: str) -> dict[str, Any]:
        """The introspection endpoint's answer about ``token`` (RFC 7662 §2)."""
        try:
            async with asyncio.timeout(self.fetch_timeout):
                response = await self.http.post(url, data={"token": token, "token_type_hint": "access_token"},
                                                auth=self._client_auth or httpx.USE_CLIENT_DEFAULT,
                                                headers={"accept": "application/json"})
            answer = orjson.loads(response.content) if response.status_code == 200 else None
        except (httpx.HTTPError, orjson.JSONDecodeError, TimeoutError) as exc:
            logger.warning("token introspection at %s failed: %s: %s", url, type(exc).__name__, exc)
            raise AuthUnavailable("the authorization server cannot be reached to check the token") from None
        if not isinstance(answer, dict):
            logger.warning("token introspection at %s answered HTTP %d%s", url, response.status_code,
                           " (check MCP_BROKER_OAUTH_CLIENT_ID and _SECRET)" if response.status_code == 401 else "")
            raise AuthUnavailable("the authorization server cannot be reached to check the token")
        return answer

    def _check(self, claims: Mapping[str, Any], now: float) -> None:
        """What ``jwt.decode`` checks of a JWT, for an introspection answer (whose ``iss`` may be left out:
        the answer comes from the server itself)."""
        if claims.get("iss", self.issuer) != self.issuer:
            raise Unauthorized("the token is from another issuer")
        audience = claims.get("aud")
        if self.audience not in (audience if isinstance(audience, list) else [audience]):
            raise Unauthorized("the token is not for this server (aud)")
        exp, nbf = claims.get("exp"), claims.get("nbf")
        if not isinstance(exp, int | float) or isinstance(exp, bool):
            raise Unauthorized("the token has no exp claim")
        if exp <= now - self.leeway:
            raise Unauthorized("the token has expired")
        if isinstance(nbf, int | float) and nbf > now + self.leeway:
            raise Unauthorized("the token is not valid yet")


def _expiry(claims: Mapping[str, Any]) -> float:
    """The token's ``exp`` as Unix seconds. Raises ``Unauthorized`` for one that is not a time (a
    string, a bool, infinite, or past ``MAX_EXP``), which would otherwise overflow or never end."""
    exp = claims.get("exp")
    if isinstance(exp, bool) or not isinstance(exp, int | float):
        raise Unauthorized("the token's exp is not a number of seconds")
    try:
        value = float(exp)
    except OverflowError:
        raise Unauthorized("the token's exp is out of range") from None
    if not value <= MAX_EXP:  # also NaN
        raise Unauthorized("the token's exp is out of range")
    return value


def _jwt_header(token: str) -> dict[str, Any] | None:
    """The header of a token in JWS compact form, None when it is not one (an opaque token)."""
    if token.count(".") != 2:
        return None
    try:
        return jwt.get_unverified_header(token)
    except jwt.PyJWTError:
        return None


def _scopes(claims: Mapping[str, Any]) -> frozenset[str]:
    """``scope`` (RFC 8693 / RFC 9068: space separated) and ``scp`` (a list, or a string), together."""
    found: set[str] = set()
    for name in ("scope", "scp"):
        value = claims.get(name)
        if isinstance(value, str):
            found.update(value.split())
        elif isinstance(value, list):
            found.update(item for item in value if isinstance(item, str))
    return frozenset(found)


def _reason(exc: jwt.PyJWTError) -> str:
    """What a client is told about a refused JWT."""
    if isinstance(exc, jwt.ExpiredSignatureError):
        return "the token has expired"
    if isinstance(exc, jwt.ImmatureSignatureError):
        return "the token is not valid yet"
    if isinstance(exc, jwt.InvalidAudienceError):
        return "the token is not for this server (aud)"
    if isinstance(exc, jwt.InvalidIssuerError):
        return "the token is from another issuer"
    if isinstance(exc, jwt.MissingRequiredClaimError):
        return f"the token has no {exc.claim} claim"
    return f"the token is not a valid JWT ({type(exc).__name__})"
