"""The broker in front of MCP servers built with the official TypeScript SDK, one of each of its lines.

* ``tests/upstreams/ts``: ``@modelcontextprotocol/sdk`` (1.x), which speaks the 2025 protocol alone
  (no ``server/discover``, no ``subscriptions/listen``): stateful sessions, one low-level ``Server``
  each. The broker's watch of it is a session of its own, ``resources/subscribe`` and its GET stream.
* ``tests/upstreams/ts-modern``: ``@modelcontextprotocol/server`` (2.x), of 2026-07-28 only:
  stateless, ``createMcpHandler``, whose listen router serves ``subscriptions/listen``. The
  broker's watch of it is one listen.

Clients of both eras reach each through the broker: its tools listed and called, a note subscribed
to (a 2025 ``resources/subscribe``, a 2026-07-28 listen) heard changing after a ``set_note`` that
went through the broker, the new text read; and however many clients subscribe, the server is
asked once for the note, by the one watch.

Each package is installed as its ``package-lock.json`` pins it, with ``npm ci`` into an ignored
folder (``.tooling`` beside it, or under ``TS_UPSTREAM_TOOLING``); again only when the lock changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import json
import os
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration import modern
from tests.integration.mcp_http import McpSession, SSEStream
from tests.integration.test_upstreams import result as modern_result
from tests.integration.test_upstreams import text_of
from tests.support import ROOT, BrokerProcess, free_port, wait_until

# The first run installs the SDK (seconds from npm's cache, longer from the registry).
pytestmark = pytest.mark.timeout(180)

SOURCES = {"ts": ROOT / "tests" / "upstreams" / "ts", "ts-modern": ROOT / "tests" / "upstreams" / "ts-modern"}
KEY = "k-acme"
MODERN_KEY = "k-globex"
OPERATOR = "k-ops"  # a key of an operators' tenant: it reads the console
UPDATED = "notifications/resources/updated"
#: Clients subscribed to one note at once, half of each era.
CROWD = 20


def tooling_of(kind: str) -> Path:
    custom = os.environ.get("TS_UPSTREAM_TOOLING")
    return Path(custom) / kind if custom else SOURCES[kind] / ".tooling"


def install(kind: str) -> Path:
    """``server.mjs`` of ``kind`` beside the SDK its ``package-lock.json`` pins, in its tooling folder; its path.

    ``npm ci`` runs when the installed lock differs from the pinned one (or nothing is installed);
    a file lock keeps two test runs from installing into one folder at once.
    """
    source, tooling = SOURCES[kind], tooling_of(kind)
    npm, node = shutil.which("npm"), shutil.which("node")
    if npm is None or node is None:
        pytest.fail("node and npm are needed for the TypeScript SDK's servers (CI installs Debian's npm)")
    tooling.mkdir(parents=True, exist_ok=True)
    with open(tooling / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        pinned = (source / "package-lock.json").read_bytes()
        installed = tooling / "package-lock.json"
        complete = tooling / "node_modules" / ".package-lock.json"  # written by npm once the install is whole
        if not complete.exists() or not installed.exists() or installed.read_bytes() != pinned:
            for name in ("package.json", "package-lock.json"):
                shutil.copyfile(source / name, tooling / name)
            done = subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--ignore-scripts", "--loglevel=error"],
                                  cwd=tooling, capture_output=True, text=True, timeout=150)
            if done.returncode != 0:
                installed.unlink(missing_ok=True)  # the next run tries again
                pytest.fail(f"npm ci of {source.name}'s packages failed in {tooling}:\n{done.stderr[-3000:]}")
        # Beside its node_modules, where node resolves the SDK from; copied each time, as it may have changed.
        shutil.copyfile(source / "server.mjs", tooling / "server.mjs")
    return tooling / "server.mjs"


class TsUpstream:
    """A ``server.mjs`` under node, on a free loopback port."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        script = install(kind)
        node = shutil.which("node")
        assert node is not None
        self.proc = subprocess.Popen([node, str(script), "--port", str(self.port)], cwd=script.parent,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_until(lambda: httpx.get(self.url + "/healthz", timeout=1).status_code == 200,
                       what=f"the TypeScript upstream {kind} to start")
        except TimeoutError:
            self.stop()
            raise

    def stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = httpx.get(self.url + "/stats", timeout=5).json()
        return stats

    def watching(self, uri: str) -> int:
        """Watches of ``uri`` at the server now: sessions subscribed to it, or open listens asking for it."""
        stats = self.stats()
        if self.kind == "ts":
            return int(stats["subscriptions"].get(uri, 0))
        return int(stats["listening"].count(uri))

    def asked(self, uri: str) -> int:
        """How often ``uri`` was asked to be watched: its ``resources/subscribe`` requests, or the listens naming it."""
        stats = self.stats()
        return int(stats["subscribes" if self.kind == "ts" else "listened"].get(uri, 0))

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


@dataclass(frozen=True)
class Target:
    """An upstream as the broker serves it: its name in the map, and the key of the tenant it is mapped to."""

    name: str
    key: str
    server: TsUpstream


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, TsUpstream]]:
    started: dict[str, TsUpstream] = {}
    try:
        for kind in ("ts", "ts-modern"):
            started[kind] = TsUpstream(kind)
        yield started
    finally:
        for server in started.values():
            server.stop()


