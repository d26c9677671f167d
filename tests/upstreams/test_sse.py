"""``streamable.read_events``: server-sent events as an upstream may cut them, within their byte bound."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from broker.upstreams.streamable import SseEvent, _TooLarge, read_events


async def chunks(*parts: bytes) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


async def collect(*parts: bytes, limit: int = 10_000, whole: bool = True) -> list[SseEvent]:
    return [event async for event in read_events(chunks(*parts), limit, whole=whole)]


async def test_lines_may_end_in_cr_lf_or_crlf_and_be_cut_anywhere() -> None:
    body = (b': keep-alive\r\n\r\nid: 1\r\nevent: message\r\ndata: {"a":\r\ndata: 1}\r\n\r\n'
            b'id: 2\rdata: {"b": 2}\r\r' b'id: 3\ndata:\n\n' b'data: {"c": 3}\n\n')
    expected = [SseEvent("1", {"a": 1}), SseEvent("2", {"b": 2}), SseEvent("3", None), SseEvent(None, {"c": 3})]
    assert await collect(body) == expected
    for size in (1, 2, 3, 7):  # the same bytes in pieces, a CRLF split between two of them included
        assert await collect(*(body[i:i + size] for i in range(0, len(body), size))) == expected


async def test_an_event_left_unfinished_at_the_end_is_not_told() -> None:
    assert await collect(b'data: {"a": 1}\n\ndata: {"b": 2}\n') == [SseEvent(None, {"a": 1})]


async def test_the_bound_is_of_the_whole_answer_or_of_each_event() -> None:
    event = b'data: {"pad": "' + b"x" * 80 + b'"}\n\n'
    with pytest.raises(_TooLarge):
        await collect(event, event, limit=150)
    assert len(await collect(event, event, event, limit=150, whole=False)) == 3
    assert len(await collect(event * 3, limit=150, whole=False)) == 3  # a chunk of several events
    with pytest.raises(_TooLarge):
        await collect(event[:60], event[60:] + event, limit=60, whole=False)
