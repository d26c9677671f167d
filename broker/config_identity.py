"""The settings of identity and tenancy: credentials (API keys, OAuth) and per-tenant quotas.

Part of ``broker.config.Settings`` (its base class), kept apart so that each file stays one
screenful of related settings; read from the same ``MCP_BROKER_*`` variables.
"""

from __future__ import annotations

from typing import Any, Self
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from broker.tenants import tenant_problem

__all__ = ["IdentitySettings"]


class IdentitySettings(BaseSettings):
    """Who may call, and how much each tenant may use."""

    model_config = SettingsConfigDict(env_prefix="MCP_BROKER_", extra="ignore")

    #: Static API keys: ``{"<key>": "<tenant>/<subject>"}``. Empty: every caller is the anonymous
    #: principal of tenant ``default``.
    api_keys: dict[str, str] = Field(default_factory=dict)

    # -- OAuth 2.1 resource server (docs/OAUTH.md has each setting) -----------------------------
    #: Credentials accepted, a comma list of ``keys`` and ``oauth``; empty: inferred (``auth_methods``).
    auth: str = ""
    #: The authorization server's issuer, and what its tokens' ``aud`` must contain.
    oauth_issuer: str = ""
    oauth_audience: str = ""
    #: The canonical URL of this server's ``/mcp`` in its protected resource metadata; empty: the audience.
    oauth_resource: str = ""
    oauth_tenant_claim: str = Field(default="tenant", min_length=1)
    #: Seconds of clock skew on ``exp``, ``nbf``, ``iat``; fewest seconds between key-set fetches for unknown kids.
    oauth_leeway: float = Field(default=30.0, ge=0, le=300)
    oauth_jwks_refresh_interval: float = Field(default=30.0, gt=0, le=3600)
    #: RFC 7662 for opaque tokens: at this URL, or (``oauth_introspection``) the metadata's; with these credentials.
    oauth_introspection_url: str = ""
    oauth_introspection: bool = False
    oauth_client_id: str = ""
    oauth_client_secret: str = ""
    #: Seconds one request to the authorization server (metadata, key set, an introspection) may
    #: take in all, however slowly its bytes come: past it the check is a 503, never a hang.
    oauth_fetch_timeout: float = Field(default=5.0, gt=0, le=60)
    #: Introspection questions in flight per worker about the tokens of peers (client addresses)
    #: whose token was refused in the last 10 s: a pool of their own, beside the 16 others share,
    #: so a flood of made-up tokens waits on itself.
    oauth_refused_peer_concurrency: int = Field(default=2, ge=1, le=64)

    # -- runtime API keys (docs/API-KEYS.md) ----------------------------------------------------
    #: Seconds a worker may answer from its last lookup of a stored key: a revocation or an
    #: expiry is seen by every worker's requests at most this long after it happened. 0: no cache.
    key_cache_seconds: float = Field(default=2.0, ge=0, le=60)
    #: Seconds between two checks, by each worker, of the stored keys behind its open streams and
    #: listens: one of them revoked ends its streams at most this long (plus one lookup) later.
    credential_check_seconds: float = Field(default=5.0, gt=0, le=300)

    #: Per-tenant quotas: JSON map of tenant (or ``default``) to ``sessions``, ``subscriptions``,
    #: ``streams``, ``listens``, ``publish_per_second``, ``publish_burst`` (docs/QUOTAS.md); read
    #: and checked strictly by ``broker.quotas``. Empty: none beyond the global bounds.
    quotas: dict[str, Any] = Field(default_factory=dict)

    @field_validator("quotas", mode="before")
    @classmethod
    def _quotas_object(cls, value: Any) -> Any:
        # The form only; every name and value is checked by broker.quotas (``mcp-broker serve``
        # checks it at start, ``broker.cli._settings_problems``).
        if not isinstance(value, dict):
            raise ValueError('MCP_BROKER_QUOTAS: write a JSON object of tenant to limits, e.g. '
                             '\'{"default": {"sessions": 10000}, "acme": {"publish_per_second": 500}}\'')
        return value

    @property
    def auth_methods(self) -> frozenset[str]:
        """The credentials accepted (``keys``, ``oauth``): ``auth`` as written, or inferred when it is empty."""
        if self.auth.strip():
            return frozenset(part.strip() for part in self.auth.split(",") if part.strip())
        return frozenset({"keys"} if self.api_keys else ()) | frozenset({"oauth"} if self.oauth_issuer else ())

    @model_validator(mode="after")
    def _oauth_complete(self) -> Self:
        unknown = self.auth_methods - {"keys", "oauth"}
        if unknown:
            raise ValueError(f"MCP_BROKER_AUTH: {', '.join(sorted(unknown))} is not a method; write a comma list of "
                             "keys and oauth (empty: inferred from MCP_BROKER_API_KEYS and MCP_BROKER_OAUTH_ISSUER)")
        if "oauth" not in self.auth_methods:
            return self
        for name, value, what in (("ISSUER", self.oauth_issuer, "the issuer URL of the authorization server"),
                                  ("AUDIENCE", self.oauth_audience, "the audience its tokens must name")):
            if not value:
                raise ValueError(f"MCP_BROKER_OAUTH_{name}: OAuth is on and needs {what} (docs/OAUTH.md)")
        for name, value in (("ISSUER", self.oauth_issuer), ("RESOURCE", self.oauth_resource or self.oauth_audience),
                            ("INTROSPECTION_URL", self.oauth_introspection_url or "https://unset")):
            parts = urlsplit(value)
            if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
                unset = " (unset: it defaults to MCP_BROKER_OAUTH_AUDIENCE)" if name == "RESOURCE" else ""
                raise ValueError(f"MCP_BROKER_OAUTH_{name}: {value!r} is not an http(s) URL without query or "
                                 f"fragment{unset}; OAuth needs it (docs/OAUTH.md)")
        return self

    @field_validator("api_keys")
    @classmethod
    def _valid_key_bindings(cls, value: dict[str, str]) -> dict[str, str]:
        for binding in value.values():
            tenant, slash, subject = binding.partition("/")
            if not slash or not subject:
                # "alice" alone used to become a tenant named alice: say which part is missing.
                raise ValueError(f'MCP_BROKER_API_KEYS: the binding {binding!r} names no subject; write '
                                 f'{{"<key>": "<tenant>/<subject>"}}, e.g. {{"k3y": "acme/{binding or "alice"}"}}')
            problem = tenant_problem(tenant)
            if problem:
                raise ValueError(f'MCP_BROKER_API_KEYS: {problem}; write {{"<key>": "<tenant>/<subject>"}}')
        return value
