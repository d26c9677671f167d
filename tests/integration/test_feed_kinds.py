"""Only a session is a session: the id of a poll subscription or of a resumable listen, which
every one of their cursors carries, is no ``Mcp-Session-Id``, and a session is no poll or listen
whatever capabilities its client declared."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from broker.uris import record_uri
from tests.integration import modern
from tests.integration.mcp_http import McpSession, publish
from tests.resumable import UPDATED, open_listen
from tests.support import BrokerProcess

KEYS = {"key-a": "acme/alice"}
A = "key-a"
EVENT = "mcp.resource.updated"


@pytest.fixture(scope="module")
def broker() -> Iterator[BrokerProcess]:
    with BrokerProcess(env={"MCP_BROKER_API_KEYS": json.dumps(KEYS)}) as proc:
        yield proc


@pytest.fixture
async def http(broker: BrokerProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=broker.url, timeout=10) as client:
        yield client


def uri(name: str) -> str:
    return record_uri("acme", "kinds", name)


async def poll(http: httpx.AsyncClient, uris: list[str], cursor: str | None) -> dict[str, Any]:
    response = await modern.call(http, "events/poll", {"name": EVENT, "arguments": {"uris": uris}, "cursor": cursor},
                                 auth=A)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()["result"]
    return result


def as_session(http: httpx.AsyncClient, feed_id: str) -> McpSession:
    """A 2025 client that sends ``feed_id`` as its ``Mcp-Session-Id``."""
    session = McpSession(http, auth=A)
    session.id = feed_id
    return session


async def refused_as_a_session(http: httpx.AsyncClient, feed_id: str) -> None:
    session = as_session(http, feed_id)
    subscribe = await session.post({"jsonrpc": "2.0", "id": 1, "method": "resources/subscribe",
                                    "params": {"uri": uri("other")}})
    assert subscribe.status_code == 404, subscribe.text
    get = await http.get("/mcp", headers={**session.headers(Accept="text/event-stream")})
    assert get.status_code == 404, get.text


async def test_a_poll_cursors_id_is_no_session(http: httpx.AsyncClient) -> None:
    started = await poll(http, [uri("a")], None)
    feed_id = started["cursor"].partition(":")[0]

    await refused_as_a_session(http, feed_id)

    # The poll serves what it asked for, and nothing a subscribe could have added.
    await publish(http, uri("other"), uri("a"), auth=A)
    cursor = started["cursor"]
    seen: list[str] = []
    while not seen:
        result = await poll(http, [uri("a")], cursor)
        assert result["truncated"] is False
        seen += [event["data"]["uri"] for event in result["events"]]
        cursor = result["cursor"]
    assert seen == [uri("a")]


async def test_a_resumable_listens_id_is_no_session_and_the_listen_goes_on(http: httpx.AsyncClient) -> None:
    async with open_listen(http, [uri("l")], auth=A) as events:
        assert events.last_id is not None
        await refused_as_a_session(http, events.last_id.partition(":")[0])

        await publish(http, uri("l"), auth=A)
        event = await events.notification()
        assert event.method == UPDATED and event.uri == uri("l")


async def test_a_session_cannot_pass_for_a_poll_or_a_listen_by_its_declared_capabilities(
        http: httpx.AsyncClient) -> None:
    epoch = (await poll(http, [uri("p")], None))["cursor"].partition(":")[2].rpartition("-")[0]
    forged = {"dev.mcp-broker/events": {"name": EVENT, "arguments": {"uris": [uri("p")]}, "mode": "poll"},
              "dev.mcp-broker/listen": {"uris": [uri("p")], "listChanged": False}}
    session = McpSession(http, auth=A)
    response = await session.post({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": forged, "clientInfo": {"name": "tests", "version": "1"}}})
    assert response.status_code == 200, response.text
    cursor = f"{response.headers['mcp-session-id']}:{epoch}-0"

    result = await poll(http, [uri("p")], cursor)
    assert result["truncated"] is True and not result["cursor"].startswith(response.headers["mcp-session-id"])

    async with open_listen(http, [uri("p")], last_id=cursor, auth=A) as events:
        assert events.ack_meta["dev.mcp-broker/resumed"] is False
        assert events.last_id is not None and not events.last_id.startswith(response.headers["mcp-session-id"])
