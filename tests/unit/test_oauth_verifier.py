"""The OAuth token verifier and the bearer composition, in process: the test authorization server's app
is reached through httpx's ASGI transport, and the key set's clock is a fake one the tests move."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from broker.auth import AuthUnavailable, Bearer, Principal, Unauthorized, authenticator_for
from broker.auth.identity import PEER
from broker.auth.jwks import FAILED_RETRY, IssuerKeys, discovery_urls
from broker.auth.oauth import OAuthTokens, metadata_paths, metadata_url
from broker.cli import _settings_problems
from broker.config import Settings
from broker.runtime import Broker
from broker.runtime.app import create_app
from tests.oauth_issuer import INTROSPECTOR, Authority

ISSUER = "http://issuer.test"
AUDIENCE = "https://broker.example.com/mcp"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Counting(httpx.AsyncBaseTransport):
    """The authority's app, counting requests per path; ``down`` makes every request fail to connect."""

    def __init__(self, authority: Authority) -> None:
        self.inner = httpx.ASGITransport(app=authority.app)
        self.paths: list[str] = []
        self.down = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.paths.append(request.url.path)
        if self.down:
            raise httpx.ConnectError("connection refused", request=request)
        return await self.inner.handle_async_request(request)


@pytest.fixture
def authority() -> Authority:
    return Authority(ISSUER, AUDIENCE)


@pytest.fixture
async def wired(authority: Authority) -> AsyncIterator[tuple[OAuthTokens, Counting, Clock]]:
    transport, clock = Counting(authority), Clock()
    async with httpx.AsyncClient(transport=transport) as http:
        tokens = OAuthTokens(ISSUER, AUDIENCE, refresh_interval=30.0, http=http,
                             introspection_url=ISSUER + "/introspect", client_id=INTROSPECTOR[0],
                             client_secret=INTROSPECTOR[1])
        tokens.keys = IssuerKeys(ISSUER, http, refresh_interval=30.0, clock=clock)
        yield tokens, transport, clock


async def test_a_valid_token_becomes_its_principal_with_scopes_and_expiry(
        wired: tuple[OAuthTokens, Counting, Clock], authority: Authority) -> None:
    tokens, _, _ = wired
    for kid in ("rsa-1", "ec-1"):
        claims = authority.claims("acme", sub="svc-1", scope="resources:read changes:publish")
        principal = await tokens.verify(authority.mint(kid=kid, **claims))
        assert principal == Principal("acme", "svc-1")
        assert principal.scopes == {"resources:read", "changes:publish"}
        assert principal.expires_at == claims["exp"] + 30.0  # accepted until exp plus the leeway: streams too


@pytest.mark.parametrize(("claims", "expected"), [
    ({"scope": None, "scp": ["resources:read", "records:write"]}, {"resources:read", "records:write"}),
    ({"scope": None, "scp": "resources:read"}, {"resources:read"}),
    ({"scope": None}, set()),  # a token that grants nothing holds nothing
])
async def test_scopes_come_from_scope_or_scp(wired: tuple[OAuthTokens, Counting, Clock], authority: Authority,
                                             claims: dict[str, Any], expected: set[str]) -> None:
    principal = await wired[0].verify(authority.mint(**claims))
    assert principal is not None and principal.scopes == expected


async def test_the_audience_may_be_one_of_several(wired: tuple[OAuthTokens, Counting, Clock],
                                                  authority: Authority) -> None:
    assert await wired[0].verify(authority.mint(aud=["https://other.example.com", AUDIENCE])) is not None
    with pytest.raises(Unauthorized, match="aud"):
        await wired[0].verify(authority.mint(aud=["https://other.example.com"]))


async def test_an_unknown_kid_refreshes_the_key_set_at_most_once_per_interval(
        wired: tuple[OAuthTokens, Counting, Clock], authority: Authority) -> None:
    tokens, transport, clock = wired
    assert await tokens.verify(authority.mint()) is not None
    assert tokens.keys.fetches == 1
    forged = authority.mint(kid="nobody", key=authority.rsa, alg="RS256")
    for _ in range(5):  # a stream of unknown key ids costs the server nothing more within the interval
        with pytest.raises(Unauthorized, match="does not publish"):
            await tokens.verify(forged)
    assert tokens.keys.fetches == 1
    kid = authority.rotate()
    rotated = authority.mint(kid=kid)
    with pytest.raises(Unauthorized):
        await tokens.verify(rotated)  # still within the interval: not fetched yet
    clock.now += 30.0
    assert await tokens.verify(rotated) is not None
    assert tokens.keys.fetches == 2
    assert transport.paths.count("/jwks") == 2 and transport.paths.count("/.well-known/oauth-authorization-server") == 1