@pytest.fixture(scope="module")
def broker(servers: dict[str, TsUpstream]) -> Iterator[BrokerProcess]:
    # One note:// for each tenant; their prefixes learnt from each server's listings. A long grace keeps the
    # notes of earlier tests watched, so that nothing but a test's own subscribers changes what is asked.
    config = {"ts": {"url": servers["ts"].url + "/mcp", "tenants": ["acme"], "watch_grace": 600},
              "ts-modern": {"url": servers["ts-modern"].url + "/mcp", "tenants": ["globex"], "watch_grace": 600}}
    env = {"MCP_BROKER_UPSTREAMS": json.dumps(config),
           "MCP_BROKER_API_KEYS": json.dumps({KEY: "acme/alice", MODERN_KEY: "globex/bob", OPERATOR: "ops/olga"}),
           "MCP_BROKER_CONSOLE_TENANTS": json.dumps(["ops"])}
    with BrokerProcess(env=env) as proc:
        # The prefixes are learnt by each upstream's probe, which the start waits for a few seconds at most:
        # until it is done, the broker does not know that note:// is an upstream's.
        for name in config:
            wait_until(functools.partial(ready, proc, name), what=f"the broker to have probed {name}")
        yield proc


def ready(broker: BrokerProcess, name: str) -> bool:
    """Whether the broker's console shows the upstream ready (as ``mcp-broker upstreams --url`` does)."""
    state = httpx.get(broker.url + "/console/state.json", headers={"Authorization": f"Bearer {OPERATOR}"},
                      timeout=5)
    rows = {row["name"]: row for row in state.json().get("upstreams", [])}
    return name in rows and rows[name]["state"] == "ready"


@pytest.fixture(params=["ts", "ts-modern"])
def target(request: pytest.FixtureRequest, servers: dict[str, TsUpstream]) -> Target:
    name = request.param
    return Target(name, KEY if name == "ts" else MODERN_KEY, servers[name])


@pytest.fixture
async def http(broker: BrokerProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=broker.url, timeout=15) as client:
        yield client


def set_note(key: str, text: str) -> dict[str, Any]:
    return {"name": "set_note", "arguments": {"id": key, "text": text}}


async def watched(server: TsUpstream, uri: str) -> None:
    """Until the broker's one watch covers ``uri`` at the server."""
    async with asyncio.timeout(15):
        while server.watching(uri) == 0:
            await asyncio.sleep(0.05)


async def changes_heard(http: httpx.AsyncClient, upstream: str) -> float:
    """``mcp_broker_upstream_changes_total`` of ``upstream``: the ``updated`` notifications its watch received."""
    text = (await http.get("/metrics")).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == "mcp_broker_upstream_changes_total" and sample.labels.get("upstream") == upstream)


async def updated_legacy(stream: SSEStream, uri: str) -> None:
    event = await stream.next_message(timeout=15)
    assert event.method == UPDATED and event.uri == uri, event.message


async def updated_modern(stream: modern.ListenStream, uri: str) -> None:
    note = await stream.next(timeout=15)
    assert note is not None and note["method"] == UPDATED and note["params"]["uri"] == uri, note


async def read_legacy(session: McpSession, uri: str) -> str:
    return text_of(await session.result("resources/read", {"uri": uri}))


async def read_modern(http: httpx.AsyncClient, key: str, uri: str) -> str:
    return text_of(await modern_result(http, key, "resources/read", {"uri": uri}, name=uri))


