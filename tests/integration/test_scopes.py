"""Scopes, tried as an attacker holding a narrow credential would: each route and method refuses
what the credential does not grant, with 403 and the scope named, and nothing is changed.

The server is a real uvicorn on a real port, in this process so the test can hand it an
authenticator whose tokens carry chosen scopes (how a credential gets its scopes is the OAuth
and API-key tests' business; what a scope allows is this file's).
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Iterator, Mapping

import httpx
import orjson
import pytest
import uvicorn

from broker.auth import ALL_SCOPES, Principal, Unauthorized, scopes
from broker.config import Settings
from broker.runtime import Broker
from broker.runtime.app import create_app
from broker.uris import record_uri
from tests.integration import modern
from tests.integration.mcp_http import McpSession
from tests.support import free_port, wait_until

TENANT = "acme"
#: Token -> the scopes its principal holds (all of one tenant, each its own subject).
TOKENS = {
    "reader": frozenset({scopes.READ}),
    "watcher": frozenset({scopes.SUBSCRIBE}),
    "writer": frozenset({scopes.WRITE}),
    "publisher": frozenset({scopes.PUBLISH}),
    "all": ALL_SCOPES,
}
FORBIDDEN = -31003


class Tokens:
    """Bearer tokens standing for principals of ``TENANT`` with the scopes of ``TOKENS``."""

    async def authenticate(self, headers: Mapping[str, str]) -> Principal:
        token = headers.get("authorization", "").removeprefix("Bearer ")
        if token not in TOKENS:
            raise Unauthorized("unknown token")
        return Principal(TENANT, token, TOKENS[token])


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    port = free_port()
    app = create_app(broker=Broker(Settings(port=port), authenticator=Tokens()))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, what="the server to start")
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=15)


@pytest.fixture
async def http(url: str) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        yield client


def assert_refused(response: httpx.Response, scope: str) -> None:
    """403, the scope named in ``WWW-Authenticate`` (RFC 6750) and in the body."""
    assert response.status_code == 403, response.text
    challenge = response.headers["www-authenticate"]
    assert challenge.startswith("Bearer ") and 'error="insufficient_scope"' in challenge, challenge
    assert f'scope="{scope}"' in challenge, challenge
    body = response.json()
    if "error" in body:  # /mcp: a JSON-RPC error naming the scope
        assert body["error"]["code"] == FORBIDDEN and body["error"]["data"] == {"scope": scope}, body
    else:
        assert scope in body["detail"], body


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def put(http: httpx.AsyncClient, collection: str, record_id: str, value: object, token: str) -> httpx.Response:
    return await http.put(f"/collections/{collection}/{record_id}", json=value, headers=bearer(token))


# -- 2025 sessions -----------------------------------------------------------------------------

async def test_a_reader_reads_but_may_neither_subscribe_nor_open_the_stream(http: httpx.AsyncClient) -> None:
    assert (await put(http, "notes", "n1", {"text": "hello"}, "writer")).status_code == 201
    uri = record_uri(TENANT, "notes", "n1")
    session = await McpSession(http, auth="reader").initialize()
    contents = (await session.result("resources/read", {"uri": uri}))["contents"]
    assert orjson.loads(contents[0]["text"]) == {"text": "hello"}
    assert "resources" in await session.result("resources/list")

    refused = await session.post({"jsonrpc": "2.0", "id": 7, "method": "resources/subscribe", "params": {"uri": uri}})
    assert_refused(refused, scopes.SUBSCRIBE)
    assert refused.json()["id"] == 7
    headers = session.headers(Accept="text/event-stream")
    headers.pop("Content-Type")
    assert_refused(await http.get("/mcp", headers=headers), scopes.SUBSCRIBE)


async def test_a_watcher_subscribes_but_may_not_read(http: httpx.AsyncClient) -> None:
    uri = record_uri(TENANT, "notes", "n1")
    session = await McpSession(http, auth="watcher").initialize()
    await session.subscribe(uri)
    for method, params in (("resources/read", {"uri": uri}), ("resources/list", {}),
                           ("resources/templates/list", {})):
        refused = await session.post({"jsonrpc": "2.0", "id": 1, "method": method, "params": params})
        assert_refused(refused, scopes.READ)
    async with session.stream():
        pass  # the GET stream is the watcher's


async def test_a_batch_member_refused_for_its_scope_leaves_the_others_answered(http: httpx.AsyncClient) -> None:
    session = await McpSession(http, version="2025-03-26", auth="reader").initialize()
    uri = record_uri(TENANT, "notes", "n1")
    response = await session.post([
        {"jsonrpc": "2.0", "id": 1, "method": "resources/subscribe", "params": {"uri": uri}},
        {"jsonrpc": "2.0", "id": 2, "method": "resources/read", "params": {"uri": uri}},
    ])
    assert response.status_code == 200, response.text
    replies = {reply["id"]: reply for reply in response.json()}
    assert replies[1]["error"]["code"] == FORBIDDEN and replies[1]["error"]["data"] == {"scope": scopes.SUBSCRIBE}
    assert "contents" in replies[2]["result"]


# -- 2026-07-28 --------------------------------------------------------------------------------

async def test_modern_requests_are_refused_for_the_scope_they_need(http: httpx.AsyncClient) -> None:
    uri = record_uri(TENANT, "notes", "n1")
    assert_refused(await modern.call(http, "resources/read", {"uri": uri}, name=uri, auth="watcher"), scopes.READ)
    body = modern.request("subscriptions/listen", {"notifications": {"resourceSubscriptions": [uri]}})
    refused = await http.post("/mcp", content=orjson.dumps(body),
                              headers=modern.headers("subscriptions/listen", auth="reader"))
    assert_refused(refused, scopes.SUBSCRIBE)
    assert (await modern.call(http, "resources/read", {"uri": uri}, name=uri, auth="reader")).status_code == 200
    async with modern.listen(http, [uri], auth="watcher") as stream:
        ack = await stream.next()
        assert ack is not None and ack.get("method") == "notifications/subscriptions/acknowledged", ack


# -- REST and POST /changes --------------------------------------------------------------------

async def test_only_a_writer_changes_records_and_a_refused_delete_deletes_nothing(http: httpx.AsyncClient) -> None:
    assert (await put(http, "ledger", "l1", {"total": 1}, "writer")).status_code == 201
    for token in ("reader", "watcher", "publisher"):
        assert_refused(await put(http, "ledger", "l1", {"total": 666}, token), scopes.WRITE)
        assert_refused(await http.patch("/collections/ledger/l1", json={"total": 666}, headers=bearer(token)),
                       scopes.WRITE)
        assert_refused(await http.delete("/collections/ledger/l1", headers=bearer(token)), scopes.WRITE)
    kept = await http.get("/collections/ledger/l1", headers=bearer("reader"))
    assert kept.status_code == 200 and kept.json() == {"total": 1}
    assert_refused(await http.get("/collections/ledger/l1", headers=bearer("writer")), scopes.READ)
    assert_refused(await http.get("/collections", headers=bearer("watcher")), scopes.READ)


async def test_only_a_publisher_publishes(http: httpx.AsyncClient) -> None:
    uri = record_uri(TENANT, "ledger", "l1")
    session = await McpSession(http, auth="all").initialize()
    await session.subscribe(uri)
    async with session.stream() as stream:
        for token in ("reader", "watcher", "writer"):
            refused = await http.post("/changes", json={"uri": uri, "kind": "deleted"}, headers=bearer(token))
            assert_refused(refused, scopes.PUBLISH)
        accepted = await http.post("/changes", json={"uri": uri, "meta": {"v": 2}}, headers=bearer("publisher"))
        assert accepted.status_code == 202, accepted.text
        # The first notification is the one allowed publish: none of the refused ones got through.
        event = await stream.next_event()
        while event.method != "notifications/resources/updated":
            event = await stream.next_event()
        assert event.message["params"] == {"uri": uri, "_meta": {"v": 2}}


@pytest.mark.parametrize("key", ["io.modelcontextprotocol/subscriptionId", "dev.mcp/x", "mcp.dev/x",
                                 "org.modelcontextprotocol.api/x", "progressToken"])
async def test_a_publisher_may_not_forge_the_protocols_meta_keys(http: httpx.AsyncClient, key: str) -> None:
    uri = record_uri(TENANT, "ledger", "l1")
    refused = await http.post("/changes", json={"uri": uri, "kind": "deleted", "meta": {key: "forged"}},
                              headers=bearer("publisher"))
    assert refused.status_code == 422, refused.text
    assert key in refused.json()["detail"]


async def test_trace_context_and_own_keys_pass(http: httpx.AsyncClient) -> None:
    uri = record_uri(TENANT, "ledger", "l1")
    meta = {"traceparent": "00-1-2-01", "com.example.mcp/v": 1}
    accepted = await http.post("/changes", json={"uri": uri, "meta": meta}, headers=bearer("publisher"))
    assert accepted.status_code == 202, accepted.text
