"""MCP servers behind the broker (docs/UPSTREAMS.md): a real broker process in front of real upstreams
built with the official SDK (``tests/upstream_server.py``), one speaking both eras and one of the
2025 protocol only, driven by clients of both eras over HTTP.

What a client would notice: the upstream's tools, prompts and resources served beside the broker's
own, to the tenants it is mapped to alone; a tool call that changes a note reaching the note's
subscribers; the upstream's progress reaching the caller; a slow or dead upstream named in the
error with its gateway status, while the broker's own resources keep working; and the client's
credential nowhere in what an upstream receives.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import orjson
import pytest
from mcp.client import Client
from mcp.client.stdio import StdioServerParameters

from tests.integration import modern
from tests.integration.mcp_http import McpSession
from tests.support import BIN, ROOT, BrokerProcess, free_port, wait_until

KEYS = {"k-acme": "acme/alice", "k-globex": "globex/bob", "k-initech": "initech/carol", "k-umbrella": "umbrella/dan",
        "k-ops": "ops/eve"}
UPDATED = "notifications/resources/updated"


class UpstreamProcess:
    """``tests/upstream_server.py`` on a free loopback port."""

    def __init__(self, *args: str, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.upstream_server", "--port", str(self.port), *args],
                                     cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_until(lambda: httpx.get(self.url + "/healthz", timeout=1).status_code == 200, what="upstream start")

    @classmethod
    def on_port(cls, port: int, *args: str) -> UpstreamProcess:
        """A new upstream where an earlier one was (a restart: everything it knew is gone)."""
        return cls(*args, port=port)

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = httpx.get(self.url + "/stats", timeout=5).json()
        return stats

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture(scope="module")
def upstreams() -> Iterator[dict[str, UpstreamProcess]]:
    both, legacy = UpstreamProcess("--token", "broker-secret"), UpstreamProcess("--era", "legacy")
    try:
        yield {"notes": both, "old": legacy}
    finally:
        both.stop()
        legacy.stop()


@pytest.fixture(scope="module")
def broker(upstreams: dict[str, UpstreamProcess], tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerProcess]:
    token = tmp_path_factory.mktemp("upstream-token") / "token"
    token.write_text("broker-secret\n")
    dead = free_port()  # nothing listens there
    config = {
        "notes": {"url": upstreams["notes"].url + "/mcp", "tenants": ["acme"], "timeout": 3, "caller": ["tenant"],
                  "auth": {"type": "bearer", "token_file": str(token)}},
        "old": {"url": upstreams["old"].url + "/mcp", "tenants": ["globex"], "prefixes": ["note://"],
                "name_prefix": "old_"},
        "dead": {"url": f"http://127.0.0.1:{dead}/mcp", "tenants": ["initech"], "prefixes": ["dead://"]},
    }
    env = {"MCP_BROKER_UPSTREAMS": json.dumps(config), "MCP_BROKER_API_KEYS": json.dumps(KEYS),
           "MCP_BROKER_CONSOLE_TENANTS": '["ops"]'}
    with BrokerProcess(env=env) as proc:
        yield proc


@pytest.fixture
async def http(broker: BrokerProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=broker.url, timeout=15) as client:
        yield client


async def rpc(http: httpx.AsyncClient, key: str, method: str, params: dict[str, Any] | None = None,
              name: str | None = None) -> httpx.Response:
    return await modern.call(http, method, params, name=name, auth=key)


async def result(http: httpx.AsyncClient, key: str, method: str, params: dict[str, Any] | None = None,
                 name: str | None = None) -> dict[str, Any]:
    response = await rpc(http, key, method, params, name)
    assert response.status_code == 200, response.text
    body = response.json()
    assert "result" in body, body
    return body["result"]  # type: ignore[no-any-return]


def text_of(read: dict[str, Any]) -> str:
    return str(read["contents"][0]["text"])


async def test_a_modern_client_is_served_the_upstreams_tools_prompts_and_resources(http: httpx.AsyncClient) -> None:
    discovered = await result(http, "k-acme", "server/discover")
    assert {"tools", "prompts", "completions", "resources"} <= set(discovered["capabilities"])
    tools = await result(http, "k-acme", "tools/list")
    assert {tool["name"] for tool in tools["tools"]} == {"set_note", "slow", "echo_meta"}
    called = await result(http, "k-acme", "tools/call", {"name": "set_note", "arguments": {"id": "m1", "text": "hi"}},
                          name="set_note")
    assert called["isError"] is False
    assert text_of(await result(http, "k-acme", "resources/read", {"uri": "note://m1"}, name="note://m1")) == "hi"
    listed = await result(http, "k-acme", "resources/list")
    assert "note://m1" in {item["uri"] for item in listed["resources"]}
    templates = await result(http, "k-acme", "resources/templates/list")
    assert "note://{id}" in {item["uriTemplate"] for item in templates["resourceTemplates"]}
    prompt = await result(http, "k-acme", "prompts/get", {"name": "greet", "arguments": {"name": "Ada"}}, name="greet")
    assert "Ada" in json.dumps(prompt["messages"])
    completed = await result(http, "k-acme", "completion/complete", {
        "ref": {"type": "ref/prompt", "name": "greet"}, "argument": {"name": "name", "value": "Al"}})
    assert set(completed["completion"]["values"]) == {"Alan", "Alonzo"}


async def test_a_2025_client_reaches_a_2025_upstream_on_its_own_session_there(
        http: httpx.AsyncClient, upstreams: dict[str, UpstreamProcess]) -> None:
    session = await McpSession(http, auth="k-globex").initialize()
    init = (await session.post({"jsonrpc": "2.0", "id": 99, "method": "ping"})).json()
    assert init["result"] == {}
    tools = await session.result("tools/list")
    assert {tool["name"] for tool in tools["tools"]} == {"old_set_note", "old_slow", "old_echo_meta"}
    before = len(upstreams["old"].stats()["requests"])
    for text in ("first", "second", "third"):
        called = await session.result("tools/call", {"name": "old_set_note", "arguments": {"id": "g1", "text": text}})
        assert called["isError"] is False
    read = await session.result("resources/read", {"uri": "note://g1"})
    assert text_of(read) == "third"
    # The three calls went on one session at the upstream, the client's own, kept in its record.
    calls = upstreams["old"].stats()["requests"][before:]
    assert len({r["headers"].get("mcp-session-id") for r in calls if r["method"] == "POST"} - {None}) <= 2


async def test_a_subscriber_of_an_upstream_note_hears_a_tool_call_change_it(http: httpx.AsyncClient) -> None:
    session = await McpSession(http, auth="k-acme").initialize()
    await session.subscribe("note://s1")
    async with session.stream() as stream:
        called = await session.result("tools/call", {"name": "set_note", "arguments": {"id": "s1", "text": "new"}})
        assert called["isError"] is False
        while True:  # the watch taking the note on may say `updated` first (the gap rule): read until new
            event = await stream.next_message(timeout=15)
            assert event.method == UPDATED and event.uri == "note://s1", event.message
            if text_of(await session.result("resources/read", {"uri": "note://s1"})) == "new":
                break


async def test_a_listen_on_an_upstream_note_hears_it_change(http: httpx.AsyncClient,
                                                           upstreams: dict[str, UpstreamProcess]) -> None:
    async with modern.listen(http, ["note://l1"], auth="k-acme") as stream:
        ack = await stream.next()
        assert ack is not None and ack["method"] == "notifications/subscriptions/acknowledged"
        async with asyncio.timeout(15):
            while "note://l1" not in upstreams["notes"].stats()["listening"]:
                await asyncio.sleep(0.05)  # the one watch has taken the note on
        await result(http, "k-acme", "tools/call", {"name": "set_note", "arguments": {"id": "l1", "text": "x"}},
                     name="set_note")
        while True:
            note = await stream.next(timeout=15)
            assert note is not None and note["method"] == UPDATED and note["params"]["uri"] == "note://l1"
            if text_of(await result(http, "k-acme", "resources/read", {"uri": "note://l1"}, name="note://l1")) == "x":
                break


async def test_progress_of_a_forwarded_call_reaches_its_caller(http: httpx.AsyncClient) -> None:
    body = modern.request("tools/call", {"name": "slow", "arguments": {"seconds": 0.5}})
    body["params"]["_meta"]["progressToken"] = "p-1"
    async with http.stream("POST", "/mcp", content=orjson.dumps(body),
                           headers=modern.headers("tools/call", "slow", auth="k-acme")) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        stream = modern.ListenStream(response)
        progress = []
        while (message := await stream.next()) is not None and "method" in message:
            assert message["method"] == "notifications/progress" and message["params"]["progressToken"] == "p-1"
            progress.append(message["params"]["progress"])
        assert message is not None and message["result"]["isError"] is False
    assert progress and progress == sorted(progress)


async def test_the_client_credential_never_reaches_an_upstream(http: httpx.AsyncClient,
                                                                upstreams: dict[str, UpstreamProcess]) -> None:
    await result(http, "k-acme", "tools/list")
    session = await McpSession(http, auth="k-globex").initialize()
    await session.result("tools/list")
    for upstream in upstreams.values():
        seen = json.dumps(upstream.stats()["requests"])
        assert "k-acme" not in seen and "k-globex" not in seen
    headers = [r["headers"] for r in upstreams["notes"].stats()["requests"]
               if r["headers"].get("mcp-method") == "tools/list"]
    assert headers and all(h.get("authorization") == "Bearer broker-secret" for h in headers)


async def test_the_caller_is_named_to_an_upstream_only_as_configured(http: httpx.AsyncClient) -> None:
    body = modern.request("tools/call", {"name": "echo_meta", "arguments": {}})
    body["params"]["_meta"]["mcp-broker/caller"] = {"tenant": "someone-else"}
    response = await http.post("/mcp", content=orjson.dumps(body),
                               headers=modern.headers("tools/call", "echo_meta", auth="k-acme"))
    echoed = json.loads(response.json()["result"]["content"][0]["text"])
    assert echoed["mcp-broker/caller"] == {"tenant": "acme"}


async def test_a_tenant_sees_only_its_upstreams(http: httpx.AsyncClient) -> None:
    assert (await result(http, "k-umbrella", "tools/list"))["tools"] == []
    assert (await result(http, "k-umbrella", "prompts/list"))["prompts"] == []
    missing = await rpc(http, "k-umbrella", "tools/call", {"name": "set_note", "arguments": {}}, name="set_note")
    assert missing.json()["error"]["code"] == -32602
    unknown = await rpc(http, "k-umbrella", "resources/read", {"uri": "note://1"}, name="note://1")
    assert unknown.json()["error"]["code"] == -32602  # not found: the note is acme's upstream's
    listed = await result(http, "k-umbrella", "resources/list")
    assert not any(item["uri"].startswith("note://") for item in listed["resources"])
    discovered = await result(http, "k-umbrella", "server/discover")
    assert "tools" not in discovered["capabilities"]


async def test_a_dead_upstream_is_a_502_naming_it_and_the_rest_keeps_working(http: httpx.AsyncClient) -> None:
    response = await rpc(http, "k-initech", "resources/read", {"uri": "dead://1"}, name="dead://1")
    assert response.status_code == 502, response.text
    error = response.json()["error"]
    assert error["code"] == -31004 and error["data"]["upstream"] == "dead" and "dead" in error["message"]
    put = await http.put("/collections/notes/r1", json={"a": 1}, headers={"Authorization": "Bearer k-initech"})
    assert put.status_code in (200, 201), put.text
    own = await result(http, "k-initech", "resources/read", {"uri": "mcpb://initech/notes/r1"},
                       name="mcpb://initech/notes/r1")
    assert json.loads(text_of(own)) == {"a": 1}
    assert (await http.get("/readyz")).status_code == 200


async def test_a_slow_upstream_is_a_504_and_the_call_is_cancelled_there(
        http: httpx.AsyncClient, upstreams: dict[str, UpstreamProcess]) -> None:
    response = await rpc(http, "k-acme", "tools/call", {"name": "slow", "arguments": {"seconds": 30}}, name="slow")
    assert response.status_code == 504, response.text
    error = response.json()["error"]
    assert error["code"] == -31005 and error["data"]["upstream"] == "notes"
    async with asyncio.timeout(10):
        while not upstreams["notes"].stats()["cancelled"]:
            await asyncio.sleep(0.05)


def test_a_bad_map_stops_the_broker_with_one_line() -> None:
    bad = {"a": {"url": "http://x/mcp", "prefixes": ["note://"]}, "b": {"url": "http://y/mcp", "prefixes": ["note:"]}}
    done = subprocess.run([str(BIN), "serve", "--port", str(free_port())], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "MCP_BROKER_UPSTREAMS": json.dumps(bad)})
    assert done.returncode == 2
    [line] = done.stderr.strip().splitlines()
    assert "MCP_BROKER_UPSTREAMS: upstream 'b': its prefix 'note:' overlaps 'note://'" in line


def test_mcp_broker_upstreams_shows_each_upstream_and_who_watches_it(
        broker: BrokerProcess, upstreams: dict[str, UpstreamProcess]) -> None:
    asked = subprocess.run([str(BIN), "upstreams", "--url", broker.url, "--key", "k-acme", "--json"],
                           capture_output=True, text=True, timeout=60)
    assert asked.returncode == 2 and "console:read" in asked.stderr  # a tenant's key is no operator's
    config = {"notes": {"url": upstreams["notes"].url + "/mcp", "auth": {"type": "bearer", "token_env": "NOTES"}},
              "gone": {"url": f"http://127.0.0.1:{free_port()}/mcp", "prefixes": ["gone://"]}}
    probed = subprocess.run([str(BIN), "upstreams"], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "MCP_BROKER_UPSTREAMS": json.dumps(config), "NOTES": "broker-secret"})
    assert probed.returncode == 0, probed.stderr
    rows = {line.split()[0]: line for line in probed.stdout.splitlines()[1:]}
    assert "modern" in rows["notes"] and "ready" in rows["notes"] and "note://" in rows["notes"]
    assert "unreachable" in rows["gone"]


async def test_the_console_names_the_worker_holding_a_watch(http: httpx.AsyncClient, broker: BrokerProcess) -> None:
    session = await McpSession(http, auth="k-acme").initialize()
    await session.subscribe("note://console")
    asked = await asyncio.to_thread(subprocess.run, [str(BIN), "upstreams", "--url", broker.url, "--json"],
                                    capture_output=True, text=True, timeout=60,
                                    env={**os.environ, "MCP_BROKER_KEY": "k-ops"})
    assert asked.returncode == 0, asked.stderr
    rows = {row["name"]: row for row in json.loads(asked.stdout)}
    assert rows["notes"]["era"] == "modern" and rows["notes"]["state"] == "ready"
    assert rows["notes"]["wanted"] >= 1 and rows["notes"]["watch_holder"].startswith("upstream-notes-")
    assert rows["dead"]["state"] in ("unknown", "unreachable") and rows["dead"]["prefixes"] == ["dead://"]


async def test_the_sdk_client_over_stdio_calls_the_upstreams_tools_with_progress(
        upstreams: dict[str, UpstreamProcess]) -> None:
    config = {"notes": {"url": upstreams["notes"].url + "/mcp", "auth": {"type": "bearer", "token_env": "NOTES"}}}
    params = StdioServerParameters(command=str(BIN), args=["--log-level", "warning", "stdio"],
                                   env={"MCP_BROKER_UPSTREAMS": json.dumps(config), "NOTES": "broker-secret"})
    for mode in ("legacy", "2026-07-28"):
        progress: list[float] = []

        async def on_progress(value: float, total: float | None, message: str | None,
                              progress: list[float] = progress) -> None:
            progress.append(value)

        async with Client(params, mode=mode, read_timeout_seconds=15) as client:
            assert {tool.name for tool in (await client.list_tools()).tools} == {"set_note", "slow", "echo_meta"}
            done = await client.call_tool("set_note", {"id": "stdio", "text": mode})
            assert not done.is_error
            read = await client.read_resource("note://stdio")
            assert read.contents[0].text == mode  # type: ignore[union-attr]
            slow = await client.call_tool("slow", {"seconds": 0.3}, progress_callback=on_progress)
            assert not slow.is_error and progress and progress == sorted(progress), (mode, progress)


async def test_a_merged_list_pages_through_the_brokers_own_then_the_upstreams(
        upstreams: dict[str, UpstreamProcess]) -> None:
    config = {"notes": {"url": upstreams["notes"].url + "/mcp", "auth": {"type": "bearer", "token_env": "NOTES"}}}
    env = {"MCP_BROKER_UPSTREAMS": json.dumps(config), "NOTES": "broker-secret", "MCP_BROKER_PAGE_SIZE": "2"}
    with BrokerProcess(env=env) as proc:
        async with httpx.AsyncClient(base_url=proc.url, timeout=15) as client:
            for index in range(3):
                assert (await client.put(f"/collections/paged/r{index}", json={"i": index})).status_code == 201
            seen: list[str] = []
            cursor: str | None = None
            for _ in range(20):
                body = await modern.call(client, "resources/list", {} if cursor is None else {"cursor": cursor})
                page = body.json()["result"]
                seen += [item["uri"] for item in page["resources"]]
                cursor = page.get("nextCursor")
                if cursor is None:
                    break
            upstream_notes = {f"note://{key}" for key in upstreams["notes"].stats()["notes"]}
            assert len(seen) == len(set(seen))
            assert {f"mcpb://default/paged/r{index}" for index in range(3)} | upstream_notes <= set(seen)
            own = [i for i, uri in enumerate(seen) if uri.startswith("mcpb://")]
            assert max(own) < min(i for i, uri in enumerate(seen) if uri.startswith("note://"))
            metrics = (await client.get("/metrics")).text
            assert 'mcp_broker_upstream_requests_total{method="resources/list",upstream="notes"}' in metrics


async def test_a_2025_clients_cancel_ends_its_forwarded_call_and_reaches_the_upstream(
        http: httpx.AsyncClient, upstreams: dict[str, UpstreamProcess]) -> None:
    session = await McpSession(http, auth="k-acme").initialize()
    def slow_calls() -> int:
        return sum(r["headers"].get("mcp-name") == "slow" for r in upstreams["notes"].stats()["requests"])

    before, calls = len(upstreams["notes"].stats()["cancelled"]), slow_calls()
    body = {"jsonrpc": "2.0", "id": "long-1", "method": "tools/call",
            "params": {"name": "slow", "arguments": {"seconds": 30}}}
    call = asyncio.create_task(session.post(body))
    async with asyncio.timeout(10):  # the call reached the upstream
        while slow_calls() == calls:
            await asyncio.sleep(0.05)
    cancel = {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": "long-1"}}
    assert (await session.post(cancel)).status_code == 202
    answer = (await asyncio.wait_for(call, 10)).json()
    assert answer["id"] == "long-1" and answer["error"]["code"] == -32800
    async with asyncio.timeout(10):
        while len(upstreams["notes"].stats()["cancelled"]) == before:
            await asyncio.sleep(0.05)


async def test_an_upstream_that_forgot_the_clients_session_gets_a_new_one_unseen() -> None:
    upstream = UpstreamProcess("--era", "legacy")
    try:
        config = {"old": {"url": upstream.url + "/mcp", "prefixes": ["note://"]}}
        with BrokerProcess(env={"MCP_BROKER_UPSTREAMS": json.dumps(config)}) as proc:
            async with httpx.AsyncClient(base_url=proc.url, timeout=15) as client:
                session = await McpSession(client).initialize()
                first = await session.result("tools/call", {"name": "set_note", "arguments": {"id": "f", "text": "1"}})
                assert first["isError"] is False
                upstream.stop()  # it restarts knowing no session
                upstream = UpstreamProcess.on_port(upstream.port, "--era", "legacy")
                again = await session.result("tools/call", {"name": "set_note", "arguments": {"id": "f", "text": "2"}})
                assert again["isError"] is False
                assert text_of(await session.result("resources/read", {"uri": "note://f"})) == "2"
    finally:
        upstream.stop()


async def test_past_an_upstreams_max_watches_a_subscription_is_refused(upstreams: dict[str, UpstreamProcess]) -> None:
    config = {"notes": {"url": upstreams["notes"].url + "/mcp", "prefixes": ["note://"], "max_watches": 2,
                        "auth": {"type": "bearer", "token_env": "NOTES"}}}
    with BrokerProcess(env={"MCP_BROKER_UPSTREAMS": json.dumps(config), "NOTES": "broker-secret"}) as proc:
        async with httpx.AsyncClient(base_url=proc.url, timeout=15) as client:
            session = await McpSession(client).initialize()
            await session.subscribe("note://w1", "note://w2", "note://w1")
            refused = await session.call("resources/subscribe", {"uri": "note://w3"})
            assert refused["error"]["code"] == -32602 and refused["error"]["data"]["upstream"] == "notes"
            assert "max_watches" in refused["error"]["message"]
            await session.subscribe("mcpb://default/own/1")  # the broker's own URIs are no upstream's
            assert await session.result("resources/unsubscribe", {"uri": "note://w3"}) == {}
