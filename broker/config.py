"""Settings, read from ``MCP_BROKER_*`` environment variables (pydantic-settings)."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["Settings"]


class Settings(BaseSettings):
    """Every bound and timeout of the broker. Each has a default that suits one small host."""

    model_config = SettingsConfigDict(env_prefix="MCP_BROKER_", extra="ignore")

    # -- serving ------------------------------------------------------------------------
    host: str = "127.0.0.1"
    port: int = 8080
    #: Empty: the in-memory backend (one process). ``redis://``, ``rediss://``,
    #: ``redis+sentinel://`` or ``redis+cluster://``: the distributed Redis backend.
    redis_url: str = ""
    redis_prefix: str = "mcpb"
    #: Seconds before a Redis command without a reply counts as a failure (503); blocking reads
    #: block for less than this.
    redis_socket_timeout: float = 5.0
    redis_connect_timeout: float = 2.0
    #: Connections per worker process in the command pool (the pub/sub connection is extra).
    redis_max_connections: int = 100
    #: Seconds of silence after which a pooled connection is checked with PING before use.
    redis_health_check_interval: int = 15
    #: Retries of a command that failed on the connection, with a short backoff.
    redis_retries: int = 1
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
    #: Static API keys: ``{"<key>": "<tenant>/<subject>"}``. Empty: every caller is the anonymous
    #: principal of tenant ``default``.
    api_keys: dict[str, str] = Field(default_factory=dict)
    default_tenant: str = "default"
    server_name: str = "mcp-broker"
    instructions: str = "Resources with change notifications. Subscribe to a URI and re-read it when notified."

    # -- limits -----------------------------------------------------------------------------
    max_body_bytes: int = 1_048_576
    max_uri_length: int = 2048
    max_record_bytes: int = 262_144
    max_sessions: int = 100_000
    max_subscriptions_per_session: int = 1000
    max_listens: int = 10_000
    max_listen_uris: int = 1000
    page_size: int = 100

    # -- sessions and delivery ---------------------------------------------------------------
    session_ttl: float = 1800.0
    #: Seconds a session's subscription set outlives its expired record, so the expiry sweep
    #: can still remove it from the index (Redis backend).
    session_index_grace: float = 600.0
    inbox_maxlen: int = 1000
    inbox_retention: float = 3600.0
    #: Frames read from an inbox in one go; a slow client's batch coalesces per URI.
    inbox_batch: int = 256
    #: Frames carried by wake-ups that one stream keeps in memory; past that it reads its inbox instead.
    stream_buffer: int = 1024
    keepalive_interval: float = 15.0
    #: The SSE ``retry:`` hint, in milliseconds.
    retry_ms: int = 1000
    #: Seconds the backend may stay unreachable (seen by the keep-alive timer) before open
    #: streams end with ``retry:``. A restart shorter than this keeps streams open; a longer
    #: outage sends clients to resume from their cursors.
    outage_grace: float = 5.0

    # -- change log and fan-out ----------------------------------------------------------------
    #: Run fan-out inside this process (the default); turn off when ``mcp-broker fanout`` runs it.
    embedded_fanout: bool = True
    changelog_maxlen: int = 100_000
    changelog_partitions: int = 1
    fanout_batch: int = 256
    fanout_claim_idle_ms: int = 5000
    #: Seconds a stopping fan-out consumer (SIGTERM) may spend finishing the batch in hand
    #: (append, broadcast, acknowledge) before it gives its partitions up; past that the batch is
    #: left to the next holder. Keep it below the 5 s a worker's shutdown waits for its tasks.
    fanout_stop_timeout: float = Field(default=2.0, ge=0, le=4)

    #: Cyclic GC thresholds set once a worker has started (see broker/server.py); empty: Python's defaults.
    gc_thresholds: tuple[int, ...] = (50_000, 50, 100)

    # -- demo ---------------------------------------------------------------------------------
    demo: bool = False
    demo_interval: float = 3.0
