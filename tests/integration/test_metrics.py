"""``GET /metrics``: the Prometheus exposition of a real ``mcp-broker serve`` (memory backend), and the
bound on per-tenant labels.

Counters are compared before and after known traffic, so the figures are exact: N changes
published, each delivered to a known number of streams before the next is published (no batch
coalesces), and the answers counted by route and status.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import AsyncExitStack

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from broker.metrics import CATALOG, OTHER_TENANTS, TenantCounter, TenantLabels
from broker.ops.prometheus import PrometheusMetrics
from examples.counting_metrics import CountingMetrics
from tests.integration.mcp_http import McpSession, SSEStream, publish
from tests.support import BrokerProcess

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse(text: str) -> Samples:
    """Every sample of an exposition, by name and labels."""
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def scrape(url: str) -> Samples:
    answer = httpx.get(url + "/metrics", timeout=10)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"].startswith("text/plain; version=0.0.4")  # what every Prometheus reads
    return parse(answer.text)


async def open_streams(http: httpx.AsyncClient, stack: AsyncExitStack, uri: str, count: int) -> list[SSEStream]:
    """``count`` sessions subscribed to ``uri``, each with its GET stream open (past its priming event)."""
    opened = []
    for _ in range(count):
        mcp = await McpSession(http).initialize()
        await mcp.subscribe(uri)
        opened.append(await stack.enter_async_context(mcp.stream()))
    for stream in opened:
        await stream.next_event()  # the priming event: the stream is live
    return opened


async def wait_for(check: object, what: str, timeout: float = 10.0) -> None:
    """Poll a figure another process reports periodically (no fixed sleep)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not check():  # type: ignore[operator]
        if loop.time() > deadline:
            raise AssertionError(f"waited {timeout}s in vain for {what}")
        await asyncio.sleep(0.05)


@pytest.fixture(scope="module")
def broker() -> Iterator[BrokerProcess]:
    with BrokerProcess(env={"MCP_BROKER_METRICS_TENANT_LIMIT": "0"}) as proc:
        yield proc


