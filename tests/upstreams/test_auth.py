"""The broker's own credentials at an upstream: a bearer token (file or variable, rotated), OAuth client
credentials (a token endpoint named or discovered), and what the upstream sees of them."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.upstreams.client import UpstreamClient, UpstreamUnavailable
from broker.upstreams.spec import AuthSpec
from tests.oauth_issuer import IssuerServer
from tests.upstreams.conftest import CLIENT_INFO, UpstreamProcess, eventually, spec_for


async def authorizations(upstream: UpstreamProcess) -> list[str | None]:
    return [entry["headers"].get("authorization") for entry in (await upstream.stats())["requests"]]


@pytest.fixture
def guarded() -> Iterator[UpstreamProcess]:
    """An upstream that takes one bearer token, T1."""
    proc = UpstreamProcess(tokens=("T1",))
    yield proc
    proc.stop()


async def test_a_bearer_token_file_is_read_again_after_a_401(guarded: UpstreamProcess, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("T1\n")
    client = UpstreamClient(spec_for(guarded.mcp_url, auth=AuthSpec(type="bearer", token_file=str(token_file))),
                            client_info=CLIENT_INFO)
    try:
        read, _ = await client.request("resources/read", {"uri": "note://1"})
        assert read["contents"]
        await guarded.side("PUT", "/tokens", {"tokens": ["T2"]})  # rotated at the upstream and in the file
        token_file.write_text("T2")
        read, _ = await client.request("resources/read", {"uri": "note://1"})
        assert read["contents"]
        seen = await authorizations(guarded)
        assert seen[-2:] == ["Bearer T1", "Bearer T2"]  # refused once, then read again
        await guarded.side("PUT", "/tokens", {"tokens": ["T3"]})  # the file was not rotated this time
        with pytest.raises(UpstreamUnavailable, match="refused the broker's credentials") as caught:
            await client.request("resources/read", {"uri": "note://1"})
        assert caught.value.upstream == "notes" and "T2" not in str(caught.value)
    finally:
        await client.aclose()


async def test_a_bearer_token_from_the_environment(guarded: UpstreamProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTES_TOKEN", "T1")
    client = UpstreamClient(spec_for(guarded.mcp_url, auth=AuthSpec(type="bearer", token_env="NOTES_TOKEN")),
                            client_info=CLIENT_INFO)
    try:
        read, _ = await client.request("resources/read", {"uri": "note://1"})
        assert read["contents"]
        monkeypatch.delenv("NOTES_TOKEN")
        client.auth.invalidate()
        with pytest.raises(UpstreamUnavailable, match="the bearer token variable NOTES_TOKEN is not set"):
            await client.request("resources/read", {"uri": "note://1"})
    finally:
        await client.aclose()


@pytest.fixture
def issuer() -> Iterator[IssuerServer]:
    with IssuerServer(audience="unused") as server:
        yield server


@pytest.mark.parametrize("named", [True, False], ids=["token-url", "discovered"])
async def test_client_credentials_for_the_upstream_as_resource(issuer: IssuerServer, tmp_path: Path,
                                                              named: bool) -> None:
    """A token for the upstream's URL as ``resource``, fetched once and kept; found through the upstream's
    protected resource metadata when no ``token_url`` is written."""
    secret = issuer.authority.register("broker-notes")
    secret_file = tmp_path / "secret"
    secret_file.write_text(secret)
    upstream = UpstreamProcess(issuer=issuer.url)
    auth = AuthSpec(type="client_credentials", client_id="broker-notes", client_secret_file=str(secret_file),
                    token_url=issuer.url + "/token" if named else None, scope="notes:read")
    client = UpstreamClient(spec_for(upstream.mcp_url, auth=auth), client_info=CLIENT_INFO)
    try:
        for _ in range(3):
            read, _ = await client.request("resources/read", {"uri": "note://1"})
            assert read["contents"]
        forms = [form for kind, form in issuer.authority.requests if kind == "token"]
        assert len(forms) == 1
        assert forms[0] == {"grant_type": "client_credentials", "client_id": "broker-notes", "client_secret": secret,
                            "resource": upstream.mcp_url, "scope": "notes:read"}
        assert set(await authorizations(upstream)) == {(await client.auth.headers())["Authorization"]}
    finally:
        await client.aclose()
        upstream.stop()


async def test_a_client_credentials_token_is_renewed_before_it_expires(issuer: IssuerServer,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    issuer.authority.token_lifetime = 3
    monkeypatch.setenv("NOTES_SECRET", issuer.authority.register("broker-notes"))
    upstream = UpstreamProcess(issuer=issuer.url)
    auth = AuthSpec(type="client_credentials", client_id="broker-notes", client_secret_env="NOTES_SECRET",
                    token_url=issuer.url + "/token")
    client = UpstreamClient(spec_for(upstream.mcp_url, auth=auth), client_info=CLIENT_INFO)
    try:
        async def renewed() -> bool:
            read, _ = await client.request("resources/read", {"uri": "note://1"})  # each one answered
            assert read["contents"]
            return client.auth.fetches >= 2

        await eventually(renewed, "a second token")
    finally:
        await client.aclose()
        upstream.stop()


async def test_credentials_that_cannot_be_had_name_what_failed(issuer: IssuerServer, tmp_path: Path) -> None:
    wrong = tmp_path / "secret"
    wrong.write_text("not-the-secret-" + secrets.token_hex(4))
    issuer.authority.register("broker-notes")
    auth = AuthSpec(type="client_credentials", client_id="broker-notes", client_secret_file=str(wrong),
                    token_url=issuer.url + "/token")
    client = UpstreamClient(spec_for("http://127.0.0.1:9/mcp", auth=auth), client_info=CLIENT_INFO)
    try:
        with pytest.raises(UpstreamUnavailable) as caught:
            await client.request("resources/read", {"uri": "note://1"})
        message = str(caught.value)
        assert "upstream 'notes'" in message and "answered HTTP 401 (invalid_client)" in message
        assert wrong.read_text() not in message
        missing = AuthSpec(type="client_credentials", client_id="broker-notes",
                           client_secret_file=str(tmp_path / "absent"), token_url=issuer.url + "/token")
        other = UpstreamClient(spec_for("http://127.0.0.1:9/mcp", auth=missing), client_info=CLIENT_INFO)
        with pytest.raises(UpstreamUnavailable, match="the client secret file .*absent cannot be read"):
            await other.request("resources/read", {"uri": "note://1"})
        await other.aclose()
    finally:
        await client.aclose()
