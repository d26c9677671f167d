"""Who is calling: the authentication seam every front door shares, and how credentials compose.

An ``Authenticator`` is asked once per HTTP request, at the edge (``broker.runtime.app``), before any
route runs; what it returns is the request's ``Principal``, and sessions and listens are bound
to that principal. A request it refuses gets 401 with the ``WWW-Authenticate`` challenge the
authenticator chose; one that cannot be checked right now gets 503 (``AuthUnavailable``). It is
async because checking a token may need I/O (a key set, an introspection endpoint).

Built in: ``Anonymous`` (no credentials configured: every caller is the anonymous principal of
the default tenant) and ``Bearer``: the ``Authorization: Bearer`` token, asked of a list of
``TokenVerifier``s in order, the first that knows the token deciding. The verifiers: static
``ApiKeys`` (``MCP_BROKER_API_KEYS``, each bound to a tenant and a subject, every data scope and
``console:read``) and
OAuth access tokens (``broker.auth.oauth``, scopes from the token). With OAuth on, every 401 names
this server's protected resource metadata (RFC 9728), where a client finds the authorization
server to get a token from.

The types every verifier needs live in ``broker.auth.identity``, re-exported here.
"""

from __future__ import annotations

import hmac
from collections.abc import Collection, Mapping, Sequence
from typing import Protocol, runtime_checkable

from broker.auth.identity import (
    ALL_SCOPES,
    OPERATOR_SCOPES,
    SCOPES,
    AuthUnavailable,
    Lifecycle,
    Principal,
    TokenVerifier,
    Unauthorized,
)
from broker.config import Settings

__all__ = ["ALL_SCOPES", "SCOPES", "Anonymous", "ApiKeys", "AuthUnavailable", "Authenticator", "Bearer", "Lifecycle",
           "Principal", "ProtectedResource", "TokenVerifier", "Unauthorized", "authenticator_for", "bearer_token"]


class Authenticator(Protocol):
    async def authenticate(self, headers: Mapping[str, str]) -> Principal:
        """The principal of a request with these headers (names in lower case).

        Raises:
            Unauthorized: the request carries no credentials this authenticator accepts.
            AuthUnavailable: its credentials cannot be checked right now.
        """


@runtime_checkable
class ProtectedResource(Protocol):
    """An authenticator that names this server's protected resource metadata (RFC 9728) in its challenges,
    so that a 403 for a missing scope can name it too (a client finds there where to ask for the scope)."""

    #: The metadata's absolute URL; None: none is published.
    resource_metadata: str | None


class Anonymous:
    """Everyone is the anonymous principal of one tenant."""

    def __init__(self, tenant: str) -> None:
        self.principal = Principal(tenant, "anonymous")

    async def authenticate(self, headers: Mapping[str, str]) -> Principal:
        return self.principal


class ApiKeys:
    """Static bearer keys, each bound to ``<tenant>/<subject>``: a ``TokenVerifier``."""

    def __init__(self, keys: Mapping[str, str], operators: Collection[str] = ()) -> None:
        """``operators``: the tenants whose keys also hold ``console:read`` (``MCP_BROKER_CONSOLE_TENANTS``)."""
        self._keys: list[tuple[bytes, Principal]] = []
        for key, binding in keys.items():
            tenant, _, subject = binding.partition("/")
            scopes = OPERATOR_SCOPES if tenant in operators else ALL_SCOPES
            self._keys.append((key.encode(), Principal(tenant, subject or "user", scopes)))

    async def verify(self, token: str) -> Principal | None:
        presented = token.encode()
        found: Principal | None = None
        for key, principal in self._keys:
            # Compare every key in constant time so the answer's timing says nothing about near misses.
            if hmac.compare_digest(presented, key) and found is None:
                found = principal
        return found


def bearer_token(headers: Mapping[str, str]) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header (RFC 6750 §2.1), None without one."""
    authorization = headers.get("authorization")
    if not authorization or authorization[:7].lower() != "bearer ":
        return None
    return authorization[7:].strip() or None


class Bearer:
    """The bearer token of a request, asked of each verifier in order until one knows it.

    ``resource_metadata`` is the absolute URL of this server's protected resource metadata
    (OAuth on), named in every challenge; None leaves challenges bare (``Bearer``).
    """

    def __init__(self, verifiers: Sequence[TokenVerifier], resource_metadata: str | None = None) -> None:
        self.verifiers = list(verifiers)
        self.resource_metadata = resource_metadata
        # Without OAuth, every token is meant as an API key.
        self._unknown = "unknown API key" if resource_metadata is None else "the bearer token is not accepted here"

    async def authenticate(self, headers: Mapping[str, str]) -> Principal:
        token = bearer_token(headers)
        if token is None:
            raise Unauthorized("a bearer token is required", self.challenge())
        for verifier in self.verifiers:
            try:
                principal = await verifier.verify(token)
            except Unauthorized as exc:
                raise Unauthorized(str(exc), self.challenge("invalid_token", str(exc))) from None
            if principal is not None:
                return principal
        raise Unauthorized(self._unknown, self.challenge("invalid_token", self._unknown))

    def challenge(self, error: str | None = None, description: str | None = None) -> str:
        """A ``WWW-Authenticate`` value (RFC 6750 §3): the error, if any, and the metadata pointer (RFC 9728 §5.1)."""
        params = []
        if error:
            params.append(f'error="{error}"')
        if description:
            # Only the characters RFC 6750 allows in a quoted value, so a claim's text cannot break the header.
            params.append('error_description="{}"'.format("".join(
                c for c in description if " " <= c <= "~" and c not in '"\\')))
        if self.resource_metadata:
            params.append(f'resource_metadata="{self.resource_metadata}"')
        return "Bearer " + ", ".join(params) if params else "Bearer"

    async def start(self) -> None:
        """Start the verifiers that hold connections (an authorization server's key set)."""
        for verifier in self.verifiers:
            if isinstance(verifier, Lifecycle):
                await verifier.start()

    async def close(self) -> None:
        for verifier in self.verifiers:
            if isinstance(verifier, Lifecycle):
                await verifier.close()


def authenticator_for(settings: Settings, stored_keys: TokenVerifier | None = None) -> Authenticator:
    """The authenticator the settings configure (``MCP_BROKER_AUTH``, or inferred: docs/OAUTH.md).

    Each method on adds its verifiers to the list, asked in this order; with none on, every caller
    is anonymous. Tokens of a kind with a prefix of its own (stored keys, ``mcpb_...``) are asked
    for before OAuth, which would otherwise send them to the authorization server.
    ``stored_keys`` (``broker.auth.keys.StoredKeys``, which the runtime builds on its backend) joins
    the list when ``keys`` is on.
    """
    methods = settings.auth_methods
    if not methods:
        return Anonymous(settings.default_tenant)
    verifiers: list[TokenVerifier] = []
    if "keys" in methods:
        verifiers.append(ApiKeys(settings.api_keys, settings.console_tenants))
        if stored_keys is not None:
            verifiers.append(stored_keys)
    metadata = None
    if "oauth" in methods:
        from broker.auth.oauth import OAuthTokens, metadata_url

        verifiers.append(OAuthTokens.from_settings(settings))
        metadata = metadata_url(settings.oauth_resource or settings.oauth_audience)
    return Bearer(verifiers, metadata)
