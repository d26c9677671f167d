"""One trace across workers: a change published with a ``traceparent`` on one ``serve`` process is
fanned out by whichever holds its partition and delivered by another, and every step is a span of
the publisher's trace, exported over OTLP/HTTP to a receiver the test runs."""

from __future__ import annotations

import asyncio
import secrets

import httpx
import pytest

from tests.distributed.conftest import WORKER_ENV
from tests.integration.mcp_http import McpSession
from tests.otlp_receiver import OtlpReceiver, ReceivedSpan
from tests.support import BrokerProcess, RedisProcess

SERVER, CLIENT, PRODUCER, CONSUMER = 2, 3, 4, 5  # OTLP span kinds


async def spans_of(receiver: OtlpReceiver, trace_id: str, *names: str) -> dict[str, ReceivedSpan]:
    """The first span of each name in the trace, once all of them were exported."""
    async with asyncio.timeout(20):
        while True:
            found = {span.name: span for span in reversed(receiver.of_trace(trace_id))}
            if all(name in found for name in names):
                return found
            await asyncio.sleep(0.05)


@pytest.mark.timeout(90)
async def test_a_change_published_with_a_trace_context_is_one_trace_from_publish_to_delivery_on_another_worker(
        ) -> None:
    receiver = OtlpReceiver().start()
    uri = "https://example.com/traced"
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    try:
        with RedisProcess() as redis:
            env = {**WORKER_ENV, "MCP_BROKER_REDIS_URL": redis.url, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
                   "OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_SERVICE_NAME": "broker-under-test"}
            publishing, streaming = BrokerProcess(env=env), BrokerProcess(env=env)
            try:
                async with httpx.AsyncClient(base_url=streaming.url, timeout=10) as b, \
                        httpx.AsyncClient(base_url=publishing.url, timeout=10) as a:
                    mcp = await McpSession(b).initialize()
                    await mcp.subscribe(uri)
                    async with mcp.stream() as stream:
                        await stream.next_event()
                        response = await a.post("/changes", json={"uri": uri, "meta": {"version": 7}},
                                                headers={"traceparent": f"00-{trace_id}-{parent_id}-01"})
                        assert response.status_code == 202, response.text
                        notification = (await stream.next_message()).message
                meta = notification["params"]["_meta"]
                assert meta["version"] == 7  # the producer's own meta is kept beside the trace context
                assert meta["traceparent"].split("-")[1] == trace_id

                found = await spans_of(receiver, trace_id, "publish", "fanout", "notifications/resources/updated")
                publish, fanout = found["publish"], found["fanout"]
                delivery = found["notifications/resources/updated"]
                # One chain: the producer's span -> publish -> fan-out -> the notification's delivery.
                assert publish.parent_span_id == parent_id
                assert fanout.parent_span_id == publish.span_id
                assert delivery.parent_span_id == fanout.span_id
                assert meta["traceparent"].split("-")[2] == fanout.span_id
                assert (publish.kind, fanout.kind, delivery.kind) == (PRODUCER, CONSUMER, CLIENT)
                # Across processes: published on one worker, delivered by the other.
                assert publish.pid == publishing.proc.pid
                assert delivery.pid == streaming.proc.pid
                assert {publish.service, fanout.service, delivery.service} == {"broker-under-test"}
                assert publish.attributes["mcp.resource.uri"] == uri
                assert delivery.attributes["mcp.method.name"] == "notifications/resources/updated"
                assert delivery.attributes["mcp.session.id"] == mcp.id
                assert delivery.attributes["mcp.resource.uri"] == uri
                # The session's own requests are server spans of the MCP conventions.
                subscribe = [span for span in receiver.spans if span.name == "resources/subscribe"]
                assert subscribe and subscribe[0].kind == SERVER
                assert subscribe[0].attributes["mcp.resource.uri"] == uri
                assert set(receiver.paths) == {"/v1/traces"}
            finally:
                publishing.kill()
                streaming.kill()
    finally:
        receiver.stop()
