"""Input a client sends is bounded and checked at the door: a 2xx means deliverable, and what the
broker keeps for a client (meta, client info, filters, URIs, records) has a size it can name."""

from __future__ import annotations

import os
import secrets
import subprocess
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import orjson
import pytest

from tests.integration.mcp_http import McpSession
from tests.integration.modern import call, listen
from tests.support import BIN, BrokerProcess, RedisProcess

KEYS = '{"ka": "a/alice", "kb": "b/bob"}'
#: A small filter bound, so a listen can pass it with URIs that each pass the URI bound.
FILTER_BYTES = 4096


def nested(depth: int, leaf: bytes = b"1") -> bytes:
    """A JSON object nested ``depth`` levels deep (built as bytes: encoders stop at 255)."""
    return b'{"a":' * depth + leaf + b"}" * depth


def uri() -> str:
    return f"https://example.com/{secrets.token_hex(4)}"


@pytest.fixture(scope="module", params=["memory", "redis"])
def limits_broker(request: pytest.FixtureRequest) -> Iterator[BrokerProcess]:
    """Tenants a and b behind API keys, on each backend."""
    env = {"MCP_BROKER_API_KEYS": KEYS, "MCP_BROKER_MAX_LISTEN_FILTER_BYTES": str(FILTER_BYTES)}
    if request.param == "memory":
        with BrokerProcess(env=env) as proc:
            yield proc
        return
    with RedisProcess() as redis, BrokerProcess(env={**env, "MCP_BROKER_REDIS_URL": redis.url}) as proc:
        yield proc


@pytest.fixture
async def http(limits_broker: BrokerProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=limits_broker.url, timeout=10,
                                 headers={"Authorization": "Bearer ka"}) as client:
        yield client


async def post_change(http: httpx.AsyncClient, body: bytes | Any, key: str = "ka") -> httpx.Response:
    content = body if isinstance(body, bytes) else orjson.dumps(body)
    return await http.post("/changes", content=content,
                           headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})


# -- a 2xx means deliverable -------------------------------------------------------------------
async def test_a_meta_fan_out_cannot_encode_is_refused_and_costs_no_other_tenant(http: httpx.AsyncClient) -> None:
    a_uri, b_uri = uri(), uri()
    watcher_a = await McpSession(http, auth="ka").initialize()
    watcher_b = await McpSession(http, auth="kb").initialize()
    await watcher_a.subscribe(a_uri)
    await watcher_b.subscribe(b_uri)
    b_meta = {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
              "deep": orjson.loads(nested(15))}  # within the bounds
    async with watcher_b.stream() as stream:
        a_answer = await post_change(http, b'{"uri":"' + a_uri.encode() + b'","meta":' + nested(300) + b"}")
        assert (await post_change(http, {"uri": b_uri, "meta": b_meta}, key="kb")).status_code == 202
        # The bound. On main tenant a's change was accepted, and fan-out retried the batch
        # holding it for 30 s before anything newer, tenant b's change included.
        event = await stream.next_message(timeout=1.0)
    assert event.message["params"] == {"uri": b_uri, "_meta": b_meta}
    assert a_answer.status_code == 422, a_answer.text
    assert "nested deeper than 16 levels" in a_answer.json()["detail"]


@pytest.mark.parametrize(("meta", "detail"), [
    ({"pad": "x" * 9000}, "more than the limit of 8192 bytes"),
    ({"io.modelcontextprotocol/subscriptionId": "forged"}, "reserved"),
    ({"com.mcp/anything": 1}, "reserved"),
    ({"progressToken": 1}, "reserved"),
])
async def test_a_meta_the_broker_cannot_carry_is_422(http: httpx.AsyncClient, meta: Any, detail: str) -> None:
    response = await post_change(http, {"uri": uri(), "meta": meta})
    assert response.status_code == 422, response.text
    assert detail in response.json()["detail"]


@pytest.mark.parametrize("kind", [["updated"], {"k": 1}])
async def test_a_kind_that_is_not_a_string_is_422(http: httpx.AsyncClient, kind: Any) -> None:
    response = await post_change(http, {"uri": uri(), "kind": kind})
    assert response.status_code == 422, response.text
    assert "kind must be one of" in response.json()["detail"]


