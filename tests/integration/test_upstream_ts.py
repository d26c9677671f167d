"""The broker in front of an MCP server built with the official TypeScript SDK (``tests/upstreams/ts``).

The server speaks the 2025 protocol (the SDK has no ``server/discover`` and no
``subscriptions/listen``), so the broker's watch of it is a session of its own with
``resources/subscribe`` and the session's GET stream. Clients of both eras reach it through the
broker: its tools listed and called, a note subscribed to (a 2025 ``resources/subscribe``, a
2026-07-28 listen) heard changing after a ``set_note`` that went through the broker, the new text
read; and however many clients subscribe, the server holds one subscription per note.

The SDK is installed as ``package-lock.json`` pins it, with ``npm ci`` into an ignored folder
(``tests/upstreams/ts/.tooling``, or ``TS_UPSTREAM_TOOLING``); again only when the lock changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration import modern
from tests.integration.mcp_http import McpSession, SSEStream
from tests.support import ROOT, BrokerProcess, free_port, wait_until

# The first run installs the SDK (seconds from npm's cache, longer from the registry).
pytestmark = pytest.mark.timeout(180)

SOURCE = ROOT / "tests" / "upstreams" / "ts"
TOOLING = Path(os.environ.get("TS_UPSTREAM_TOOLING", SOURCE / ".tooling"))
KEY = "k-acme"
OPERATOR = "k-ops"  # a key of an operators' tenant: it reads the console
UPDATED = "notifications/resources/updated"
#: Clients subscribed to one note at once, half of each era.
CROWD = 20


def install_sdk(tooling: Path = TOOLING) -> Path:
    """``server.mjs`` beside the SDK that ``package-lock.json`` pins, in ``tooling``; its path.

    ``npm ci`` runs when the installed lock differs from the pinned one (or nothing is installed);
    a file lock keeps two test runs from installing into one folder at once.
    """
    npm, node = shutil.which("npm"), shutil.which("node")
    if npm is None or node is None:
        pytest.fail("node and npm are needed for the TypeScript SDK's server (CI installs Debian's npm)")
    tooling.mkdir(parents=True, exist_ok=True)
    with open(tooling / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        pinned = (SOURCE / "package-lock.json").read_bytes()
        installed = tooling / "package-lock.json"
        sdk = tooling / "node_modules" / "@modelcontextprotocol" / "sdk" / "package.json"
        if not sdk.exists() or not installed.exists() or installed.read_bytes() != pinned:
            for name in ("package.json", "package-lock.json"):
                shutil.copyfile(SOURCE / name, tooling / name)
            done = subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--ignore-scripts", "--loglevel=error"],
                                  cwd=tooling, capture_output=True, text=True, timeout=150)
            if done.returncode != 0:
                installed.unlink(missing_ok=True)  # the next run tries again
                pytest.fail(f"npm ci of the TypeScript SDK failed in {tooling}:\n{done.stderr[-3000:]}")
        # Beside its node_modules, where node resolves the SDK from; copied each time, as it may have changed.
        shutil.copyfile(SOURCE / "server.mjs", tooling / "server.mjs")
    return tooling / "server.mjs"


class TsUpstream:
    """``server.mjs`` under node, on a free loopback port."""

    def __init__(self, script: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        node = shutil.which("node")
        assert node is not None
        self.proc = subprocess.Popen([node, str(script), "--port", str(self.port)], cwd=script.parent,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_until(lambda: httpx.get(self.url + "/healthz", timeout=1).status_code == 200,
                       what="the TypeScript upstream to start")
        except TimeoutError:
            self.stop()
            raise

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = httpx.get(self.url + "/stats", timeout=5).json()
        return stats

    def subscriptions(self, uri: str) -> int:
        """The sessions subscribed to ``uri`` at the upstream now."""
        return int(self.stats()["subscriptions"].get(uri, 0))

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture(scope="module")
def upstream() -> Iterator[TsUpstream]:
    server = TsUpstream(install_sdk())
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def broker(upstream: TsUpstream) -> Iterator[BrokerProcess]:
    config = {"ts": {"url": upstream.url + "/mcp", "tenants": ["acme"]}}  # its prefixes learnt: note://
    env = {"MCP_BROKER_UPSTREAMS": json.dumps(config),
           "MCP_BROKER_API_KEYS": json.dumps({KEY: "acme/alice", OPERATOR: "ops/olga"}),
           "MCP_BROKER_CONSOLE_TENANTS": json.dumps(["ops"])}
    with BrokerProcess(env=env) as proc:
        # Its prefixes are learnt by the probe the broker starts in the background: until it is done, the
        # broker does not know that note:// is the upstream's.
        wait_until(lambda: upstream_state(proc) == "ready", what="the broker to have probed the upstream")
        yield proc


def upstream_state(broker: BrokerProcess) -> str:
    """The upstream's state as the broker's console shows it (``mcp-broker upstreams --url``)."""
    state = httpx.get(broker.url + "/console/state.json", headers={"Authorization": f"Bearer {OPERATOR}"},
                      timeout=5)
    rows = {row["name"]: row for row in state.json().get("upstreams", [])}
    return str(rows["ts"]["state"]) if "ts" in rows else "absent"


@pytest.fixture
async def http(broker: BrokerProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=broker.url, timeout=15) as client:
        yield client


async def modern_result(http: httpx.AsyncClient, method: str, params: dict[str, Any] | None = None,
                        name: str | None = None) -> dict[str, Any]:
    response = await modern.call(http, method, params, name=name, auth=KEY)
    assert response.status_code == 200, response.text
    body = response.json()
    assert "result" in body, body
    return body["result"]  # type: ignore[no-any-return]


def text_of(read: dict[str, Any]) -> str:
    return str(read["contents"][0]["text"])


def set_note(key: str, text: str) -> dict[str, Any]:
    return {"name": "set_note", "arguments": {"id": key, "text": text}}


async def watched(upstream: TsUpstream, uri: str) -> None:
    """Until the broker's one watch has subscribed to ``uri`` at the upstream."""
    async with asyncio.timeout(15):
        while upstream.subscriptions(uri) == 0:
            await asyncio.sleep(0.05)


