"""Who is calling: principals, and the authentication seam every front door shares.

An ``Authenticator`` is asked once per HTTP request, at the edge (``broker.app``), before any
route runs; what it returns is the request's ``Principal``, and sessions and listens are bound
to that principal. A request it refuses gets 401 with the ``WWW-Authenticate`` challenge the
authenticator chose (an OAuth resource server names its metadata there). It is async because
checking a token may need I/O (a key set, an introspection endpoint).

Built in: ``Anonymous`` (no credentials configured: every caller is the anonymous principal of
the default tenant) and ``ApiKeys`` (static keys from ``MCP_BROKER_API_KEYS``, each bound to a
tenant and a subject). Both grant every scope. A principal carries its scopes (``SCOPES`` names
them), but nothing checks them yet: every principal may do whatever its tenant may.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final, Protocol

from broker.config import Settings

__all__ = ["ALL_SCOPES", "SCOPES", "Anonymous", "ApiKeys", "Authenticator", "Principal", "Unauthorized",
           "authenticator_for"]

#: What a principal may do: read resources, watch them, write records, publish changes.
SCOPES: Final = ("resources:read", "resources:subscribe", "records:write", "changes:publish")
ALL_SCOPES: Final = frozenset(SCOPES)


@dataclass(frozen=True, slots=True)
class Principal:
    tenant: str
    subject: str
    #: The scopes it holds (not part of its identity: a session stays bound across a token refresh).
    scopes: frozenset[str] = field(default=ALL_SCOPES, compare=False)
    #: When its credential stops being valid (a token's ``exp``, a key's expiry; Unix seconds), None: never.
    expires_at: float | None = field(default=None, compare=False)
    #: Which stored credential it came from (a runtime API key's id), so a revocation can find its streams.
    credential: str | None = field(default=None, compare=False)

    @property
    def key(self) -> str:
        """The binding stored on a session: ``<tenant>/<subject>``."""
        return f"{self.tenant}/{self.subject}"


class Unauthorized(Exception):
    """No valid credentials were presented (HTTP 401); ``challenge`` is the ``WWW-Authenticate`` value."""

    def __init__(self, reason: str, challenge: str = "Bearer") -> None:
        super().__init__(reason)
        self.challenge = challenge


class Authenticator(Protocol):
    async def authenticate(self, headers: Mapping[str, str]) -> Principal:
        """The principal of a request with these headers (names in lower case).

        Raises:
            Unauthorized: the request carries no credentials this authenticator accepts.
        """


class Anonymous:
    """Everyone is the anonymous principal of one tenant."""

    def __init__(self, tenant: str) -> None:
        self.principal = Principal(tenant, "anonymous")

    async def authenticate(self, headers: Mapping[str, str]) -> Principal:
        return self.principal


class ApiKeys:
    """Static bearer keys, each bound to ``<tenant>/<subject>``."""

    def __init__(self, keys: Mapping[str, str]) -> None:
        self._keys: list[tuple[bytes, Principal]] = []
        for key, binding in keys.items():
            tenant, _, subject = binding.partition("/")
            self._keys.append((key.encode(), Principal(tenant, subject or "user")))

    async def authenticate(self, headers: Mapping[str, str]) -> Principal:
        authorization = headers.get("authorization")
        if not authorization or not authorization.lower().startswith("bearer "):
            raise Unauthorized("a bearer API key is required")
        presented = authorization[7:].strip().encode()
        found: Principal | None = None
        for key, principal in self._keys:
            # Compare every key in constant time so the answer's timing says nothing about near misses.
            if hmac.compare_digest(presented, key) and found is None:
                found = principal
        if found is None:
            raise Unauthorized("unknown API key")
        return found


def authenticator_for(settings: Settings) -> Authenticator:
    """The authenticator the settings configure: API keys when there are any, anonymous otherwise."""
    if settings.api_keys:
        return ApiKeys(settings.api_keys)
    return Anonymous(settings.default_tenant)
