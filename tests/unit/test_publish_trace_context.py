"""``POST /changes`` with a W3C ``traceparent`` header: the context goes into each change's ``meta``
unless the change has its own, and an invalid header changes nothing. In-process, over ASGI, with
no fan-out running, so the change log is read as fan-out would read it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from broker.config import Settings
from broker.runtime import Broker
from broker.runtime.app import create_app

HEADER = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
OWN = "00-11111111111111111111111111111111-2222222222222222-01"


@pytest.fixture
async def broker() -> AsyncIterator[Broker]:
    broker = Broker(Settings(_env_file=None, metrics=False, embedded_fanout=False))  # type: ignore[call-arg]
    await broker.start()
    yield broker
    await broker.stop()


async def published(broker: Broker, body: Any, **headers: str) -> list[dict[str, Any] | None]:
    """The ``meta`` of each change the request appended, as fan-out reads them."""
    transport = httpx.ASGITransport(app=create_app(broker=broker))
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as http:
        answer = await http.post("/changes", json=body, headers=headers)
    assert answer.status_code == 202, answer.text
    batch = await broker.backend.changelog.read("test", 100, 0)
    return [change.meta for _, change in batch]


async def test_the_traceparent_header_is_the_context_of_every_change_without_one(broker: Broker) -> None:
    metas = await published(broker, [{"uri": "https://example.com/a", "meta": {"etag": "1"}},
                                     {"uri": "https://example.com/b"},
                                     {"uri": "https://example.com/c", "meta": {"traceparent": OWN}}],
                            traceparent=HEADER, tracestate="vendor=1")
    assert metas == [{"traceparent": HEADER, "tracestate": "vendor=1", "etag": "1"},
                     {"traceparent": HEADER, "tracestate": "vendor=1"},
                     {"traceparent": OWN}]


async def test_an_invalid_traceparent_header_is_ignored_and_the_change_published(broker: Broker) -> None:
    assert await published(broker, {"uri": "https://example.com/a"}, traceparent="00-not-a-context-01") == [None]


async def test_the_header_never_pushes_a_change_near_the_meta_bound_into_a_refusal() -> None:
    broker = Broker(Settings(_env_file=None, metrics=False, embedded_fanout=False,  # type: ignore[call-arg]
                             max_meta_bytes=100))
    await broker.start()
    try:
        near = {"pad": "x" * 80}  # 92 bytes encoded: the header's context would make it 160
        metas = await published(broker, [{"uri": "https://example.com/a", "meta": near},
                                         {"uri": "https://example.com/b"}], traceparent=HEADER)
        assert metas == [near, {"traceparent": HEADER}]
    finally:
        await broker.stop()
