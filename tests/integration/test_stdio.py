"""``mcp-broker stdio``: one client on stdin/stdout, both eras; with the SDK client and with exact lines.

Changes come from the demo record (``MCP_BROKER_DEMO``), which ticks every 0.2 s inside the
stdio process itself.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import orjson
import pytest
from mcp.client import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.subscriptions import ResourceUpdated
from mcp.shared.exceptions import MCPDeprecationWarning
from mcp_types import ServerNotification

from tests.integration.modern import SERVER_INFO, SUBSCRIPTION_ID, meta
from tests.support import BIN

#: The SDK's stdio client starts the broker itself, out of sight of the tier markers' walk (tests/tiers.py).
pytestmark = pytest.mark.process

MODERN = "2026-07-28"
TIMEOUT = 10.0
CLOCK = "mcpb://default/demo/clock"
README = "mcpb://default/demo/readme"
DEMO_ENV = {"MCP_BROKER_DEMO": "true", "MCP_BROKER_DEMO_INTERVAL": "0.2"}


def stdio_params(**env: str) -> StdioServerParameters:
    return StdioServerParameters(command=str(BIN), args=["--log-level", "warning", "stdio"], env={**DEMO_ENV, **env})


# -- with the SDK client --------------------------------------------------------------------------
async def test_a_modern_sdk_client_listens_over_stdio() -> None:
    async with Client(stdio_params(), mode=MODERN, read_timeout_seconds=TIMEOUT) as client:
        listed = await client.list_resources()
        assert CLOCK in {str(r.uri) for r in listed.resources}
        async with client.listen(resource_subscriptions=[CLOCK]) as sub:
            assert sub.honored.resource_subscriptions == [CLOCK]
            for _ in range(2):
                assert await asyncio.wait_for(anext(sub), TIMEOUT) == ResourceUpdated(uri=CLOCK)
        # Closing the listen (a notifications/cancelled on stdio) leaves the channel usable.
        read = await client.read_resource(README)
        assert "Subscribe" in read.contents[0].text  # type: ignore[union-attr]


async def test_the_sdk_probe_detects_the_modern_era_on_stdio() -> None:
    async with Client(stdio_params(), mode="auto", read_timeout_seconds=TIMEOUT) as client:
        assert client.protocol_version == MODERN
        assert client.server_info is not None and client.server_info.name == "mcp-broker"


async def test_two_sdk_listens_on_stdio_are_told_apart() -> None:
    async with Client(stdio_params(), mode=MODERN, read_timeout_seconds=TIMEOUT) as client:
        async with client.listen(resource_subscriptions=[README]) as quiet, \
                client.listen(resource_subscriptions=[CLOCK]) as ticking:
            assert quiet.subscription_id != ticking.subscription_id
            for _ in range(3):
                assert await asyncio.wait_for(anext(ticking), TIMEOUT) == ResourceUpdated(uri=CLOCK)


async def test_a_legacy_sdk_client_gets_notifications_over_stdio() -> None:
    heard = asyncio.Event()

    async def on_message(message: Any) -> None:
        if isinstance(message, ServerNotification) and message.method == "notifications/resources/updated":
            if str(message.params.uri) == CLOCK:
                heard.set()

    async with Client(stdio_params(), mode="legacy", message_handler=on_message,
                      read_timeout_seconds=TIMEOUT) as client:
        assert client.protocol_version != MODERN
        with pytest.warns(MCPDeprecationWarning):
            await client.subscribe_resource(CLOCK)
        await asyncio.wait_for(heard.wait(), TIMEOUT)


# -- exact lines ------------------------------------------------------------------------------------
class StdioProcess:
    """``mcp-broker stdio`` driven line by line."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.seen: list[dict[str, Any]] = []

    async def send(self, message: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(orjson.dumps(message) + b"\n")
        await self.proc.stdin.drain()

    async def next(self, timeout: float = TIMEOUT) -> dict[str, Any] | None:
        """The next message on stdout; None at EOF. Every line must be one compact JSON message."""
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        if not line:
            return None
        assert line.endswith(b"\n") and line.count(b"\n") == 1
        message: dict[str, Any] = orjson.loads(line)
        self.seen.append(message)
        return message

    async def until(self, predicate: Any, timeout: float = TIMEOUT) -> dict[str, Any]:
        async with asyncio.timeout(timeout):
            while True:
                message = await self.next()
                assert message is not None, "stdout closed"
                if predicate(message):
                    return message

    async def close_stdin(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()


@asynccontextmanager
async def stdio_process(**env: str) -> AsyncIterator[StdioProcess]:
    proc = await asyncio.create_subprocess_exec(
        str(BIN), "--log-level", "warning", "stdio", env={**os.environ, **DEMO_ENV, **env},
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        yield StdioProcess(proc)
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


def listen_request(id_: Any, *uris: str) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": id_, "method": "subscriptions/listen",
            "params": {"_meta": meta(), "notifications": {"resourceSubscriptions": list(uris)}}}


def sub_id(message: dict[str, Any]) -> Any:
    params = message.get("params") or message.get("result") or {}
    return params.get("_meta", {}).get(SUBSCRIPTION_ID)


def is_ack(id_: Any) -> Any:
    return lambda m: m.get("method") == "notifications/subscriptions/acknowledged" and sub_id(m) == id_


def is_update(id_: Any) -> Any:
    return lambda m: m.get("method") == "notifications/resources/updated" and sub_id(m) == id_


async def test_listen_frames_share_stdout_and_carry_their_own_subscription_id() -> None:
    async with stdio_process() as stdio:
        await stdio.send(listen_request(1, CLOCK))
        # A tick was published after the demo wrote its readme: from now on the readme is quiet.
        await stdio.until(is_update(1))
        await stdio.send(listen_request("quiet", README))
        quiet_ack = await stdio.until(is_ack("quiet"))
        assert quiet_ack["params"]["notifications"] == {"resourceSubscriptions": [README]}
        for _ in range(3):
            frame = await stdio.until(is_update(1))
            assert frame["params"] == {"_meta": {SUBSCRIPTION_ID: 1}, "uri": CLOCK}
        # Three ticks went to listen 1; none of them went to the listen on the other URI.
        assert [m for m in stdio.seen if sub_id(m) == "quiet"] == [quiet_ack]


async def test_a_cancelled_listen_gets_nothing_more() -> None:
    async with stdio_process() as stdio:
        await stdio.send(listen_request(1, CLOCK))
        await stdio.until(is_update(1))
        await stdio.send({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 1}})
        # Read in order after the cancel: once listen 2 is acknowledged, listen 1 must be silent for good.
        await stdio.send(listen_request(2, CLOCK))
        await stdio.until(is_ack(2))
        after = len(stdio.seen)
        for _ in range(3):
            await stdio.until(is_update(2))
        assert not [m for m in stdio.seen[after:] if sub_id(m) == 1]
        assert not [m for m in stdio.seen if m.get("id") == 1]  # no result either: it was cancelled


@pytest.mark.parametrize("ending", ["eof", "sigterm"])
async def test_shutdown_ends_open_listens_with_the_complete_result(ending: str) -> None:
    async with stdio_process() as stdio:
        await stdio.send(listen_request("a", CLOCK))
        await stdio.send(listen_request(7, README))
        await stdio.until(is_ack("a"))
        await stdio.until(is_ack(7))
        if ending == "eof":
            await stdio.close_stdin()
        else:
            stdio.proc.send_signal(signal.SIGTERM)
        finals: dict[Any, dict[str, Any]] = {}
        while (message := await stdio.next()) is not None:
            if "id" in message:
                finals[message["id"]] = message["result"]
        assert set(finals) == {"a", 7}
        for id_, result in finals.items():
            assert result["resultType"] == "complete"
            assert result["_meta"][SUBSCRIPTION_ID] == id_
            assert result["_meta"][SERVER_INFO]["name"] == "mcp-broker"
        assert await asyncio.wait_for(stdio.proc.wait(), TIMEOUT) == 0


async def test_envelope_errors_and_parse_errors_are_answered_on_stdout() -> None:
    async with stdio_process() as stdio:
        assert stdio.proc.stdin is not None
        stdio.proc.stdin.write(b"{not json\n")
        error = await stdio.next()
        assert error is not None and error["error"]["code"] == -32700 and "id" not in error
        await stdio.send({"jsonrpc": "2.0", "id": 2, "method": "resources/list", "params": {}})
        assert (await stdio.until(lambda m: m.get("id") == 2))["error"]["code"] == -32602
        bad_version = {"jsonrpc": "2.0", "id": 3, "method": "resources/list",
                       "params": {"_meta": meta(protocolVersion="2099-01-01")}}
        await stdio.send(bad_version)
        reply = await stdio.until(lambda m: m.get("id") == 3)
        assert reply["error"]["code"] == -32022 and reply["error"]["data"]["supported"] == [MODERN]
        await stdio.send({"jsonrpc": "2.0", "id": 4, "method": "tools/list", "params": {"_meta": meta()}})
        assert (await stdio.until(lambda m: m.get("id") == 4))["error"]["code"] == -32601
        await stdio.send({"jsonrpc": "2.0", "id": 5, "method": "resources/read",
                          "params": {"_meta": meta(), "uri": "mcpb://default/demo/missing"}})
        error = (await stdio.until(lambda m: m.get("id") == 5))["error"]
        assert error["code"] == -32602 and error["data"] == {"uri": "mcpb://default/demo/missing"}
        await stdio.close_stdin()
        assert await asyncio.wait_for(stdio.proc.wait(), TIMEOUT) == 0


async def test_a_stdio_process_watches_the_resources_of_a_running_broker(redis_server: Any) -> None:
    pytest.importorskip("broker.backends.redis")
    import httpx

    from tests.support import BrokerProcess

    prefix = f"stdio{os.getpid()}"
    env = {"MCP_BROKER_REDIS_URL": redis_server.url, "MCP_BROKER_REDIS_PREFIX": prefix}
    with BrokerProcess(env=env) as broker:
        async with stdio_process(MCP_BROKER_DEMO="false", **env) as stdio, \
                httpx.AsyncClient(base_url=broker.url, timeout=TIMEOUT) as rest:
            uri = "mcpb://default/common/x"
            await stdio.send(listen_request(1, uri))
            await stdio.until(is_ack(1))
            assert (await rest.put("/collections/common/x", json={"a": 1})).status_code in (200, 201)
            frame = await stdio.until(is_update(1))
            assert frame["params"]["uri"] == uri
            await stdio.send({"jsonrpc": "2.0", "id": 2, "method": "resources/read",
                              "params": {"_meta": meta(), "uri": uri}})
            assert orjson.loads((await stdio.until(lambda m: m.get("id") == 2))["result"]["contents"][0]["text"]) \
                == {"a": 1}
