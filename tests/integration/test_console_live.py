"""The live console of real ``mcp-broker serve`` processes: the page in a headless Chromium, and
``mcp-broker status --json`` against ``/metrics``.

The browser (Debian's ``chromium``, driven by Playwright through its ``executable_path``) opens
``/console/`` with an operator's key, and the page must load without a console error or an
uncaught exception, then show the figures change as sessions are opened, a stream is held and
changes are published. ``status --json`` is compared with ``/metrics`` on two workers sharing a
Redis, once their figures have settled: both must say the same.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import AsyncExitStack
from typing import Any

import httpx
import pytest

from tests.integration.mcp_http import McpSession, publish
from tests.integration.test_metrics import Samples, scrape, value, wait_for
from tests.support import BIN, BrokerProcess, RedisProcess

KEY = "operator-key-for-the-console"
ENV = {"MCP_BROKER_API_KEYS": json.dumps({KEY: "ops/console"}), "MCP_BROKER_CONSOLE_TENANTS": '["ops"]'}
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
#: What a figure reads once the page has it; a rate above zero.
NUMBER = re.compile(r"^[0-9]+$")
POSITIVE = re.compile(r"^(0\.0*[1-9][0-9]*|[1-9][0-9]*(\.[0-9]+)?)$")
#: How long the page may take to show what happened (it polls every second; a busy machine is slower).
WAIT_MS = 20_000
#: Where the page keeps the key it was given (console.js).
STORED_KEY = "mcp-broker-console-key"


def browser_parts() -> Any:
    """Playwright's async API, or a skip saying what is missing."""
    if not os.path.exists(CHROMIUM):
        pytest.skip("chromium is not installed (Debian's chromium): the console is tested in a real browser")
    return pytest.importorskip("playwright.async_api", reason="playwright is not installed (the dev extra)")


@pytest.fixture(scope="module")
def broker() -> Iterator[BrokerProcess]:
    with BrokerProcess(env=ENV) as proc:
        yield proc


async def test_the_page_loads_cleanly_and_its_figures_follow_the_deployment(broker: BrokerProcess) -> None:
    playwright = browser_parts()
    errors: list[str] = []
    async with playwright.async_playwright() as driver:
        browser = await driver.chromium.launch(executable_path=CHROMIUM)
        try:
            page = await browser.new_page()
            page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
            page.on("pageerror", lambda error: errors.append(str(error)))
            await page.add_init_script(f"sessionStorage.setItem({STORED_KEY!r}, {KEY!r})")
            await page.goto(broker.url + "/console/")
            expect = playwright.expect
            sessions, streams = page.locator("[data-metric=sessions]"), page.locator("[data-metric=streams]")
            await expect(sessions).to_have_text(NUMBER, timeout=WAIT_MS)
            before = int(await sessions.text_content() or "")
            assert await streams.text_content() == "0"
            async with httpx.AsyncClient(base_url=broker.url, timeout=10) as http, AsyncExitStack() as stack:
                opened = [await McpSession(http, auth=KEY).initialize() for _ in range(3)]
                await opened[0].subscribe("https://example.com/console")
                stream = await stack.enter_async_context(opened[0].stream())
                await stream.next_event()  # the priming event: the stream is open
                await expect(sessions).to_have_text(str(before + 3), timeout=WAIT_MS)
                await expect(streams).to_have_text("1", timeout=WAIT_MS)
                for _ in range(10):
                    await publish(http, "https://example.com/console", auth=KEY)
                await expect(page.locator("[data-metric=changes_per_second]")).to_have_text(POSITIVE, timeout=WAIT_MS)
            assert await page.locator("[data-metric=partitions]").text_content() == "1"
            assert await page.locator("#workers tr").count() == 1
            assert await page.locator("#login").is_hidden()
        finally:
            await browser.close()
    assert errors == []


async def test_the_page_asks_for_a_key_and_shows_the_figures_once_given_one(broker: BrokerProcess) -> None:
    playwright = browser_parts()
    async with playwright.async_playwright() as driver:
        browser = await driver.chromium.launch(executable_path=CHROMIUM)
        try:
            page = await browser.new_page()
            failures: list[str] = []
            page.on("pageerror", lambda error: failures.append(str(error)))
            await page.goto(broker.url + "/console/")
            await page.locator("#login").wait_for(state="visible")  # the figures were refused (401)
            await page.locator("#key").fill(KEY)
            await page.locator("#login button").click()
            await playwright.expect(page.locator("[data-metric=sessions]")).to_have_text(NUMBER, timeout=WAIT_MS)
            assert await page.locator("#login").is_hidden()
            assert failures == []
        finally:
            await browser.close()


