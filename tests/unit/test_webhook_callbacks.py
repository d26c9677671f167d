"""Callback safety: which webhook URLs ``Callbacks.check`` lets through, and why it refuses the others;
and how ``Callbacks.post`` bounds a POST (its deadline, the connections at once, what it asks for)."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from broker.config import Settings
from broker.events.callbacks import CallbackRefused, Callbacks, Target

SECRET = "whsec_" + "QUFB" * 8


def callbacks(*allow: str, **settings: Any) -> Callbacks:
    return Callbacks(Settings(_env_file=None, webhook_allow=list(allow), **settings))  # type: ignore[call-arg]


@pytest.mark.parametrize("url", [
    "https://127.0.0.1/h", "https://10.0.0.5/h", "https://172.16.3.4/h", "https://192.168.1.1/h",
    "https://169.254.169.254/latest/meta-data", "https://100.64.0.1/h", "https://0.0.0.0/h", "https://224.0.0.1/h",
    "https://[::1]/h", "https://[fc00::1]/h", "https://[fe80::1]/h", "https://[::ffff:127.0.0.1]/h",
    "https://240.0.0.1/h", "https://localhost/h", "https://[2002:7f00:1::]/h", "https://[2002:a00:1::]/h",
    # Special-purpose ranges Python 3.11's ipaddress reads as global: site-local, documentation, 6to4 relay.
    "https://[fec0::1]/h", "https://[feff:ffff::1]/h", "https://[3fff::1]/h", "https://[3fff:fff:ffff::1]/h",
    "https://192.88.99.1/h", "https://[2002:c058:6301::]/h",
])
async def test_non_public_addresses_are_refused_by_default(url: str) -> None:
    with pytest.raises(CallbackRefused):
        await callbacks().check(url)


@pytest.mark.parametrize("url", ["http://8.8.8.8/h", "ftp://8.8.8.8/h", "https://user:pw@8.8.8.8/h", "https:///h",
                                 "https://8.8.8.8:99999/h", "https://8.8.8.8/" + "x" * 3000, "https://[::1/h",
                                 "https://[notipv6]/h", "http://127.0.0.1:9/\x01", "http://127.0.0.1:9/a\x7f",
                                 "http://127.0.0.1:9/a b"])
async def test_malformed_or_plain_http_urls_are_refused(url: str) -> None:
    with pytest.raises(CallbackRefused):
        await callbacks("127.0.0.1").check(url)


async def test_a_refusal_never_tells_what_a_name_resolved_to() -> None:
    with pytest.raises(CallbackRefused) as refused:
        await callbacks().check("https://localhost/h")
    assert "127.0.0.1" not in str(refused.value) and "::1" not in str(refused.value)


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


async def test_a_slow_resolver_is_cut_off_and_never_takes_the_shared_executor(monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()

    def slow(*args: object, **kwargs: object) -> list[Any]:
        release.wait(5)
        return []

    class Refusing(ThreadPoolExecutor):
        def submit(self, *args: Any, **kwargs: Any) -> Any:
            raise AssertionError("the event loop's shared executor was used")

    monkeypatch.setattr(socket, "getaddrinfo", slow)
    asyncio.get_running_loop().set_default_executor(Refusing(1))
    checker = callbacks(webhook_connect_timeout=0.2)
    started = time.monotonic()
    try:
        with pytest.raises(CallbackRefused, match="in time"):
            await checker.check("https://hooks.example.com/h")
        assert time.monotonic() - started < 1.5
    finally:
        release.set()
        await checker.aclose()


async def test_a_request_httpx_cannot_make_is_a_failure_that_is_not_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    poster = callbacks("127.0.0.1")

    async def check(url: str) -> Target:  # as if a URL httpx refuses had been stored
        return Target(url, "http", "127.0.0.1", 9, "/\x01", ipaddress.ip_address("127.0.0.1"), True)

    monkeypatch.setattr(poster, "check", check)
    outcome = await poster.post("http://127.0.0.1:9/", SECRET, "msg_1", b"{}", "sub_1", "acme")
    assert (outcome.ok, outcome.retry) == (False, False)
    await poster.aclose()


class Endpoint:
    """A loopback HTTP endpoint: answers 200 after ``delay``, its body a byte every ``trickle`` seconds."""

    def __init__(self, delay: float = 0.0, trickle: float = 0.0) -> None:
        self.delay, self.trickle = delay, trickle
        self.open = self.most = 0
        self.heads: list[bytes] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.open += 1
        self.most = max(self.most, self.open)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            self.heads.append(head.lower())
            await reader.readexactly(int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0]))
            await asyncio.sleep(self.delay)
            body = b"x" * 40 if self.trickle else b""
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body))
            for byte in body:
                writer.write(bytes([byte]))
                await writer.drain()
                await asyncio.sleep(self.trickle)
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.open -= 1
            writer.close()


@pytest.fixture
async def endpoint() -> AsyncIterator[tuple[Endpoint, str]]:
    found = Endpoint()
    server = await asyncio.start_server(found.handle, "127.0.0.1", 0)
    async with server:
        yield found, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/hook"


async def test_a_post_has_a_deadline_however_slowly_its_answer_trickles(endpoint: tuple[Endpoint, str]) -> None:
    found, url = endpoint
    found.trickle = 0.1  # each byte well within the read timeout; the 40 of them not within the deadline
    poster = callbacks("127.0.0.1", webhook_connect_timeout=0.2, webhook_read_timeout=0.5)
    started = time.monotonic()
    outcome = await poster.post(url, SECRET, "msg_1", b"{}", "sub_1", "acme")
    assert (outcome.ok, outcome.error) == (False, "timeout") and time.monotonic() - started < 2
    await poster.aclose()


async def test_posts_are_bounded_in_number_and_ask_for_an_uncompressed_answer(
        endpoint: tuple[Endpoint, str]) -> None:
    found, url = endpoint
    found.delay = 0.2
    poster = callbacks("127.0.0.1", webhook_max_connections=2, webhook_tenant_connections=2)
    outcomes = await asyncio.gather(*(poster.post(url, SECRET, f"msg_{n}", b"{}", "sub_1", "acme") for n in range(5)))
    assert all(outcome.ok for outcome in outcomes)
    assert found.most == 2
    assert all(b"\r\naccept-encoding: identity\r\n" in head for head in found.heads)
    await poster.aclose()


async def test_a_tenant_holds_only_its_share_and_waits_for_it_no_longer_than_the_deadline(
        endpoint: tuple[Endpoint, str]) -> None:
    found, url = endpoint
    found.delay = 0.4
    poster = callbacks("127.0.0.1", webhook_max_connections=3, webhook_tenant_connections=2)
    done: list[str] = []

    async def post(tenant: str, n: int) -> None:
        if (await poster.post(url, SECRET, f"msg_{n}", b"{}", "sub_1", tenant)).ok:
            done.append(tenant)

    await asyncio.gather(*(post("a", n) for n in range(6)), post("b", 6))
    assert found.most == 3, "a's share is 2 of the 3 places; b got the third"
    assert done.index("b") <= 2, "b went out with a's first two, not behind a's queue"
    assert sorted(done) == ["a"] * 6 + ["b"] and not poster._shares, "shares are dropped once unused"
    short = callbacks("127.0.0.1", webhook_tenant_connections=1, webhook_connect_timeout=0.1,
                      webhook_read_timeout=0.1)  # a deadline of 0.2 s: the second waits for the first's 0.4 s
    outcomes = await asyncio.gather(*(short.post(url, SECRET, f"msg_{n}", b"{}", "sub_1", "a") for n in range(2)))
    assert sorted((o.ok, o.error) for o in outcomes) == [(False, "timeout"), (False, "timeout")]
    await poster.aclose()
    await short.aclose()
