"""The admin REST API (``/admin/keys``) of a real broker on a private redis-server, stored keys only.

A tenant's admin (a key with ``keys:admin``, made by the operator's CLI) manages its own
tenant's keys and nothing else: another tenant's key is "not found", a key for another tenant
or with a scope it lacks is 403, and a caller without the admin scope gets 403 naming it in
``WWW-Authenticate``. Without stored keys there is no admin API at all.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from broker.auth import SCOPES
from tests.keys_support import Key, create_key
from tests.support import BrokerProcess, RedisProcess

ALL = ",".join([*SCOPES, "keys:admin"])


@pytest.fixture(scope="module")
def env() -> Iterator[dict[str, str]]:
    with RedisProcess() as redis:
        yield {"MCP_BROKER_REDIS_URL": redis.url, "MCP_BROKER_AUTH": "keys"}


@pytest.fixture(scope="module")
def broker(env: dict[str, str]) -> Iterator[BrokerProcess]:
    with BrokerProcess(env=env) as proc:
        yield proc


@pytest.fixture
def tenant() -> str:
    return f"t{secrets.token_hex(3)}"


@pytest.fixture
def admin(env: dict[str, str], tenant: str) -> Key:
    return create_key(env, tenant, "root", "--scopes", ALL)


@pytest.fixture
async def http(broker: BrokerProcess, admin: Key) -> AsyncIterator[httpx.AsyncClient]:
    """A client that calls as the tenant's admin."""
    async with httpx.AsyncClient(base_url=broker.url, timeout=10, headers=bearer(admin.key)) as client:
        yield client


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def make(http: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    response = await http.post("/admin/keys", json={"subject": "alice", **body})
    assert response.status_code == 201, response.text
    made: dict[str, Any] = response.json()
    return made


async def test_an_admin_makes_a_key_that_works_at_once_and_is_shown_only_then(
        http: httpx.AsyncClient, tenant: str) -> None:
    made = await make(http, scopes=["resources:read"], expires_in="1h")
    assert made["key"].startswith("mcpb_") and made["tenant"] == tenant and made["state"] == "active"
    assert made["scopes"] == ["resources:read"] and 3590 < made["expires_at"] - made["created_at"] <= 3600
    assert (await http.get("/collections", headers=bearer(made["key"]))).status_code == 200
    listed = (await http.get("/admin/keys")).json()["keys"]
    assert {k["id"] for k in listed} >= {made["id"]}
    one = (await http.get(f"/admin/keys/{made['id']}")).json()
    assert one == {k: v for k, v in made.items() if k != "key"}
    assert all("key" not in k and "digest" not in k for k in [*listed, one])
    # A read-only key may read, not write.
    denied = await http.put("/collections/c/1", json={}, headers=bearer(made["key"]))
    assert denied.status_code == 403


async def test_revoking_answers_the_revoked_record_then_409_and_the_key_stops(http: httpx.AsyncClient) -> None:
    made = await make(http)
    revoked = await http.delete(f"/admin/keys/{made['id']}")
    assert revoked.status_code == 200 and revoked.json()["state"] == "revoked" and revoked.json()["revoked_at"]
    assert (await http.delete(f"/admin/keys/{made['id']}")).status_code == 409
    # This worker forgets its cached lookup within MCP_BROKER_KEY_CACHE_SECONDS (2).
    async with httpx.AsyncClient(base_url=str(http.base_url), timeout=10) as other:
        for _ in range(200):
            if (await other.get("/collections", headers=bearer(made["key"]))).status_code == 401:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the revoked key kept working")


async def until_refused(base_url: str, key: str) -> None:
    """Wait (within the key cache's 2 s) until ``key`` gets 401."""
    async with httpx.AsyncClient(base_url=base_url, timeout=10) as other:
        for _ in range(200):
            if (await other.get("/collections", headers=bearer(key))).status_code == 401:
                return
            await asyncio.sleep(0.05)
    raise AssertionError("the key kept working")


async def test_keys_made_with_a_key_are_revoked_with_it_at_any_depth(http: httpx.AsyncClient) -> None:
    """Whoever holds an admin key cannot keep access by minting a child (and a grandchild) first."""
    parent = await make(http, scopes=["resources:read", "keys:admin"])
    child = (await http.post("/admin/keys", json={"subject": "c", "scopes": ["resources:read", "keys:admin"]},
                             headers=bearer(parent["key"]))).json()
    assert child["created_by"] == parent["id"]
    grandchild = (await http.post("/admin/keys", json={"subject": "g", "scopes": ["resources:read"]},
                                  headers=bearer(child["key"]))).json()
    bystander = await make(http, scopes=["resources:read"])
    assert (await http.delete(f"/admin/keys/{parent['id']}")).status_code == 200
    for made in (child, grandchild):
        assert (await http.get(f"/admin/keys/{made['id']}")).json()["state"] == "revoked"
        await until_refused(str(http.base_url), made["key"])
    assert (await http.get(f"/admin/keys/{bystander['id']}")).json()["state"] == "active"


async def test_a_key_made_with_an_expiring_key_expires_no_later(http: httpx.AsyncClient) -> None:
    parent = await make(http, scopes=["resources:read", "keys:admin"], expires_in="10m")
    child = (await http.post("/admin/keys", json={"subject": "c", "scopes": ["resources:read"]},
                             headers=bearer(parent["key"]))).json()
    assert child["expires_at"] == parent["expires_at"]  # asked for no expiry: capped at its maker's
    longer = (await http.post("/admin/keys", json={"subject": "c", "scopes": ["resources:read"], "expires_in": "1d"},
                              headers=bearer(parent["key"]))).json()
    assert longer["expires_at"] == parent["expires_at"]


async def test_a_tenant_admin_manages_only_its_own_tenant(env: dict[str, str], http: httpx.AsyncClient,
                                                          tenant: str) -> None:
    stranger = create_key(env, f"o{secrets.token_hex(3)}", "bob")
    assert (await http.get(f"/admin/keys/{stranger.id}")).status_code == 404
    assert (await http.delete(f"/admin/keys/{stranger.id}")).status_code == 404
    assert stranger.id not in {k["id"] for k in (await http.get("/admin/keys", params={"limit": 1000})).json()["keys"]}
    other_tenant = await http.post("/admin/keys", json={"tenant": "elsewhere", "subject": "x"})
    assert other_tenant.status_code == 403
    assert (await http.post("/admin/keys", json={"tenant": tenant, "subject": "x"})).status_code == 201


async def test_an_admin_grants_only_scopes_it_holds(env: dict[str, str], broker: BrokerProcess, tenant: str) -> None:
    narrow = create_key(env, tenant, "helper", "--scopes", "keys:admin,resources:read")
    async with httpx.AsyncClient(base_url=broker.url, timeout=10, headers=bearer(narrow.key)) as http:
        assert (await http.post("/admin/keys", json={"subject": "x", "scopes": ["records:write"]})).status_code == 403
        default = await make(http)  # by default: the data scopes it holds
        assert default["scopes"] == ["resources:read"]


async def test_a_caller_without_the_admin_scope_gets_403_naming_it(env: dict[str, str], broker: BrokerProcess,
                                                                   tenant: str) -> None:
    user = create_key(env, tenant, "alice")
    async with httpx.AsyncClient(base_url=broker.url, timeout=10, headers=bearer(user.key)) as http:
        for method, path in (("GET", "/admin/keys"), ("POST", "/admin/keys"), ("DELETE", f"/admin/keys/{user.id}")):
            response = await http.request(method, path)
            assert response.status_code == 403, (method, response.text)
            assert response.headers["www-authenticate"] == 'Bearer error="insufficient_scope", scope="keys:admin"'


async def test_the_admin_api_needs_credentials(broker: BrokerProcess) -> None:
    async with httpx.AsyncClient(base_url=broker.url, timeout=10) as anonymous:
        for path in ("/admin/keys", "/admin/keys/0123456789abcdef", "/admin", "/admin/other"):
            assert (await anonymous.get(path)).status_code == 401, path


@pytest.mark.parametrize(("body", "status"), [
    (b"not json", 400),
    (b"[]", 422),
    (b'{"subject": "x", "colour": "red"}', 422),
    (b'{"scopes": ["resources:read"]}', 422),
    (b'{"subject": "x", "scopes": "resources:read"}', 422),
    (b'{"subject": "x", "scopes": ["nope"]}', 422),
    (b'{"subject": "x", "scopes": []}', 422),
    (b'{"subject": "x", "expires_in": -5}', 422),
    (b'{"subject": "x", "expires_in": true}', 422),
    (b'{"subject": "x", "expires_in": "forever"}', 422),
    (b'{"subject": ""}', 422),
    (b'{"subject": "x", "tenant": 7}', 422),
    (b'{"subject": "' + b"x" * 5000 + b'"}', 413),
])
async def test_a_bad_create_gets_the_precise_status(http: httpx.AsyncClient, body: bytes, status: int) -> None:
    response = await http.post("/admin/keys", content=body, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    assert "detail" in response.json()


async def test_unknown_and_malformed_ids(http: httpx.AsyncClient) -> None:
    assert (await http.get("/admin/keys/0123456789abcdef")).status_code == 404
    assert (await http.delete("/admin/keys/0123456789abcdef")).status_code == 404
    assert (await http.get("/admin/keys/NOT-AN-ID")).status_code == 422
    assert (await http.get("/admin/keys", params={"limit": 0})).status_code == 422


async def test_the_listing_pages(http: httpx.AsyncClient, admin: Key) -> None:
    made = {(await make(http, subject=f"u{n}"))["id"] for n in range(4)}
    seen: list[str] = []
    after = ""
    while True:
        page = (await http.get("/admin/keys", params={"limit": 2, "after": after})).json()
        seen += [k["id"] for k in page["keys"]]
        if "next" not in page:
            break
        after = page["next"]
    assert seen == sorted(seen) and set(seen) == made | {admin.id}


async def test_without_stored_keys_there_is_no_admin_api() -> None:
    with BrokerProcess() as anonymous:  # no credentials configured: everyone is anonymous
        assert httpx.get(anonymous.url + "/admin/keys").status_code == 404
        assert httpx.post(anonymous.url + "/admin/keys", json={"subject": "x"}).status_code == 404


async def test_keys_minted_while_their_maker_is_revoked_never_stay_active(http: httpx.AsyncClient) -> None:
    """A holder who keeps minting while its key is revoked keeps nothing: the worker still answers from
    its cached lookup of the revoked key for a moment, but a key made after the revocation is refused
    when it is made, and one made before it is revoked with it."""
    maker = await make(http, scopes=["resources:read", "keys:admin"])
    minted: list[dict[str, Any]] = []
    refusals: list[int] = []

    async def mint(client: httpx.AsyncClient) -> None:
        while True:
            answer = await client.post("/admin/keys", json={"subject": "m", "scopes": ["resources:read"]},
                                       headers=bearer(maker["key"]))
            if answer.status_code != 201:
                refusals.append(answer.status_code)
                return
            minted.append(answer.json())

    async with httpx.AsyncClient(base_url=str(http.base_url), timeout=10) as minter:
        minting = [asyncio.create_task(mint(minter)) for _ in range(8)]
        while len(minted) < 8:  # under way
            await asyncio.sleep(0.01)
        assert (await http.delete(f"/admin/keys/{maker['id']}")).status_code == 200
        revoked_with_it = len(minted)
        await asyncio.gather(*minting)
    made = [k for k in (await http.get("/admin/keys", params={"limit": 1000})).json()["keys"]
            if k["created_by"] == maker["id"]]
    active = [k["id"] for k in made if k["state"] != "revoked"]
    print(f"{len(minted)} keys minted ({len(minted) - revoked_with_it} after the revocation answered), "
          f"{len(active)} still active; minting ended with {sorted(set(refusals))}")
    assert not active
    for key in minted:
        assert (await http.get("/collections", headers=bearer(key["key"]))).status_code == 401
