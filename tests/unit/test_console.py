"""The live console in-process: who may read its figures, what they count, and that they stay cheap and bounded.

A broker on the memory backend, its app over ``httpx.ASGITransport``: the figures of
``/console/state.json`` follow the sessions a client opens; with authentication off they are
answered to loopback names only, with it on to a credential holding ``console:read`` only; a
state is computed at most once a second however often it is asked for; the workers of one host
meet through their cards; the tenants shown are bounded. The page in a real browser, and
``mcp-broker status`` against ``/metrics``, are in ``tests/integration/test_console_live.py``.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from importlib import resources
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from broker.auth import Principal
from broker.backends.types import DeadLetter, WebhookRecord
from broker.config import Settings
from broker.feeds.model import FeedKind, Filter
from broker.ops.console import FAILING_SHOWN, FIGURES, TOP_TENANTS, WEBHOOK_SCAN, WEBHOOK_SECONDS, Console
from broker.quotas import Lease
from broker.runtime import Broker
from broker.runtime.app import create_app

TENANT_KEY = "a-static-key-of-tenant-acme"
STATIC_KEY = "console-test-key"
INIT = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
        "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}
MCP_HEADERS = {"accept": "application/json, text/event-stream", "content-type": "application/json"}


@pytest.fixture
async def broker(request: pytest.FixtureRequest) -> AsyncIterator[Broker]:
    extra: dict[str, Any] = getattr(request, "param", {})
    running = Broker(Settings(_env_file=None, **extra))  # type: ignore[call-arg]
    await running.start()
    yield running
    await running.stop()


def client(broker: Broker, host: str = "127.0.0.1:8080", peer: str = "127.0.0.1", **headers: str) -> httpx.AsyncClient:
    """A client of ``broker``'s app naming ``host``, from the address ``peer``."""
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(broker=broker), client=(peer, 50000)),
                             base_url=f"http://{host}", headers=headers)


async def figures(http: httpx.AsyncClient) -> dict[str, Any]:
    answer = await http.get("/console/state.json")
    assert answer.status_code == 200, answer.text
    found: dict[str, Any] = answer.json()["figures"]
    return found


async def test_the_figures_count_the_sessions_a_client_opens(broker: Broker) -> None:
    async with client(broker) as http:
        before = await figures(http)
        assert set(before) == set(FIGURES)
        assert before["workers"] == 1 and before["partitions"] == 1 and before["streams"] == 0
        for _ in range(3):
            answer = await http.post("/mcp", json=INIT, headers=MCP_HEADERS)
            assert answer.status_code == 200
        # A feed of another kind (an events poll subscription) is not a session.
        await broker.feeds.create(Principal("default", "anonymous"), FeedKind.POLL, Filter.of(["mcpb://default/c/1"]))
        broker.console._state = None  # the next request computes anew, as it would a second later
        assert (await figures(http))["sessions"] == before["sessions"] + 3


async def test_the_page_and_its_files_are_served_with_every_live_figure_named() -> None:
    page = resources.files("broker.ops.console").joinpath("index.html").read_text()
    for name in ("sessions", "streams", "listens", "changes_per_second", "partitions"):
        assert f'data-metric="{name}"' in page
    running = Broker(Settings(_env_file=None))  # type: ignore[call-arg]
    await running.start()
    try:
        async with client(running) as http:
            answer = await http.get("/console/")
            assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/html")
            assert "frame-ancestors 'none'" in answer.headers["content-security-policy"]
            assert (await http.get("/console/console.js")).headers["content-type"].startswith("text/javascript")
            assert (await http.get("/console/console.css")).status_code == 200
            moved = await http.get("/console")
            assert moved.status_code == 308 and moved.headers["location"] == "console/"
            assert (await http.post("/console/state.json")).status_code == 405
    finally:
        await running.stop()
    described = create_app(Settings(_env_file=None, docs=True)).api.openapi()  # type: ignore[call-arg]
    assert {"/console/", "/console/console.js", "/console/state.json"} <= set(described["paths"])
    assert "console:read" in described["paths"]["/console/state.json"]["get"]["summary"]


