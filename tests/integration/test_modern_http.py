"""The 2026-07-28 era over HTTP, driven by the official SDK client (``mode="2026-07-28"``) against a real broker."""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import httpx
import pytest
from mcp.client import Client
from mcp.client.subscriptions import ResourceUpdated, Subscription
from mcp.shared.exceptions import MCPDeprecationWarning
from mcp_types import ServerNotification

from tests.integration.modern import (
    SERVER_INFO,
    SUBSCRIPTION_ID,
    call,
    listen,
    listen_count,
    put_record,
    wait_listens,
)
from tests.support import BrokerProcess

MODERN = "2026-07-28"
TIMEOUT = 10.0


def sdk_client(proc: BrokerProcess, **kwargs: Any) -> Client:
    """An SDK client pinned to 2026-07-28; entered inside each test (its task group must not span tasks)."""
    return Client(proc.mcp_url, mode=MODERN, read_timeout_seconds=TIMEOUT, **kwargs)


async def next_event(sub: Subscription) -> Any:
    return await asyncio.wait_for(anext(sub), TIMEOUT)


async def test_the_sdk_probe_finds_a_modern_server_with_truthful_capabilities(broker: BrokerProcess) -> None:
    async with Client(broker.mcp_url, mode="auto", read_timeout_seconds=TIMEOUT) as sdk:
        assert sdk.protocol_version == MODERN  # server/discover answered, no initialize fallback
        assert sdk.server_info is not None and sdk.server_info.name == "mcp-broker"
        resources = sdk.server_capabilities.resources
        assert resources is not None and resources.subscribe and resources.list_changed
        assert sdk.server_capabilities.tools is None and sdk.server_capabilities.prompts is None


async def test_read_and_list_work_for_a_modern_client(broker: BrokerProcess, http: httpx.AsyncClient) -> None:
    async with sdk_client(broker) as client:
        uri = await put_record(http, "http-read", "one", {"n": 1})
        read = await client.read_resource(uri)
        assert read.contents[0].text == '{"n":1}'  # type: ignore[union-attr]
        listed = await client.list_resources()
        assert uri in {str(r.uri) for r in listed.resources}


async def test_a_listen_is_acknowledged_then_notified_of_a_change(
    broker: BrokerProcess, http: httpx.AsyncClient
) -> None:
    async with sdk_client(broker) as client:
        uri = await put_record(http, "http-listen", "a", {"v": 0})
        async with client.listen(resource_subscriptions=[uri], tools_list_changed=True) as sub:
            # The broker has no tools: the ack honours only the URI subscription.
            assert sub.honored.resource_subscriptions == [uri]
            assert not sub.honored.tools_list_changed
            await put_record(http, "http-listen", "a", {"v": 1})
            assert await next_event(sub) == ResourceUpdated(uri=uri)


async def test_two_listens_side_by_side_receive_only_their_own_uris(
    broker: BrokerProcess, http: httpx.AsyncClient
) -> None:
    async with sdk_client(broker) as client:
        uri_a = await put_record(http, "http-two", "a", {})
        uri_b = await put_record(http, "http-two", "b", {})
        async with client.listen(resource_subscriptions=[uri_a]) as sub_a, \
                client.listen(resource_subscriptions=[uri_b]) as sub_b:
            assert sub_a.subscription_id != sub_b.subscription_id
            await put_record(http, "http-two", "a", {"v": 1})
            await put_record(http, "http-two", "b", {"v": 1})
            assert await next_event(sub_a) == ResourceUpdated(uri=uri_a)
            # b's change was published after a's: had a's reached this listen, it would come first.
            assert await next_event(sub_b) == ResourceUpdated(uri=uri_b)


async def test_closing_a_listen_frees_it_on_the_broker(broker: BrokerProcess, http: httpx.AsyncClient) -> None:
    async with sdk_client(broker) as client:
        uri = await put_record(http, "http-close", "a", {})
        await wait_listens(http, 0)
        async with client.listen(resource_subscriptions=[uri]) as kept:
            async with client.listen(resource_subscriptions=[uri]):
                assert await listen_count(http) == 2
            await wait_listens(http, 1)
            await put_record(http, "http-close", "a", {"v": 1})
            assert await next_event(kept) == ResourceUpdated(uri=uri)
        await wait_listens(http, 0)