async def changes_heard(http: httpx.AsyncClient) -> float:
    """``mcp_broker_upstream_changes_total`` of the upstream: its ``updated`` notifications the watch received."""
    text = (await http.get("/metrics")).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "mcp_broker_upstream_changes_total" and sample.labels.get("upstream") == "ts")


async def updated_legacy(stream: SSEStream, uri: str) -> None:
    event = await stream.next_message(timeout=15)
    assert event.method == UPDATED and event.uri == uri, event.message


async def updated_modern(stream: modern.ListenStream, uri: str) -> None:
    note = await stream.next(timeout=15)
    assert note is not None and note["method"] == UPDATED and note["params"]["uri"] == uri, note


async def read_legacy(session: McpSession, uri: str) -> str:
    return text_of(await session.result("resources/read", {"uri": uri}))


async def read_modern(http: httpx.AsyncClient, uri: str) -> str:
    return text_of(await modern_result(http, "resources/read", {"uri": uri}, name=uri))


async def test_a_2025_client_calls_the_typescript_upstream_and_hears_its_note_change(
        http: httpx.AsyncClient, upstream: TsUpstream) -> None:
    uri = "note://legacy"
    session = await McpSession(http, auth=KEY).initialize()
    tools = await session.result("tools/list")
    assert [tool["name"] for tool in tools["tools"]] == ["set_note"]
    called = await session.result("tools/call", set_note("legacy", "first"))
    assert not called.get("isError") and called["content"][0]["text"] == "note://legacy set"
    assert await read_legacy(session, uri) == "first"
    listed = await session.result("resources/list")
    assert {"note://1", "note://2", uri} <= {item["uri"] for item in listed["resources"]}
    templates = await session.result("resources/templates/list")
    assert "note://{id}" in {item["uriTemplate"] for item in templates["resourceTemplates"]}

    await session.subscribe(uri)
    async with session.stream() as stream:
        # The watch taking the note on says `updated` by the gap rule: the subscriber came before it.
        await watched(upstream, uri)
        await updated_legacy(stream, uri)
        assert await read_legacy(session, uri) == "first"
        # Then the upstream's own notification, after a change made through the broker.
        await session.result("tools/call", set_note("legacy", "second"))
        await updated_legacy(stream, uri)
        assert await read_legacy(session, uri) == "second"
    assert upstream.stats()["notes"]["legacy"] == "second"


