"""What the app says about itself: method and path in its refusal lines.

In-process: the app over ``httpx.ASGITransport`` on the memory backend.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import httpx
import pytest

from broker.config import Settings
from broker.ops import logs
from broker.runtime import Broker
from broker.runtime.app import create_app


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    broker = Broker(Settings(_env_file=None, auth="keys"))  # type: ignore[call-arg]
    await broker.start()
    transport = httpx.ASGITransport(app=create_app(broker=broker))
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        yield client
    await broker.stop()


async def test_a_refusal_line_names_the_method_and_the_path_escaped(
        http: httpx.AsyncClient, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logs, "_refused", {})  # no line of another test holds this one back
    with caplog.at_level(logging.WARNING, logger="broker.requests"):
        answer = await http.put("/collections/notes/a%0Atenant=x", json={"v": 1})
        assert answer.status_code == 401
        await http.post("/changes", json={"uri": "x:y"}, headers={"origin": "https://evil.example"})
    lines = [record.getMessage() for record in caplog.records]
    assert "refused a request to api with 401: PUT /collections/notes/a%0Atenant%3Dx" in lines, lines
    assert "refused a request to changes with 403: POST /changes" in lines, lines