async def test_one_refused_change_refuses_the_whole_request_and_names_it(http: httpx.AsyncClient) -> None:
    response = await post_change(http, [{"uri": uri()}, {"uri": uri(), "kind": ["x"]}])
    assert response.status_code == 422
    assert response.json()["detail"].startswith("change 1: ")


# -- URIs: one namespace per tenant, one spelling per URI ----------------------------------------
async def test_publishing_into_another_tenants_namespace_is_403(http: httpx.AsyncClient) -> None:
    response = await post_change(http, {"uri": "mcpb://b/orders/1"})
    assert response.status_code == 403, response.text
    assert "namespace of tenant 'b'" in response.json()["detail"]
    assert (await post_change(http, {"uri": "mcpb://a/orders/1"})).status_code == 202


@pytest.mark.parametrize("bad", ["MCPB://a/orders/1", "Mcpb://a/orders", "mcpb:a/orders"])
async def test_a_record_uri_spelled_otherwise_is_refused_everywhere(http: httpx.AsyncClient, bad: str) -> None:
    published = await post_change(http, {"uri": bad})
    assert published.status_code == 422 and "scheme in lower case" in published.json()["detail"]
    mcp = await McpSession(http, auth="ka").initialize()
    for method in ("resources/subscribe", "resources/read"):
        reply = await mcp.call(method, {"uri": bad})
        assert reply["error"]["code"] == -32602 and "scheme in lower case" in reply["error"]["message"], reply
    response = await call(http, "subscriptions/listen", {"notifications": {"resourceSubscriptions": [bad]}},
                          auth="ka")
    assert response.json()["error"]["code"] == -32602, response.text


@pytest.mark.parametrize("bad", ["mcpb://a", "mcpb://a/orders/1/extra", "mcpb://a/or%20ders"])
async def test_publishing_to_a_record_uri_that_names_no_record_is_422(http: httpx.AsyncClient, bad: str) -> None:
    response = await post_change(http, {"uri": bad})
    assert response.status_code == 422 and "not a record or collection URI" in response.json()["detail"]


async def test_a_uri_is_bounded_in_bytes_on_every_entry_point(http: httpx.AsyncClient) -> None:
    long = "https://example.com/" + "é" * 1100  # 1120 characters, 2220 bytes: over the 2048 default
    response = await post_change(http, {"uri": long})
    assert response.status_code == 422 and "2048 bytes" in response.json()["detail"]
    mcp = await McpSession(http, auth="ka").initialize()
    for method in ("resources/subscribe", "resources/read"):
        reply = await mcp.call(method, {"uri": long})
        assert reply["error"]["code"] == -32602 and "2048 bytes" in reply["error"]["message"], reply


# -- what a session or a listen keeps ----------------------------------------------------------
async def test_a_large_client_info_is_refused_at_initialize_naming_the_limit(http: httpx.AsyncClient) -> None:
    mcp = McpSession(http, auth="ka")
    response = await mcp.post({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "x" * 100_000, "version": "1"}}})
    reply = response.json()
    assert reply["error"]["code"] == -32602, reply
    assert "more than the limit of 4096 bytes" in reply["error"]["message"]
    assert "mcp-session-id" not in response.headers


async def test_deeply_nested_capabilities_are_refused_at_initialize(http: httpx.AsyncClient) -> None:
    body = (b'{"jsonrpc":"2.0","id":0,"method":"initialize","params":{"protocolVersion":"2025-11-25",'
            b'"clientInfo":{"name":"t","version":"1"},"capabilities":' + nested(300) + b"}}")
    reply = (await McpSession(http, auth="ka").post(body)).json()
    assert reply["error"]["code"] == -32602 and "nested deeper than 16 levels" in reply["error"]["message"], reply


