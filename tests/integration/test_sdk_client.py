"""The official MCP Python SDK (legacy mode) against a real broker: subscribe, change, notify, read."""

from __future__ import annotations

import json
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest
from mcp import MCPError, types
from mcp.client.client import Client

from tests.sdk_inbox import Inbox
from tests.support import BrokerProcess

# resources/subscribe is deprecated by 2026-07-28 only; the legacy era is what is under test.
pytestmark = pytest.mark.filterwarnings("ignore::mcp.shared.exceptions.MCPDeprecationWarning")



@asynccontextmanager
async def connect(broker: BrokerProcess) -> AsyncIterator[tuple[Client, Inbox]]:
    inbox = Inbox()
    async with Client(broker.mcp_url, mode="legacy", message_handler=inbox.handler) as client:
        yield client, inbox


def collection() -> str:
    return "c" + secrets.token_hex(4)


async def test_the_broker_announces_subscriptions_and_list_changes(broker: BrokerProcess) -> None:
    async with connect(broker) as (client, _):
        assert client.protocol_version == "2025-11-25"
        resources = client.server_capabilities.resources
        assert resources is not None and resources.subscribe and resources.list_changed
        assert client.server_info is not None and client.server_info.name == "mcp-broker"


async def test_a_subscriber_is_notified_of_a_record_change_and_reads_the_new_value(
        broker: BrokerProcess, http: httpx.AsyncClient) -> None:
    name = collection()
    uri = f"mcpb://default/{name}/42"
    assert (await http.put(f"/collections/{name}/42", json={"price": 1})).status_code == 201
    async with connect(broker) as (client, inbox):
        await client.subscribe_resource(uri)
        assert (await http.put(f"/collections/{name}/42", json={"price": 2})).status_code == 200
        await inbox.wait_for(types.ResourceUpdatedNotification, uri)
        read = await client.read_resource(uri, cache_mode="bypass")
        assert json.loads(read.contents[0].text) == {"price": 2}  # type: ignore[union-attr]


async def test_a_collection_subscriber_is_notified_when_one_of_its_records_changes(
        broker: BrokerProcess, http: httpx.AsyncClient) -> None:
    name = collection()
    await http.put(f"/collections/{name}/1", json={"v": 1})
    async with connect(broker) as (client, inbox):
        await client.subscribe_resource(f"mcpb://default/{name}")
        await http.patch(f"/collections/{name}/1", json={"v": 2})
        await inbox.wait_for(types.ResourceUpdatedNotification, f"mcpb://default/{name}")
        assert f"mcpb://default/{name}/1" not in inbox.updated()  # only what was subscribed


async def test_creating_a_record_tells_every_session_that_the_list_changed(
        broker: BrokerProcess, http: httpx.AsyncClient) -> None:
    name = collection()
    async with connect(broker) as (client, inbox):
        await client.list_resources()
        await http.put(f"/collections/{name}/new", json={})
        await inbox.wait_for(types.ResourceListChangedNotification)
        listed = await client.list_resources(cache_mode="bypass")
        assert f"mcpb://default/{name}/new" in {str(r.uri) for r in listed.resources}


async def test_after_unsubscribing_a_change_is_no_longer_notified(
        broker: BrokerProcess, http: httpx.AsyncClient) -> None:
    name = collection()
    await http.put(f"/collections/{name}/a", json={})
    await http.put(f"/collections/{name}/b", json={})
    async with connect(broker) as (client, inbox):
        await client.subscribe_resource(f"mcpb://default/{name}/a")
        await client.subscribe_resource(f"mcpb://default/{name}/b")
        await client.unsubscribe_resource(f"mcpb://default/{name}/a")
        await http.put(f"/collections/{name}/a", json={"v": 1})
        await http.put(f"/collections/{name}/b", json={"v": 1})
        await inbox.wait_for(types.ResourceUpdatedNotification, f"mcpb://default/{name}/b")
        assert inbox.updated() == [f"mcpb://default/{name}/b"]


async def test_a_change_published_for_an_external_uri_reaches_its_subscriber(
        broker: BrokerProcess, http: httpx.AsyncClient) -> None:
    uri = f"https://example.com/{secrets.token_hex(4)}"
    async with connect(broker) as (client, inbox):
        await client.subscribe_resource(uri)
        assert (await http.post("/changes", json={"uri": uri})).status_code == 202
        await inbox.wait_for(types.ResourceUpdatedNotification, uri)


async def test_reading_an_unknown_record_is_resource_not_found(broker: BrokerProcess) -> None:
    async with connect(broker) as (client, _):
        with pytest.raises(MCPError) as info:
            await client.read_resource("mcpb://default/nothing/here")
        assert info.value.error.code == -32002
        assert info.value.error.data == {"uri": "mcpb://default/nothing/here"}
