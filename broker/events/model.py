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

import orjson

from broker.backends.types import Frame
from broker.delivery.resumable import format_listen_id
from broker.notifications import LIST_CHANGED_KEY
from broker.protocol import jsonrpc as rpc

__all__ = ["EVENTS", "RESOURCE_UPDATED", "STATE", "event_type", "gap_events", "iso", "not_found", "occurrence",
           "occurrences"]

#: The extension's identifier (``server/discover`` ``capabilities.extensions``).
EVENTS: Final = "io.modelcontextprotocol/events"
#: The one event type: a watched resource changed; re-read it.
RESOURCE_UPDATED: Final = "mcp.resource.updated"
#: Where a hidden session of a poll or webhook subscription keeps what it is (``client_capabilities``).
STATE: Final = "dev.mcp-broker/events"

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
        params = orjson.loads(frame.data).get("params") or {}
        uri = params.get("uri")
        if isinstance(uri, str):
            out.append(occurrence(format_listen_id(session, epoch, offset), uri, params.get("_meta"), at))
    return out


def gap_events(cursor: str, uris: list[str], at: float) -> list[dict[str, Any]]:
    """The gap rule as events: one for every watched URI, so the client re-reads each."""
    return [occurrence(f"{cursor}~{n}", uri, {"dev.mcp-broker/resync": True}, at) for n, uri in enumerate(uris)]
