"""The JSON-RPC messages of both MCP eras, as a subscriber sends and reads them."""

from __future__ import annotations

import base64
import itertools
import json
from typing import Any

from broker_client.errors import RpcError

MODERN = "2026-07-28"
LEGACY = "2025-11-25"
UPDATED = "notifications/resources/updated"
ACKNOWLEDGED = "notifications/subscriptions/acknowledged"
SUBSCRIPTION_ID = "io.modelcontextprotocol/subscriptionId"
#: The extension a server may offer to resume a listen from an event id (not offered by any server yet).
RESUMABLE_LISTEN = "dev.mcp-broker/resumable-listen"
#: In a resumable listen's ack: whether the server continued the listen the client named.
RESUMED = "dev.mcp-broker/resumed"
CLIENT_INFO = {"name": "broker-client", "version": "0.1.0"}

_ids = itertools.count(1)


def next_id() -> int:
    return next(_ids)


def envelope() -> dict[str, Any]:
    """The ``_meta`` every 2026-07-28 request carries: there is no handshake to say it once."""
    return {"io.modelcontextprotocol/protocolVersion": MODERN,
            "io.modelcontextprotocol/clientCapabilities": {},
            "io.modelcontextprotocol/clientInfo": CLIENT_INFO}


def request(method: str, params: dict[str, Any] | None = None, *, modern: bool, id_: Any = None) -> dict[str, Any]:
    body = dict(params or {})
    if modern:
        body["_meta"] = envelope()
    return {"jsonrpc": "2.0", "id": next_id() if id_ is None else id_, "method": method, "params": body}


def notification(method: str) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "method": method}


def initialize() -> dict[str, Any]:
    return request("initialize", {"protocolVersion": LEGACY, "capabilities": {}, "clientInfo": CLIENT_INFO},
                   modern=False)


def listen(uris: list[str], id_: str, *, resumable: bool = False) -> dict[str, Any]:
    """A listen for ``uris``; ``resumable`` asks for the resumable-listen extension (event ids, ``Last-Event-ID``)."""
    body = request("subscriptions/listen", {"notifications": {"resourceSubscriptions": uris}}, modern=True, id_=id_)
    if resumable:
        body["params"]["_meta"]["io.modelcontextprotocol/clientCapabilities"] = {"extensions": {RESUMABLE_LISTEN: {}}}
    return body


def header_value(value: str) -> str:
    """A header-safe ``Mcp-Name``: printable ASCII as is, anything else base64 in the form the spec gives."""
    if value.isascii() and value.isprintable():
        return value
    return "=?base64?" + base64.b64encode(value.encode()).decode() + "?="


def result(message: dict[str, Any]) -> dict[str, Any]:
    """The result of an answer; raises ``RpcError`` for an error answer."""
    if "error" in message:
        error = message["error"] or {}
        raise RpcError(int(error.get("code", 0)), str(error.get("message", "")), error.get("data"))
    value = message.get("result")
    return value if isinstance(value, dict) else {}


def can_subscribe(capabilities: Any) -> bool:
    """``resources.subscribe`` of a server's capabilities (initialize or server/discover)."""
    resources = capabilities.get("resources") if isinstance(capabilities, dict) else None
    return isinstance(resources, dict) and resources.get("subscribe") is True


def modern_offered(discover_result: dict[str, Any]) -> bool:
    return MODERN in (discover_result.get("supportedVersions") or [])


def extensions(capabilities: Any) -> frozenset[str]:
    """The extension identifiers a server advertises in ``capabilities.extensions``."""
    found = capabilities.get("extensions") if isinstance(capabilities, dict) else None
    return frozenset(found) if isinstance(found, dict | list) else frozenset()


def updated_uri(message: dict[str, Any]) -> str | None:
    """The URI of a ``notifications/resources/updated``, else None."""
    if message.get("method") != UPDATED:
        return None
    uri = (message.get("params") or {}).get("uri")
    return uri if isinstance(uri, str) else None


def subscription_of(message: dict[str, Any]) -> Any:
    """The listen a 2026-07-28 frame belongs to: ``_meta`` of its params (notification) or result (end)."""
    holder = message.get("params") if "method" in message else message.get("result")
    meta = (holder or {}).get("_meta") if isinstance(holder, dict) else None
    return meta.get(SUBSCRIPTION_ID) if isinstance(meta, dict) else None


def decode(line: str | bytes) -> dict[str, Any] | None:
    """One JSON-RPC message, or None for anything that is not a JSON object."""
    try:
        message = json.loads(line)
    except ValueError:
        return None
    return message if isinstance(message, dict) else None


def encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode()
