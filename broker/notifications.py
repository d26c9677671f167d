"""What a change notifies, and how: written once, for inboxes (fan-out) and listens alike.

A change of a URI notifies the subscribers of each of its ``targets``: the URI itself and, for a
record, its collection (``mcpb://t/Product/42`` -> ``mcpb://t/Product``). A change that is not a
plain update (a resource was created or deleted) also changes the tenant's resource list, so
clients that asked for list changes get ``notifications/resources/list_changed``.

Every notification is keyed by what it is about (``u:<uri>`` or ``l``): a reader that falls
behind keeps only the newest of each key, which is safe because both are level triggers
("re-read this"), never content. A change's ``meta`` goes into the notification's
``params._meta``; listens add their subscription id there, which wins a clash.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final

import orjson

from broker.backends.types import Frame
from broker.changes import Change, ChangeKind
from broker.protocol.jsonrpc import encode_notification
from broker.uris import notify_targets

__all__ = [
    "LIST_CHANGED",
    "LIST_CHANGED_KEY",
    "LIST_CHANGED_METHOD",
    "UPDATED_METHOD",
    "ListChanged",
    "Update",
    "changes_list",
    "decode",
    "encode_list_changed",
    "encode_update",
    "resync_frames",
    "targets",
    "update_frame",
    "update_key",
]

logger = logging.getLogger(__name__)

UPDATED_METHOD: Final = "notifications/resources/updated"
LIST_CHANGED_METHOD: Final = "notifications/resources/list_changed"
LIST_CHANGED_KEY: Final = "l"


def targets(change: Change) -> tuple[str, ...]:
    """The URIs whose subscribers ``change`` notifies."""
    return notify_targets(change.uri)


def changes_list(change: Change) -> bool:
    """Does ``change`` change its tenant's resource list (a create or a delete, not an update)?"""
    return change.kind is not ChangeKind.UPDATED


def update_key(uri: str) -> str:
    return "u:" + uri


def encode_update(uri: str, meta: dict[str, Any] | None = None, stamp: dict[str, Any] | None = None) -> bytes:
    """``notifications/resources/updated`` for ``uri``, with ``meta`` and ``stamp`` in ``params._meta``.

    A ``meta`` that cannot be encoded (``ChangeRules`` keeps such changes out of the log, but one
    may predate the rule) is left out: the notification still says "re-read this", and the batch
    it came in is not failed, and retried, for every tenant's changes behind it.
    """
    if not meta and stamp is None:
        return encode_notification(UPDATED_METHOD, {"uri": uri})
    try:
        if stamp is None:
            return encode_notification(UPDATED_METHOD, {"uri": uri, "_meta": meta})
        return encode_notification(UPDATED_METHOD, {"_meta": {**meta, **stamp} if meta else stamp, "uri": uri})
    except TypeError:  # orjson.JSONEncodeError: too deep, a type JSON lacks, an integer too large
        logger.error("the meta of a change of %s cannot be encoded; notifying without it", uri)
        if stamp is None:
            return encode_notification(UPDATED_METHOD, {"uri": uri})
        return encode_notification(UPDATED_METHOD, {"_meta": stamp, "uri": uri})


def encode_list_changed(stamp: dict[str, Any] | None = None) -> bytes:
    return encode_notification(LIST_CHANGED_METHOD, {"_meta": stamp} if stamp is not None else None)


def update_frame(uri: str, meta: dict[str, Any] | None = None, change: str = "") -> Frame:
    """The inbox frame of an update of ``uri``; ``change`` is the id of the change behind it (``Frame.change``)."""
    return Frame(update_key(uri), encode_update(uri, meta), change)


#: The inbox frame of a list change (fan-out sets its ``change``).
LIST_CHANGED: Final = Frame(LIST_CHANGED_KEY, encode_list_changed())


def resync_frames(uris: Iterable[str]) -> list[Frame]:
    """The gap rule for a legacy stream: an update of every subscribed URI, then ``list_changed``."""
    return [*(update_frame(uri) for uri in sorted(uris)), LIST_CHANGED]


@dataclass(frozen=True, slots=True)
class Update:
    """A decoded ``notifications/resources/updated``: ``uri`` changed; ``meta`` is its change's meta, if any."""

    uri: str
    meta: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class ListChanged:
    """A decoded ``notifications/resources/list_changed``."""


def decode(data: bytes) -> Update | ListChanged | None:
    """What an inbox frame's notification says; None for anything this module does not encode.

    The one decoder of frames: a reader that only passes frames on (a 2025 session's stream)
    never calls it, one that restates them (a listen stamps its id, an event carries the URI) does.
    """
    if data == LIST_CHANGED.data:
        return ListChanged()
    try:
        message = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    params = message.get("params") if isinstance(message, dict) else None
    if not isinstance(params, dict):
        return None
    if message.get("method") == LIST_CHANGED_METHOD:
        return ListChanged()
    uri = params.get("uri")
    if message.get("method") != UPDATED_METHOD or not isinstance(uri, str):
        return None
    meta = params.get("_meta")
    return Update(uri, meta if isinstance(meta, dict) else None)