def status(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN), "status", "--url", url, *args], capture_output=True, text=True, timeout=60,
                          check=False, env={**os.environ, "MCP_BROKER_KEY": KEY})


def state_of(url: str) -> dict[str, Any]:
    done = status(url, "--json")
    assert done.returncode == 0, done.stderr
    found: dict[str, Any] = json.loads(done.stdout)
    return found


def cards_in(state: dict[str, Any]) -> bool:
    """Both workers have written their cards, and every partition is held by one of them."""
    workers = {f"{w['pid']}@{w['host']}" for w in state["workers"]}
    return len(workers) == 2 and all(p["holder"] in workers for p in state["partitions"])


def agree(state: dict[str, Any], samples: Samples) -> dict[str, tuple[Any, float]]:
    """Each figure of ``status`` beside the same figure of ``/metrics``."""
    figures = state["figures"]
    return {
        "sessions": (figures["sessions"], value(samples, "mcp_broker_sessions_open")),
        "streams": (figures["streams"], value(samples, "mcp_broker_streams_open", era="legacy")),
        "listens": (figures["listens"], value(samples, "mcp_broker_streams_open", era="modern")),
        "partitions held": (sum(w["partitions"] for w in state["workers"]),
                            value(samples, "mcp_broker_fanout_leases_held")),
        "lag": (sum(p["lag_entries"] for p in state["partitions"]),
                sum(value(samples, "mcp_broker_changelog_lag_entries", partition=str(p))
                    for p in range(figures["partitions"]))),
    }


async def test_status_says_what_the_metrics_say_on_two_workers() -> None:
    with RedisProcess() as redis, BrokerProcess(env={**ENV, "MCP_BROKER_REDIS_URL": redis.url},
                                                args=["--workers", "2"]) as broker:
        async with httpx.AsyncClient(base_url=broker.url, timeout=10) as http, AsyncExitStack() as stack:
            sessions = [await McpSession(http, auth=KEY).initialize() for _ in range(4)]
            streams = []  # held: a stream no longer referenced is closed by the client
            for session in sessions[:2]:
                await session.subscribe("https://example.com/status")
                streams.append(await stack.enter_async_context(session.stream()))
                await streams[-1].next_event()
            # Settled: the periodic figures of every worker (the session count, the leases) have come in,
            # and each worker's card is as fresh as its gauges.
            await wait_for(lambda: value(scrape(broker.url), "mcp_broker_sessions_open") == 4, "the session count")
            await wait_for(lambda: value(scrape(broker.url), "mcp_broker_fanout_leases_held")
                           == len(state_of(broker.url)["partitions"]), "every partition's lease report")
            await wait_for(lambda: cards_in(state_of(broker.url)), "both workers' cards, every partition in them")
            state, samples = state_of(broker.url), scrape(broker.url)
            pairs = agree(state, samples)
            assert all(ours == theirs for ours, theirs in pairs.values()), pairs
            assert state["figures"]["streams"] == 2 and state["figures"]["sessions"] == 4
            shown = status(broker.url)
            assert shown.returncode == 0, shown.stderr
            assert "sessions (deployment)" in shown.stdout and "workers of this host:" in shown.stdout


def test_status_says_why_it_is_refused(broker: BrokerProcess) -> None:
    without_key = {name: value for name, value in os.environ.items() if name != "MCP_BROKER_KEY"}
    anonymous = subprocess.run([str(BIN), "status", "--url", broker.url], capture_output=True, text=True,
                               timeout=60, check=False, env=without_key)
    assert anonymous.returncode == 2 and "401" in anonymous.stderr and "--key" in anonymous.stderr
    nobody = status("http://127.0.0.1:9", "--json")  # the discard port: nothing listens
    assert nobody.returncode == 75 and "could not be reached" in nobody.stderr
    bad = status("127.0.0.1:8080")  # no scheme
    assert bad.returncode == 2 and "--url" in bad.stderr and "Traceback" not in bad.stderr
