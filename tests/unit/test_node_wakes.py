"""Wake-up messages to a worker are bounded in size, and a large frame is announced without itself."""

from __future__ import annotations

from broker.backends.base import Frame, Wake
from broker.backends.redis.codec import (
    NodeWake,
    decode_changes,
    decode_node_wakes,
    decode_wakes,
    encode_changes,
    encode_frame,
    split_node_wakes,
)
from broker.changes import Change


def packed(*frames: Frame) -> bytes:
    return b"".join(encode_frame(frame) for frame in frames)


def test_a_batch_for_one_worker_is_cut_into_messages_of_bounded_size_and_loses_nothing() -> None:
    frame = Frame("u:x", b"x" * 5000)
    entries: list[NodeWake] = [(f"session-{n}", n + 1, packed(frame)) for n in range(45)]
    messages = split_node_wakes(entries, 64 * 1024)
    assert len(messages) > 1
    assert all(len(message) <= 64 * 1024 for message in messages)
    decoded = [item for message in messages for item in decode_node_wakes(message)]
    assert decoded == [(f"session-{n}", [Wake("frames", n + 1, frame=frame)]) for n in range(45)]


def test_a_small_batch_is_one_message() -> None:
    entries: list[NodeWake] = [("a", 1, packed(Frame("u:x", b"1"), Frame("u:y", b"2"))), ("b", 7, None)]
    [message] = split_node_wakes(entries, 1024)
    assert decode_node_wakes(message) == [
        ("a", [Wake("frames", 1, frame=Frame("u:x", b"1")), Wake("frames", 2, frame=Frame("u:y", b"2"))]),
        ("b", [Wake("frames", 7)]),  # frameless: the stream reads its inbox
    ]


def test_an_entry_larger_than_the_bound_travels_alone() -> None:
    entries: list[NodeWake] = [("a", 1, packed(Frame("u:x", b"x" * 3000))), ("b", 1, packed(Frame("u:y", b"y")))]
    messages = split_node_wakes(entries, 1024)
    assert [[sid for sid, _ in decode_node_wakes(message)] for message in messages] == [["a"], ["b"]]


def test_a_session_wake_without_its_frames_sends_the_stream_to_its_inbox() -> None:
    # Published by inbox_append.lua on a Cluster when the frames are too large to carry.
    assert decode_wakes(b"F7:") == [Wake("frames", 7)]


def test_a_broadcast_is_cut_into_messages_of_bounded_size_in_order() -> None:
    changes = [(f"0:{n}-0", Change("t", f"x:{n}", meta={"blob": "x" * 300})) for n in range(100)]
    messages = encode_changes(changes, 4096)
    assert len(messages) > 1 and all(len(message) <= 4096 for message in messages)
    assert [pair for message in messages for pair in decode_changes(message)] == changes
    assert len(encode_changes(changes[:1], 10)) == 1  # a change larger than the bound travels alone