# Each test changes a note the server was started with: a new note would also change the resource list,
# and the `list_changed` that follows would reach the 2025 sessions of whichever test runs then.


async def test_a_2025_client_calls_a_typescript_upstream_and_hears_its_note_change(
        http: httpx.AsyncClient, target: Target) -> None:
    uri = "note://1"
    session = await McpSession(http, auth=target.key).initialize()
    tools = await session.result("tools/list")
    assert [tool["name"] for tool in tools["tools"]] == ["set_note"]
    called = await session.result("tools/call", set_note("1", "first"))
    assert not called.get("isError") and called["content"][0]["text"] == "note://1 set"
    assert await read_legacy(session, uri) == "first"
    listed = await session.result("resources/list")
    assert {"note://1", "note://2", "note://3"} <= {item["uri"] for item in listed["resources"]}
    templates = await session.result("resources/templates/list")
    assert "note://{id}" in {item["uriTemplate"] for item in templates["resourceTemplates"]}

    await session.subscribe(uri)
    async with session.stream() as stream:
        # The watch taking the note on says `updated` by the gap rule: the subscriber came before it.
        await watched(target.server, uri)
        await updated_legacy(stream, uri)
        assert await read_legacy(session, uri) == "first"
        # Then the server's own notification, after a change made through the broker.
        await session.result("tools/call", set_note("1", "second"))
        await updated_legacy(stream, uri)
        assert await read_legacy(session, uri) == "second"
    assert target.server.stats()["notes"]["1"] == "second"


async def test_a_2026_client_calls_a_typescript_upstream_and_hears_its_note_change(
        http: httpx.AsyncClient, target: Target) -> None:
    uri = "note://2"
    tools = await modern_result(http, target.key, "tools/list")
    assert [tool["name"] for tool in tools["tools"]] == ["set_note"]
    await modern_result(http, target.key, "tools/call", set_note("2", "first"), name="set_note")
    assert await read_modern(http, target.key, uri) == "first"

    async with modern.listen(http, [uri], auth=target.key) as stream:
        ack = await stream.next()
        assert ack is not None and ack["method"] == "notifications/subscriptions/acknowledged"
        await watched(target.server, uri)
        await updated_modern(stream, uri)  # the gap rule's, as the watch took the note on
        assert await read_modern(http, target.key, uri) == "first"
        await modern_result(http, target.key, "tools/call", set_note("2", "second"), name="set_note")
        await updated_modern(stream, uri)
        assert await read_modern(http, target.key, uri) == "second"
    assert target.server.stats()["notes"]["2"] == "second"


async def test_many_subscribers_of_one_note_are_one_watch_at_the_upstream(
        http: httpx.AsyncClient, target: Target) -> None:
    uri, key = "note://3", target.key
    async with contextlib.AsyncExitStack() as stack:
        legacy: list[tuple[McpSession, SSEStream]] = []
        for _ in range(CROWD // 2):
            session = await McpSession(http, auth=key).initialize()
            await session.subscribe(uri)
            legacy.append((session, await stack.enter_async_context(session.stream())))
        listens: list[modern.ListenStream] = []
        for index in range(CROWD - CROWD // 2):
            stream = await stack.enter_async_context(modern.listen(http, [uri], id_=f"crowd-{index}", auth=key))
            ack = await stream.next()
            assert ack is not None and ack["method"] == "notifications/subscriptions/acknowledged"
            listens.append(stream)
        await watched(target.server, uri)
        assert target.server.watching(uri) == 1
        assert target.server.asked(uri) == 1
        heard = await changes_heard(http, target.name)

        await modern_result(http, key, "tools/call", set_note("3", "after"), name="set_note")

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
                if await read_modern(http, key, uri) == "after":
                    return

        async with asyncio.TaskGroup() as hearing:
            for session, events in legacy:
                hearing.create_task(legacy_hears(session, events))
            for listen in listens:
                hearing.create_task(modern_hears(listen))
        # Each of the twenty heard it, from one notification of the server on the one watch.
        async with asyncio.timeout(15):
            while await changes_heard(http, target.name) == heard:
                await asyncio.sleep(0.05)
        assert await changes_heard(http, target.name) == heard + 1
        assert target.server.watching(uri) == 1
        assert target.server.asked(uri) == 1
