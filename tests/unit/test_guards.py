"""Which Host headers the DNS-rebinding guard lets through, by configuration."""

from __future__ import annotations

import pytest

from broker.transport.guards import HostPolicy


@pytest.mark.parametrize("bind", ["127.0.0.1", "localhost", "::1"])
def test_a_loopback_server_answers_to_loopback_names_only_by_default(bind: str) -> None:
    policy = HostPolicy(None, bind)
    assert policy.allows("localhost:8080") and policy.allows("127.0.0.1") and policy.allows("[::1]:1")
    assert not policy.allows("evil.example") and not policy.allows("127.0.0.1.nip.io")


def test_a_server_bound_to_every_address_accepts_any_host_by_default() -> None:
    policy = HostPolicy(None, "0.0.0.0")
    assert policy.any and policy.allows("mcp.example.com")


def test_configured_hosts_match_any_port_unless_they_name_one() -> None:
    policy = HostPolicy(["mcp.example.com", "internal:9000"], "127.0.0.1")
    assert policy.allows("MCP.example.com:443") and policy.allows("internal:9000")
    assert not policy.allows("internal:9001") and not policy.allows("localhost")
    assert not policy.allows("mcp.example.com:99999")  # an invalid port is no match


def test_a_star_accepts_every_host_and_a_missing_host_always_passes() -> None:
    assert HostPolicy(["*"], "127.0.0.1").allows("anything")
    assert HostPolicy(["x"], "127.0.0.1").allows(None)