async def test_an_unreachable_server_is_unavailable_never_an_acceptance_and_is_asked_again_later(
        wired: tuple[OAuthTokens, Counting, Clock], authority: Authority) -> None:
    tokens, transport, clock = wired
    transport.down = True
    with pytest.raises(AuthUnavailable) as info:
        await tokens.verify(authority.mint())
    assert info.value.retry_after >= 1
    asked = len(transport.paths)
    with pytest.raises(AuthUnavailable):
        await tokens.verify(authority.mint())
    assert len(transport.paths) == asked  # within FAILED_RETRY: not asked again
    transport.down = False
    clock.now += FAILED_RETRY
    assert await tokens.verify(authority.mint()) is not None


async def test_keys_fetched_before_stay_in_use_when_a_later_fetch_fails(
        wired: tuple[OAuthTokens, Counting, Clock], authority: Authority) -> None:
    tokens, transport, clock = wired
    assert await tokens.verify(authority.mint()) is not None
    transport.down = True
    clock.now += 4000  # the set is stale: fetched again, which fails
    assert await tokens.verify(authority.mint()) is not None


async def test_metadata_naming_another_issuer_is_not_used(authority: Authority) -> None:
    authority.issuer = "http://impostor.test"  # what its metadata says; the tokens would name it too
    async with httpx.AsyncClient(transport=Counting(authority)) as http:
        tokens = OAuthTokens(ISSUER, AUDIENCE, http=http)
        with pytest.raises(AuthUnavailable):
            await tokens.verify(authority.mint(iss=ISSUER))


