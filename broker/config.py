"""Settings, read from ``MCP_BROKER_*`` environment variables and a TOML file (pydantic-settings).

The file is named by ``MCP_BROKER_CONFIG`` (``mcp-broker serve --config FILE`` sets it, so that
every worker process reads the same file); its keys are the settings' names (``redis_url =
"redis://..."``), and a variable of the environment wins over the file. Its form (it exists, it
is TOML, each key is a setting) is checked by ``config_file``, whose problems stop any command at
start (``broker.cli``): a misspelled key silently ignored would leave a default in its place.
"""

from __future__ import annotations

import ipaddress
import os
import re
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
    TomlConfigSettingsSource,
)

from broker.tenants import tenant_problem

if TYPE_CHECKING:
    from broker.upstreams.spec import UpstreamSpec

__all__ = ["CONFIG_ENV", "FACTORY_SPEC", "Settings", "config_file"]

#: The variable naming the settings file (TOML); unset or empty: none.
CONFIG_ENV = "MCP_BROKER_CONFIG"


class Settings(BaseSettings):
    """Every bound and timeout of the broker. Each has a default that suits one small host."""

    model_config = SettingsConfigDict(env_prefix="MCP_BROKER_", extra="ignore")

    # -- serving ------------------------------------------------------------------------
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    #: Empty: the in-memory backend (one process). ``redis://``, ``rediss://``,
    #: ``redis+sentinel://`` or ``redis+cluster://``: the distributed Redis backend.
    redis_url: str = ""
    redis_prefix: str = "mcpb"
    #: Seconds before a Redis command without a reply counts as a failure (503); blocking reads
    #: block for less than this.
    redis_socket_timeout: float = Field(default=5.0, gt=0)
    redis_connect_timeout: float = Field(default=2.0, gt=0)
    #: Connections per worker process in the command pool (the pub/sub connection is extra).
    redis_max_connections: int = Field(default=100, ge=1)
    #: Seconds of silence after which a pooled connection is checked with PING before use.
    redis_health_check_interval: int = Field(default=15, ge=0)
    #: Retries of a command that failed on the connection, with a short backoff.
    redis_retries: int = Field(default=1, ge=0)
    #: Durable mode: a published change, a record write and a key's creation or revocation are
    #: acknowledged only once this many replicas have them (``WAIT``), so a failover keeps them;
    #: 0 (the default) acknowledges once the master has them. Single server and Sentinel only.
    redis_durable_replicas: int = Field(default=0, ge=0)
    #: Seconds a durable write waits for its replicas before it is answered 503 (not acknowledged).
    redis_durable_timeout: float = Field(default=1.0, gt=0)
    #: Origins allowed to call /mcp (DNS-rebinding protection). Requests without Origin pass.
    allowed_origins: list[str] = Field(
        default_factory=lambda: [
            "http://localhost",
            "http://127.0.0.1",
            "http://[::1]",
            "https://localhost",
            "https://127.0.0.1",
            "https://[::1]",
        ]
    )
    #: Host names (``name`` or ``name:port``; ``*`` for any) the HTTP server answers to, against
    #: DNS rebinding; others get 421. Unset: loopback names when bound to a loopback address,
    #: else any.
    allowed_hosts: list[str] | None = None
    default_tenant: str = "default"
    server_name: str = "mcp-broker"
    instructions: str = "Resources with change notifications. Subscribe to a URI and re-read it when notified."

    # -- on the wire (broker/transport/wire.py): request heads, bodies, connections per worker ----------
    #: Bytes of one request head (request line and headers); larger heads get 431 and a close.
    #: nginx's default allows 4 x 8 KiB; tokens and cookies of real clients fit well within this.
    max_header_bytes: int = Field(default=32_768, ge=1024)
    #: Seconds from a connection's start, or from a kept-alive request's first byte, to its
    #: complete head; then 408 and close (slow-header attacks). Idle between requests:
    #: ``http_keepalive_timeout``.
    header_timeout: float = Field(default=10.0, gt=0)
    #: Seconds from a complete head to a complete body (a short or endless body); then 408 and close.
    #: At the 1 MiB body limit this asks for about 35 KB/s.
    body_timeout: float = Field(default=30.0, gt=0)
    #: Open connections per worker process; more are answered 503 and closed at once. 0: derived
    #: from the descriptor limit (``ulimit -n``) minus a tenth of it, and at least the Redis pool
    #: plus 128, kept for everything else (18,000 with 20,000 descriptors).
    max_connections: int = Field(default=0, ge=0)
    #: Open connections of one client address (an IPv6 /64) that have not authenticated, per
    #: worker process; more are answered 503 and closed at once. 0: a quarter of
    #: ``max_connections``. A connection whose request carried a valid credential stops counting.
    max_connections_per_peer: int = Field(default=0, ge=0)
    #: Addresses or networks of proxies in front of the workers (a load balancer, a sidecar):
    #: their connections carry many clients' requests, so no per-peer bound applies to them.
    trusted_proxies: list[str] = Field(default_factory=lambda: ["127.0.0.1", "::1"])

    # -- identity and tenancy: who may call, and how much each tenant may use ------------------
    #: Static API keys: ``{"<key>": "<tenant>/<subject>"}``. Empty: every caller is the anonymous
    #: principal of tenant ``default``.
    api_keys: dict[str, str] = Field(default_factory=dict)
    #: Tenants whose static API keys also hold ``console:read``: the operators', who may see every
    #: tenant's figures on the console (docs/CONSOLE.md). Empty: no static key does.
    console_tenants: list[str] = Field(default_factory=list)

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

    # -- connections to a load balancer, and stopping ------------------------------------------
    #: Seconds the HTTP server keeps an idle keep-alive connection open (uvicorn's
    #: ``timeout_keep_alive``). A load balancer that keeps connections to the workers must close
    #: idle ones sooner (nginx: ``keepalive_timeout`` in the upstream block, 3 s in
    #: deploy/nginx.conf), or it may send a request on a connection the worker is closing.
    http_keepalive_timeout: int = Field(default=5, ge=1)
    #: Seconds a worker stopped by SIGTERM goes on answering requests on its open connections
    #: (each with ``Connection: close``) after it stops accepting new ones; it ends sooner once
    #: none is left. Behind a load balancer, longer than its idle timeout; 0: close at once
    #: (``make run``). The image sets 5.
    shutdown_drain: float = Field(default=0.0, ge=0)

    # -- limits -----------------------------------------------------------------------------
    max_body_bytes: int = Field(default=1_048_576, ge=1)
    #: Bytes (UTF-8) of any URI a client sends: params, listen filters, published changes.
    max_uri_length: int = Field(default=2048, ge=1)
    max_record_bytes: int = Field(default=262_144, ge=1)
    max_sessions: int = Field(default=100_000, ge=1)
    max_subscriptions_per_session: int = Field(default=1000, ge=1)
    max_listens: int = Field(default=10_000, ge=1)
    max_listen_uris: int = Field(default=1000, ge=1)
    #: The share of ``max_sessions`` and of ``max_listens`` one tenant may hold, so that it cannot fill
    #: them for the others (``broker.quotas.tenant_share``); its ``quotas`` may bound it further.
    tenant_share: float = 0.5
    page_size: int = Field(default=100, ge=1)

    # -- requests: what one request may cost the worker that answers it -------------------
    #: Messages in one 2025-03-26 JSON-RPC batch (HTTP body or stdio line); a longer batch is
    #: refused whole with -32600 (HTTP 400) before any of it runs.
    max_batch_items: int = Field(default=100, ge=1)
    #: Bytes of one batch's answer; past it the remaining requests get -31001, not run (docs/LIMITS.md).
    max_response_bytes: int = Field(default=4_194_304, ge=1024)
    #: Bytes of any other answer, encoded (a read of a 10 MiB file is 13.3 MiB as base64); larger: -32602.
    max_read_bytes: int = Field(default=16_777_216, ge=1024)
    # -- input: what a client may make the broker keep (docs/LIMITS.md, "Input") ---------------
    #: Bytes of a change's ``meta`` (encoded JSON): it is copied into every notification of the change.
    max_meta_bytes: int = Field(default=8192, gt=0)
    #: How deep a change's ``meta``, and ``initialize``'s ``clientInfo`` and ``capabilities``, may nest.
    max_input_depth: int = Field(default=16, gt=0)
    #: Bytes of ``clientInfo`` plus ``capabilities`` (encoded JSON), kept with the session for its life.
    max_client_info_bytes: int = Field(default=4096, gt=0)
    #: Bytes of all the URIs of one ``subscriptions/listen`` filter together.
    max_listen_filter_bytes: int = Field(default=131_072, gt=0)
    #: How deep a record (PUT) or a merge patch (PATCH) may nest; below orjson's own 255.
    max_record_depth: int = Field(default=64, gt=0, le=250)
    #: Records one tenant may keep, and their bytes (values), across all its collections.
    max_records_per_tenant: int = Field(default=100_000, gt=0)
    max_record_bytes_per_tenant: int = Field(default=268_435_456, gt=0)

    # -- sessions and delivery ---------------------------------------------------------------
    session_ttl: float = Field(default=1800.0, gt=0)
    #: Seconds a session's subscription set outlives its expired record, so the expiry sweep
    #: can still remove it from the index (Redis backend).
    session_index_grace: float = Field(default=600.0, ge=0)
    inbox_maxlen: int = Field(default=1000, ge=1)
    inbox_retention: float = Field(default=3600.0, gt=0)
    #: Frames read from an inbox in one go; a slow client's batch coalesces per URI.
    inbox_batch: int = Field(default=256, ge=1)
    #: Frames carried by wake-ups that one stream keeps in memory; past that it reads its inbox instead.
    stream_buffer: int = Field(default=1024, ge=0)
    keepalive_interval: float = Field(default=15.0, gt=0)
    #: The SSE ``retry:`` hint, in milliseconds.
    retry_ms: int = Field(default=1000, ge=0)
    #: Seconds the backend may stay unreachable before open streams and listens end with
    #: ``retry:``, timed from when the first health ping that got no answer was sent (a hung
    #: Redis counts from then, not from its socket timeout). A restart shorter than this keeps
    #: streams open; a longer outage sends clients to resume from their cursors, elsewhere.
    outage_grace: float = Field(default=5.0, gt=0)
    #: Seconds between health pings while this process holds open streams (one in flight at a
    #: time, none while it holds none). Streams end at most this long after ``outage_grace``.
    outage_check_interval: float = Field(default=1.0, gt=0)

    # -- change log and fan-out ----------------------------------------------------------------
    #: Run fan-out inside this process (the default); turn off when ``mcp-broker fanout`` runs it.
    embedded_fanout: bool = True
    #: Changes one partition of the change log may hold that fan-out has not processed yet;
    #: a publish beyond it is refused with 503 before it is acknowledged (nothing unread is
    #: ever trimmed). Processed changes are trimmed as fan-out acknowledges them.
    changelog_maxlen: int = Field(default=100_000, ge=1)
    #: Partitions of the change log on Redis (changes go to the partition of their URI, or of a
    #: record's collection). None: the deployment's count, or 16 for a new one. Set and not the
    #: count in Redis, a worker stops at start; change it with ``mcp-broker partitions set N``.
    changelog_partitions: int | None = Field(default=None, ge=1, le=1024)
    fanout_batch: int = Field(default=256, ge=1)
    fanout_claim_idle_ms: int = Field(default=5000, ge=30)
    #: Seconds a stopping fan-out consumer (SIGTERM) may spend finishing the batch in hand
    #: (append, broadcast, acknowledge) before it gives its partitions up; past that the batch is
    #: left to the next holder. Keep it below the 5 s a worker's shutdown waits for its tasks.
    fanout_stop_timeout: float = Field(default=2.0, ge=0, le=4)

    # -- change-log and backend bounds (docs/LIMITS.md, "Change log and backend") ---------------
    #: Changes one tenant may have in a partition of the change log that fan-out has not processed yet;
    #: more are refused with 429 before they are acknowledged. 0: 100 where callers may be of several
    #: tenants (API keys, OAuth), as another tenant's change waits behind these (every partition's on
    #: one fan-out consumer) and a flood must wait behind itself; else 10,000, for bursts to ride out
    #: a fan-out pause (docs/QUOTAS.md, "Fair by default").
    changelog_tenant_max: int = Field(default=0, ge=0)
    #: Bytes of one wake-up message to a worker (Redis pub/sub, single node): a fan-out batch's
    #: wake-ups for one worker are split into messages of at most this size, far below Redis's
    #: pub/sub output buffer limit (32 MB by default), which would drop the worker's connection.
    wake_message_max_bytes: int = Field(default=262_144, ge=1024)
    #: A session's frames larger than this are not carried in its wake-up: the stream reads
    #: them from its inbox instead.
    wake_frame_max_bytes: int = Field(default=65_536, ge=0)

    #: Cyclic GC thresholds set once a worker has started (see broker/runtime/server.py); empty: Python's defaults.
    gc_thresholds: tuple[int, ...] = Field(default=(50_000, 50, 100), max_length=3)

    # -- change sources (docs/SOURCES.md) -------------------------------------------------------
    #: JSON map of tenant to directory: its files are resources ``file://<absolute path>`` of
    #: that tenant, watched for changes (``broker/sources/files.py``).
    file_roots: dict[str, str] = Field(default_factory=dict)
    #: Files larger than this are not served (a precise error instead).
    max_file_bytes: int = Field(default=10_485_760, ge=1, le=1_073_741_824)
    #: PostgreSQL to watch (``postgresql://...``); empty: none (``broker/sources/postgres.py``).
    postgres_url: str = ""
    #: PostgreSQL reads: connections per worker (a tenant holds all but one at most), and seconds per
    #: read, its wait for a connection included (then 503).
    postgres_pool_size: int = Field(default=4, ge=1, le=100)
    postgres_read_timeout: float = Field(default=10.0, gt=0, le=300)
    #: JSON map of table (``schema.table`` or ``table``) to the tenant whose records its rows are.
    postgres_tables: dict[str, str] = Field(default_factory=dict)
    #: JSON list of ``module:factory`` callables that return providers and change sources of the
    #: deployment's own code (``broker/sources/extensions.py``).
    providers: list[str] = Field(default_factory=list)
    #: JSON map of upstream name to the MCP server the broker stands in front of (``url`` or
    #: ``command``, ``tenants``, ``prefixes``, ``auth``...): ``broker/upstreams/spec.py``, docs/UPSTREAMS.md.
    upstreams: dict[str, Any] = Field(default_factory=dict)
    #: The lease of a change source that runs on one worker of the deployment at a time: the
    #: worker running it renews it every third of this; one that stops renewing (it died, or
    #: lost the backend) stops the source, and another worker takes it over after this long.
    source_lease_ms: int = Field(default=5000, ge=100, le=600_000)

    # -- events extension, experimental (docs/EVENTS.md) ----------------------------------------
    #: Events one ``events/poll`` returns when it names no ``maxEvents``, and the most it may name.
    events_poll_default: int = Field(default=100, ge=1)
    events_poll_max: int = Field(default=1000, ge=1)
    #: The ``nextPollMs`` a poll answers with (when nothing more is waiting).
    events_next_poll_ms: int = Field(default=5000, ge=0)
    #: Callback hosts (``name``) and address ranges (``10.0.0.0/8``, ``::1``) webhooks may reach
    #: although private, loopback or link-local, over plain http too, without the verification
    #: handshake; every other callback must be https to public addresses and answer the handshake.
    webhook_allow: list[str] = Field(default_factory=list)
    #: Webhook subscription leases: the longest granted, the shortest, and the default (no ``ttlMs``).
    webhook_max_ttl_ms: int = Field(default=86_400_000, ge=1000)
    webhook_min_ttl_ms: int = Field(default=1000, ge=100)
    webhook_default_ttl_ms: int = Field(default=3_600_000, ge=100)
    #: Webhook subscriptions of the whole deployment (more: -32013 ResourceExhausted).
    webhook_max_subscriptions: int = Field(default=10_000, ge=1)
    #: The lease of one subscription's deliveries, held by one worker at a time (renewed every third).
    webhook_lease_ms: int = Field(default=5000, ge=300, le=600_000)
    #: Seconds to connect to a callback, and to wait for its answer; bytes of an answer read (the rest is not).
    webhook_connect_timeout: float = Field(default=5.0, gt=0, le=60)
    webhook_read_timeout: float = Field(default=10.0, gt=0, le=300)
    webhook_max_response_bytes: int = Field(default=65_536, ge=0)
    #: Callback connections one worker has open at once (more POSTs wait for a place).
    webhook_max_connections: int = Field(default=64, ge=1, le=10_000)
    #: Of those, the most one tenant's POSTs (deliveries and verifications) hold at once, so one
    #: tenant's slow endpoints leave the rest to the others; at most ``webhook_max_connections``.
    webhook_tenant_connections: int = Field(default=16, ge=1, le=10_000)
    #: Verification POSTs the subscribes of one tenant may make the broker send a minute, all
    #: workers together (each is a signed request to a URL the caller chose; the tenant's bucket
    #: holds a minute's worth).
    webhook_verifications_per_minute: int = Field(default=30, ge=1, le=100_000)
    #: Attempts at one event before it goes to the dead letters; the first and the longest pause between them.
    webhook_max_attempts: int = Field(default=8, ge=1, le=100)
    webhook_retry_initial: float = Field(default=0.5, gt=0)
    webhook_retry_max: float = Field(default=60.0, gt=0)
    #: Dead letters kept for the whole deployment (the newest).
    webhook_dead_letters: int = Field(default=1000, ge=1, le=1_000_000)

    # -- operations (docs/OPERATIONS.md) --------------------------------------------------------
    #: Serve Prometheus metrics on ``/metrics`` (every worker of ``serve --workers N`` in one scrape).
    metrics: bool = True
    #: Tenants that get labels of their own in the per-tenant metrics; the rest count as ``other``.
    #: 0 (the default) leaves tenants out of the metrics: their names are visible to whoever can
    #: reach ``/metrics``, which asks for no credentials.
    metrics_tenant_limit: int = Field(default=0, ge=0, le=10_000)
    #: Seconds between SIGTERM and the end of the streams: ``/readyz`` answers 503 from the first
    #: moment, so a load balancer or Kubernetes stops sending new work before anything is cut.
    readiness_delay: float = Field(default=0.0, ge=0, le=300)
    #: Seconds a stopping worker waits for its open requests after the drain before it closes them.
    graceful_timeout: float = Field(default=10.0, gt=0, le=3600)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    #: ``text`` (readable) or ``json`` (one object a line, for a log pipeline).
    log_format: Literal["text", "json"] = "text"
    #: Serve FastAPI's ``/docs`` and ``/openapi.json`` (off: they describe the API to anyone).
    docs: bool = False

    # -- demo ---------------------------------------------------------------------------------
    demo: bool = False
    demo_interval: float = Field(default=3.0, gt=0)

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource,
                                   dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource,
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Arguments, then the environment, then the file of ``MCP_BROKER_CONFIG`` (when it is set)."""
        path, keys = config_file()
        if keys is None:
            return init_settings, env_settings, dotenv_settings, file_secret_settings
        unknown = sorted(key for key in keys if key not in cls.model_fields)
        if unknown:  # a typo in the file: never a default silently in its place
            raise SettingsError(f"{path}: {', '.join(unknown)} is not a setting")
        return (init_settings, env_settings, dotenv_settings, file_secret_settings,
                TomlConfigSettingsSource(settings_cls, toml_file=path))

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
    def _oauth_complete(self) -> Settings:
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

    @field_validator("console_tenants")
    @classmethod
    def _valid_console_tenants(cls, value: list[str]) -> list[str]:
        for tenant in value:
            problem = tenant_problem(tenant)
            if problem:
                raise ValueError(f'MCP_BROKER_CONSOLE_TENANTS: {problem}; write a JSON list of tenants, e.g. ["ops"]')
        return value

    @field_validator("trusted_proxies")
    @classmethod
    def _trusted_proxies(cls, value: list[str]) -> list[str]:
        for entry in value:
            try:
                ipaddress.ip_network(entry, strict=False)
            except ValueError:
                raise ValueError(f"{entry!r} is not an address or a network; write e.g. "
                                 "'[\"10.0.0.5\", \"10.1.0.0/16\"]', or '[]' to trust none") from None
        return value

    @field_validator("upstreams", mode="before")
    @classmethod
    def _upstreams_object(cls, value: Any) -> Any:
        from broker.upstreams.spec import parse_upstreams  # the one reader of the map; small, no I/O

        if not isinstance(value, dict):
            parse_upstreams(value)  # UpstreamsError (a ValueError): one line naming the setting
        return value

    @model_validator(mode="after")
    def _valid_upstreams(self) -> Settings:
        self.upstream_specs  # noqa: B018 -- read once here: a bad map stops the start with one line
        return self

    @property
    def upstream_specs(self) -> tuple[UpstreamSpec, ...]:
        """The upstreams of ``upstreams``, read (``broker.upstreams.spec.parse_upstreams``); an upstream
        without ``tenants`` is the default tenant's."""
        from broker.upstreams.spec import parse_upstreams

        return parse_upstreams(self.upstreams, self.default_tenant)

    @field_validator("providers")
    @classmethod
    def _loadable_providers(cls, value: list[str]) -> list[str]:
        # The form only: the modules are imported where they are used (``mcp-broker serve`` and
        # ``stdio`` check them at start, ``broker.cli._settings_problems``), not by every command
        # that reads the settings, nor again from inside a module being imported.
        for spec in value:
            if not FACTORY_SPEC.match(spec):
                raise ValueError(f"MCP_BROKER_PROVIDERS: {spec!r} is not of the form package.module:factory")
        return value

    @field_validator("tenant_share", mode="before")
    @classmethod
    def _share(cls, value: Any) -> float:
        try:
            share = float(value)
        except (TypeError, ValueError):
            share = 0.0
        if not 0 < share <= 1:  # NaN too
            raise ValueError(f"MCP_BROKER_TENANT_SHARE: {value!r} is not a share; write a number above 0 and at "
                             "most 1, e.g. 0.5 (a tenant may hold half of MAX_SESSIONS and of MAX_LISTENS)")
        return share

    @field_validator("allowed_origins")
    @classmethod
    def _origins(cls, value: list[str]) -> list[str]:
        for origin in value:
            parts = urlsplit(origin)
            if not (parts.scheme and parts.hostname) or parts.path not in ("", "/"):
                raise ValueError(f"{origin!r} is not an origin; write scheme://host[:port], "
                                 "e.g. https://app.example.com")
        return value

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, value: str) -> str:
        schemes = ("redis", "rediss", "unix", "redis+sentinel", "rediss+sentinel", "redis+cluster", "rediss+cluster")
        scheme = value.partition("://")[0].lower() if "://" in value else ""
        if value and scheme not in schemes:
            raise ValueError(f"write a URL that starts with one of {', '.join(s + '://' for s in schemes)}, "
                             "or leave it empty for the in-memory backend")
        return value

    @field_validator("webhook_allow")
    @classmethod
    def _webhook_allow(cls, value: list[str]) -> list[str]:
        for entry in value:
            try:
                ipaddress.ip_network(entry, strict=False)
            except ValueError:
                if not _HOST_NAME.match(entry):
                    raise ValueError(f"{entry!r} is neither a host name nor an address range; write e.g. "
                                     "'[\"hooks.internal\", \"10.0.0.0/8\", \"127.0.0.1\"]'") from None
        return value

    @model_validator(mode="after")
    def _durable(self) -> Settings:
        if not self.redis_durable_replicas:
            return self
        if not self.redis_url:
            raise ValueError("MCP_BROKER_REDIS_DURABLE_REPLICAS needs a Redis with replicas; set MCP_BROKER_REDIS_URL "
                             "or write MCP_BROKER_REDIS_DURABLE_REPLICAS=0")
        if self.redis_url.lower().partition("://")[0].endswith("+cluster"):
            raise ValueError("MCP_BROKER_REDIS_DURABLE_REPLICAS is not supported on Redis Cluster (a node's WAIT "
                             "cannot follow a script to its slot); write 0, or use one server or Sentinel")
        if self.redis_durable_timeout >= self.redis_socket_timeout:
            raise ValueError(f"MCP_BROKER_REDIS_DURABLE_TIMEOUT ({self.redis_durable_timeout}) must be below "
                             f"MCP_BROKER_REDIS_SOCKET_TIMEOUT ({self.redis_socket_timeout}), or the wait would "
                             "count as a lost connection; write a smaller value")
        return self

    @model_validator(mode="after")
    def _tenant_backlog(self) -> Settings:
        if not self.changelog_tenant_max:
            self.changelog_tenant_max = 100 if self.auth_methods & {"keys", "oauth"} else 10_000
        return self

    @model_validator(mode="after")
    def _events_bounds(self) -> Settings:
        """Bounds that only make sense together: each pair read the other way round would be silently clamped."""
        problems = [line for bad, line in (
            (self.webhook_min_ttl_ms > self.webhook_max_ttl_ms, "MCP_BROKER_WEBHOOK_MIN_TTL_MS is above _MAX_TTL_MS"),
            (not self.webhook_min_ttl_ms <= self.webhook_default_ttl_ms <= self.webhook_max_ttl_ms,
             "MCP_BROKER_WEBHOOK_DEFAULT_TTL_MS is outside [_MIN_TTL_MS, _MAX_TTL_MS]"),
            (self.events_poll_default > self.events_poll_max, "MCP_BROKER_EVENTS_POLL_DEFAULT is above _POLL_MAX"),
            (self.webhook_retry_initial > self.webhook_retry_max,
             "MCP_BROKER_WEBHOOK_RETRY_INITIAL is above _RETRY_MAX"),
            (self.webhook_tenant_connections > self.webhook_max_connections,
             f"MCP_BROKER_WEBHOOK_TENANT_CONNECTIONS ({self.webhook_tenant_connections}) is above "
             f"_MAX_CONNECTIONS ({self.webhook_max_connections}); write at most {self.webhook_max_connections}"),
            (self.webhook_max_response_bytes == 0,
             "MCP_BROKER_WEBHOOK_MAX_RESPONSE_BYTES is 0: no verification answer could be read; write 1 or more"),
        ) if bad]
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @field_validator("default_tenant")
    @classmethod
    def _valid_default_tenant(cls, value: str) -> str:
        problem = tenant_problem(value)
        if problem:
            raise ValueError(f"MCP_BROKER_DEFAULT_TENANT: {problem}")
        return value

    @field_validator("file_roots")
    @classmethod
    def _valid_file_roots(cls, value: dict[str, str]) -> dict[str, str]:
        real: dict[str, str] = {}
        for tenant, path in value.items():
            problem = tenant_problem(tenant)
            if problem:
                raise ValueError(f'MCP_BROKER_FILE_ROOTS: {problem}; write {{"<tenant>": "/absolute/directory"}}')
            if not os.path.isabs(path) or not os.path.isdir(path):
                raise ValueError(f"MCP_BROKER_FILE_ROOTS: {path!r} (tenant {tenant!r}) is not an absolute path "
                                 "to an existing directory")
            real[tenant] = os.path.realpath(path)
        # Roots of two tenants may not share a file: one nested in (or the same as) the other, once
        # symlinks are resolved, would let a tenant reach the other's files through a path or a link.
        for tenant, path in real.items():
            for other, other_path in real.items():
                if other != tenant and (path == other_path or path.startswith(other_path.rstrip("/") + "/")):
                    raise ValueError(f"MCP_BROKER_FILE_ROOTS: the roots of tenants {tenant!r} ({value[tenant]}) and "
                                     f"{other!r} ({value[other]}) overlap; give each tenant a directory of its own")
        return value

def config_file() -> tuple[str, dict[str, Any] | None]:
    """The settings file named by ``MCP_BROKER_CONFIG`` and its keys and values: ("", None) when none is named.

    Raises:
        SettingsError: the file cannot be read, or is not TOML (one line, naming the file).
    """
    import tomllib

    path = os.environ.get(CONFIG_ENV, "").strip()
    if not path:
        return "", None
    try:
        with open(path, "rb") as file:
            return path, tomllib.load(file)
    except OSError as exc:
        raise SettingsError(f"{CONFIG_ENV}: cannot read {path}: {exc.strerror or exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"{path}: not TOML: {exc}; write one `name = value` a line, e.g. "
                            'redis_url = "redis://127.0.0.1:6379"') from exc


#: A host name as a webhook allow-list entry: letters, digits, ``-`` and dots.
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?"
_HOST_NAME = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*$")

#: ``package.module:name`` (the module dotted, the name an identifier or dotted attributes of one).
FACTORY_SPEC = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
