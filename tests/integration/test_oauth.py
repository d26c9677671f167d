"""mcp-broker as an OAuth 2.1 resource server, against a real authorization server (``tests/oauth_issuer.py``).

A broker process trusts the test server's tokens (and keeps its static API keys beside them); the
tests present good and bad tokens on both protocol eras and the REST API, rotate keys, keep the
authorization server away at start, and let the official SDK's OAuth client find the server
from a 401 and get its own token with client credentials.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import httpx2
import orjson
import pytest
from mcp import types
from mcp.client import Client
from mcp.client.auth.extensions.client_credentials import ClientCredentialsOAuthProvider
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.auth import OAuthClientInformationFull, OAuthToken

from tests.integration import modern
from tests.integration.mcp_http import McpSession, StreamEnded
from tests.oauth_issuer import INTROSPECTOR, Authority, IssuerServer
from tests.sdk_inbox import Inbox
from tests.support import BrokerProcess, free_port, wait_until

pytestmark = pytest.mark.filterwarnings("ignore::mcp.shared.exceptions.MCPDeprecationWarning")

TIMEOUT = 10.0
#: Seconds of clock skew the broker allows: a token is accepted, and its streams last, until exp plus this.
LEEWAY = 2
SCOPES = ["resources:read", "resources:subscribe", "records:write", "changes:publish", "tools:call", "keys:admin"]


def oauth_env(issuer: str, audience: str, **extra: str) -> dict[str, str]:
    return {"MCP_BROKER_OAUTH_ISSUER": issuer, "MCP_BROKER_OAUTH_AUDIENCE": audience,
            "MCP_BROKER_API_KEYS": '{"static-key": "acme/robot"}', "MCP_BROKER_OAUTH_JWKS_REFRESH_INTERVAL": "0.2",
            "MCP_BROKER_OAUTH_LEEWAY": str(LEEWAY),
            "MCP_BROKER_OAUTH_INTROSPECTION": "true", "MCP_BROKER_OAUTH_CLIENT_ID": INTROSPECTOR[0],
            "MCP_BROKER_OAUTH_CLIENT_SECRET": INTROSPECTOR[1], **extra}


@pytest.fixture(scope="module")
def deployment() -> Iterator[tuple[BrokerProcess, Authority]]:
    port = free_port()
    audience = f"http://127.0.0.1:{port}/mcp"
    with IssuerServer(audience) as issuer, BrokerProcess(env=oauth_env(issuer.url, audience), port=port) as broker:
        yield broker, issuer.authority


@pytest.fixture
def broker(deployment: tuple[BrokerProcess, Authority]) -> BrokerProcess:
    return deployment[0]


@pytest.fixture
def authority(deployment: tuple[BrokerProcess, Authority]) -> Authority:
    return deployment[1]


@pytest.fixture
async def http(broker: BrokerProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=broker.url, timeout=TIMEOUT) as client:
        yield client


def pointer(broker: BrokerProcess) -> str:
    return f'resource_metadata="{broker.url}/.well-known/oauth-protected-resource/mcp"'


def tenant() -> str:
    return "t" + secrets.token_hex(4)


INITIALIZE = {"jsonrpc": "2.0", "id": 0, "method": "initialize", "params": {
    "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "tests", "version": "1"}}}


# -- discovery ---------------------------------------------------------------------------------
async def test_a_request_without_a_token_is_told_where_the_metadata_is(broker: BrokerProcess,
                                                                       http: httpx.AsyncClient) -> None:
    answers = [await McpSession(http).post(INITIALIZE),
               await http.post("/mcp", content=orjson.dumps(modern.request("resources/list")),
                               headers=modern.headers("resources/list")),
               await http.post("/changes", json={"uri": "x:a"}),
               await http.get("/collections")]
    for answer in answers:
        assert answer.status_code == 401
        assert answer.headers["www-authenticate"] == "Bearer " + pointer(broker)
    assert answers[0].json()["error"]["message"].startswith("Unauthorized")


async def test_the_metadata_names_the_issuer_without_credentials_and_to_browsers(
        broker: BrokerProcess, authority: Authority, http: httpx.AsyncClient) -> None:
    for path in ("/.well-known/oauth-protected-resource", "/.well-known/oauth-protected-resource/mcp"):
        answer = await http.get(path, headers={"Origin": "http://localhost"})
        assert answer.status_code == 200 and answer.headers["content-type"] == "application/json"
        assert answer.json() == {"resource": broker.mcp_url, "authorization_servers": [authority.issuer],
                                 "scopes_supported": SCOPES, "bearer_methods_supported": ["header"],
                                 "resource_name": "mcp-broker"}
        assert answer.headers["access-control-allow-origin"] == "http://localhost"
    preflight = await http.options("/.well-known/oauth-protected-resource/mcp", headers={
        "Origin": "http://localhost", "Access-Control-Request-Method": "GET"})
    assert preflight.status_code == 204


# -- good tokens -------------------------------------------------------------------------------
async def test_a_valid_token_works_on_rest_and_both_eras(authority: Authority, http: httpx.AsyncClient) -> None:
    name = tenant()
    for kid in ("rsa-1", "ec-1"):
        token = authority.mint(name, kid=kid)
        uri = await modern.put_record(http, "things", kid, {"kid": kid}, auth=token)
        assert uri == f"mcpb://{name}/things/{kid}"
        session = await McpSession(http, auth=token).initialize()
        read = await session.result("resources/read", {"uri": uri})
        assert orjson.loads(read["contents"][0]["text"]) == {"kid": kid}
        answer = await modern.call(http, "resources/read", {"uri": uri}, name=uri, auth=token)
        assert answer.status_code == 200, answer.text
        assert orjson.loads(answer.json()["result"]["contents"][0]["text"]) == {"kid": kid}


async def test_static_api_keys_keep_working_beside_oauth(http: httpx.AsyncClient) -> None:
    assert (await modern.put_record(http, "keys", "1", {}, auth="static-key")) == "mcpb://acme/keys/1"


async def test_an_opaque_token_is_introspected_once_then_remembered(authority: Authority,
                                                                    http: httpx.AsyncClient) -> None:
    name = tenant()
    token = authority.opaque(tenant=name, sub="svc")
    for _ in range(2):
        assert (await modern.put_record(http, "opaque", "1", {}, auth=token)) == f"mcpb://{name}/opaque/1"
    assert [asked for kind, asked in authority.requests if kind == "introspect"].count(token) == 1


# -- bad tokens --------------------------------------------------------------------------------
BAD: dict[str, Callable[[Authority], str]] = {
    "wrong audience": lambda a: a.mint(aud="http://127.0.0.1:1/mcp"),
    "expired": lambda a: a.mint(exp=1_000_000, iat=999_000),
    "not yet valid": lambda a: a.mint(nbf=4_000_000_000),
    "issued in the future": lambda a: a.mint(iat=4_000_000_000),
    "wrong issuer": lambda a: a.mint(iss="http://127.0.0.1:1"),
    "no exp": lambda a: a.mint(exp=None),
    "unknown kid": lambda a: a.mint(kid="nobody", key=a.rsa, alg="RS256"),
    "alg none": lambda a: a.unsigned(),
    "tampered signature": lambda a: (lambda t: t[:-6] + ("AAAAAA" if not t.endswith("AAAAAA") else "BBBBBB"))(a.mint()),
    "tampered claims": lambda a: (lambda h, p, s: ".".join((h, a.mint("other").split(".")[1], s)))(
        *a.mint().split(".")),
    "HS256 with the public key": lambda a: a.hs256_with_public_key(),
    "no tenant": lambda a: a.mint(None),
    "not a tenant name": lambda a: a.mint("../etc"),
    "no subject": lambda a: a.mint(sub=None),
    "inactive opaque token": lambda a: a.opaque(active=False),
    "unknown opaque token": lambda a: "opaque-never-issued",
}


@pytest.mark.parametrize("case", sorted(BAD))
async def test_a_bad_token_is_refused_on_every_front_door(case: str, broker: BrokerProcess, authority: Authority,
                                                          http: httpx.AsyncClient) -> None:
    token = BAD[case](authority)
    answers = [await McpSession(http, auth=token).post(INITIALIZE),
               await modern.call(http, "resources/list", auth=token),
               await http.post("/changes", json={"uri": "x:a"}, headers={"Authorization": f"Bearer {token}"}),
               await http.get("/collections", headers={"Authorization": f"Bearer {token}"})]
    for answer in answers:
        assert answer.status_code == 401, answer.text
        challenge = answer.headers["www-authenticate"]
        assert challenge.startswith('Bearer error="invalid_token", error_description="'), challenge
        assert challenge.endswith(pointer(broker))


async def test_a_rotated_signing_key_is_picked_up_by_its_first_token(broker: BrokerProcess,
                                                                      authority: Authority) -> None:
    token = authority.mint(tenant(), kid=authority.rotate())
    wait_until(lambda: httpx.get(broker.url + "/collections", headers={"Authorization": f"Bearer {token}"},
                                 timeout=TIMEOUT).status_code == 200, TIMEOUT, "the new key to be accepted")


# -- tenants -----------------------------------------------------------------------------------
async def test_a_token_for_one_tenant_never_reaches_another(authority: Authority, http: httpx.AsyncClient) -> None:
    mine, theirs = tenant(), tenant()
    a, b = authority.mint(mine), authority.mint(theirs)
    their_uri = await modern.put_record(http, "secrets", "1", {"v": 1}, auth=b)
    my_uri = await modern.put_record(http, "secrets", "1", {"v": "mine"}, auth=a)
    assert my_uri != their_uri
    headers = {"Authorization": f"Bearer {a}"}
    assert (await http.get("/collections/secrets/1", headers=headers)).json() == {"v": "mine"}
    assert (await http.post("/changes", json={"uri": their_uri}, headers=headers)).status_code == 403
    session = await McpSession(http, auth=a).initialize()
    assert "error" in await session.call("resources/read", {"uri": their_uri})
    listed = await session.result("resources/list")
    assert all(r["uri"].startswith(f"mcpb://{mine}/") for r in listed["resources"]) and listed["resources"]
    modern_read = await modern.call(http, "resources/read", {"uri": their_uri}, name=their_uri, auth=a)
    assert "error" in modern_read.json()
    refused = await session.call("resources/subscribe", {"uri": their_uri})
    assert refused["error"]["code"] == -32002  # as if it did not exist
    body = modern.request("subscriptions/listen", {"notifications": {"resourceSubscriptions": [their_uri]}})
    listen = await http.post("/mcp", content=orjson.dumps(body), headers=modern.headers("subscriptions/listen",
                                                                                         auth=a))
    assert listen.headers["content-type"].startswith("application/json") and "error" in listen.json()


# -- the authorization server away at start ----------------------------------------------------
async def test_an_issuer_down_at_start_gives_503_with_retry_after_then_recovers() -> None:
    port = free_port()
    audience = f"http://127.0.0.1:{port}/mcp"
    issuer = IssuerServer(audience)  # not started: nothing listens on its port yet
    with BrokerProcess(env=oauth_env(issuer.url, audience), port=port) as broker:
        token = issuer.authority.mint(tenant())
        async with httpx.AsyncClient(base_url=broker.url, timeout=TIMEOUT) as http:
            rpc = await McpSession(http, auth=token).post(INITIALIZE)
            assert rpc.status_code == 503 and int(rpc.headers["retry-after"]) >= 1
            assert rpc.json()["error"]["message"].startswith("Service unavailable")
            rest = await http.get("/collections", headers={"Authorization": f"Bearer {token}"})
            assert rest.status_code == 503 and "retry-after" in rest.headers
            # A token that is no JWT, with introspection unreachable too: 503 as well, never a 401 or a 500.
            assert (await http.get("/collections", headers={"Authorization": "Bearer opaque-x"})).status_code == 503
            assert (await http.get("/collections")).status_code == 401  # no token: nothing to check
            with issuer:
                wait_until(lambda: httpx.get(broker.url + "/collections", headers={"Authorization": f"Bearer {token}"},
                                             timeout=TIMEOUT).status_code == 200, TIMEOUT, "the issuer to be found")


# -- the official SDK --------------------------------------------------------------------------
@asynccontextmanager
async def sdk(broker: BrokerProcess, mode: str, message_handler: Any = None, **client: Any) -> AsyncIterator[Client]:
    async with httpx2.AsyncClient(timeout=TIMEOUT, **client) as http_client, \
            Client(streamable_http_client(broker.mcp_url, http_client=http_client), mode=mode,
                   read_timeout_seconds=TIMEOUT, message_handler=message_handler) as session:
        yield session


@pytest.mark.parametrize("mode", ["legacy", "2026-07-28"])
async def test_the_sdk_client_with_a_token_works(mode: str, broker: BrokerProcess, authority: Authority,
                                                 http: httpx.AsyncClient) -> None:
    name = tenant()
    token = authority.mint(name)
    uri = await modern.put_record(http, "sdk", "1", {"mode": mode}, auth=token)
    inbox = Inbox()
    async with sdk(broker, mode, headers={"Authorization": f"Bearer {token}"}, message_handler=inbox.handler) \
            as client:
        read = await client.read_resource(uri)
        assert orjson.loads(read.contents[0].text) == {"mode": mode}  # type: ignore[union-attr]
        if mode == "legacy":  # subscribed on the session's stream, which carries the token too
            await client.subscribe_resource(uri)
            await modern.put_record(http, "sdk", "1", {"mode": "changed"}, auth=token)
            await inbox.wait_for(types.ResourceUpdatedNotification, uri)


class Memory:
    """Token storage for the SDK's OAuth client, in memory."""

    def __init__(self) -> None:
        self.tokens: OAuthToken | None = None
        self.client: OAuthClientInformationFull | None = None

    async def get_tokens(self) -> OAuthToken | None:
        return self.tokens

    async def set_tokens(self, tokens: OAuthToken) -> None:
        self.tokens = tokens

    async def get_client_info(self) -> OAuthClientInformationFull | None:
        return self.client

    async def set_client_info(self, client_info: OAuthClientInformationFull) -> None:
        self.client = client_info