async def test_openid_configuration_is_the_fallback_and_issuers_with_a_path_insert_the_well_known_part() -> None:
    assert discovery_urls("https://as.example.com") == [
        "https://as.example.com/.well-known/oauth-authorization-server",
        "https://as.example.com/.well-known/openid-configuration"]
    assert discovery_urls("https://as.example.com/realms/x/") == [
        "https://as.example.com/.well-known/oauth-authorization-server/realms/x",
        "https://as.example.com/realms/x/.well-known/openid-configuration",
        "https://as.example.com/.well-known/openid-configuration/realms/x"]

    def openid_only(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/realms/x/.well-known/openid-configuration":
            return httpx.Response(200, json={"issuer": "https://as.example.com/realms/x", "jwks_uri": "https://k"})
        return httpx.Response(404)

    async with httpx.AsyncClient(transport=httpx.MockTransport(openid_only)) as http:
        metadata = await IssuerKeys("https://as.example.com/realms/x", http).metadata()
    assert metadata.jwks_uri == "https://k"


async def test_opaque_tokens_are_introspected_checked_and_cached(
        wired: tuple[OAuthTokens, Counting, Clock], authority: Authority) -> None:
    tokens, transport, _ = wired
    token = authority.opaque(tenant="globex", sub="bob")
    assert await tokens.verify(token) == Principal("globex", "bob")
    assert await tokens.verify(token) == Principal("globex", "bob")
    assert transport.paths.count("/introspect") == 1
    for bad in (authority.opaque(active=False), authority.opaque(aud="https://other.example.com"),
                authority.opaque(iss="http://other.test"), authority.opaque(exp=1), authority.opaque(tenant=None)):
        with pytest.raises(Unauthorized):
            await tokens.verify(bad)


async def test_a_refused_token_is_remembered_and_one_token_is_asked_about_once_at_a_time(
        wired: tuple[OAuthTokens, Counting, Clock], authority: Authority) -> None:
    """Made-up tokens sent again and again, or many at once, do not each become a question to the server."""
    tokens, transport, _ = wired
    bad = authority.opaque(active=False)
    for _ in range(5):
        with pytest.raises(Unauthorized):
            await tokens.verify(bad)
    assert transport.paths.count("/introspect") == 1
    good = authority.opaque(tenant="globex", sub="carol")
    answers = await asyncio.gather(*(tokens.verify(good) for _ in range(20)))
    assert set(answers) == {Principal("globex", "carol")}
    assert transport.paths.count("/introspect") == 2


class Held(Counting):
    """The authority's app, but a request for a path in ``held`` (an introspection: of a token
    starting ``made-up``) waits until ``release`` is set."""

    def __init__(self, authority: Authority, *held: str) -> None:
        super().__init__(authority)
        self.held = set(held)
        self.release = asyncio.Event()
        self.waiting = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path in self.held and (path != "/introspect" or b"made-up" in await request.aread()):
            self.waiting += 1
            await self.release.wait()
        return await super().handle_async_request(request)


async def test_a_peer_whose_token_was_refused_asks_through_a_small_pool_of_its_own(authority: Authority) -> None:
    """While a flood of made-up tokens from one address waits on the server, another address's valid
    token, never seen before, is asked about at once (not behind the flood in the shared places)."""
    transport = Held(authority, "/introspect")
    async with httpx.AsyncClient(transport=transport) as http:
        tokens = OAuthTokens(ISSUER, AUDIENCE, http=http, introspection_url=ISSUER + "/introspect",
                             client_id=INTROSPECTOR[0], client_secret=INTROSPECTOR[1], refused_peer_concurrency=2)

        async def verify(token: str, peer: str) -> Principal | None:
            PEER.set(peer)  # as the edge does, in the request's own task
            return await tokens.verify(token)

        with pytest.raises(Unauthorized, match="not active"):
            await verify("opaque-never-issued", "192.0.2.7")  # refused: that peer's questions go to its pool
        flood = [asyncio.create_task(verify(f"made-up-{n}", "192.0.2.7")) for n in range(40)]
        valid = authority.opaque(tenant="acme", sub="dora")
        assert await asyncio.wait_for(verify(valid, "198.51.100.1"), 5) == Principal("acme", "dora")
        assert transport.waiting == 2  # the flood holds its two places, and no more
        transport.release.set()
        refused = await asyncio.gather(*flood, return_exceptions=True)
        assert all(isinstance(answer, Unauthorized) for answer in refused)


async def test_what_is_no_bearer_token_is_refused_without_a_question(
        wired: tuple[OAuthTokens, Counting, Clock]) -> None:
    tokens, transport, _ = wired
    with pytest.raises(Unauthorized, match="RFC 6750"):
        await tokens.verify("not a token")
    assert "/introspect" not in transport.paths


async def test_checks_do_not_wait_for_a_refresh_of_an_old_key_set_that_has_their_key(
        authority: Authority) -> None:
    transport, clock = Held(authority), Clock()
    async with httpx.AsyncClient(transport=transport) as http:
        tokens = OAuthTokens(ISSUER, AUDIENCE, http=http)
        tokens.keys = IssuerKeys(ISSUER, http, clock=clock)
        assert await tokens.verify(authority.mint()) is not None
        transport.held.add("/jwks")  # the server stops answering for its keys
        clock.now += 4000  # the set is old: the next check fetches it again
        refreshing = asyncio.create_task(tokens.verify(authority.mint()))
        while not transport.waiting:
            await asyncio.sleep(0)
        assert await asyncio.wait_for(tokens.verify(authority.mint()), 5) is not None  # the keys in hand serve
        transport.release.set()
        assert await refreshing is not None


async def test_a_fetch_that_never_completes_is_unavailable_after_its_deadline(authority: Authority) -> None:
    transport = Held(authority, "/jwks")
    async with httpx.AsyncClient(transport=transport) as http:
        tokens = OAuthTokens(ISSUER, AUDIENCE, http=http, fetch_timeout=0.2)
        with pytest.raises(AuthUnavailable):
            await asyncio.wait_for(tokens.verify(authority.mint()), 5)


@pytest.mark.parametrize("exp", ["99999999999", True, 1e12])
async def test_an_exp_that_is_not_a_time_is_refused_not_a_crash(wired: tuple[OAuthTokens, Counting, Clock],
                                                                authority: Authority, exp: object) -> None:
    tokens, _, _ = wired
    with pytest.raises(Unauthorized):
        await tokens.verify(authority.opaque(exp=exp))


async def test_a_signed_exp_too_large_for_a_float_is_refused_not_a_crash(
        wired: tuple[OAuthTokens, Counting, Clock], authority: Authority) -> None:
    tokens, _, _ = wired
    with pytest.raises(Unauthorized, match="out of range"):
        await tokens.verify(authority.mint(exp=10**400))


async def test_stored_keys_and_opaque_tokens_without_introspection_are_not_oauths(authority: Authority) -> None:
    async with httpx.AsyncClient(transport=Counting(authority)) as http:
        tokens = OAuthTokens(ISSUER, AUDIENCE, http=http)
        assert await tokens.verify("not-a-jwt") is None
        assert await tokens.verify("mcpb_" + "x" * 40) is None
        assert http._transport.paths == []  # type: ignore[attr-defined]


async def test_bearer_asks_each_verifier_in_order_and_names_the_metadata_in_every_challenge(
        wired: tuple[OAuthTokens, Counting, Clock], authority: Authority) -> None:
    from broker.auth import ApiKeys

    bearer = Bearer([ApiKeys({"k1": "acme/robot"}), wired[0]], metadata_url(AUDIENCE))
    pointer = 'resource_metadata="https://broker.example.com/.well-known/oauth-protected-resource/mcp"'
    assert await bearer.authenticate({"authorization": "Bearer k1"}) == Principal("acme", "robot")
    assert await bearer.authenticate({"authorization": "bearer " + authority.mint()}) == Principal("acme", "alice")
    with pytest.raises(Unauthorized) as missing:
        await bearer.authenticate({})
    assert missing.value.challenge == "Bearer " + pointer
    with pytest.raises(Unauthorized) as refused:
        await bearer.authenticate({"authorization": "Bearer " + authority.mint(tenant='a"b')})
    assert refused.value.challenge.startswith('Bearer error="invalid_token", error_description="the token')
    assert refused.value.challenge.endswith(pointer) and refused.value.challenge.count('"') == 6


def test_the_metadata_is_served_at_the_root_and_path_forms_and_pointed_to_from_the_resource() -> None:
    assert metadata_url("https://b.example.com/mcp") == "https://b.example.com/.well-known/oauth-protected-resource/mcp"
    assert metadata_paths("https://b.example.com/mcp") == ("/.well-known/oauth-protected-resource",
                                                           "/.well-known/oauth-protected-resource/mcp")
    assert metadata_paths("https://b.example.com/p/mcp")[-1] == "/.well-known/oauth-protected-resource/p/mcp"


def test_methods_are_inferred_from_the_settings() -> None:
    def methods(**kw: Any) -> frozenset[str]:
        return Settings(_env_file=None, **kw).auth_methods  # type: ignore[call-arg]

    oauth = {"oauth_issuer": ISSUER, "oauth_audience": AUDIENCE}
    assert methods() == set()
    assert methods(api_keys={"k": "a/b"}) == {"keys"}
    assert methods(**oauth) == {"oauth"}
    assert methods(api_keys={"k": "a/b"}, **oauth) == {"keys", "oauth"}
    assert methods(api_keys={"k": "a/b"}, auth="oauth", **oauth) == {"oauth"}  # keys turned off
    bearer = authenticator_for(Settings(_env_file=None, auth="keys", api_keys={"k": "a/b"}, **oauth))  # type: ignore[call-arg]
    assert isinstance(bearer, Bearer) and bearer.resource_metadata is None


@pytest.fixture
def environment() -> Iterator[dict[str, str]]:
    saved = dict(os.environ)
    for name in [name for name in os.environ if name.startswith("MCP_BROKER_")]:
        del os.environ[name]
    yield os.environ  # type: ignore[misc]
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.parametrize(("env", "line"), [
    ({"MCP_BROKER_AUTH": "oauth"}, "MCP_BROKER_OAUTH_ISSUER: OAuth is on and needs the issuer"),
    ({"MCP_BROKER_AUTH": "keys,saml"}, "MCP_BROKER_AUTH: saml is not a method"),
    ({"MCP_BROKER_OAUTH_ISSUER": ISSUER}, "MCP_BROKER_OAUTH_AUDIENCE: OAuth is on and needs the audience"),
    ({"MCP_BROKER_OAUTH_ISSUER": "as.example.com", "MCP_BROKER_OAUTH_AUDIENCE": AUDIENCE},
     "MCP_BROKER_OAUTH_ISSUER: 'as.example.com' is not an http(s) URL"),
    ({"MCP_BROKER_OAUTH_ISSUER": ISSUER, "MCP_BROKER_OAUTH_AUDIENCE": "api://broker"},
     "MCP_BROKER_OAUTH_RESOURCE: 'api://broker' is not an http(s) URL"),
])
def test_incomplete_oauth_settings_stop_the_process_with_one_line(environment: dict[str, str], env: dict[str, str],
                                                                  line: str) -> None:
    environment.update(env)
    problems = _settings_problems()
    assert len(problems) == 1 and problems[0].startswith(line), problems


async def test_without_oauth_there_is_no_resource_metadata_and_challenges_stay_bare() -> None:
    broker = Broker(Settings(_env_file=None, api_keys={"k": "acme/a"}))  # type: ignore[call-arg]
    await broker.start()
    try:
        transport = httpx.ASGITransport(app=create_app(broker=broker))
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            assert (await client.get("/.well-known/oauth-protected-resource")).status_code == 404
            answer = await client.get("/collections", headers={"authorization": "Bearer nope"})
            assert answer.status_code == 401
            assert answer.headers["www-authenticate"] == 'Bearer error="invalid_token", error_description=' \
                '"unknown API key"'
    finally:
        await broker.stop()
