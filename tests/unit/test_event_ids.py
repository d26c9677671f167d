"""SSE event ids are cursors: ``<epoch>-<offset>``; anything else is refused, never read as "from the start"."""

from __future__ import annotations

import pytest

from broker.backends.base import Frame
from broker.feeds.model import format_event_id, parse_event_id
from broker.feeds.session import coalesce


def test_an_issued_event_id_parses_back_to_its_epoch_and_offset() -> None:
    assert parse_event_id(format_event_id("ab12cd34", 17)) == ("ab12cd34", 17)
    assert parse_event_id("ab12cd34-0") == ("ab12cd34", 0)


@pytest.mark.parametrize(
    "value",
    ["", "-", "17", "ab-", "-17", "ab-x7", "ab-1.5", "a/b-3", "ab--3", "ab- 3x", "a" * 33 + "-1", "ab-" + "9" * 20,
     "ab-+3", "ab-\u0663", "ab-\u00b2", "\u00e9t\u00e9-3"],
)
def test_a_malformed_event_id_is_refused(value: str) -> None:
    assert parse_event_id(value) is None


def test_coalescing_keeps_the_newest_frame_of_each_uri_in_offset_order() -> None:
    a, b, listed = Frame("u:a", b"1"), Frame("u:b", b"2"), Frame("l", b"3")
    frames = [(1, a), (2, b), (3, a), (4, listed), (5, listed), (6, Frame("u:c", b"4"))]
    assert [off for off, _ in coalesce(frames)] == [2, 3, 5, 6]


def test_coalescing_leaves_distinct_frames_alone() -> None:
    frames = [(1, Frame("u:a", b"")), (2, Frame("u:b", b""))]
    assert coalesce(frames) == frames
    assert coalesce([]) == []
