"""JSON-RPC 2.0 framing: parsing, error codes and encoders.

Encoders return ``bytes`` (orjson) because every message ends up on a socket or in a
backend; the hot path never builds a JSON string twice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final, Literal, cast

import orjson

__all__ = [
    "HEADER_MISMATCH",
    "INTERNAL_ERROR",
    "EVENTS_CALLBACK_ERROR",
    "EVENTS_EXHAUSTED",
    "EVENTS_FORBIDDEN",
    "EVENTS_NOT_FOUND",
    "EVENTS_UNSUPPORTED",
    "INSUFFICIENT_SCOPE",
    "INVALID_PARAMS",
    "INVALID_REQUEST",
    "METHOD_NOT_FOUND",
    "MISSING_CLIENT_CAPABILITY",
    "NOT_RUN_RESPONSE_TOO_LARGE",
    "PARSE_ERROR",
    "QUOTA_EXCEEDED",
    "RESOURCE_NOT_FOUND",
    "SERVICE_UNAVAILABLE",
    "UNSUPPORTED_PROTOCOL_VERSION",
    "Message",
    "RpcError",
    "encode_error",
    "encode_notification",
    "encode_result",
    "parse_body",
    "parse_message",
]

PARSE_ERROR: Final = -32700
INVALID_REQUEST: Final = -32600
METHOD_NOT_FOUND: Final = -32601
INVALID_PARAMS: Final = -32602
INTERNAL_ERROR: Final = -32603
#: Legacy (<= 2025-11-25) "resource not found".
RESOURCE_NOT_FOUND: Final = -32002
#: 2026-07-28 codes.
HEADER_MISMATCH: Final = -32020
MISSING_CLIENT_CAPABILITY: Final = -32021
UNSUPPORTED_PROTOCOL_VERSION: Final = -32022
#: Broker-defined, outside the reserved range: the caller's credential lacks the scope in ``data.scope``.
INSUFFICIENT_SCOPE: Final = -31003
#: Broker-defined, outside the reserved range: the broker cannot serve this now (its backend is unreachable,
#: or it holds ``MCP_BROKER_MAX_SESSIONS`` sessions); retry later. HTTP 503.
SERVICE_UNAVAILABLE: Final = -31000
#: Broker-defined: the tenant is at one of its quotas (``data.limit`` names which); HTTP 429.
QUOTA_EXCEEDED: Final = -31002
#: Broker-defined: an upstream MCP server (``MCP_BROKER_UPSTREAMS``) did not answer a forwarded request:
#: it cannot be reached, refused the broker's credentials or did not speak MCP (HTTP 502), or took longer
#: than its ``timeout`` (HTTP 504). ``data.upstream`` names it. Its bound of requests in flight is -31000.
UPSTREAM_UNREACHABLE: Final = -31004
UPSTREAM_TIMEOUT: Final = -31005
#: Broker-defined: a batch member left unrun because the batch's answer reached its size bound.
NOT_RUN_RESPONSE_TOO_LARGE: Final = -31001
#: The events extension draft's (SEP-3415) codes: not found, forbidden, a bound of its own exhausted
#: (webhook subscriptions), a delivery mode not supported, a callback endpoint that did not confirm.
EVENTS_NOT_FOUND: Final = -32011
EVENTS_FORBIDDEN: Final = -32012
EVENTS_EXHAUSTED: Final = -32013
EVENTS_UNSUPPORTED: Final = -32014
EVENTS_CALLBACK_ERROR: Final = -32015

Id = str | int
MessageKind = Literal["request", "notification", "response"]


class RpcError(Exception):
    """A JSON-RPC error to send back to the peer.

    ``invalid``: the request cannot be served as sent (a malformed envelope or filter, a bad
    argument), as opposed to an error its method answered (a resource that does not exist);
    on HTTP the first is a 400 when it is the whole reply, the second travels in a 200 (the
    status of every code is ``broker.transport.rpc``'s). ``retry_after`` (seconds), when set,
    says when to ask again (HTTP: ``Retry-After``).
    """

    def __init__(self, code: int, message: str, data: Any = None, *, invalid: bool = False,
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.data = data
        self.invalid = invalid
        self.retry_after = retry_after

    def __repr__(self) -> str:
        return f"RpcError(code={self.code}, message={self.message!r})"

    def to_dict(self) -> dict[str, Any]:
        err: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.data is not None:
            err["data"] = self.data
        return err


@dataclass(frozen=True, slots=True)
class Message:
    """One parsed JSON-RPC message. ``kind`` is ``request``, ``notification`` or ``response``."""

    kind: MessageKind
    method: str | None
    id: Id | None
    params: dict[str, Any]
    raw: dict[str, Any]

    @property
    def is_request(self) -> bool:
        return self.kind == "request"


def parse_body(body: bytes) -> Any:
    """Decode a JSON body.

    Raises:
        RpcError: -32700 when the body is not JSON.
    """
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise RpcError(PARSE_ERROR, "Parse error: body is not valid JSON") from exc


def _valid_id(value: Any) -> bool:
    # bool is an int subclass in Python, but true/false is not a JSON-RPC id.
    return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))


def request_id_of(obj: Any) -> Id | None:
    """The id of a possibly malformed message, when it can be read (for the error reply)."""
    if isinstance(obj, dict):
        value = obj.get("id")
        if _valid_id(value):
            return cast(Id, value)
    return None


def parse_message(obj: Any) -> Message:
    """Validate one decoded JSON-RPC message.

    Raises:
        RpcError: -32600 for anything that is not a JSON-RPC 2.0 message.
    """
    if not isinstance(obj, dict) or obj.get("jsonrpc") != "2.0":
        raise RpcError(INVALID_REQUEST, "Invalid Request: not a JSON-RPC 2.0 message")
    method = obj.get("method")
    has_id = "id" in obj
    if method is None:
        if has_id and _valid_id(obj["id"]) and (("result" in obj) != ("error" in obj)):
            return Message("response", None, obj["id"], {}, obj)
        raise RpcError(INVALID_REQUEST, "Invalid Request: missing method")
    if not isinstance(method, str) or not method:
        raise RpcError(INVALID_REQUEST, "Invalid Request: method must be a non-empty string")
    params = obj.get("params", {})
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise RpcError(INVALID_REQUEST, "Invalid Request: params must be an object")
    if has_id:
        if not _valid_id(obj["id"]):
            raise RpcError(INVALID_REQUEST, "Invalid Request: id must be a string or an integer")
        return Message("request", method, obj["id"], params, obj)
    return Message("notification", method, None, params, obj)


def encode_result(id_: Id | None, result: dict[str, Any]) -> bytes:
    return orjson.dumps({"jsonrpc": "2.0", "id": id_, "result": result})


def encode_error(id_: Id | None, error: RpcError) -> bytes:
    """Encode an error response; the id is left out when the request's id could not be read.

    ``data`` may echo what the client sent; when that cannot be encoded (nested past orjson's
    limit) the error goes without it rather than failing the answer.
    """
    body: dict[str, Any] = {"jsonrpc": "2.0"} if id_ is None else {"jsonrpc": "2.0", "id": id_}
    body["error"] = error.to_dict()
    try:
        return orjson.dumps(body)
    except orjson.JSONEncodeError:
        body["error"].pop("data", None)
        return orjson.dumps(body)


def encode_notification(method: str, params: dict[str, Any] | None = None) -> bytes:
    if params is None:
        return orjson.dumps({"jsonrpc": "2.0", "method": method})
    return orjson.dumps({"jsonrpc": "2.0", "method": method, "params": params})
