"""``MCP_BROKER_PROVIDERS``: a live provider of the deployment's own code, loaded from ``module:factory``."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from mcp import types
from mcp.client.client import Client

from broker.config import Settings
from broker.sources.extensions import ExtensionError, LiveSource, build
from tests.custom_providers import Notes
from tests.sdk_inbox import Inbox
from tests.support import BIN, BrokerProcess

pytestmark = pytest.mark.filterwarnings("ignore::mcp.shared.exceptions.MCPDeprecationWarning")


async def test_a_live_provider_named_in_the_setting_answers_and_its_changes_reach_a_subscriber() -> None:
    with BrokerProcess(env={"MCP_BROKER_PROVIDERS": '["tests.custom_providers:live"]'}) as broker:
        inbox = Inbox()
        async with Client(broker.mcp_url, mode="legacy", message_handler=inbox.handler) as client:
            await client.subscribe_resource("notes://1")
            await inbox.wait_for(types.ResourceUpdatedNotification, "notes://1")
            read = await client.read_resource("notes://1", cache_mode="bypass")
            assert json.loads(read.contents[0].text)["version"] >= 1  # type: ignore[union-attr]


def test_build_turns_a_live_provider_into_a_provider_and_an_exclusive_source() -> None:
    extension = build(Settings(providers=["tests.custom_providers:live"]))
    (provider,) = extension.providers
    (source,) = extension.sources
    assert isinstance(provider, Notes) and isinstance(source, LiveSource)
    assert source.name == "notes" and source.exclusive


def test_a_factory_that_returns_something_else_is_refused_in_one_line() -> None:
    with pytest.raises(ExtensionError, match=r"^MCP_BROKER_PROVIDERS: 'tests.custom_providers:not_a_provider' "
                                             r"returned int, not a provider"):
        build(Settings(providers=["tests.custom_providers:not_a_provider"]))


@pytest.mark.parametrize("spec", ["no-colon", "tests.no_such_module:factory", "tests.custom_providers:missing"])
def test_a_bad_module_factory_stops_serve_with_one_line_and_exit_2(spec: str) -> None:
    done = subprocess.run([str(BIN), "serve", "--port", "0"], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "MCP_BROKER_PROVIDERS": json.dumps([spec])})
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "MCP_BROKER_PROVIDERS" in lines[0] and spec in lines[0], done.stderr
