"""The settings of the wire: what a client may send before the app sees a request, and how many connections it may hold.

Part of ``broker.config.Settings`` (one of its base classes), kept apart so that each file stays
one screenful of related settings; read from the same ``MCP_BROKER_*`` variables. They are
enforced by ``broker.transport.wire``.
"""

from __future__ import annotations

import ipaddress

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

__all__ = ["WireSettings"]


class WireSettings(BaseSettings):
    """Bounds on request heads, bodies and connections, per worker process."""

    model_config = SettingsConfigDict(env_prefix="MCP_BROKER_", extra="ignore")

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