async def test_a_listen_filter_over_its_byte_bound_is_refused(http: httpx.AsyncClient) -> None:
    uris = [uri() + "/" + "p" * 1500 for _ in range(3)]  # each under the URI bound, together over 4096
    response = await call(http, "subscriptions/listen", {"notifications": {"resourceSubscriptions": uris}},
                          auth="ka")
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == -32602 and f"more than the limit of {FILTER_BYTES}" in error["message"]
    async with listen(http, uris[:2], auth="ka") as stream:
        assert (await stream.next()) is not None  # two of them pass: the ack


# -- records -----------------------------------------------------------------------------------
@pytest.mark.parametrize("depth", [65, 300])
async def test_a_record_nested_too_deep_is_422_on_put_and_patch(http: httpx.AsyncClient, depth: int) -> None:
    name = "deep" + secrets.token_hex(4)
    put = await http.put(f"/collections/{name}/1", content=nested(depth))
    assert put.status_code == 422 and "nested deeper than 64 levels" in put.json()["detail"], put.text
    assert (await http.put(f"/collections/{name}/1", content=nested(64))).status_code == 201
    patch = await http.patch(f"/collections/{name}/1", content=nested(depth))
    assert patch.status_code == 422, patch.text
    assert (await http.get(f"/collections/{name}/1")).content == nested(64)


def test_the_cli_refuses_what_post_changes_refuses() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MCP_BROKER_")}  # the memory backend
    for args, detail in [(["MCPB://default/c/1"], "scheme in lower case"),
                         (["x:y", "--meta", nested(40).decode()], "nested deeper than 16 levels"),
                         (["mcpb://other/c/1"], "namespace of tenant 'other'")]:
        done = subprocess.run([str(BIN), "publish", *args], capture_output=True, text=True, timeout=30,
                              env=env, check=False)
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        assert detail in done.stderr and done.stdout == ""


# -- the tenant's record quota -------------------------------------------------------------------
@pytest.fixture(scope="module")
def quota_broker() -> Iterator[BrokerProcess]:
    env = {"MCP_BROKER_API_KEYS": KEYS, "MCP_BROKER_MAX_RECORDS_PER_TENANT": "3",
           "MCP_BROKER_MAX_RECORD_BYTES_PER_TENANT": "1000"}
    with BrokerProcess(env=env) as proc:
        yield proc


async def test_a_tenant_past_its_record_quota_gets_507_and_others_do_not(quota_broker: BrokerProcess) -> None:
    async with httpx.AsyncClient(base_url=quota_broker.url, timeout=10,
                                 headers={"Authorization": "Bearer ka"}) as http:
        for rid in ("1", "2", "3"):
            assert (await http.put(f"/collections/c/{rid}", json={"v": rid})).status_code == 201
        over = await http.put("/collections/other/4", json={})
        assert over.status_code == 507, over.text
        assert over.json()["detail"] == "the tenant's record quota is reached: at most 3 records"
        assert (await http.get("/collections/other/4")).status_code == 404
        assert (await http.put("/collections/c/1", json={"v": "replaced"})).status_code == 200
        assert (await http.put("/collections/c/4", json={}, headers={"Authorization": "Bearer kb"})).status_code == 201
        assert (await http.delete("/collections/c/3")).status_code == 204
        assert (await http.put("/collections/other/4", json={})).status_code == 201


async def test_a_tenant_past_its_record_bytes_gets_507_on_put_and_patch(quota_broker: BrokerProcess) -> None:
    async with httpx.AsyncClient(base_url=quota_broker.url, timeout=10,
                                 headers={"Authorization": "Bearer kb"}) as http:
        await http.delete("/collections/c/4")
        assert (await http.put("/collections/big/1", json={"pad": "x" * 900})).status_code == 201
        over = await http.put("/collections/big/2", json={"pad": "x" * 200})
        assert over.status_code == 507, over.text
        assert over.json()["detail"] == "the tenant's record quota is reached: at most 1000 bytes of records"
        patch = await http.patch("/collections/big/1", json={"more": "y" * 200})
        assert patch.status_code == 507, patch.text
        assert (await http.put("/collections/big/1", json={"pad": "small"})).status_code == 200
        assert (await http.put("/collections/big/2", json={"pad": "x" * 200})).status_code == 201