@pytest.mark.parametrize("broker", [{"allowed_hosts": ["*"]}], indirect=True)
@pytest.mark.parametrize("host", ["broker.example", "10.0.0.5:8080", "localhost.example"])
async def test_with_authentication_off_only_loopback_names_are_answered(broker: Broker, host: str) -> None:
    async with client(broker, host) as http:
        for path in ("/console/state.json", "/console/"):
            refused = await http.get(path)
            assert refused.status_code == 403
            assert "loopback" in refused.json()["detail"]
    for loopback in ("localhost:8080", "127.0.0.1", "[::1]:8080"):
        async with client(broker, loopback) as http:
            assert (await http.get("/console/state.json")).status_code == 200


@pytest.mark.parametrize("broker", [{"allowed_hosts": ["*"], "host": "0.0.0.0"}], indirect=True)
async def test_with_authentication_off_a_loopback_name_from_elsewhere_is_refused(broker: Broker) -> None:
    # Any client can send "Host: localhost": from another machine, or relayed by a proxy on this one.
    async with client(broker, "localhost:8080", peer="192.0.2.7") as http:
        assert (await http.get("/console/state.json")).status_code == 403
    for forwarded in ({"X-Forwarded-For": "192.0.2.7"}, {"Forwarded": "for=192.0.2.7"}):
        async with client(broker, "localhost:8080", **forwarded) as http:
            assert (await http.get("/console/state.json")).status_code == 403
    async with client(broker, "localhost:8080", peer="::1") as http:
        assert (await http.get("/console/state.json")).status_code == 200


@pytest.mark.parametrize("broker", [{"allowed_hosts": ["*"], "host": "0.0.0.0"}], indirect=True)
@pytest.mark.parametrize("header", ["Via", "X-Forwarded-Host", "X-Forwarded-Proto", "X-Forwarded-Port"])
async def test_with_authentication_off_any_proxys_header_marks_a_request_relayed(broker: Broker, header: str) -> None:
    value = {"Via": "1.1 proxy", "X-Forwarded-Host": "broker.example", "X-Forwarded-Proto": "https",
             "X-Forwarded-Port": "443"}[header]
    async with client(broker, "127.0.0.1:8080", **{header: value}) as http:
        assert (await http.get("/console/state.json")).status_code == 403
        assert (await http.get("/console/")).status_code == 403


@pytest.mark.parametrize("broker", [{"allowed_hosts": ["*"], "host": "::"}], indirect=True)
async def test_with_authentication_off_a_dual_stack_loopback_peer_is_this_machine(broker: Broker) -> None:
    async with client(broker, "127.0.0.1:8080", peer="::ffff:127.0.0.1") as http:
        assert (await http.get("/console/state.json")).status_code == 200
    async with client(broker, "127.0.0.1:8080", peer="::ffff:192.0.2.7") as http:
        assert (await http.get("/console/state.json")).status_code == 403


@pytest.mark.parametrize("broker", [{"api_keys": {STATIC_KEY: "ops/alice", TENANT_KEY: "acme/carol"},
                                     "console_tenants": ["ops"], "allowed_hosts": ["*"]}], indirect=True)
async def test_with_authentication_on_the_figures_need_the_console_scope(broker: Broker) -> None:
    assert broker.keys is not None
    plain = await broker.keys.create("acme", "bob")  # the data scopes only, as every key by default
    operator = await broker.keys.create("ops", "carol", ["console:read"])
    # The scope alone, from a tenant not in MCP_BROKER_CONSOLE_TENANTS (as an OAuth token asking for it may have).
    foreign = await broker.keys.create("acme", "mallory", ["console:read"])
    async with client(broker, "broker.example", peer="192.0.2.7") as http:
        # The page holds no figure: served to a browser, which cannot send a token when it opens it.
        assert (await http.get("/console/")).status_code == 200
        assert (await http.get("/console/state.json")).status_code == 401
        # Every tenant's figures are an operator's: not a tenant's key, stored or static.
        for key in (plain.key, TENANT_KEY):
            refused = await http.get("/console/state.json", headers={"Authorization": f"Bearer {key}"})
            assert refused.status_code == 403
            assert 'scope="console:read"' in refused.headers["www-authenticate"]
        refused = await http.get("/console/state.json", headers={"Authorization": f"Bearer {foreign.key}"})
        assert refused.status_code == 403 and "MCP_BROKER_CONSOLE_TENANTS" in refused.json()["detail"]
        for key in (operator.key, STATIC_KEY):  # a static key of MCP_BROKER_CONSOLE_TENANTS holds the scope
            answer = await http.get("/console/state.json", headers={"Authorization": f"Bearer {key}"})
            assert answer.status_code == 200 and set(answer.json()["figures"]) == set(FIGURES)


