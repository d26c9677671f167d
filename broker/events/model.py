"""The wire shapes of the events extension: its event type, arguments, occurrences, cursors and errors.

The draft (SEP-3415, ``io.modelcontextprotocol/events``) is followed where it is specific; the
broker's choices are named here: arguments are ``{"uris": [...]}`` held to a listen filter's
rules, an event's ``data`` is ``{"uri", "_meta"?}`` (the change's ``meta``), and a cursor is a
position in the hidden session's inbox, ``<session>:<epoch>-<offset>`` (the resumable listen's
event id), opaque to clients. An event's ``eventId`` is the cursor just after it, so the same
event read twice, or delivered twice after a worker died, has the same id.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, Final

from broker.backends.types import Frame
from broker.feeds.model import Cursor, Filter
from broker.methods import Call, Methods
from broker.notifications import LIST_CHANGED_KEY, Update, decode
from broker.protocol import jsonrpc as rpc

__all__ = ["EVENTS", "RESOURCE_UPDATED", "event_filter", "event_type", "gap_events", "iso", "not_found",
           "occurrence", "occurrences", "wanted"]

#: The extension's identifier (``server/discover`` ``capabilities.extensions``).
EVENTS: Final = "io.modelcontextprotocol/events"
#: The one event type: a watched resource changed; re-read it.
RESOURCE_UPDATED: Final = "mcp.resource.updated"

#: The draft's general-purpose error codes (their HTTP statuses: ``broker.transport.rpc``).
NOT_FOUND: Final = rpc.EVENTS_NOT_FOUND
FORBIDDEN: Final = rpc.EVENTS_FORBIDDEN
EXHAUSTED: Final = rpc.EVENTS_EXHAUSTED
UNSUPPORTED: Final = rpc.EVENTS_UNSUPPORTED
CALLBACK_ERROR: Final = rpc.EVENTS_CALLBACK_ERROR


def event_type(delivery: list[str], max_uris: int) -> dict[str, Any]:
    """``mcp.resource.updated`` as ``events/list`` describes it."""
    return {
        "name": RESOURCE_UPDATED,
        "description": "A watched resource changed: re-read it. Experimental (the Events extension draft).",
        "delivery": delivery,
        "inputSchema": {
            "type": "object",
            "properties": {"uris": {"type": "array", "items": {"type": "string", "format": "uri"},
                                    "maxItems": max_uris, "description": "The resources to watch"}},
            "required": ["uris"],
            "additionalProperties": False,
        },
        "payloadSchema": {
            "type": "object",
            "properties": {"uri": {"type": "string"},
                           "_meta": {"type": "object", "description": "The publisher's meta of the change"}},
            "required": ["uri"],
        },
        "_meta": {"dev.mcp-broker/experimental": True},
    }


def not_found(message: str, kind: str) -> rpc.RpcError:
    return rpc.RpcError(NOT_FOUND, message, {"kind": kind})


def iso(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def occurrence(event_id: str, uri: str, meta: Any, at: float, cursor: str | None = None) -> dict[str, Any]:
    """An ``EventOccurrence`` of a change of ``uri``."""
    data: dict[str, Any] = {"uri": uri}
    if isinstance(meta, dict) and meta:
        data["_meta"] = meta
    event: dict[str, Any] = {"eventId": event_id, "name": RESOURCE_UPDATED, "timestamp": iso(at), "data": data}
    if cursor is not None:
        event["cursor"] = cursor
    return event


def occurrences(session: str, epoch: str, frames: list[tuple[int, Frame]], at: float) -> list[dict[str, Any]]:
    """The events of inbox frames, in order; list changes (which this event type does not carry) are left out."""
    out = []
    for offset, frame in frames:
        if frame.key == LIST_CHANGED_KEY:
            continue
        decoded = decode(frame.data)
        if isinstance(decoded, Update):
            out.append(occurrence(str(Cursor(session, epoch, offset)), decoded.uri, decoded.meta, at))
    return out


def wanted(methods: Methods, call: Call, params: dict[str, Any], mode: str) -> dict[str, Any]:
    """What a request subscribes to, canonical: ``{"name", "arguments": {"uris": sorted}, "mode"}``.

    Raises:
        RpcError: -32602 (``invalid``) for a bad name or arguments (the URIs held to a listen
            filter's rules); -32011 for an event type the server does not have.
    """
    name = params.get("name")
    if not isinstance(name, str):
        raise rpc.RpcError(rpc.INVALID_PARAMS, "params.name must be a string", invalid=True)
    if name != RESOURCE_UPDATED:
        raise not_found(f"Unknown event: {name[:100]!r}; events/list names the one this server has", "event")
    arguments = params.get("arguments")
    if not isinstance(arguments, dict):
        raise rpc.RpcError(rpc.INVALID_PARAMS, 'params.arguments must be an object: {"uris": [...]}', invalid=True)
    if unknown := sorted(set(arguments) - {"uris"}):
        raise rpc.RpcError(rpc.INVALID_PARAMS, f"Unknown arguments: {', '.join(unknown)[:200]}; known: uris",
                           invalid=True)
    uris = methods.watched_uris(call, arguments.get("uris"), "arguments.uris")
    if not uris:
        raise rpc.RpcError(rpc.INVALID_PARAMS, "arguments.uris must name at least one resource", invalid=True)
    return {"name": name, "arguments": {"uris": sorted(uris)}, "mode": mode}


def event_filter(what: dict[str, Any]) -> Filter:
    """The filter of the feed that serves ``what`` (``wanted``, with a webhook's ``id``)."""
    return Filter.of(what["arguments"]["uris"], event=what["name"], subscription=what.get("id"))


def gap_events(cursor: str, uris: list[str], at: float) -> list[dict[str, Any]]:
    """The gap rule as events: one for every watched URI, so the client re-reads each."""
    return [occurrence(f"{cursor}~{n}", uri, {"dev.mcp-broker/resync": True}, at) for n, uri in enumerate(uris)]
