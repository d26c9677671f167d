"""The 2026-07-28 request envelope: ``_meta`` fields and the routing headers of SEP-2243.

Pure functions over a parsed message and a header lookup; the HTTP transport calls them and
stdio calls the ``_meta`` part (stdio has no headers).

Order of the checks, so that each request gets the most precise error: the ``_meta`` fields
first (-32602), then the headers against the body (-32020), then the version itself (-32022).
A header naming a version the broker speaks over a body naming one it does not is a mismatch,
not an unsupported version (the conformance suite checks exactly this).

-32021 (MissingRequiredClientCapability) is never emitted, by decision: every method the
broker serves (``server/discover``, ``resources/*``, ``subscriptions/listen``) works for a
client that declares no capabilities at all. The broker never asks the client for sampling,
elicitation or roots (it returns no ``InputRequiredResult``), and a listen filter needs no
client capability either. ``clientCapabilities`` is still required to be an object, as the
specification says, and is otherwise ignored. A future method that needs one must raise
``RpcError(MISSING_CLIENT_CAPABILITY, ..., {"requiredCapabilities": {...}})``
from here, checked against *this* request's capabilities only.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable
from typing import Any, Final, Literal

from broker.protocol import jsonrpc as rpc
from broker.protocol.jsonrpc import Message
from broker.protocol.versions import LEGACY_VERSIONS, MODERN_VERSIONS

__all__ = ["PROTOCOL_VERSION_KEY", "Era", "check_headers", "check_meta", "decode_header_value", "has_modern_meta",
           "http_era", "stdio_era"]

Era = Literal["legacy", "modern"]

PROTOCOL_VERSION_KEY: Final = "io.modelcontextprotocol/protocolVersion"
CLIENT_CAPABILITIES_KEY: Final = "io.modelcontextprotocol/clientCapabilities"
#: Methods whose ``Mcp-Name`` header mirrors a param.
_NAME_PARAM: Final = {"resources/read": "uri", "tools/call": "name", "prompts/get": "name"}


def has_modern_meta(obj: Any) -> bool:
    """Does a decoded body carry the modern envelope (used to route requests without a version header)?"""
    if not isinstance(obj, dict):
        return False
    params = obj.get("params")
    meta = params.get("_meta") if isinstance(params, dict) else None
    return isinstance(meta, dict) and PROTOCOL_VERSION_KEY in meta


def http_era(version_header: str | None, obj: Any) -> Era | None:
    """The era of an HTTP POST body (docs/PROTOCOL.md, "Two eras on one endpoint"); None for a version
    header nobody speaks without the modern envelope (a 400).

    A legacy version header is legacy; a modern one, or the modern ``_meta`` envelope on anything
    but ``initialize``, is modern (an unknown version with the envelope is answered the modern
    way, -32022); no header at all is legacy.
    """
    if version_header in LEGACY_VERSIONS:
        return "legacy"
    is_initialize = isinstance(obj, dict) and obj.get("method") == "initialize"
    if version_header in MODERN_VERSIONS or (not is_initialize and has_modern_meta(obj)):
        return "modern"
    return None if version_header is not None else "legacy"


def stdio_era(obj: Any, method: str | None, has_session: bool) -> Era:
    """The era of one stdio message: the modern envelope, or anything but ``initialize`` and ``ping``
    before a session exists, is modern; the rest belongs to the legacy session."""
    if has_modern_meta(obj) or (not has_session and method not in ("initialize", "ping")):
        return "modern"
    return "legacy"


def check_meta(msg: Message, header: Callable[[str], str | None] | None = None) -> tuple[str, dict[str, Any]]:
    """The request's protocol version and client capabilities; with ``header`` (HTTP), the headers too.

    The order follows the specification's precedence: missing fields, then headers that
    disagree with the body (so a header naming a supported version over a body naming an
    unknown one is a mismatch), then the version itself.

    Raises:
        RpcError: -32602 (HTTP 400) when a required field is missing or mistyped;
            -32020 (HTTP 400) when a routing header is missing or differs from the body;
            -32022 (HTTP 400) when the version is not one the broker speaks.
    """
    meta = msg.params.get("_meta")
    if not isinstance(meta, dict):
        raise rpc.RpcError(rpc.INVALID_PARAMS, "params._meta is required (protocolVersion, clientCapabilities)",
                           invalid=True)
    version = meta.get(PROTOCOL_VERSION_KEY)
    if not isinstance(version, str):
        raise rpc.RpcError(rpc.INVALID_PARAMS, f"params._meta[{PROTOCOL_VERSION_KEY!r}] is required", invalid=True)
    caps = meta.get(CLIENT_CAPABILITIES_KEY)
    if not isinstance(caps, dict):
        raise rpc.RpcError(rpc.INVALID_PARAMS, f"params._meta[{CLIENT_CAPABILITIES_KEY!r}] is required", invalid=True)
    if header is not None:
        check_headers(msg, version, header)
    if version not in MODERN_VERSIONS:
        raise rpc.RpcError(rpc.UNSUPPORTED_PROTOCOL_VERSION, f"Unsupported protocol version: {version}",
                           {"supported": list(MODERN_VERSIONS), "requested": version})
    return version, caps


def decode_header_value(value: str) -> str:
    """Decode the ``=?base64?...?=`` form; plain values must be visible ASCII without outer spaces.

    Raises:
        ValueError: invalid characters or invalid base64.
    """
    if value.startswith("=?base64?") and value.endswith("?="):
        try:
            return base64.b64decode(value[9:-2], validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError) as exc:
            raise ValueError("invalid base64 header value") from exc
    if value != value.strip() or any(not 0x20 <= ord(c) < 0x7F for c in value):
        raise ValueError("header value must be visible ASCII or base64-encoded")
    return value


def _mismatch(text: str) -> rpc.RpcError:
    return rpc.RpcError(rpc.HEADER_MISMATCH, f"Header mismatch: {text}")


def check_headers(msg: Message, version: str, header: Callable[[str], str | None]) -> None:
    """Check ``MCP-Protocol-Version``, ``Mcp-Method`` and ``Mcp-Name`` against the body.

    Raises:
        RpcError: -32020 (HTTP 400) when one is missing, malformed or different from the body.
    """
    expected: list[tuple[str, str]] = [("MCP-Protocol-Version", version), ("Mcp-Method", msg.method or "")]
    name_param = _NAME_PARAM.get(msg.method or "")
    if name_param is not None:
        body_value = msg.params.get(name_param)
        if isinstance(body_value, str):
            expected.append(("Mcp-Name", body_value))
    for name, body_value in expected:
        raw = header(name)
        if raw is None:
            raise _mismatch(f"{name} header is required")
        try:
            value = decode_header_value(raw)
        except ValueError as exc:
            raise _mismatch(f"{name} header: {exc}") from exc
        if value != body_value:
            raise _mismatch(f"{name} header value {value!r} does not match body value {body_value!r}")
