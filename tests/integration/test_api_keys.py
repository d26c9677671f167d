"""Runtime API keys, for real: ``mcp-broker keys`` subprocesses and a broker on a private redis-server.

The broker runs with ``MCP_BROKER_AUTH=keys`` and no static key at all: every caller comes with a
key the CLI (or the admin REST API) put in Redis, and the key works on ``/mcp`` in both eras and
on the REST API. A revoked key gets 401 within seconds; a stream opened with a short-lived key
ends with ``retry:`` (a listen with its ``complete`` result) within seconds of the key's expiry.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from tests.distributed.scenario import UPDATED, uris
from tests.integration import modern
from tests.integration.mcp_http import McpSession, publish
from tests.keys_support import create_key, keys_cli, revoke_key
from tests.support import BrokerProcess, RedisProcess, wait_until

TENANT = "acme"


@pytest.fixture(scope="module")
def redis() -> Iterator[RedisProcess]:
    with RedisProcess() as server:
        yield server


@pytest.fixture(scope="module")
def env(redis: RedisProcess) -> dict[str, str]:
    """The settings the broker and the CLI share: stored keys only (no MCP_BROKER_API_KEYS)."""
    return {"MCP_BROKER_REDIS_URL": redis.url, "MCP_BROKER_AUTH": "keys", "MCP_BROKER_API_KEYS": "{}"}


@pytest.fixture(scope="module")
def broker(env: dict[str, str]) -> Iterator[BrokerProcess]:
    with BrokerProcess(env=env) as proc:
        yield proc


@pytest.fixture
async def http(broker: BrokerProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=broker.url, timeout=10) as client:
        yield client


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# -- the CLI ------------------------------------------------------------------------------------


def test_the_cli_creates_lists_and_revokes_keys_and_never_shows_a_secret_again(env: dict[str, str]) -> None:
    tenant = f"cli{secrets.token_hex(3)}"
    made = keys_cli(env, "create", "--tenant", tenant, "--subject", "alice", "--expires-in", "12h")
    assert made.returncode == 0, made.stderr
    key = made.stdout.strip()
    assert key.startswith("mcpb_") and len(key) == 48 and "\n" not in key  # alone on stdout
    assert "shown this once" in made.stderr
    listed = json.loads(keys_cli(env, "list", "--tenant", tenant, "--json").stdout)["keys"]
    assert len(listed) == 1
    view = listed[0]
    assert view["subject"] == "alice" and view["state"] == "active"
    assert view["scopes"] == ["resources:read", "resources:subscribe", "records:write", "changes:publish", "tools:call"]
    assert 12 * 3600 - 60 < view["expires_at"] - view["created_at"] <= 12 * 3600
    table = keys_cli(env, "list")
    assert table.returncode == 0 and view["id"] in table.stdout and tenant in table.stdout
    for shown in (table.stdout, json.dumps(listed)):
        assert key not in shown and key[5:] not in shown and "digest" not in shown
    assert keys_cli(env, "revoke", view["id"]).returncode == 0
    again = keys_cli(env, "revoke", view["id"])
    assert again.returncode == 1 and "revoked already" in again.stderr
    assert json.loads(keys_cli(env, "list", "--tenant", tenant, "--json").stdout)["keys"][0]["state"] == "revoked"


@pytest.mark.parametrize(("args", "says"), [
    (["create", "--tenant", "acme", "--subject", "x", "--scopes", "resources:read,nope"], "scopes: nope"),
    (["create", "--tenant", "acme", "--subject", "x", "--expires-in", "soon"], "--expires-in"),
    (["create", "--tenant", "acme", "--subject", "x", "--expires-in", "0"], "--expires-in"),
    (["create", "--tenant", "no/such", "--subject", "x"], "not a valid tenant name"),
    (["create", "--tenant", "acme", "--subject", "has space"], "subject"),
])
def test_the_cli_refuses_bad_input_with_one_line_and_exit_2(env: dict[str, str], args: list[str], says: str) -> None:
    done = keys_cli(env, *args)
    assert done.returncode == 2 and says in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stdout == ""


def test_the_cli_says_no_such_key_with_exit_1(env: dict[str, str]) -> None:
    done = keys_cli(env, "revoke", "0123456789abcdef")
    assert done.returncode == 1 and "no key" in done.stderr


def test_the_cli_needs_the_redis_the_workers_share(env: dict[str, str]) -> None:
    done = keys_cli({"MCP_BROKER_REDIS_URL": ""}, "list")
    assert done.returncode == 2 and "MCP_BROKER_REDIS_URL" in done.stderr


def test_a_bad_key_setting_stops_the_cli_with_one_line(env: dict[str, str]) -> None:
    done = keys_cli({**env, "MCP_BROKER_KEY_CACHE_SECONDS": "-1"}, "list")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [line for line in done.stderr.strip().splitlines()
                                                if "MCP_BROKER_KEY_CACHE_SECONDS" in line]


def test_the_cli_reports_an_unreachable_redis_with_exit_75() -> None:
    with RedisProcess() as gone:
        url = gone.url
    done = keys_cli({"MCP_BROKER_REDIS_URL": url, "MCP_BROKER_REDIS_CONNECT_TIMEOUT": "0.5"}, "list")
    assert done.returncode == 75 and "could not be reached" in done.stderr


# -- a stored key on every front door ---------------------------------------------------------------


async def test_a_stored_key_works_on_mcp_in_both_eras_and_on_rest(env: dict[str, str], http: httpx.AsyncClient) -> None:
    key = create_key(env, TENANT, "alice").key
    legacy_uri, modern_uri = uris(2)
    session = await McpSession(http, auth=key).initialize()
    await session.subscribe(legacy_uri)
    async with session.stream() as stream:
        await stream.next_event()  # priming: the stream is claimed and reading
        await publish(http, legacy_uri, auth=key)
        assert (await stream.next_message()).uri == legacy_uri
    async with modern.listen(http, [modern_uri], auth=key) as listening:
        assert (await listening.next())["method"] == "notifications/subscriptions/acknowledged"  # type: ignore[index]
        await publish(http, modern_uri, auth=key)
        notified = await listening.next()
        assert notified is not None and notified["method"] == UPDATED and notified["params"]["uri"] == modern_uri
    uri = await modern.put_record(http, "keyed", "one", {"n": 1}, auth=key)
    assert uri == f"mcpb://{TENANT}/keyed/one"
    assert (await http.get("/collections/keyed/one", headers=bearer(key))).json() == {"n": 1}


async def test_without_a_stored_key_every_front_door_says_401(http: httpx.AsyncClient) -> None:
    forged = "mcpb_" + secrets.token_urlsafe(32)
    for headers in ({}, bearer(forged), bearer("not-a-key")):
        assert (await http.get("/collections", headers=headers)).status_code == 401
        response = await McpSession(http, auth=headers.get("Authorization", "")[7:] or None).post(
            {"jsonrpc": "2.0", "id": 1, "method": "ping"})
        assert response.status_code == 401
        assert response.headers["www-authenticate"].startswith("Bearer")
    answer = await http.get("/collections", headers=bearer(forged))
    assert 'error="invalid_token"' in answer.headers["www-authenticate"]


async def test_a_revoked_key_is_refused_within_seconds_without_a_restart(
        env: dict[str, str], broker: BrokerProcess, http: httpx.AsyncClient) -> None:
    made = create_key(env, TENANT, "bob")
    assert (await http.get("/collections", headers=bearer(made.key))).status_code == 200  # cached now
    revoke_key(env, made.id)
    revoked_at = time.monotonic()
    # The worker may answer from its lookup for MCP_BROKER_KEY_CACHE_SECONDS (2 by default).
    wait_until(lambda: httpx.get(f"{broker.url}/collections", headers=bearer(made.key)).status_code == 401,
               timeout=10, what="the revoked key refused")
    assert time.monotonic() - revoked_at < 10
    answer = await http.get("/collections", headers=bearer(made.key))
    assert "revoked" in answer.json()["detail"]


async def test_streams_of_a_short_lived_key_end_within_seconds_of_its_expiry(
        env: dict[str, str], http: httpx.AsyncClient) -> None:
    made = create_key(env, TENANT, "carol", "--expires-in", "3s")
    expires_at = made.view["expires_at"]
    watched = uris(1)
    session = await McpSession(http, auth=made.key).initialize()
    await session.subscribe(*watched)
    async with session.stream() as stream, modern.listen(http, watched, auth=made.key) as listening:
        await stream.next_event()
        assert (await listening.next())["method"] == "notifications/subscriptions/acknowledged"  # type: ignore[index]
        legacy_end = await stream.until_end(timeout=10)
        ended = time.time()
        final = await listening.next(timeout=5)
        assert await listening.next(timeout=5) is None  # then the listen's stream closes
    assert legacy_end and legacy_end[-1].retry is not None and legacy_end[-1].data in (None, "")  # retry:, no message
    assert final is not None and final["id"] == "listen-1" and final["result"]["resultType"] == "complete"
    print(f"the legacy stream ended {ended - expires_at:+.2f}s from the key's expiry")
    assert expires_at - 0.5 <= ended <= expires_at + 3  # ended at the expiry, within a few seconds
    # And it is not served again: the client must come back with a fresh credential.
    assert (await http.get("/collections", headers=bearer(made.key))).status_code == 401
    reconnect = await http.get("/mcp", headers={**session.headers(Accept="text/event-stream"), **bearer(made.key)})
    assert reconnect.status_code == 401