async def test_a_2026_client_calls_the_typescript_upstream_and_hears_its_note_change(
        http: httpx.AsyncClient, upstream: TsUpstream) -> None:
    uri = "note://modern"
    tools = await modern_result(http, "tools/list")
    assert [tool["name"] for tool in tools["tools"]] == ["set_note"]
    await modern_result(http, "tools/call", set_note("modern", "first"), name="set_note")
    assert await read_modern(http, uri) == "first"

    async with modern.listen(http, [uri], auth=KEY) as stream:
        ack = await stream.next()
        assert ack is not None and ack["method"] == "notifications/subscriptions/acknowledged"
        await watched(upstream, uri)
        await updated_modern(stream, uri)  # the gap rule's, as the watch took the note on
        assert await read_modern(http, uri) == "first"
        await modern_result(http, "tools/call", set_note("modern", "second"), name="set_note")
        await updated_modern(stream, uri)
        assert await read_modern(http, uri) == "second"
    assert upstream.stats()["notes"]["modern"] == "second"


async def test_many_subscribers_of_one_note_are_one_subscription_at_the_upstream(
        http: httpx.AsyncClient, upstream: TsUpstream) -> None:
    uri = "note://crowd"
    await modern_result(http, "tools/call", set_note("crowd", "before"), name="set_note")
    async with contextlib.AsyncExitStack() as stack:
        legacy: list[tuple[McpSession, SSEStream]] = []
        for _ in range(CROWD // 2):
            session = await McpSession(http, auth=KEY).initialize()
            await session.subscribe(uri)
            legacy.append((session, await stack.enter_async_context(session.stream())))
        listens: list[modern.ListenStream] = []
        for index in range(CROWD - CROWD // 2):
            stream = await stack.enter_async_context(modern.listen(http, [uri], id_=f"crowd-{index}", auth=KEY))
            ack = await stream.next()
            assert ack is not None and ack["method"] == "notifications/subscriptions/acknowledged"
            listens.append(stream)
        await watched(upstream, uri)
        assert upstream.subscriptions(uri) == 1
        heard = await changes_heard(http)

        await modern_result(http, "tools/call", set_note("crowd", "after"), name="set_note")

        async def legacy_hears(session: McpSession, events: SSEStream) -> None:
            # An `updated` of the gap rule may come first, for those that subscribed before the watch took
            # the note on: read after each until the new text.
            while True:
                await updated_legacy(events, uri)
                if await read_legacy(session, uri) == "after":
                    return

        async def modern_hears(listen: modern.ListenStream) -> None:
            while True:
                await updated_modern(listen, uri)
                if await read_modern(http, uri) == "after":
                    return

        async with asyncio.TaskGroup() as hearing:
            for session, events in legacy:
                hearing.create_task(legacy_hears(session, events))
            for listen in listens:
                hearing.create_task(modern_hears(listen))
        # Each of the twenty heard it, from one notification of the upstream on the one watch.
        async with asyncio.timeout(15):
            while await changes_heard(http) == heard:
                await asyncio.sleep(0.05)
        assert await changes_heard(http) == heard + 1
        assert upstream.subscriptions(uri) == 1
        assert upstream.stats()["subscribes"][uri] == 1
