"""Callback safety: which webhook URLs ``Callbacks.check`` lets through, and why it refuses the others."""

from __future__ import annotations

import pytest

from broker.config import Settings
from broker.events.callbacks import CallbackRefused, Callbacks


def callbacks(*allow: str) -> Callbacks:
    return Callbacks(Settings(_env_file=None, webhook_allow=list(allow)))  # type: ignore[call-arg]


@pytest.mark.parametrize("url", [
    "https://127.0.0.1/h", "https://10.0.0.5/h", "https://172.16.3.4/h", "https://192.168.1.1/h",
    "https://169.254.169.254/latest/meta-data", "https://100.64.0.1/h", "https://0.0.0.0/h", "https://224.0.0.1/h",
    "https://[::1]/h", "https://[fc00::1]/h", "https://[fe80::1]/h", "https://[::ffff:127.0.0.1]/h",
    "https://240.0.0.1/h", "https://localhost/h",
])
async def test_non_public_addresses_are_refused_by_default(url: str) -> None:
    with pytest.raises(CallbackRefused):
        await callbacks().check(url)


@pytest.mark.parametrize("url", ["http://8.8.8.8/h", "ftp://8.8.8.8/h", "https://user:pw@8.8.8.8/h", "https:///h",
                                 "https://8.8.8.8:99999/h", "https://8.8.8.8/" + "x" * 3000])
async def test_malformed_or_plain_http_urls_are_refused(url: str) -> None:
    with pytest.raises(CallbackRefused):
        await callbacks().check(url)


async def test_a_public_address_passes_and_is_pinned() -> None:
    target = await callbacks().check("https://8.8.8.8:8443/hook?x=1")
    assert (target.pinned(), target.host_header, target.allowed) == ("https://8.8.8.8:8443/hook?x=1", "8.8.8.8:8443",
                                                                     False)


async def test_the_allow_list_lets_hosts_and_ranges_through_over_http_too() -> None:
    allowed = callbacks("127.0.0.1", "10.0.0.0/8")
    assert (await allowed.check("http://127.0.0.1:9/h")).allowed
    assert (await allowed.check("https://10.2.3.4/h")).allowed
    with pytest.raises(CallbackRefused):
        await allowed.check("https://192.168.0.1/h")