@pytest.mark.parametrize("broker", [{"demo": True}], indirect=True)
async def test_partitions_and_exclusive_sources_are_shown_with_their_holders(broker: Broker) -> None:
    here = f"{broker.console.pid}@{broker.console.host}"

    async def held_here() -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 10
        while True:
            broker.console._state = None
            state = await broker.console.state()
            if state["partitions"][0]["holder"] == here and state["sources"][0]["holders"] == [here]:
                return state
            assert loop.time() < deadline, state
            await asyncio.sleep(0.02)  # the fan-out's first read, the source's first lease

    state = await held_here()
    assert state["sources"] == [{"name": "demo", "exclusive": True, "holders": [here]}]
    assert state["workers"][0]["partitions"] == 1 and state["workers"][0]["sources"] == ["demo"]
    # A holder that is no worker of this host (a consumer of another pod) is named as it is.
    assert broker.fanout is not None
    broker.console.consumer = lambda: "a-consumer-of-this-worker-no-more"
    broker.console._state = None
    assert (await broker.console.state())["partitions"][0]["holder"] == broker.fanout.name


class CountingSessions:
    """A session store that counts how often it is counted."""

    def __init__(self) -> None:
        self.counted = 0

    async def count_sessions(self) -> int:
        self.counted += 1
        return 7


class NoWebhooks:
    """A webhook store holding ``records`` and ``letters``, counting how often it is scanned."""

    def __init__(self, records: list[WebhookRecord] | None = None, letters: list[DeadLetter] | None = None) -> None:
        self.records = records or []
        self.letters = letters or []
        self.scans = 0

    async def page(self, after: str, limit: int) -> list[WebhookRecord]:
        self.scans += 1
        return self.records[:limit]

    async def dead_letters(self, limit: int) -> list[DeadLetter]:
        return self.letters[:limit]


def webhook(n: int, failing: bool) -> WebhookRecord:
    return WebhookRecord(id=f"w{n:04d}", tenant=f"t{n % 3}", principal="p", name="resource_changed", arguments={},
                         url="https://hooks.example/x", secret="s", session="s", epoch="e", offset=0,
                         expires_at=2e9, created_at=1e9, last_error="http_5xx" if failing else None,
                         failed_since=1e9 + n if failing else None)


def console(broker: Broker, clock: list[float], cards_dir: Path | None = None,
            sessions: CountingSessions | None = None, webhooks: NoWebhooks | None = None) -> Console:
    return Console(streams=broker.streams, quotas=broker.quotas, publisher=broker.publisher,
                   changelog=broker.backend.changelog, sessions=sessions or CountingSessions(),  # type: ignore[arg-type]
                   webhooks=webhooks or NoWebhooks(), leases=broker.backend.leases,  # type: ignore[arg-type]
                   runners=[], consumer=lambda: None,
                   cards_dir=None if cards_dir is None else str(cards_dir), clock=lambda: clock[0])


async def test_a_state_is_computed_at_most_once_a_second_however_often_it_is_asked_for(broker: Broker) -> None:
    clock = [1000.0]
    sessions = CountingSessions()
    watched = console(broker, clock, sessions=sessions)
    first = await watched.state()
    for _ in range(50):
        assert await watched.state() is first
    clock[0] += 0.999
    assert await watched.state() is first and sessions.counted == 1
    clock[0] += 0.001
    assert await watched.state() is not first and sessions.counted == 2


