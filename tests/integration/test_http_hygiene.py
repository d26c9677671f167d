"""HTTP hygiene: quiet logs for clients that leave, a health probe that tells nothing about tenants,
headers that keep answers out of caches and MIME sniffing, and no redirect built from ``Host``."""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest

from tests.integration.mcp_http import McpSession, publish
from tests.support import BrokerProcess

pytestmark = pytest.mark.timeout(60)

ABANDONED = [
    b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    b"Accept: application/json, text/event-stream\r\nContent-Length: 1000\r\n\r\n{\"jsonrpc\": ",
    b"POST /changes HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000\r\n\r\n[{\"uri\": ",
    b"PUT /collections/c/r HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000\r\n\r\n{\"a\": ",
    b"POST /changes HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n[{\"ur\r\n",
]


def test_a_client_that_leaves_in_the_middle_of_its_body_leaves_no_traceback_in_the_log() -> None:
    broker = BrokerProcess()
    try:
        for _ in range(5):
            for request in ABANDONED:
                with socket.create_connection(("127.0.0.1", broker.port), timeout=10) as sock:
                    sock.sendall(request)
        assert httpx.get(broker.url + "/healthz", timeout=10).status_code == 200
        # A graceful stop waits for every request task, so whatever they log is in by then
        # (uvicorn then re-raises the SIGTERM it caught).
        assert broker.terminate() in (0, -15)
        assert broker.proc.stderr is not None
        log = broker.proc.stderr.read().decode()
    finally:
        broker.kill()
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-3000:]


async def test_the_health_probe_shows_no_count_that_follows_what_tenants_publish(http: httpx.AsyncClient) -> None:
    before = (await http.get("/healthz")).json()
    await publish(http, *[f"https://example.com/health/{i}" for i in range(20)])
    mcp = await McpSession(http).initialize()
    await mcp.subscribe("https://example.com/health/0")
    await publish(http, "https://example.com/health/0")
    after = (await http.get("/healthz")).json()
    assert set(after) <= {"status", "streams", "listens"}, after
    assert after == before


def assert_safe(response: httpx.Response) -> None:
    assert response.headers.get("x-content-type-options") == "nosniff", (response.status_code, response.headers)
    assert "no-store" in response.headers.get("cache-control", ""), (response.status_code, response.headers)


async def test_every_json_answer_is_neither_sniffed_nor_stored(http: httpx.AsyncClient) -> None:
    mcp = McpSession(http)
    answers = [
        await mcp.post({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}}),
        await mcp.post({"jsonrpc": "2.0", "id": 1, "method": "ping"}, Accept="text/html"),  # 406
        await http.post("/changes", json={"uri": "https://example.com/h"}),  # 202
        await http.get("/changes"),  # 405
        await http.post("/changes", content=b"{"),  # 400
        await http.put("/collections/c/r", json={"a": 1}),
        await http.get("/collections/c/r"),
        await http.get("/collections"),
        await http.get("/collections/c", params={"limit": 0}),  # 422
        await http.get("/collections/c/missing"),  # 404
        await http.get("/nowhere"),  # 404
        await http.delete("/healthz"),  # 405
        await http.get("/healthz"),
        await http.get("/healthz", headers={"Host": "evil.example"}),  # 421
    ]
    assert {r.status_code for r in answers} >= {200, 201, 202, 400, 404, 405, 406, 421, 422}
    for response in answers:
        assert_safe(response)


async def test_the_event_stream_is_neither_sniffed_nor_stored(http: httpx.AsyncClient) -> None:
    mcp = await McpSession(http).initialize()
    async with mcp.stream() as stream:
        assert_safe(stream.response)
        await asyncio.wait_for(stream.response.aclose(), 10)


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost:1"])
async def test_a_trailing_slash_is_not_found_rather_than_redirected(http: httpx.AsyncClient, host: str) -> None:
    for path in ("/collections/", "/healthz/", "/collections/c/"):
        response = await http.get(path, headers={"Host": host})
        assert response.status_code == 404 and "location" not in response.headers, (path, response.headers)