async def test_shutdown_ends_an_open_listen_with_the_complete_result() -> None:
    with BrokerProcess() as proc:
        async with httpx.AsyncClient(base_url=proc.url, timeout=TIMEOUT) as http, \
                Client(proc.mcp_url, mode=MODERN, read_timeout_seconds=TIMEOUT) as sdk:
            uri = await put_record(http, "http-stop", "a", {})
            async with sdk.listen(resource_subscriptions=[uri]) as sub:
                proc.proc.send_signal(signal.SIGTERM)
                # A graceful end stops the iteration; a bare disconnect would raise SubscriptionLost.
                # (The record's creation may still be on its way: level triggers before the end are fine.)
                async with asyncio.timeout(TIMEOUT):
                    async for event in sub:
                        assert event == ResourceUpdated(uri=uri)
        # uvicorn re-raises the signal once it has shut down gracefully.
        assert await asyncio.to_thread(proc.proc.wait, TIMEOUT) in (0, -signal.SIGTERM)


async def test_the_complete_result_carries_the_listen_id_verbatim() -> None:
    with BrokerProcess() as proc:
        async with httpx.AsyncClient(base_url=proc.url, timeout=TIMEOUT) as http:
            uri = await put_record(http, "http-stop", "raw", {})
            async with listen(http, [uri], id_=7) as numeric, listen(http, [uri], id_="7") as text:
                for stream, id_ in ((numeric, 7), (text, "7")):
                    ack = await stream.next()
                    assert ack is not None and ack["params"]["_meta"][SUBSCRIPTION_ID] == id_
                proc.proc.send_signal(signal.SIGTERM)
                for stream, id_ in ((numeric, 7), (text, "7")):
                    final = await stream.next()
                    while final is not None and "id" not in final:  # the record's creation, still on its way
                        assert final["params"]["_meta"][SUBSCRIPTION_ID] == id_
                        final = await stream.next()
                    assert final is not None
                    assert final["id"] == id_ and type(final["id"]) is type(id_)
                    assert final["result"]["resultType"] == "complete"
                    assert final["result"]["_meta"][SUBSCRIPTION_ID] == id_
                    assert type(final["result"]["_meta"][SUBSCRIPTION_ID]) is type(id_)
                    assert await stream.next() is None  # then the stream closes


async def test_a_legacy_and_a_modern_client_both_hear_of_one_change(
    broker: BrokerProcess, http: httpx.AsyncClient
) -> None:
    async with sdk_client(broker) as client:
        uri = await put_record(http, "http-eras", "shared", {})
        legacy_heard = asyncio.Event()

        async def on_message(message: Any) -> None:
            if isinstance(message, ServerNotification) and message.method == "notifications/resources/updated":
                if str(message.params.uri) == uri:
                    legacy_heard.set()

        async with Client(broker.mcp_url, mode="legacy", message_handler=on_message,
                          read_timeout_seconds=TIMEOUT) as legacy:
            assert legacy.protocol_version != MODERN
            with pytest.warns(MCPDeprecationWarning):
                await legacy.subscribe_resource(uri)
            async with client.listen(resource_subscriptions=[uri]) as sub:
                # The legacy GET stream opens in the background: wait until the broker holds it.
                async with asyncio.timeout(TIMEOUT):
                    while (await http.get("/healthz")).json()["streams"] < 1:
                        await asyncio.sleep(0.02)
                await put_record(http, "http-eras", "shared", {"v": 1})
                assert await next_event(sub) == ResourceUpdated(uri=uri)
                await asyncio.wait_for(legacy_heard.wait(), TIMEOUT)


async def test_listen_streams_send_keepalive_comments_unbuffered(http: httpx.AsyncClient) -> None:
    async with listen(http, ["mcpb://default/http-keepalive/a"]) as stream:
        assert stream.response.headers["x-accel-buffering"] == "no"
        assert (await stream.next()) is not None  # the ack
        await stream.wait_comment()  # the test broker sends one every second


async def test_every_result_carries_result_type_and_server_info(http: httpx.AsyncClient) -> None:
    uri = await put_record(http, "http-shape", "a", {})
    for method, params, name in [
        ("server/discover", {}, None),
        ("resources/list", {}, None),
        ("resources/templates/list", {}, None),
        ("resources/read", {"uri": uri}, uri),
    ]:
        response = await call(http, method, params, name=name)
        assert response.status_code == 200, response.text
        result = response.json()["result"]
        assert result["resultType"] == "complete", method
        assert result["_meta"][SERVER_INFO]["name"] == "mcp-broker", method
        assert isinstance(result["ttlMs"], int) and result["ttlMs"] >= 0, method
        assert result["cacheScope"] in ("public", "private"), method
