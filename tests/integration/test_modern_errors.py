"""Every 2026-07-28 error code and HTTP status of ``/mcp``, with exact requests (raw httpx)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import orjson
import pytest

from tests.integration.modern import (
    SUBSCRIPTION_ID,
    VERSION,
    base64_header,
    call,
    headers,
    listen,
    listen_count,
    put_record,
    request,
    wait_listens,
)
from tests.support import BrokerProcess

KEYS = '{"k1": "t1/alice", "k2": "t2/bob"}'


@pytest.fixture(scope="module")
def errors_broker() -> Iterator[BrokerProcess]:
    """Tenants t1 and t2 behind API keys, and small listen limits so they can be reached."""
    # The whole of MCP_BROKER_MAX_LISTENS to one tenant: the worker's limit is tested here, the
    # tenant's share of it in test_fair_defaults.
    env = {"MCP_BROKER_API_KEYS": KEYS, "MCP_BROKER_MAX_LISTEN_URIS": "3", "MCP_BROKER_MAX_LISTENS": "2",
           "MCP_BROKER_TENANT_SHARE": "1"}
    with BrokerProcess(env=env) as proc:
        yield proc


@pytest.fixture
async def http(errors_broker: BrokerProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=errors_broker.url, timeout=10,
                                 headers={"Authorization": "Bearer k1"}) as client:
        yield client


async def post(http: httpx.AsyncClient, body: Any, hdrs: dict[str, str]) -> httpx.Response:
    return await http.post("/mcp", content=orjson.dumps(body), headers=hdrs)


def error_of(response: httpx.Response, status: int, code: int, id_: Any = 1) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    reply = response.json()
    assert reply["error"]["code"] == code, reply
    assert reply.get("id") == id_
    error: dict[str, Any] = reply["error"]
    return error


# -- the _meta envelope ---------------------------------------------------------------------
@pytest.mark.parametrize("missing", ["protocolVersion", "clientCapabilities"])
async def test_a_request_without_a_required_meta_field_is_invalid_params_400(http: httpx.AsyncClient,
                                                                          missing: str) -> None:
    body = request("resources/list", **{missing: None})
    # Without a version in the body the header has nothing to match; send it all the same.
    error_of(await post(http, body, headers("resources/list")), 400, -32602)


async def test_a_request_without_meta_at_all_is_invalid_params_400(http: httpx.AsyncClient) -> None:
    body = {"jsonrpc": "2.0", "id": 1, "method": "resources/list", "params": {}}
    error_of(await post(http, body, headers("resources/list")), 400, -32602)


async def test_client_capabilities_must_be_an_object(http: httpx.AsyncClient) -> None:
    body = request("resources/list", clientCapabilities="all")
    error_of(await post(http, body, headers("resources/list")), 400, -32602)


async def test_an_unsupported_version_names_the_supported_ones(http: httpx.AsyncClient) -> None:
    body = request("resources/list", protocolVersion="2099-01-01")
    error = error_of(await post(http, body, headers("resources/list", version="2099-01-01")), 400, -32022)
    assert error["data"] == {"supported": [VERSION], "requested": "2099-01-01"}


async def test_no_request_needs_a_client_capability(http: httpx.AsyncClient) -> None:
    # -32021 is never emitted (see broker/protocol/envelope.py): an empty capability set is enough for everything.
    for method in ("server/discover", "resources/list", "resources/templates/list"):
        response = await call(http, method)
        assert response.status_code == 200 and "result" in response.json(), response.text


# -- SEP-2243 headers -------------------------------------------------------------------------
async def test_a_missing_protocol_version_header_is_a_header_mismatch(http: httpx.AsyncClient) -> None:
    error = error_of(await post(http, request("resources/list"), headers("resources/list", version=None)),
                     400, -32020)
    assert "MCP-Protocol-Version" in error["message"]


async def test_a_protocol_version_header_that_differs_from_the_body_is_a_header_mismatch(
    http: httpx.AsyncClient,
) -> None:
    error_of(await post(http, request("resources/list"), headers("resources/list", version="2099-01-01")),
             400, -32020)


async def test_a_supported_version_header_over_an_unknown_body_version_is_a_mismatch_not_unsupported(
    http: httpx.AsyncClient,
) -> None:
    # The header names 2026-07-28, the body an unknown version: the header disagrees with the body first.
    body = request("resources/list", protocolVersion="2099-01-01")
    error_of(await post(http, body, headers("resources/list")), 400, -32020)


async def test_a_missing_or_different_method_header_is_a_header_mismatch(http: httpx.AsyncClient) -> None:
    hdrs = headers("resources/list")
    del hdrs["Mcp-Method"]
    error_of(await post(http, request("resources/list"), hdrs), 400, -32020)
    error_of(await post(http, request("resources/list"), headers("resources/read")), 400, -32020)


async def test_resources_read_needs_a_name_header_equal_to_the_uri(http: httpx.AsyncClient) -> None:
    uri = await put_record(http, "errors", "a", {"n": 1})
    body = request("resources/read", {"uri": uri})
    error_of(await post(http, body, headers("resources/read")), 400, -32020)
    error = error_of(await post(http, body, headers("resources/read", name=uri + "x")), 400, -32020)
    assert "Mcp-Name" in error["message"]
    ok = await post(http, body, headers("resources/read", name=uri))
    assert ok.status_code == 200 and ok.json()["result"]["contents"][0]["uri"] == uri


async def test_header_values_in_the_base64_form_are_decoded_before_comparing(http: httpx.AsyncClient) -> None:
    uri = "mcpb://t1/errors/späce"  # not plain ASCII: a client must encode it
    body = request("resources/read", {"uri": uri})
    reply = (await post(http, body, headers("resources/read", name=base64_header(uri)))).json()
    # The headers match, so the request reaches the handler: the record does not exist.
    assert reply["error"]["code"] == -32602 and reply["error"]["data"] == {"uri": uri}
    error_of(await post(http, body, headers("resources/read", name=base64_header(uri + "x"))), 400, -32020)
    error_of(await post(http, body, headers("resources/read", name="=?base64?not base64!?=")), 400, -32020)
    method = headers("resources/list", **{"Mcp-Method": base64_header("resources/list")})
    assert (await post(http, request("resources/list"), method)).status_code == 200


async def test_a_plain_header_value_that_is_not_ascii_is_refused(http: httpx.AsyncClient) -> None:
    uri = "mcpb://t1/errors/späce"
    body = request("resources/read", {"uri": uri})
    raw = {**headers("resources/read"), "Mcp-Name": uri.encode("latin-1")}  # sent unencoded: invalid characters
    response = await http.post("/mcp", content=orjson.dumps(body), headers=raw)  # type: ignore[arg-type]
    error = error_of(response, 400, -32020)
    assert "Mcp-Name" in error["message"]


# -- methods, results, HTTP shape -----------------------------------------------------------------
@pytest.mark.parametrize("method", ["tools/list", "ping", "resources/subscribe", "initialize/nope"])
async def test_an_unknown_method_is_method_not_found_404(http: httpx.AsyncClient, method: str) -> None:
    error_of(await post(http, request(method), headers(method)), 404, -32601)


async def test_a_resource_that_does_not_exist_is_invalid_params_with_its_uri(http: httpx.AsyncClient) -> None:
    uri = "mcpb://t1/errors/missing"
    response = await call(http, "resources/read", {"uri": uri}, name=uri)
    # A handler error: in-band on 200 (docs/PROTOCOL.md), never the legacy -32002.
    error = error_of(response, 200, -32602)
    assert error["data"] == {"uri": uri}


async def test_another_tenants_resource_reads_as_not_found(http: httpx.AsyncClient) -> None:
    uri = await put_record(http, "errors", "theirs", {}, auth="k2")
    assert uri.startswith("mcpb://t2/")
    error = error_of(await call(http, "resources/read", {"uri": uri}, name=uri), 200, -32602)
    assert error["data"] == {"uri": uri}


@pytest.mark.parametrize("verb", ["GET", "DELETE"])
async def test_get_and_delete_with_a_modern_version_are_405_allow_post(http: httpx.AsyncClient, verb: str) -> None:
    response = await http.request(verb, "/mcp", headers={"MCP-Protocol-Version": VERSION,
                                                          "Accept": "text/event-stream"})
    assert response.status_code == 405
    assert response.headers["allow"] == "POST"


async def test_a_stray_cancelled_notification_is_accepted_with_202(http: httpx.AsyncClient) -> None:
    body = {"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": "listen-9"}}
    response = await post(http, body, headers("notifications/cancelled"))
    assert response.status_code == 202 and response.content == b""


async def test_a_session_id_header_is_ignored_by_modern_requests(http: httpx.AsyncClient) -> None:
    response = await post(http, request("resources/list"), headers("resources/list", **{"Mcp-Session-Id": "nope"}))
    assert response.status_code == 200 and "result" in response.json()
    assert "mcp-session-id" not in response.headers


async def test_a_modern_body_without_the_version_header_is_routed_modern(http: httpx.AsyncClient) -> None:
    # Routed by the _meta envelope (no session needed), then refused for the missing header.
    error_of(await post(http, request("resources/list"), headers("resources/list", version=None)), 400, -32020)


# -- subscriptions/listen refusals: all before the ack, as JSON --------------------------------------
async def listen_error(http: httpx.AsyncClient, notifications: Any, id_: Any = "l1") -> httpx.Response:
    body = request("subscriptions/listen", {"notifications": notifications}, id_)
    return await post(http, body, headers("subscriptions/listen"))


async def test_a_listen_for_another_tenants_uri_is_refused_before_the_ack(http: httpx.AsyncClient) -> None:
    theirs = "mcpb://t2/errors/theirs"
    response = await listen_error(http, {"resourceSubscriptions": ["mcpb://t1/errors/mine", theirs]})
    error = error_of(response, 200, -32602, "l1")
    assert error["data"] == {"uri": theirs}
    assert await listen_count(http) == 0


async def test_a_listen_with_too_many_uris_is_refused(http: httpx.AsyncClient) -> None:
    uris = [f"mcpb://t1/errors/u{i}" for i in range(4)]
    error = error_of(await listen_error(http, {"resourceSubscriptions": uris}), 400, -32602, "l1")
    assert error["data"] == {"limit": 3}
    assert "at most 3" in error["message"]


@pytest.mark.parametrize("notifications", [
    None, [], {"resourceSubscriptions": "mcpb://t1/errors/a"}, {"resourceSubscriptions": [1]},
    {"resourcesListChanged": "yes"}, {"resourceSubscriptions": ["not a uri"]},
])
async def test_a_malformed_filter_is_invalid_params(http: httpx.AsyncClient, notifications: Any) -> None:
    response = await listen_error(http, notifications)
    assert response.json()["error"]["code"] == -32602
    assert response.status_code in (200, 400)


async def test_listens_past_the_limit_are_refused_until_one_closes(http: httpx.AsyncClient) -> None:
    uri = "mcpb://t1/errors/limit"
    await wait_listens(http, 0)
    async with listen(http, [uri], "one", auth="k1") as first, listen(http, [uri], "two", auth="k1"):
        assert await first.next() is not None
        error = error_of(await listen_error(http, {"resourceSubscriptions": [uri]}, "three"), 200, -32603, "three")
        assert "limit" in error["message"].lower() and error["data"] == {"limit": 2}
    await wait_listens(http, 0)
    async with listen(http, [uri], "four", auth="k1") as fourth:
        ack = await fourth.next()
        assert ack is not None and ack["params"]["_meta"][SUBSCRIPTION_ID] == "four"


async def test_the_ack_names_only_what_the_broker_honours(http: httpx.AsyncClient) -> None:
    uri = "mcpb://t1/errors/ack"
    async with listen(http, [uri, uri], 5, toolsListChanged=True, promptsListChanged=True,
                      resourcesListChanged=True) as stream:
        ack = await stream.next()
        assert ack == {"jsonrpc": "2.0", "method": "notifications/subscriptions/acknowledged",
                       "params": {"_meta": {SUBSCRIPTION_ID: 5},
                                  "notifications": {"resourcesListChanged": True, "resourceSubscriptions": [uri]}}}


async def test_a_listen_gets_only_the_notification_types_it_asked_for(http: httpx.AsyncClient) -> None:
    watched = await put_record(http, "errors-types", "watched", {})
    async with listen(http, [watched], "types") as stream:
        assert (await stream.next()) is not None
        # A new record changes the list, but this listen did not ask for list_changed.
        await put_record(http, "errors-types", "new-one", {})
        await put_record(http, "errors-types", "watched", {"v": 1})
        frame = await stream.next()
        assert frame is not None and frame["method"] == "notifications/resources/updated"
        assert frame["params"] == {"_meta": {SUBSCRIPTION_ID: "types"}, "uri": watched}


async def test_a_changes_meta_reaches_the_listen_beside_the_subscription_id(http: httpx.AsyncClient) -> None:
    uri = "bench://meta/1"
    async with listen(http, [uri], "with-meta") as stream:
        assert (await stream.next()) is not None  # the ack
        forged = await http.post("/changes", json={"uri": uri, "meta": {"seq": 7, SUBSCRIPTION_ID: "forged"}})
        assert forged.status_code == 422 and "reserved" in forged.json()["detail"]
        response = await http.post("/changes", json={"uri": uri, "meta": {"seq": 7}})
        assert response.status_code == 202
        frame = await stream.next()
        assert frame is not None
        assert frame["params"] == {"_meta": {"seq": 7, SUBSCRIPTION_ID: "with-meta"}, "uri": uri}
