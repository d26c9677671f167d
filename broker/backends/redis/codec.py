"""How sessions, frames, changes and wake-ups are encoded in Redis. Pure: no I/O.

Frames and changes are msgpack. A wake-up published on a session's channel is either
``F<first offset>:<packed frame><packed frame>...`` (built by ``inbox_append.lua`` from the
frames it just stored, so a stream usually needs no read), ``T<generation>`` (a takeover;
``T`` alone closes every stream), or ``S+<uri>`` / ``S-<uri>`` (the session subscribed to or unsubscribed from a URI).
A message on a worker's node channel is a msgpack list of ``NodeWake`` entries, cut to a bounded
size (``split_node_wakes``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any, cast

import msgpack

from broker.backends.types import CLOSE_ALL, Frame, SessionRecord, Wake, change_position
from broker.changes import Change
from broker.feeds.model import LEGACY_FEED_VERSION, FeedKind, Filter, legacy_kind

__all__ = [
    "NodeWake",
    "decode_change",
    "decode_changes",
    "decode_session",
    "decode_wakes",
    "encode_change",
    "encode_changes",
    "encode_frame",
    "encode_mark",
    "encode_session",
    "encode_session_fields",
    "entry_offset",
    "split_node_wakes",
]

# SessionRecord attribute -> hash field; dict-valued attributes are msgpack, the rest text.
_FIELDS = {
    "tenant": "tenant",
    "principal": "principal",
    "protocol_version": "version",
    "epoch": "epoch",
    "created_at": "created",
    "client_info": "info",
    "client_capabilities": "caps",
    "initialized": "init",
    "kind": "kind",
    "filter": "filter",
    "since": "since",
    "upstreams": "ups",
}
_PACKED = {"client_info", "client_capabilities", "upstreams"}
_KINDS = {kind.value for kind in FeedKind}


def _encode_value(name: str, value: Any) -> bytes | str:
    if name in _PACKED:
        packed: bytes = msgpack.packb(value)
        return packed
    if name == "initialized":
        return "1" if value else "0"
    if name == "created_at":
        return repr(float(value))
    if name == "filter":
        packed_filter: bytes = msgpack.packb(None if value is None else value.as_dict())
        return packed_filter
    if name == "since":
        packed_since: bytes = msgpack.packb(None if value is None else list(value))
        return packed_since
    return str(value)


def encode_session_fields(fields: Mapping[str, Any]) -> list[bytes | str]:
    """Flat ``field, value`` pairs for HSET. Unknown attributes raise ``TypeError`` (as ``setattr`` would not)."""
    pairs: list[bytes | str] = []
    for name, value in fields.items():
        field = _FIELDS.get(name)
        if field is None:
            raise TypeError(f"SessionRecord has no field {name!r}")
        pairs += [field, _encode_value(name, value)]
    return pairs


def encode_session(record: SessionRecord) -> list[bytes | str]:
    return encode_session_fields({name: getattr(record, name) for name in _FIELDS})


def decode_session(session_id: str, raw: Mapping[bytes, bytes]) -> SessionRecord | None:
    """The record stored in a session hash; None when the hash is empty or not a session."""
    if b"tenant" not in raw:
        return None

    def text(field: str) -> str:
        return raw.get(field.encode(), b"").decode()

    capabilities = msgpack.unpackb(raw[b"caps"]) if b"caps" in raw else {}
    if b"kind" in raw:
        if text("kind") not in _KINDS:
            return None  # a kind of feed a newer version made: nothing this one can serve
        kind = FeedKind(text("kind"))
        packed = msgpack.unpackb(raw[b"filter"]) if b"filter" in raw else None
        feed_filter = None if packed is None else Filter.from_dict(packed)
        since = msgpack.unpackb(raw[b"since"]) if b"since" in raw else None
        position = None if since is None else (str(since[0]), int(since[1]))
    elif text("version") == LEGACY_FEED_VERSION:
        # Written by an older version, which made every feed but a session under this version and
        # told its kind in its capabilities; a 2025 client's capabilities tell nothing.
        kind, feed_filter, position = legacy_kind(capabilities)
    else:
        kind, feed_filter, position = FeedKind.SESSION, None, None
    return SessionRecord(
        id=session_id,
        tenant=text("tenant"),
        principal=text("principal"),
        protocol_version=text("version"),
        epoch=text("epoch"),
        created_at=float(text("created") or 0.0),
        client_info=msgpack.unpackb(raw[b"info"]) if b"info" in raw else {},
        client_capabilities=capabilities,
        initialized=raw.get(b"init") == b"1",
        kind=kind,
        filter=feed_filter,
        since=position,
        upstreams=msgpack.unpackb(raw[b"ups"]) if b"ups" in raw else {},
    )


def encode_frame(frame: Frame) -> bytes:
    packed: bytes = msgpack.packb((frame.key, frame.data))
    return packed


def encode_mark(change_id: str) -> tuple[str, str]:
    """What ``inbox_append.lua`` compares a frame's change by: the hash field of its partition
    (``c<partition>``) and its position; both '' for none."""
    position = change_position(change_id) if change_id else None
    return ("", "") if position is None else ("c" + position[0], position[1])


def _frames(packed: bytes) -> Iterator[Frame]:
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(packed)
    for key, data in unpacker:
        yield Frame(key, data)


def as_text(value: bytes | str) -> str:
    """A reply value as ``str``. Replies are bytes: the clients do not decode responses (redis-py's
    annotations say ``bytes | str`` only because they cannot know that)."""
    return cast("bytes", value).decode()


def entry_offset(entry_id: bytes) -> int:
    """An inbox entry id ``<offset>-0`` as its offset."""
    return int(entry_id.split(b"-", 1)[0])


def decode_entry(fields: Sequence[bytes] | Mapping[bytes, bytes]) -> Frame:
    """The frame of an inbox entry, from the raw field list of a script reply or a decoded mapping."""
    packed = fields[b"f"] if isinstance(fields, Mapping) else fields[fields.index(b"f") + 1]
    key, data = msgpack.unpackb(packed, raw=False)
    return Frame(key, data)


def decode_wakes(payload: bytes) -> list[Wake]:
    """The wake-ups in one message of a session channel (empty for a malformed one)."""
    if payload[:1] == b"T":
        generation = payload[1:]
        return [Wake("takeover", generation=int(generation) if generation.isdigit() else CLOSE_ALL)]
    if payload[:2] in (b"S+", b"S-"):
        return [Wake("subscribe" if payload[1:2] == b"+" else "unsubscribe", uri=payload[2:].decode())]
    if payload[:1] == b"F":
        first, sep, packed = payload[1:].partition(b":")
        if sep and first.isdigit():
            start = int(first)
            if not packed:  # frames too large to carry: the stream reads its inbox up to ``start``
                return [Wake("frames", start)]
            return [Wake("frames", start + i, frame=frame) for i, frame in enumerate(_frames(packed))]
    return []


def encode_change(change: Change) -> bytes:
    packed: bytes = msgpack.packb(change.to_wire())
    return packed


def decode_change(packed: bytes) -> Change:
    return Change.from_wire(msgpack.unpackb(packed, raw=False))


def encode_changes(changes: Sequence[tuple[str, Change]], max_bytes: int) -> list[bytes]:
    """A broadcast, as messages of at most ``max_bytes`` (a change larger than that travels alone).

    Each message is a msgpack list of the changes' wire forms, each with its id under ``i`` (a
    reader that predates ids ignores it); the changes keep their order across the messages.
    """
    items = [msgpack.packb({**change.to_wire(), "i": change_id}) for change_id, change in changes]
    messages: list[bytes] = []
    start, size = 0, 0
    for end, item in enumerate(items):
        if end > start and size + len(item) + _LIST_HEADER > max_bytes:
            messages.append(_packed_list(items[start:end]))
            start, size = end, 0
        size += len(item)
    messages.append(_packed_list(items[start:]))
    return messages


#: Bytes of a msgpack list header, at most.
_LIST_HEADER = 5


def _packed_list(items: Sequence[bytes]) -> bytes:
    header: bytes = msgpack.Packer().pack_array_header(len(items))
    return header + b"".join(items)


def decode_changes(packed: bytes) -> list[tuple[str, Change]]:
    """``(change id, change)`` pairs of a broadcast; the id is empty in one sent without ids."""
    return [(wire.get("i", ""), Change.from_wire(wire)) for wire in msgpack.unpackb(packed, raw=False)]


#: Bytes a node wake-up entry costs beside its session id and frames (msgpack headers, offset).
_ENTRY_OVERHEAD = 16

#: One session's entry in a node wake-up: (session id, first offset, packed frames), or, for a
#: frameless wake, (session id, newest offset, None): the stream reads its inbox.
NodeWake = tuple[str, int, bytes | None]


def encode_node_wakes(entries: Sequence[NodeWake]) -> bytes:
    """The frame wake-ups of one message for one worker node."""
    packed: bytes = msgpack.packb(entries)
    return packed


def split_node_wakes(entries: Sequence[NodeWake], max_bytes: int) -> list[bytes]:
    """The entries as messages of at most ``max_bytes`` each (an entry larger than that alone in one).

    A message a worker's pub/sub connection cannot take fast enough grows Redis's output
    buffer for it; past the buffer's limit (32 MB by default) Redis drops the connection and
    every stream of the worker re-reads its inbox. So a batch's wake-ups are cut into bounded
    messages (the caller keeps any one session's frames below a bound too).
    """
    messages: list[bytes] = []
    start, size = 0, 0
    for i, (sid, _, packed) in enumerate(entries):
        cost = len(sid) + len(packed or b"") + _ENTRY_OVERHEAD
        if i > start and size + cost > max_bytes:
            messages.append(encode_node_wakes(entries[start:i]))
            start, size = i, 0
        size += cost
    if start < len(entries):
        messages.append(encode_node_wakes(entries[start:]))
    return messages


def decode_node_wakes(payload: bytes) -> list[tuple[str, list[Wake]]]:
    """Per session, the frame wake-ups in one message of a node channel (empty for a malformed one).

    Sessions of one URI carry the same packed frames: each distinct packing is decoded once per
    message and its (immutable) frames shared, not decoded again for every session.
    """
    decoded: dict[bytes, list[Frame]] = {}
    out: list[tuple[str, list[Wake]]] = []
    try:
        for sid, first, packed in msgpack.unpackb(payload, raw=False):
            if packed is None:
                out.append((sid, [Wake("frames", first)]))
                continue
            frames = decoded.get(packed)
            if frames is None:
                frames = decoded[packed] = list(_frames(packed))
            out.append((sid, [Wake("frames", first + i, frame=frame) for i, frame in enumerate(frames)]))
    except (ValueError, TypeError):
        return []
    return out
