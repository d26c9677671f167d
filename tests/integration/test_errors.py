"""Every way to get /mcp wrong gets a precise JSON-RPC or HTTP error, never a 500."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import orjson
import pytest

from tests.integration.mcp_http import ACCEPT_BOTH, McpSession
from tests.support import BrokerProcess

PING = {"jsonrpc": "2.0", "id": 1, "method": "ping"}


@pytest.fixture
async def mcp(http: httpx.AsyncClient) -> McpSession:
    return await McpSession(http).initialize()


def rpc_error(response: httpx.Response, status: int, code: int) -> dict[str, object]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert body["jsonrpc"] == "2.0" and body["error"]["code"] == code, body
    return body  # type: ignore[no-any-return]


# -- JSON-RPC errors ---------------------------------------------------------------------------------


async def test_a_body_that_is_not_json_is_a_parse_error_with_400(mcp: McpSession) -> None:
    body = rpc_error(await mcp.post(b'{"jsonrpc": "2.0", "id": 1, "method": '), 400, -32700)
    assert "id" not in body


@pytest.mark.parametrize("message", [{"jsonrpc": "2.0"}, {"jsonrpc": "1.0", "id": 1, "method": "ping"},
                                     {"jsonrpc": "2.0", "id": 1, "method": "ping", "params": "x"}, 42])
async def test_a_message_that_is_not_json_rpc_is_an_invalid_request(mcp: McpSession, message: object) -> None:
    rpc_error(await mcp.post(message), 400, -32600)


async def test_an_unknown_method_is_method_not_found(mcp: McpSession) -> None:
    reply = await mcp.call("tools/list")
    assert reply["error"]["code"] == -32601


@pytest.mark.parametrize(
    ("method", "params"),
    [
        ("resources/read", {}),
        ("resources/read", {"uri": 5}),
        ("resources/read", {"uri": None}),
        ("resources/read", {"uri": "mcpb://default/c/" + "x" * 3000}),
        ("resources/read", {"uri": "no scheme"}),
        ("resources/subscribe", {}),
        ("resources/subscribe", {"uri": ["mcpb://default/c/1"]}),
        ("resources/subscribe", {"uri": "https://example.com/" + "x" * 3000}),
        ("resources/unsubscribe", {"uri": 1}),
        ("resources/list", {"cursor": "not-a-cursor"}),
        ("resources/list", {"cursor": 7}),
        ("resources/templates/list", {"cursor": "not-a-cursor"}),
    ],
)
async def test_bad_params_are_invalid_params(mcp: McpSession, method: str, params: dict[str, object]) -> None:
    reply = await mcp.call(method, params)
    assert reply["error"]["code"] == -32602, reply


async def test_reading_an_unknown_resource_names_the_uri(mcp: McpSession) -> None:
    for uri in ("mcpb://default/none/1", "mcpb://default/none", "https://example.com/elsewhere"):
        reply = await mcp.call("resources/read", {"uri": uri})
        assert reply["error"]["code"] == -32002
        assert reply["error"]["data"] == {"uri": uri}


async def test_subscribing_to_another_tenants_record_is_refused(mcp: McpSession) -> None:
    reply = await mcp.call("resources/subscribe", {"uri": "mcpb://other/c/1"})
    assert reply["error"]["code"] == -32002
    assert reply["error"]["data"] == {"uri": "mcpb://other/c/1"}


async def test_ping_and_notifications_and_responses(mcp: McpSession) -> None:
    assert await mcp.result("ping") == {}
    for message in ({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": 1}},
                    {"jsonrpc": "2.0", "method": "notifications/whatever"},
                    {"jsonrpc": "2.0", "id": 9, "result": {}}):
        response = await mcp.post(message)
        assert response.status_code == 202 and response.content == b""


# -- HTTP errors ---------------------------------------------------------------------------------------


async def test_a_body_over_the_limit_is_refused_with_413(mcp: McpSession, http: httpx.AsyncClient) -> None:
    big = orjson.dumps({**PING, "params": {"pad": "x" * 1_100_000}})
    rpc_error(await mcp.post(big), 413, -32600)

    async def chunks():  # no Content-Length: the limit is enforced while reading
        for _ in range(12):
            yield b" " * 100_000

    response = await http.post("/mcp", content=chunks(), headers=mcp.headers())
    rpc_error(response, 413, -32600)


@pytest.mark.parametrize("accept", ["application/json", "text/event-stream", "text/html", ""])
async def test_a_post_that_does_not_accept_both_json_and_sse_gets_406(mcp: McpSession, accept: str) -> None:
    rpc_error(await mcp.post(PING, Accept=accept), 406, -32600)


async def test_a_get_that_does_not_accept_sse_gets_406(mcp: McpSession, http: httpx.AsyncClient) -> None:
    rpc_error(await http.get("/mcp", headers=mcp.headers(Accept="application/json")), 406, -32600)


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", ""])
async def test_a_post_that_is_not_json_gets_415(mcp: McpSession, content_type: str) -> None:
    rpc_error(await mcp.post(PING, **{"Content-Type": content_type}), 415, -32600)


async def test_a_request_without_a_session_id_gets_400(http: httpx.AsyncClient) -> None:
    anonymous = McpSession(http)
    rpc_error(await anonymous.post(PING), 400, -32600)
    rpc_error(await http.get("/mcp", headers={"Accept": "text/event-stream"}), 400, -32600)
    rpc_error(await http.delete("/mcp"), 400, -32600)


async def test_an_unknown_session_id_gets_404(http: httpx.AsyncClient) -> None:
    stranger = McpSession(http)
    stranger.id = "no-such-session"
    rpc_error(await stranger.post(PING), 404, -32600)
    rpc_error(await http.get("/mcp", headers=stranger.headers(Accept="text/event-stream")), 404, -32600)
    stranger.id = "x" * 500
    rpc_error(await stranger.post(PING), 404, -32600)


@pytest.mark.parametrize("version", ["1999-01-01", "garbage", "2025-11-25x"])
async def test_an_unsupported_protocol_version_header_gets_400(
        mcp: McpSession, http: httpx.AsyncClient, version: str) -> None:
    headers = mcp.headers(**{"MCP-Protocol-Version": version})
    response = await mcp.post(PING, **{"MCP-Protocol-Version": version})
    assert response.status_code == 400
    assert "unsupported MCP-Protocol-Version" in response.json()["error"]["message"]
    assert (await http.get("/mcp", headers={**headers, "Accept": "text/event-stream"})).status_code == 400
    assert (await http.delete("/mcp", headers=headers)).status_code == 400
    assert await mcp.result("ping") == {}  # the session is still there


async def test_a_missing_protocol_version_header_is_read_as_2025_03_26(mcp: McpSession) -> None:
    headers = mcp.headers()
    del headers["MCP-Protocol-Version"]
    response = await mcp.http.post("/mcp", content=orjson.dumps(PING), headers=headers)
    assert response.json()["result"] == {}


@pytest.mark.parametrize("method", ["PUT", "PATCH"])
async def test_other_http_methods_get_405(http: httpx.AsyncClient, method: str) -> None:
    response = await http.request(method, "/mcp", headers={"Accept": ACCEPT_BOTH})
    rpc_error(response, 405, -32600)
    assert "POST" in response.headers["allow"]


@pytest.mark.parametrize("origin", ["http://evil.example", "https://localhost.evil.example", "null",
                                    "http://127.0.0.2", "file://", "http://[::1"])
async def test_a_foreign_origin_gets_403(http: httpx.AsyncClient, origin: str) -> None:
    response = await McpSession(http).post({**PING, "method": "initialize"}, Origin=origin)
    rpc_error(response, 403, -32600)


@pytest.mark.parametrize("origin", ["http://localhost", "http://localhost:5173", "http://127.0.0.1:6274",
                                    "https://[::1]:8443"])
async def test_a_localhost_origin_on_any_port_passes(http: httpx.AsyncClient, origin: str) -> None:
    response = await McpSession(http).post({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}},
        Origin=origin)
    assert response.status_code == 200 and "mcp-session-id" in response.headers


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8080", "localhost.evil.example", "127.0.0.2",
                                  "[::1", "\u00e9"])
async def test_a_foreign_host_gets_421_everywhere_on_a_loopback_server(http: httpx.AsyncClient, host: str) -> None:
    """DNS rebinding: a page on a rebound name sends its own name as Host and, on a GET, no Origin."""
    headers = {"Host": host.encode("latin-1")}
    response = await McpSession(http).post({**PING, "method": "initialize"}, Host=host.encode("latin-1"))
    rpc_error(response, 421, -32600)
    for path in ("/collections", "/healthz"):
        response = await http.get(path, headers=headers)
        assert response.status_code == 421 and response.json() == {"detail": "Host not allowed"}


@pytest.mark.parametrize("host", ["localhost", "localhost:5173", "127.0.0.1:8080", "[::1]:8443", "LOCALHOST"])
async def test_a_loopback_host_on_any_port_passes(http: httpx.AsyncClient, host: str) -> None:
    response = await McpSession(http).post({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}},
        Host=host)
    assert response.status_code == 200 and "mcp-session-id" in response.headers


# -- initialize ----------------------------------------------------------------------------------------


async def test_initialize_echoes_a_known_version_and_offers_the_newest_otherwise(http: httpx.AsyncClient) -> None:
    for asked, offered in [("2025-03-26", "2025-03-26"), ("2025-06-18", "2025-06-18"), ("2024-11-05", "2025-11-25"),
                           ("2099-01-01", "2025-11-25")]:
        response = await McpSession(http).post({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
            "protocolVersion": asked, "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}})
        assert response.json()["result"]["protocolVersion"] == offered


async def test_session_ids_are_random_visible_ascii(http: httpx.AsyncClient) -> None:
    ids = {(await McpSession(http).initialize()).id for _ in range(5)}
    assert len(ids) == 5
    for sid in ids:
        assert sid is not None and len(sid) >= 22 and all(0x21 <= ord(c) <= 0x7E for c in sid)


@pytest.mark.parametrize("params", [{}, {"protocolVersion": 5}, {"protocolVersion": "2025-11-25", "clientInfo": []}])
async def test_initialize_with_bad_params_is_invalid_params(http: httpx.AsyncClient, params: object) -> None:
    response = await McpSession(http).post({"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": params})
    assert response.json()["error"]["code"] == -32602
    assert "mcp-session-id" not in response.headers


async def test_initialize_as_a_notification_is_refused(http: httpx.AsyncClient) -> None:
    rpc_error(await McpSession(http).post({"jsonrpc": "2.0", "method": "initialize"}), 400, -32600)


# -- batches -------------------------------------------------------------------------------------------


async def test_a_2025_03_26_client_may_send_a_batch(http: httpx.AsyncClient) -> None:
    mcp = await McpSession(http, "2025-03-26").initialize()
    response = await mcp.post([
        {"jsonrpc": "2.0", "id": "a", "method": "ping"},
        {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": "zz"}},
        {"jsonrpc": "2.0", "id": "b", "method": "resources/templates/list"},
        {"jsonrpc": "2.0", "id": "c", "method": "nope"},
        {"jsonrpc": "2.0", "id": "d", "method": "initialize", "params": {}},
        {"bad": True},
    ])
    assert response.status_code == 200
    replies = {reply.get("id"): reply for reply in response.json()}
    assert replies["a"]["result"] == {}
    assert replies["b"]["result"]["resourceTemplates"]
    assert replies["c"]["error"]["code"] == -32601
    assert replies["d"]["error"]["code"] == -32600
    assert replies[None]["error"]["code"] == -32600
    assert len(replies) == 5


async def test_a_batch_of_notifications_only_is_accepted_with_202(http: httpx.AsyncClient) -> None:
    mcp = await McpSession(http, "2025-03-26").initialize()
    response = await mcp.post([{"jsonrpc": "2.0", "method": "notifications/initialized"}])
    assert response.status_code == 202 and response.content == b""


async def test_an_empty_batch_is_invalid(http: httpx.AsyncClient) -> None:
    mcp = await McpSession(http, "2025-03-26").initialize()
    rpc_error(await mcp.post([]), 400, -32600)


@pytest.mark.parametrize("version", ["2025-06-18", "2025-11-25"])
async def test_later_versions_may_not_send_batches(http: httpx.AsyncClient, version: str) -> None:
    mcp = await McpSession(http, version).initialize()
    rpc_error(await mcp.post([PING]), 400, -32600)


# -- ending a session ----------------------------------------------------------------------------------


async def test_a_deleted_session_is_gone(mcp: McpSession, http: httpx.AsyncClient) -> None:
    response = await http.delete("/mcp", headers=mcp.headers())
    assert response.status_code in (200, 204)
    rpc_error(await mcp.post(PING), 404, -32600)
    rpc_error(await http.get("/mcp", headers=mcp.headers(Accept="text/event-stream")), 404, -32600)
    rpc_error(await http.delete("/mcp", headers=mcp.headers()), 404, -32600)


async def test_deleting_a_session_ends_its_open_stream(mcp: McpSession, http: httpx.AsyncClient) -> None:
    async with mcp.stream() as stream:
        await stream.next_event()  # priming
        assert (await http.delete("/mcp", headers=mcp.headers())).status_code in (200, 204)
        assert [e for e in await stream.until_end() if e.data] == []


# -- nothing is a 500 ----------------------------------------------------------------------------------

GARBAGE: list[bytes] = [
    b"", b"null", b"true", b"0", b'"x"', b"[]", b"[[]]", b"[1,2]", b"{}", b'{"jsonrpc":"2.0"}',
    b'{"jsonrpc":"2.0","id":{},"method":"ping"}', b'{"jsonrpc":"2.0","id":[],"method":"ping"}',
    b'{"jsonrpc":"2.0","id":1,"method":"resources/read","params":{"uri":{}}}',
    b'{"jsonrpc":"2.0","id":1,"method":"resources/read","params":{"uri":"mcpb://default/\\u0000/x"}}',
    b'{"jsonrpc":"2.0","id":1,"method":"resources/read","params":{"uri":"mcpb://default/c/\\ud800"}}',
    b'{"jsonrpc":"2.0","id":1,"method":"resources/list","params":{"cursor":"\\u0000"}}',
    b'{"jsonrpc":"2.0","id":1,"method":"resources/list","params":{"cursor":"W10="}}',
    b'{"jsonrpc":"2.0","id":1,"method":"resources/list","params":{"cursor":"WzAsMV0="}}',
    b'{"jsonrpc":"2.0","id":1,"method":"resources/list","params":{"cursor":"WzEuNSwiIl0="}}',
    b'{"jsonrpc":"2.0","id":1,"method":"resources/list","params":{"cursor":"WzAsIlx1MDAwMCJd"}}',
    b'{"jsonrpc":"2.0","id":1,"method":"resources/subscribe","params":{"uri":"x:\\u2028"}}',
    b'{"jsonrpc":"2.0","id":1,"method":"initialize","params":{"protocolVersion":"2025-11-25","capabilities":[]}}',
    b'{"jsonrpc":"2.0","id":1,"method":"initialize","params":null}',
    b'{"jsonrpc":"2.0","id":1,"method":"subscriptions/listen","params":{}}',
    b'{"jsonrpc":"2.0","id":1,"method":"server/discover"}',
    b'{"jsonrpc":"2.0","id":1,"method":"ping","params":{"_meta":{"io.modelcontextprotocol/protocolVersion":1}}}',
    b'{"jsonrpc":"2.0","id":1e400,"method":"ping"}', b'{"jsonrpc":"2.0","id":99999999999999999999999,"method":"ping"}',
    b"\xff\xfe\x00", b"[" * 5000 + b"]" * 5000, b'{"a":' * 300 + b"1" + b"}" * 300,
]


@pytest.mark.parametrize("body", GARBAGE, ids=lambda b: repr(b[:40]))
async def test_garbage_bodies_never_get_a_500(mcp: McpSession, body: bytes) -> None:
    for session_id in (mcp.id, None):
        headers = mcp.headers()
        if session_id is None:
            headers.pop("Mcp-Session-Id")
            headers.pop("MCP-Protocol-Version")
        response = await mcp.http.post("/mcp", content=body, headers=headers)
        assert response.status_code < 500, response.text
        if response.content:
            assert response.headers["content-type"].startswith("application/json")
    assert await mcp.result("ping") == {}


@pytest.mark.parametrize("header", [{"Last-Event-ID": "\u00e9t\u00e9-1"}, {"Last-Event-ID": "abc-\u00b2"},
                                    {"Mcp-Session-Id": "\u00e9"}, {"MCP-Protocol-Version": "\u00e9"},
                                    {"Origin": "http://\u00e9"}, {"Origin": "http://localhost:99999"}])
async def test_odd_header_values_never_get_a_500(mcp: McpSession, header: dict[str, str]) -> None:
    headers = {**mcp.headers(Accept="text/event-stream"), **header}
    encoded = {k: v.encode("latin-1") for k, v in headers.items()}
    for method in ("GET", "POST", "DELETE"):
        response = await mcp.http.request(method, "/mcp", headers=encoded, content=orjson.dumps(PING))
        assert response.status_code < 500, (method, response.text)


# -- limits ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def limited_broker() -> Iterator[BrokerProcess]:
    with BrokerProcess(env={"MCP_BROKER_MAX_SUBSCRIPTIONS_PER_SESSION": "2"}) as proc:
        yield proc


async def test_a_subscription_over_the_limit_is_refused_with_a_clear_error(limited_broker: BrokerProcess) -> None:
    async with httpx.AsyncClient(base_url=limited_broker.url, timeout=10) as http:
        mcp = await McpSession(http).initialize()
        await mcp.subscribe("https://example.com/1", "https://example.com/2")
        await mcp.subscribe("https://example.com/2")  # already subscribed: not a new one
        reply = await mcp.call("resources/subscribe", {"uri": "https://example.com/3"})
        assert reply["error"]["code"] == -32602
        assert reply["error"]["data"] == {"limit": 2}
        assert "limit" in reply["error"]["message"].lower()
