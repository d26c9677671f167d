"""``MCP_BROKER_QUOTAS`` is read strictly: a bad one stops the process with one line saying what to write."""

from __future__ import annotations

import pytest

from broker.cli import _settings_problems
from broker.config import Settings
from broker.quotas import Limits, TenantQuotas, tenant_share

KEYS = '{"ka": "acme/a", "kb": "other/b"}'


def test_a_tenant_entry_overrides_default_limit_by_limit_and_absent_limits_are_unlimited() -> None:
    quotas = TenantQuotas.parse({"default": {"sessions": 10, "streams": 3},
                                 "acme": {"sessions": 50, "publish_per_second": 5}}, {"acme", "other"})
    assert quotas.of("acme") == Limits(sessions=50, streams=3, publish_per_second=5)
    assert quotas.of("other") == Limits(sessions=10, streams=3)
    assert quotas.of("acme").burst == 5, "one second's worth by default"
    assert TenantQuotas.parse({}, set()).of("x") == Limits()


@pytest.mark.parametrize(("value", "says"), [
    ('{"not a name": {"sessions": 1}}', "MCP_BROKER_QUOTAS: tenant"),
    ('{"acme": {"session": 1}}', "'session' (tenant 'acme') is not a limit; write one of sessions"),
    ('{"acme": {"sessions": -1}}', "acme.sessions is -1; write a whole number"),
    ('{"acme": {"sessions": 1.5}}', "acme.sessions is 1.5; write a whole number"),
    ('{"acme": {"sessions": "5"}}', "acme.sessions is '5'; write a whole number"),
    ('{"acme": {"sessions": true}}', "acme.sessions is True"),
    ('{"acme": {"publish_per_second": 0}}', "write 1 or more"),
    ('{"acme": {"publish_burst": 5}}', "publish_burst needs a publish_per_second"),
    ('{"acme": 5}', "must be an object of limits"),
    ('["acme"]', "MCP_BROKER_QUOTAS: write a JSON object of tenant to limits"),
    ('{not json', "MCP_BROKER_QUOTAS: not valid JSON"),
])
def test_a_bad_quota_setting_is_one_line_saying_what_to_write(monkeypatch: pytest.MonkeyPatch, value: str,
                                                              says: str) -> None:
    monkeypatch.setenv("MCP_BROKER_API_KEYS", KEYS)
    monkeypatch.setenv("MCP_BROKER_QUOTAS", value)
    problems = _settings_problems()
    assert len(problems) == 1 and says in problems[0], problems
    assert problems[0].startswith("MCP_BROKER_QUOTAS")


def test_configured_tenants_and_default_are_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MCP_BROKER_API_KEYS", KEYS)
    monkeypatch.setenv("MCP_BROKER_QUOTAS", '{"default": {"sessions": 5}, "other": {"listens": 0}}')
    assert _settings_problems() == []


def test_with_stored_keys_or_oauth_any_valid_tenant_may_have_a_quota(monkeypatch: pytest.MonkeyPatch) -> None:
    """Runtime keys and tokens bring tenants no setting names: their quotas must be writable."""
    monkeypatch.setenv("MCP_BROKER_AUTH", "keys")
    monkeypatch.setenv("MCP_BROKER_REDIS_URL", "redis://127.0.0.1:1/0")
    monkeypatch.setenv("MCP_BROKER_QUOTAS", '{"newcomer": {"sessions": 5}}')
    assert _settings_problems() == []


def test_anonymous_quotas_name_only_the_tenants_there_are(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without credentials every caller is the default tenant: another name is a typo, said at start."""
    monkeypatch.setenv("MCP_BROKER_QUOTAS", '{"nobody": {"sessions": 1}}')
    problems = _settings_problems()
    assert len(problems) == 1 and "'nobody' is not a configured tenant" in problems[0], problems


async def test_a_taken_over_streams_place_goes_back_whichever_of_the_two_ends_last() -> None:
    """A session's stream taken over by a newer one on the same worker: the two hold one place,
    and it goes back when both have ended, in either order (else it stayed until it lapsed)."""
    import asyncio

    from broker.backends.memory.quotas import MemoryQuotas
    from broker.quotas import Quotas

    for order in ("newer first", "taken over first"):
        store = MemoryQuotas()
        quotas = Quotas(store, TenantQuotas.parse({"acme": {"streams": 1}}, {"acme"}))
        older = await quotas.acquire("streams", "acme", "session-1")
        newer = await quotas.acquire("streams", "acme", "session-1")  # the takeover: the same place
        if order == "newer first":
            quotas.release(newer)  # the client went away
            quotas.release(older, keep=True)  # the stream it took over
        else:
            quotas.release(older, keep=True)
            quotas.release(newer)
        await asyncio.gather(*quotas._tasks)  # the release runs in the background
        assert await quotas.acquire("streams", "acme", "session-2") is not None, order


@pytest.mark.parametrize("value", ["0", "-0.5", "1.5", "half", "nan"])
def test_a_bad_tenant_share_is_one_line_saying_what_to_write(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("MCP_BROKER_TENANT_SHARE", value)
    problems = _settings_problems()
    assert len(problems) == 1 and problems[0].startswith("MCP_BROKER_TENANT_SHARE: ") \
        and "write a number above 0 and at most 1" in problems[0], problems


def test_a_tenant_holds_its_share_of_each_capacity_where_there_can_be_more_than_one() -> None:
    two = Settings(_env_file=None, api_keys={"ka": "acme/a", "kb": "other/b"})  # type: ignore[call-arg]
    assert tenant_share(two, 10) == 5 and tenant_share(two, 1) == 1
    assert tenant_share(Settings(_env_file=None, api_keys={"ka": "acme/a", "kb": "other/b"},  # type: ignore[call-arg]
                                 tenant_share=0.25), 10) == 2
    assert tenant_share(Settings(_env_file=None, api_keys={"ka": "acme/a", "kb": "other/b"},  # type: ignore[call-arg]
                                 tenant_share=1), 10) is None
    # Without credentials every caller is the default tenant: the share would only take capacity away.
    assert tenant_share(Settings(_env_file=None), 10) is None  # type: ignore[call-arg]
    # API keys of one tenant: keys stored at run time may bring others.
    assert tenant_share(Settings(_env_file=None, api_keys={"ka": "default/a"}), 10) == 5  # type: ignore[call-arg]
