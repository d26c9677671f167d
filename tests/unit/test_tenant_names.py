"""Tenant names: which are valid, how a bad one in the settings is refused, and Redis key names."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from broker.backends.redis.keys import Keys
from broker.config import Settings
from broker.tenants import tenant_problem


@pytest.mark.parametrize("name", ["default", "acme", "a", "A-1", "team.eu_2", "9lives", "x" * 64])
def test_plain_names_are_valid(name: str) -> None:
    assert tenant_problem(name) is None


@pytest.mark.parametrize("name", ["", "a:b", "a/b", "a{b}", "-lead", ".hidden", "a b", "é", "x" * 65, "a%3A"])
def test_names_with_separators_braces_or_odd_characters_are_not(name: str) -> None:
    assert tenant_problem(name) is not None


def test_an_api_key_bound_to_a_bad_tenant_is_refused_with_what_to_write() -> None:
    with pytest.raises(ValidationError) as refused:
        Settings(_env_file=None, api_keys={"k1": "acme/alice", "k2": "a:b/bob"})  # type: ignore[call-arg]
    message = str(refused.value)
    assert "MCP_BROKER_API_KEYS" in message and "'a:b'" in message and "<tenant>/<subject>" in message


def test_a_bad_default_tenant_is_refused() -> None:
    with pytest.raises(ValidationError, match="MCP_BROKER_DEFAULT_TENANT"):
        Settings(_env_file=None, default_tenant="a:b")  # type: ignore[call-arg]


def test_valid_tenants_keep_the_key_names_they_had() -> None:
    keys = Keys("mcpb")
    assert keys.index("acme", "mcpb://acme/P/1") == "mcpb:{i:acme:mcpb://acme/P/1}"
    assert keys.tenant_sessions("team.eu_2") == "mcpb:{t:team.eu_2}:sessions"
    assert keys.records(0, "acme", "P") == "mcpb:{c:0}:rec:acme/P"
    assert keys.record_ids(0, "acme", "P") == "mcpb:{c:0}:ids:acme/P"
    assert keys.collections(0, "acme") == "mcpb:{c:0}:cols:acme"


def test_look_alike_tenants_get_different_keys() -> None:
    keys = Keys("mcpb")
    assert keys.index("a:b", "c:y") != keys.index("a", "b:c:y")
    assert keys.records(0, "a/b", "c") != keys.records(0, "a", "b/c")
    assert keys.tenant_sessions("a}x") != keys.tenant_sessions("a%7Dx")


@given(st.text(max_size=8), st.text(max_size=8), st.text(max_size=8), st.text(max_size=8))
def test_index_keys_are_injective_whatever_the_input(tenant1: str, uri1: str, tenant2: str, uri2: str) -> None:
    keys = Keys("p")
    if (tenant1, uri1) != (tenant2, uri2):
        assert keys.index(tenant1, uri1) != keys.index(tenant2, uri2)
