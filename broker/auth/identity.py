"""Who a caller is, and the three answers a credential check can give: a principal, a refusal, "not now".

Kept apart from ``broker.auth`` (which composes the checks and re-exports all of this) so that
a module that checks one kind of credential (``broker.auth.oauth``, a key store) can name these
types without importing the module that builds it: ``broker.auth`` imports those modules,
never the other way round.
"""

from __future__ import annotations

import ipaddress
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Final, Protocol, runtime_checkable

__all__ = ["ALL_SCOPES", "CONSOLE", "OPERATOR_SCOPES", "PEER", "SCOPES", "AuthUnavailable", "Lifecycle", "Principal",
           "TokenVerifier", "Unauthorized", "peer_key"]

#: What a principal may do: read resources, watch them, write records, publish changes.
SCOPES: Final = ("resources:read", "resources:subscribe", "records:write", "changes:publish", "tools:call")
ALL_SCOPES: Final = frozenset(SCOPES)
#: See the deployment as a whole: the live console and ``mcp-broker status`` (every tenant's figures).
#: An operator's scope: never a tenant's by default; the static API keys of the tenants named in
#: ``MCP_BROKER_CONSOLE_TENANTS`` hold it (``OPERATOR_SCOPES``).
CONSOLE: Final = "console:read"
#: What a static API key of an operators' tenant holds: every data scope and the console's.
OPERATOR_SCOPES: Final = ALL_SCOPES | {CONSOLE}


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


#: Who sent the request being authenticated (``peer_key``), set by the edge: a verifier whose checks
#: cost something (asking an authorization server) charges what a bad token costs to its sender.
#: None outside a request, or for a client without an address.
PEER: ContextVar[str | None] = ContextVar("mcp_broker_peer", default=None)


def peer_key(host: str | None) -> str | None:
    """The peer a client address belongs to: the address itself, or an IPv6 address's /64 (what one
    host is usually given, so a new address from it is the same peer)."""
    if not host:
        return None
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if address.version == 6 and address.ipv4_mapped is None:
        return str(ipaddress.ip_network(f"{address}/64", strict=False))
    return str(address)


class Unauthorized(Exception):
    """No valid credentials were presented (HTTP 401); ``challenge`` is the ``WWW-Authenticate`` value."""

    def __init__(self, reason: str, challenge: str = "Bearer") -> None:
        super().__init__(reason)
        self.challenge = challenge


class AuthUnavailable(Exception):
    """The credential cannot be checked right now (the authorization server or its keys cannot be
    reached): HTTP 503 with ``Retry-After``, never an acceptance and never a 401 that would make a
    client throw a good token away."""

    def __init__(self, reason: str, retry_after: int = 1) -> None:
        super().__init__(reason)
        self.retry_after = max(1, retry_after)


@runtime_checkable
class Lifecycle(Protocol):
    """An authenticator or a verifier that holds connections or tasks (an authorization server's key
    set): started with the broker, closed when it stops. Those that hold nothing need neither."""

    async def start(self) -> None:
        """Begin; must not wait on anything remote (the broker starts whether it answers or not)."""

    async def close(self) -> None:
        """Let go of what ``start`` and the checks since took; the broker may start it again."""


class TokenVerifier(Protocol):
    """One kind of bearer token (static keys, stored keys, OAuth access tokens)."""

    async def verify(self, token: str) -> Principal | None:
        """The principal ``token`` stands for, or None when it is not a token of this kind (the next
        verifier is asked).

        Raises:
            Unauthorized: it is a token of this kind, and it is refused (expired, revoked, forged...).
            AuthUnavailable: whether it is valid cannot be known right now.
        """
