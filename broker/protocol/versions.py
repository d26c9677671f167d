"""MCP protocol versions served by the broker and how they are negotiated."""

from __future__ import annotations

from typing import Final

__all__ = [
    "BATCH_VERSIONS",
    "LEGACY_VERSIONS",
    "MODERN_VERSIONS",
    "NEWEST_LEGACY",
    "PRIMING_VERSIONS",
    "negotiate_legacy",
]

#: Handshake-era versions (``initialize`` + ``Mcp-Session-Id``), oldest first.
LEGACY_VERSIONS: Final = ("2025-03-26", "2025-06-18", "2025-11-25")
#: Stateless versions (per-request ``_meta`` envelope, ``subscriptions/listen``).
MODERN_VERSIONS: Final = ("2026-07-28",)
NEWEST_LEGACY: Final = LEGACY_VERSIONS[-1]
#: The only version whose clients may send JSON-RPC batches.
BATCH_VERSIONS: Final = frozenset({"2025-03-26"})
#: Versions whose clients expect a priming event (id + empty data) on SSE streams (SEP-1699).
PRIMING_VERSIONS: Final = frozenset({"2025-11-25"})
#: The version a legacy request without ``MCP-Protocol-Version`` is assumed to speak.
DEFAULT_LEGACY: Final = "2025-03-26"


def negotiate_legacy(requested: str) -> str:
    """Echo the client's version when the broker speaks it, otherwise offer the newest legacy one."""
    return requested if requested in LEGACY_VERSIONS else NEWEST_LEGACY
