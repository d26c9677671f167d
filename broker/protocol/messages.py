"""MCP messages the broker builds: capabilities, results and notifications."""

from __future__ import annotations

from typing import Any, Final

from broker.protocol.jsonrpc import Id, encode_notification, encode_result

__all__ = ["SERVER_INFO_KEY", "capabilities", "complete_result", "encode_notification"]

SERVER_INFO_KEY: Final = "io.modelcontextprotocol/serverInfo"


def capabilities() -> dict[str, Any]:
    """What the broker truthfully offers, in every era: resources, subscriptions and list changes."""
    return {"resources": {"subscribe": True, "listChanged": True}}


def complete_result(request_id: Id, server_meta: dict[str, Any], stamp: dict[str, Any]) -> bytes:
    """The graceful end of a ``subscriptions/listen`` stream (2026-07-28)."""
    return encode_result(request_id, {"resultType": "complete", "_meta": {**server_meta, **stamp}})
