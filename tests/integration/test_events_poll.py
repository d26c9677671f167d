"""``events/poll`` on one real broker: a cursor from null, events after a publish, hasMore, the principal check, gaps.

The Redis restart that loses a cursor's data is in ``tests/distributed/test_webhooks.py``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from broker.uris import record_uri
from tests.integration import modern
from tests.integration.mcp_http import publish
from tests.support import BrokerProcess

KEYS = {"key-a": "acme/alice", "key-b": "acme/bob"}
EVENT = "mcp.resource.updated"


@pytest.fixture(scope="module")
def broker() -> Iterator[BrokerProcess]:
    with BrokerProcess(env={"MCP_BROKER_API_KEYS": json.dumps(KEYS), "MCP_BROKER_INBOX_MAXLEN": "20",
                            "MCP_BROKER_WEBHOOK_ALLOW": '["127.0.0.1"]'}) as proc:
        yield proc


@pytest.fixture
async def http(broker: BrokerProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=broker.url, timeout=10) as client:
        yield client


def uri(n: int) -> str:
    return record_uri("acme", "polled", f"r{n}")


async def poll(http: httpx.AsyncClient, uris: list[str], cursor: str | None, auth: str = "key-a",
               **extra: Any) -> dict[str, Any]:
    response = await modern.call(http, "events/poll", {"name": EVENT, "arguments": {"uris": uris}, "cursor": cursor,
                                                       **extra}, auth=auth)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()["result"]
    return result


async def poll_until(http: httpx.AsyncClient, uris: list[str], cursor: str, done: Any, **extra: Any) -> dict[str, Any]:
    """Poll from ``cursor`` until ``done(result)``: fan-out delivers after the publish is acknowledged."""
    async with asyncio.timeout(10):
        while not done(result := await poll(http, uris, cursor, **extra)):
            await asyncio.sleep(0.02)
    return result


def count(n: int) -> Any:
    return lambda result: len(result["events"]) >= n


async def test_discover_and_list_offer_the_event_type(http: httpx.AsyncClient) -> None:
    discover = (await modern.call(http, "server/discover", auth="key-a")).json()["result"]
    assert "io.modelcontextprotocol/events" in discover["capabilities"]["extensions"]
    listed = (await modern.call(http, "events/list", auth="key-a")).json()["result"]["events"]
    assert [(e["name"], e["delivery"]) for e in listed] == [(EVENT, ["poll", "webhook"])]
    assert listed[0]["inputSchema"]["required"] == ["uris"] and "uri" in listed[0]["payloadSchema"]["properties"]


async def test_a_null_cursor_starts_from_now_then_each_publish_is_an_event_in_order(http: httpx.AsyncClient) -> None:
    watched = [uri(1), uri(2)]
    first = await poll(http, watched, None)
    assert first["events"] == [] and first["truncated"] is False and first["hasMore"] is False
    assert isinstance(first["cursor"], str) and first["nextPollMs"] > 0
    await publish(http, uri(2), uri(1), auth="key-a")
    await publish(http, record_uri("acme", "polled", "other"), auth="key-a")  # not watched
    second = await poll_until(http, watched, first["cursor"], count(2))
    assert [e["data"]["uri"] for e in second["events"]] == [uri(2), uri(1)]
    assert {e["name"] for e in second["events"]} == {EVENT} and second["truncated"] is False
    assert all(e["eventId"] and e["timestamp"].endswith("Z") for e in second["events"])
    again = await poll(http, watched, first["cursor"])  # the same cursor again: the same events, same ids
    assert [e["eventId"] for e in again["events"]] == [e["eventId"] for e in second["events"]]
    assert (await poll(http, watched, second["cursor"]))["events"] == []


async def test_max_events_pages_with_has_more(http: httpx.AsyncClient) -> None:
    watched = [uri(n) for n in range(10, 15)]
    cursor = (await poll(http, watched, None))["cursor"]
    await publish(http, *watched, auth="key-a")
    await poll_until(http, watched, cursor, count(5))  # all of them in, then read in pages
    seen: list[str] = []
    pages = 0
    while True:
        page = await poll(http, watched, cursor, maxEvents=2)
        pages += 1
        seen += [e["data"]["uri"] for e in page["events"]]
        cursor = page["cursor"]
        if not page["hasMore"]:
            break
    assert seen == watched and pages == 3


async def test_another_principal_or_other_arguments_get_a_fresh_state_never_the_events(
        http: httpx.AsyncClient) -> None:
    watched = [uri(20)]
    cursor = (await poll(http, watched, None))["cursor"]
    await publish(http, uri(20), auth="key-a")
    bob = await poll(http, watched, cursor, auth="key-b")
    assert bob["truncated"] is True and bob["cursor"] != cursor
    assert [e["data"]["uri"] for e in bob["events"]] == watched  # the gap rule: re-read what you watch
    assert all(e["data"]["_meta"] == {"dev.mcp-broker/resync": True} for e in bob["events"])
    other = await poll(http, [uri(21)], cursor)
    assert other["truncated"] is True and [e["data"]["uri"] for e in other["events"]] == [uri(21)]
    alice = await poll_until(http, watched, cursor, count(1))  # the owner's state was left alone
    assert alice["truncated"] is False and [e["data"]["uri"] for e in alice["events"]] == watched


async def test_a_trimmed_position_is_truncated_with_the_gap_rule_then_goes_on(http: httpx.AsyncClient) -> None:
    watched = [uri(30), uri(31)]
    cursor = (await poll(http, watched, None))["cursor"]
    for _ in range(15):  # 30 frames into an inbox of 20
        await publish(http, *watched, auth="key-a")
    gap = await poll_until(http, watched, cursor, lambda result: result["truncated"])
    assert gap["truncated"] is True and sorted(e["data"]["uri"] for e in gap["events"]) == watched
    await publish(http, uri(31), auth="key-a")
    after = await poll_until(http, watched, gap["cursor"], count(1))
    assert after["truncated"] is False and [e["data"]["uri"] for e in after["events"]] == [uri(31)]


@pytest.mark.parametrize(("params", "code", "status"), [
    ({"name": "nope", "arguments": {"uris": ["mcpb://acme/x/1"]}}, -32011, 404),
    ({"name": EVENT, "arguments": {"uris": []}}, -32602, 400),
    ({"name": EVENT, "arguments": {"uris": "mcpb://acme/x/1"}}, -32602, 400),
    ({"name": EVENT, "arguments": {"uris": ["mcpb://acme/x/1"], "what": 1}}, -32602, 400),
    ({"name": EVENT, "arguments": {"uris": ["mcpb://acme/x/1"]}, "cursor": "junk"}, -32602, 400),
    ({"name": EVENT, "arguments": {"uris": ["mcpb://acme/x/1"]}, "cursor": None, "maxEvents": 0}, -32602, 400),
    ({"name": EVENT, "arguments": {"uris": ["mcpb://other/x/1"]}, "cursor": None}, -32602, 200),  # as a listen
])
async def test_bad_polls_get_precise_errors(http: httpx.AsyncClient, params: dict[str, Any], code: int,
                                           status: int) -> None:
    response = await modern.call(http, "events/poll", params, auth="key-a")
    assert response.status_code == status, response.text
    assert response.json()["error"]["code"] == code


async def test_webhook_subscribe_refuses_a_private_callback_and_a_bad_secret(http: httpx.AsyncClient) -> None:
    base = {"name": EVENT, "arguments": {"uris": [uri(40)]}}
    private = await modern.call(http, "events/subscribe", {**base, "delivery": {
        "mode": "webhook", "url": "https://10.1.2.3/hook", "secret": "whsec_" + "QUFB" * 8}}, auth="key-a")
    assert private.status_code == 400 and private.json()["error"]["code"] == -32602
    assert "private" in private.json()["error"]["message"]
    secret = await modern.call(http, "events/subscribe", {**base, "delivery": {
        "mode": "webhook", "url": "https://example.com/hook", "secret": "hunter2"}}, auth="key-a")
    assert secret.status_code == 400 and "whsec_" in secret.json()["error"]["message"]
    push = await modern.call(http, "events/subscribe", {**base, "delivery": {"mode": "push"}}, auth="key-a")
    assert push.json()["error"]["code"] == -32014
    gone = await modern.call(http, "events/unsubscribe", {**base, "delivery": {"url": "https://example.com/h"}},
                             auth="key-a")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == -32011


SECRET = "whsec_" + "QUFB" * 8


@pytest.mark.parametrize(("url", "secret", "says"), [
    ("http://127.0.0.1:9/\x01", SECRET, "control characters"),  # allow-listed: it would reach the delivery
    ("http://127.0.0.1:9/\x7f", SECRET, "control characters"),
    ("https://[::1/h", SECRET, "host is malformed"),
    ("https://[notipv6]/h", SECRET, "host is malformed"),
    ("https://example.com/h", "whsec_ééé", "whsec_"),
])
async def test_hostile_callbacks_and_secrets_are_invalid_params_not_internal_errors(
        http: httpx.AsyncClient, url: str, secret: str, says: str) -> None:
    response = await modern.call(http, "events/subscribe", {"name": EVENT, "arguments": {"uris": [uri(41)]},
                                 "delivery": {"mode": "webhook", "url": url, "secret": secret}}, auth="key-a")
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == -32602 and says in error["message"]


@pytest.fixture(scope="module")
def quota_broker() -> Iterator[BrokerProcess]:
    with BrokerProcess(env={"MCP_BROKER_API_KEYS": json.dumps(KEYS), "MCP_BROKER_WEBHOOK_ALLOW": '["127.0.0.1"]',
                            "MCP_BROKER_QUOTAS": json.dumps({"default": {"subscriptions": 2, "webhooks": 1}})}) as proc:
        yield proc


async def test_events_are_held_to_the_tenant_subscriptions_and_webhooks_quotas(quota_broker: BrokerProcess) -> None:
    def hook(url: str, uris: list[str], auth: str = "key-a") -> Any:
        return modern.call(client, "events/subscribe", {"name": EVENT, "arguments": {"uris": uris}, "delivery": {
            "mode": "webhook", "url": url, "secret": SECRET}}, auth=auth)

    def refused(response: httpx.Response, limit: str) -> bool:
        error = response.json()["error"]
        return response.status_code == 429 and error["code"] == -31002 and error["data"]["limit"] == limit

    three = [uri(50), uri(51), uri(52)]
    async with httpx.AsyncClient(base_url=quota_broker.url, timeout=10) as client:
        polled = await modern.call(client, "events/poll", {"name": EVENT, "arguments": {"uris": three},
                                                           "cursor": None}, auth="key-a")
        assert refused(polled, "subscriptions"), polled.text
        assert refused(await hook("http://127.0.0.1:9/a", three), "subscriptions")
        first = await hook("http://127.0.0.1:9/a", three[:2])
        assert first.status_code == 200, first.text
        assert refused(await hook("http://127.0.0.1:9/b", three[:2]), "webhooks")
        assert refused(await hook("http://127.0.0.1:9/b", three[:1], auth="key-b"), "webhooks")  # the tenant's
        again = await hook("http://127.0.0.1:9/a", three[:2])  # a refresh is never refused
        assert again.status_code == 200 and again.json()["result"]["id"] == first.json()["result"]["id"]
