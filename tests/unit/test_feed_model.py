"""A feed's kind, filter and cursor, and how a session record of any kind is stored."""

from __future__ import annotations

import msgpack
import pytest

from broker.backends.redis.codec import decode_session, encode_session
from broker.backends.types import SessionRecord
from broker.feeds.model import MAX_FEED_ID, Cursor, FeedKind, Filter
from broker.notifications import LIST_CHANGED, ListChanged, Update, decode, encode_list_changed, update_frame


def test_a_cursor_reads_back_what_it_spells() -> None:
    cursor = Cursor("AbC_9-x", "ab12cd34", 17)
    assert str(cursor) == "AbC_9-x:ab12cd34-17"
    assert cursor.event_id == "ab12cd34-17"
    assert Cursor.parse(str(cursor)) == cursor


@pytest.mark.parametrize("value", ["", "ab12-3", ":ab12-3", "a b:ab12-3", "é:ab12-3", "x:ab12", "x:ab12-",
                                   "x:ab12-1²", "x" * (MAX_FEED_ID + 1) + ":ab12-3"])
def test_a_cursor_the_broker_never_issues_is_none(value: str) -> None:
    assert Cursor.parse(value) is None


def test_a_filter_is_the_same_whatever_the_order_or_repetition_of_its_uris() -> None:
    assert Filter.of(["b", "a", "b"], True) == Filter.of(["a", "b"], True)
    assert Filter.of(["a"]) != Filter.of(["a"], True)
    assert Filter.from_dict(Filter.of(["a"], event="e", subscription="s").as_dict()) == Filter.of(
        ["a"], event="e", subscription="s")


def _record(**fields: object) -> SessionRecord:
    return SessionRecord(id="s1", tenant="t", principal="t/alice", protocol_version="2026-07-28", epoch="e1",
                         created_at=1.0, **fields)  # type: ignore[arg-type]


def _stored(record: SessionRecord) -> dict[bytes, bytes]:
    pairs = encode_session(record)
    return {(k.encode() if isinstance(k, str) else k): (v.encode() if isinstance(v, str) else v)
            for k, v in zip(pairs[::2], pairs[1::2], strict=True)}


@pytest.mark.parametrize("kind", list(FeedKind))
def test_a_record_keeps_its_kind_filter_and_refilter_position_on_redis(kind: FeedKind) -> None:
    record = _record(kind=kind, filter=None if kind is FeedKind.SESSION else Filter.of(["u"], True),
                     since=("e1", 4) if kind is FeedKind.LISTEN else None)
    assert decode_session("s1", _stored(record)) == record


def test_a_record_without_a_kind_is_a_session_whatever_its_capabilities_hold_once_it_has_one() -> None:
    record = _record(client_capabilities={"dev.mcp-broker/events": {"name": "e", "arguments": {"uris": ["u"]},
                                                                    "mode": "poll"}})
    decoded = decode_session("s1", _stored(record))
    assert decoded is not None and decoded.kind is FeedKind.SESSION and decoded.filter is None


def test_an_older_versions_hidden_listen_and_subscriptions_are_recognised_by_their_capabilities() -> None:
    stored = _stored(_record())
    del stored[b"kind"], stored[b"filter"], stored[b"since"]
    listen = {**stored, b"caps": msgpack.packb({"dev.mcp-broker/listen": {"uris": ["b", "a"], "listChanged": True},
                                                "dev.mcp-broker/listenSince": ["e1", 3]})}
    decoded = decode_session("s1", listen)
    assert decoded is not None
    assert (decoded.kind, decoded.filter, decoded.since) == (FeedKind.LISTEN, Filter.of(["a", "b"], True), ("e1", 3))
    webhook = {**stored, b"caps": msgpack.packb({"dev.mcp-broker/events": {
        "name": "mcp.resource.updated", "arguments": {"uris": ["u"]}, "mode": "webhook", "id": "sub_1"}})}
    decoded = decode_session("s1", webhook)
    assert decoded is not None and decoded.kind is FeedKind.WEBHOOK
    assert decoded.filter == Filter.of(["u"], event="mcp.resource.updated", subscription="sub_1")
    decoded = decode_session("s1", stored)
    assert decoded is not None and decoded.kind is FeedKind.SESSION


def test_a_kind_this_version_does_not_know_is_not_served() -> None:
    assert decode_session("s1", {**_stored(_record()), b"kind": b"durable"}) is None


def test_a_frame_is_decoded_back_into_what_was_encoded() -> None:
    assert decode(update_frame("mcpb://t/a", {"k": 1}).data) == Update("mcpb://t/a", {"k": 1})
    assert decode(update_frame("mcpb://t/a").data) == Update("mcpb://t/a")
    assert decode(LIST_CHANGED.data) == ListChanged()
    assert decode(encode_list_changed({"s": 1})) == ListChanged()
    assert decode(b'{"jsonrpc": "2.0", "method": "other", "params": {}}') is None
    assert decode(b"not json") is None