@pytest.mark.parametrize("mode", ["legacy", "2026-07-28"])
async def test_the_sdk_oauth_client_finds_the_issuer_from_the_401_and_gets_a_token(
        mode: str, broker: BrokerProcess, authority: Authority, http: httpx.AsyncClient) -> None:
    name, client_id = tenant(), "machine-" + secrets.token_hex(3)
    secret = authority.register(client_id, tenant=name)
    uri = await modern.put_record(http, "sdk-oauth", "1", {"mode": mode}, auth=authority.mint(name))
    storage = Memory()
    provider = ClientCredentialsOAuthProvider(broker.mcp_url, storage, client_id, secret, issuer=authority.issuer)
    async with sdk(broker, mode, auth=provider) as client:
        read = await client.read_resource(uri)
        assert orjson.loads(read.contents[0].text) == {"mode": mode}  # type: ignore[union-attr]
    asked = [form for kind, form in authority.requests if kind == "token" and form.get("resource")]
    assert asked and asked[-1]["resource"] == broker.mcp_url  # RFC 8707: the token was asked for this server
    assert storage.tokens is not None and set(storage.tokens.scope.split()) == set(SCOPES)  # type: ignore[union-attr]


async def test_the_token_scopes_are_the_principal_scopes(broker: BrokerProcess, authority: Authority,
                                                         http: httpx.AsyncClient) -> None:
    read_only = authority.mint(tenant(), scope="resources:read")
    answer = await http.put("/collections/scoped/1", json={}, headers={"Authorization": f"Bearer {read_only}"})
    assert answer.status_code == 403
    assert answer.headers["www-authenticate"] == \
        'Bearer error="insufficient_scope", scope="records:write", ' + pointer(broker)
    assert (await http.get("/collections", headers={"Authorization": f"Bearer {read_only}"})).status_code == 200