async def test_a_scrape_counts_publishes_fanout_notifications_and_answers_exactly(broker: BrokerProcess) -> None:
    changes, streams, uri = 5, 3, "https://example.com/metrics-a"
    before = scrape(broker.url)
    async with httpx.AsyncClient(base_url=broker.url, timeout=10) as http, AsyncExitStack() as stack:
        opened = await open_streams(http, stack, uri, streams)
        for _ in range(changes):
            await publish(http, uri)
            for stream in opened:
                assert (await stream.next_message()).uri == uri
        # A list change reaches every session of the tenant: one more frame per stream, of the other kind.
        await publish(http, "https://example.com/metrics-new", kind="created")
        for stream in opened:
            assert (await stream.next_message()).method == "notifications/resources/list_changed"
        after = scrape(broker.url)
        assert value(after, "mcp_broker_streams_open", era="legacy") == streams
        await wait_for(lambda: value(scrape(broker.url), "mcp_broker_sessions_open") >= streams,
                       "the periodic session count")

    def grew(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert grew("mcp_broker_changes_published_total", source="http") == changes + 1
    assert grew("mcp_broker_fanout_changes_total") == changes + 1
    assert grew("mcp_broker_fanout_frames_total") == (changes + 1) * streams
    assert grew("mcp_broker_notifications_sent_total", era="legacy", kind="updated") == changes * streams
    assert grew("mcp_broker_notifications_sent_total", era="legacy", kind="list_changed") == streams
    assert grew("mcp_broker_http_answers_total", route="changes", status="202") == changes + 1
    assert grew("mcp_broker_http_answers_total", route="mcp", status="200") >= streams * 3  # initialize, sub, GET
    # The scrape before this one was counted (when its answer started), this one is not yet.
    assert grew("mcp_broker_http_answers_total", route="metrics", status="200") == 1
    # Tenants carry no names by default: every tenant counts as "other".
    assert grew("mcp_broker_tenant_publishes_total", tenant=OTHER_TENANTS) == changes + 1
    assert grew("mcp_broker_tenant_sessions_created_total", tenant=OTHER_TENANTS) == streams
    assert grew("mcp_broker_tenant_subscriptions_total", tenant=OTHER_TENANTS) == streams
    assert grew("mcp_broker_tenant_frames_total", tenant=OTHER_TENANTS) == (changes + 1) * streams
    assert not any(labels and ("tenant", "default") in labels for _, labels in after)
    # Sampled, and the first write batch always is.
    assert value(after, "mcp_broker_publish_to_frame_seconds_count", era="legacy") >= 1
    # Acknowledged changes leave the memory log.
    assert grew("mcp_broker_changelog_trimmed_total") == changes + 1


async def test_every_catalog_instrument_is_exposed_from_the_start(broker: BrokerProcess) -> None:
    names = {family.name for family in text_string_to_metric_families(httpx.get(broker.url + "/metrics").text)}
    for name in CATALOG:
        assert name.removesuffix("_total") in names, name


async def test_a_scrape_shows_the_process_and_python_runtime_of_the_worker(broker: BrokerProcess) -> None:
    samples = scrape(broker.url)
    assert value(samples, "process_resident_memory_bytes") > 10_000_000  # a Python worker holds more than 10 MB
    assert value(samples, "process_open_fds") > 0
    assert value(samples, "process_max_fds") >= value(samples, "process_open_fds")
    assert value(samples, "process_cpu_seconds_total") > 0
    assert value(samples, "python_gc_collections_total", generation="0") > 0
    assert any(name == "python_info" for name, _ in samples)


async def test_every_mcp_request_is_timed_by_method_as_the_mcp_conventions_name_it(broker: BrokerProcess) -> None:
    before = scrape(broker.url)
    async with httpx.AsyncClient(base_url=broker.url, timeout=10) as http:
        mcp = await McpSession(http).initialize()
        await mcp.subscribe("https://example.com/timed")
        for _ in range(3):
            await mcp.result("ping")
    after = scrape(broker.url)

    def grew(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert grew("mcp_server_operation_duration_seconds_count", mcp_method_name="ping") == 3
    assert grew("mcp_server_operation_duration_seconds_count", mcp_method_name="resources/subscribe") == 1
    assert grew("mcp_server_operation_duration_seconds_count", mcp_method_name="initialize") == 1
    # The buckets the conventions advise, from 10 ms to 5 minutes: a ping answers within the first.
    assert grew("mcp_server_operation_duration_seconds_bucket", mcp_method_name="ping", le="0.01") == 3
    assert grew("mcp_server_operation_duration_seconds_bucket", mcp_method_name="ping", le="300.0") == 3


async def test_the_fanout_holder_reports_its_lease_and_an_empty_lag(broker: BrokerProcess) -> None:
    await wait_for(lambda: value(scrape(broker.url), "mcp_broker_fanout_leases_held") == 1, "the lease report")
    samples = scrape(broker.url)
    assert value(samples, "mcp_broker_changelog_lag_entries", partition="0") == 0


def test_metrics_can_be_turned_off() -> None:
    with BrokerProcess(env={"MCP_BROKER_METRICS": "false"}) as broker:
        assert httpx.get(broker.url + "/metrics").status_code == 404


# -- the tenant-label bound -----------------------------------------------------------------------
def test_the_first_tenants_up_to_the_limit_keep_their_labels_and_the_rest_are_other() -> None:
    labels = TenantLabels(2)
    assert [labels(t) for t in ("acme", "beta", "gamma", "acme", "delta", "beta")] == [
        "acme", "beta", OTHER_TENANTS, "acme", OTHER_TENANTS, "beta"]
    assert labels("gamma") == OTHER_TENANTS  # later tenants never get a name, however often they come


def test_a_limit_of_zero_names_no_tenant() -> None:
    labels = TenantLabels(0)
    assert {labels(t) for t in ("acme", "beta", "default")} == {OTHER_TENANTS}


def test_per_tenant_counters_share_one_bound_and_count_every_tenant() -> None:
    metrics = CountingMetrics()
    labels = TenantLabels(1)
    frames = TenantCounter(metrics, "mcp_broker_tenant_frames_total", labels)
    publishes = TenantCounter(metrics, "mcp_broker_tenant_publishes_total", labels)
    publishes.inc("beta")  # beta comes first, in any counter: it keeps its label in all of them
    frames.inc("acme", 3)
    frames.inc("beta", 2)
    frames.inc("gamma")
    assert metrics.get("mcp_broker_tenant_frames_total", tenant="beta") == 2
    assert metrics.get("mcp_broker_tenant_frames_total", tenant=OTHER_TENANTS) == 4
    assert metrics.get("mcp_broker_tenant_frames_total", tenant="acme") == 0
    assert metrics.get("mcp_broker_tenant_publishes_total", tenant="beta") == 1


def test_the_prometheus_binding_exposes_bounded_tenant_series() -> None:
    metrics = PrometheusMetrics()
    counter = TenantCounter(metrics, "mcp_broker_tenant_sessions_created_total", TenantLabels(2))
    for i in range(50):
        counter.inc(f"tenant{i}")
    samples = parse(metrics.render()[0].decode())
    series = {dict(labels)["tenant"]: v for (name, labels), v in samples.items()
              if name == "mcp_broker_tenant_sessions_created_total"}
    assert series == {"tenant0": 1, "tenant1": 1, OTHER_TENANTS: 48}


def test_the_prometheus_binding_refuses_a_name_of_another_kind_and_caches_children() -> None:
    metrics = PrometheusMetrics()
    assert metrics.counter("mcp_broker_gap_resyncs_total", era="legacy") is metrics.counter(
        "mcp_broker_gap_resyncs_total", era="legacy")
    with pytest.raises(ValueError, match="is a counter"):
        metrics.gauge("mcp_broker_gap_resyncs_total", era="legacy")
    with pytest.raises(KeyError):
        metrics.counter("mcp_broker_no_such_total")