async def test_the_workers_of_a_host_meet_through_their_cards_and_a_silent_one_drops_out(
        broker: Broker, tmp_path: Path) -> None:
    clock = [1000.0]
    mine = console(broker, clock, tmp_path)
    other = console(broker, clock, tmp_path)
    other._write(other.card())  # the other worker's last card
    assert (await mine.state())["figures"]["workers"] == 2
    clock[0] += 10  # the other worker was killed: its card is no longer renewed
    mine._state = None
    assert (await mine.state())["figures"]["workers"] == 1
    other.close()
    assert [path.name for path in tmp_path.iterdir()] == []  # only the other wrote a card; it took it away


async def test_the_rate_is_of_the_last_seconds_once_the_changes_stop(broker: Broker) -> None:
    clock = [1000.0]
    watched = console(broker, clock)
    start = broker.publisher.accepted
    for second in range(1, 6):  # ten changes a second, sampled each second (as ``run`` does)
        broker.publisher.accepted = start + 10 * second
        clock[0] += 1
        rate = watched.card()["changes_per_second"]
    assert rate == 10.0
    for _ in range(7):  # the changes stop: the rate falls to nothing within the window
        clock[0] += 1
        rate = watched.card()["changes_per_second"]
    assert rate == 0.0


async def test_the_tenants_shown_are_the_busiest_and_bounded(broker: Broker) -> None:
    for n in range(TOP_TENANTS * 3):
        for i in range(n % 5 + 1):
            broker.quotas.held[Lease(f"t{n:03d}", "streams", f"h{i}")] = 1
    state = await console(broker, [1000.0]).state()
    tenants = state["tenants"]
    assert len(tenants) == TOP_TENANTS
    # The busiest first: the twelve tenants with five streams, then eight of those with four.
    assert [row["streams"][0] for row in tenants] == [5] * 12 + [4] * 8
    assert len(orjson.dumps(state)) < 16_384
    broker.quotas.held.clear()


async def test_failing_webhooks_and_dead_letters_are_shown_bounded_and_scanned_every_few_seconds(
        broker: Broker) -> None:
    records = [webhook(n, failing=n % 2 == 0) for n in range(WEBHOOK_SCAN + 10)]
    letters = [DeadLetter("w0000", "t0", "https://hooks.example/x", f"e{n}", "{}", 5, "timeout", 1e9 + n)
               for n in range(30)]
    store = NoWebhooks(records, letters)
    clock = [1000.0]
    watched = console(broker, clock, webhooks=store)
    state = await watched.state()
    assert state["figures"]["webhooks"] == WEBHOOK_SCAN and not state["webhooks"]["complete"]
    assert state["figures"]["webhooks_failing"] == WEBHOOK_SCAN // 2 and state["figures"]["dead_letters"] == 30
    assert [f["id"] for f in state["webhooks"]["failing"]][:2] == ["w0000", "w0002"]  # failing longest first
    assert len(state["webhooks"]["failing"]) == FAILING_SHOWN and len(state["webhooks"]["dead_letters"]) == 5
    assert "https://hooks.example/x" not in orjson.dumps(state).decode()  # an endpoint's URL may hold a secret
    clock[0] += 1
    await watched.state()
    assert store.scans == 1  # the scan is reused for WEBHOOK_SECONDS
    clock[0] += WEBHOOK_SECONDS
    await watched.state()
    assert store.scans == 2


def test_the_cards_directory_is_the_metrics_directory_of_the_workers(monkeypatch: pytest.MonkeyPatch,
                                                                     tmp_path: Path) -> None:
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    assert Broker(Settings(_env_file=None)).console._card_path.parent == tmp_path  # type: ignore[call-arg,union-attr]
    assert os.environ["PROMETHEUS_MULTIPROC_DIR"] == str(tmp_path)


@pytest.mark.parametrize("broker", [{"api_keys": {STATIC_KEY: "ops/alice"}, "allowed_hosts": ["*"]}], indirect=True)
async def test_with_authentication_on_and_no_console_tenants_no_credential_sees_the_figures(broker: Broker) -> None:
    assert broker.keys is not None
    operator = await broker.keys.create("ops", "carol", ["console:read"])
    async with client(broker) as http:
        for key in (operator.key, STATIC_KEY):
            answer = await http.get("/console/state.json", headers={"Authorization": f"Bearer {key}"})
            assert answer.status_code == 403