async def test_streams_end_when_their_token_expires(authority: Authority, http: httpx.AsyncClient) -> None:
    """A legacy GET stream ends with ``retry:`` (the client comes back with a fresh token), a listen
    with its ``complete`` result, both within a few seconds of when the broker stops accepting the
    token (its ``exp`` plus the leeway)."""
    name = tenant()
    expires = int(time.time()) + 3
    token = authority.mint(name, exp=expires)
    uri = f"mcpb://{name}/things/x"
    session = await McpSession(http, auth=token).initialize()
    await session.subscribe(uri)
    async with session.stream() as stream, modern.listen(http, [uri], auth=token) as listen:
        assert (await listen.next())["method"] == "notifications/subscriptions/acknowledged"  # type: ignore[index]
        final = None
        async with asyncio.timeout(expires + LEEWAY - time.time() + 5):
            while True:
                try:
                    final = await stream.next_event(timeout=30)
                except StreamEnded:
                    break
            legacy_ended = time.time()
            last = None
            while (message := await listen.next(timeout=30)) is not None:
                last = message
            listen_ended = time.time()
    # The last event is a bare ``retry:`` (the priming event, which also names a retry, has an id).
    assert final is not None and final.retry is not None and final.id is None and not final.data, final
    assert last is not None and last["result"]["resultType"] == "complete", last
    for ended in (legacy_ended, listen_ended):
        assert expires + LEEWAY - 1 <= ended <= expires + LEEWAY + 5, (ended, expires)
