"""The events extension's settings that only make sense together, and who may have webhooks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
from pydantic import ValidationError

from broker.auth import Principal
from broker.cli import _settings_problems
from broker.config import Settings
from broker.errors import BackendUnavailable, Refusal
from broker.events.callbacks import Outcome
from broker.events.model import CALLBACK_ERROR, FORBIDDEN
from broker.methods import Call
from broker.protocol import jsonrpc as rpc
from broker.runtime import Broker
from broker.transport.rpc import as_rpc


@pytest.mark.parametrize(("values", "says"), [
    ({"webhook_min_ttl_ms": 5000, "webhook_max_ttl_ms": 2000, "webhook_default_ttl_ms": 3000}, "MIN_TTL_MS is above"),
    ({"webhook_default_ttl_ms": 500}, "DEFAULT_TTL_MS is outside"),
    ({"webhook_default_ttl_ms": 100_000_000}, "DEFAULT_TTL_MS is outside"),
    ({"events_poll_default": 50, "events_poll_max": 10}, "POLL_DEFAULT is above"),
    ({"webhook_retry_initial": 5.0, "webhook_retry_max": 1.0}, "RETRY_INITIAL is above"),
    ({"webhook_max_response_bytes": 0}, "MAX_RESPONSE_BYTES is 0"),
    ({"webhook_max_connections": 8, "webhook_tenant_connections": 9},
     "TENANT_CONNECTIONS .9. is above .*write at most 8"),
])
def test_contradictory_events_settings_are_refused(values: dict[str, Any], says: str) -> None:
    with pytest.raises(ValidationError, match=says):
        Settings(_env_file=None, **values)  # type: ignore[call-arg]


def test_a_contradiction_is_one_line_of_the_start_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MCP_BROKER_EVENTS_POLL_DEFAULT", "50")
    monkeypatch.setenv("MCP_BROKER_EVENTS_POLL_MAX", "10")
    assert _settings_problems() == ["MCP_BROKER_EVENTS_POLL_DEFAULT is above _POLL_MAX"]


class Custom:
    """An authenticator of the deployment's own, with no ``MCP_BROKER_AUTH`` behind it."""

    async def authenticate(self, headers: Mapping[str, str]) -> Principal:
        return Principal("acme", "alice")


async def test_webhooks_are_offered_under_a_custom_authenticator_and_refused_to_anonymous_callers() -> None:
    settings = Settings(_env_file=None)  # type: ignore[call-arg]
    custom = Broker(settings, authenticator=Custom())
    assert custom.events.modes == ["poll", "webhook"]
    assert Broker(settings).events.modes == ["poll"]
    with pytest.raises(rpc.RpcError) as refused:  # stdio's caller, or a custom authenticator's anonymous one
        await custom.events.webhooks.subscribe(Call(Principal("acme", "anonymous"), modern=True), {})
    assert refused.value.code == FORBIDDEN


async def test_verifications_are_counted_against_the_tenant_before_they_are_sent(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each verification is a signed POST to a URL the caller chose: over its bucket, none is sent."""
    broker = Broker(Settings(_env_file=None, webhook_verifications_per_minute=3),  # type: ignore[call-arg]
                    authenticator=Custom())
    sent: list[str] = []

    async def post(url: str, *args: Any) -> Outcome:
        sent.append(url)
        return Outcome(False, "connection_refused")

    monkeypatch.setattr(broker.events.callbacks, "post", post)

    async def subscribe(n: int, tenant: str = "acme") -> rpc.RpcError:
        params = {"name": "mcp.resource.updated", "arguments": {"uris": [f"mcpb://{tenant}/items/1"]},
                  "delivery": {"mode": "webhook", "url": f"https://8.8.8.8/hook/{n}", "secret": "whsec_" + "QUFB" * 8}}
        with pytest.raises((rpc.RpcError, Refusal)) as refused:
            await broker.events.webhooks.subscribe(Call(Principal(tenant, "alice"), modern=True), params)
        return as_rpc(refused.value)  # the JSON-RPC error the client gets

    assert [(await subscribe(n)).code for n in range(3)] == [CALLBACK_ERROR] * 3
    over = await subscribe(3)
    assert over.code == rpc.QUOTA_EXCEEDED and over.data["limit"] == "webhook_verifications"  # type: ignore[index]
    assert len(sent) == 3, "the fourth was never sent"
    assert (await subscribe(4, "other")).code == CALLBACK_ERROR, "another tenant's count is its own"


async def test_a_webhook_subscription_that_cannot_be_stored_leaves_no_feed_behind(
        monkeypatch: pytest.MonkeyPatch) -> None:
    broker = Broker(Settings(_env_file=None, webhook_allow=["8.8.8.8"]),  # type: ignore[call-arg]
                    authenticator=Custom())
    await broker.start()
    try:
        async def unavailable(*args: Any) -> bool:
            raise BackendUnavailable("Redis went away")

        monkeypatch.setattr(broker.events.webhooks.store, "create", unavailable)
        params = {"name": "mcp.resource.updated", "arguments": {"uris": ["mcpb://acme/items/1"]},
                  "delivery": {"mode": "webhook", "url": "https://8.8.8.8/hook", "secret": "whsec_" + "QUFB" * 8}}
        with pytest.raises(BackendUnavailable):
            await broker.events.webhooks.subscribe(Call(Principal("acme", "alice"), modern=True), params)
        assert await broker.backend.sessions.count() == 0  # its feed went with it: no place of the quota held
    finally:
        await broker.stop()
