"""Callback safety and the signed POST: where a webhook may be sent, and how every delivery goes out.

SSRF: a callback URL is https to a host whose every resolved address is globally routable (no
loopback, private, link-local, CGNAT, multicast, reserved or unspecified address, per the
``ipaddress`` module's reading of the IANA special-purpose registries), unless its host or its
addresses are on ``MCP_BROKER_WEBHOOK_ALLOW`` (which also allows plain http). It is checked at
subscribe and again before every POST, and the POST goes to the very address that was checked
(the URL's host in ``Host`` and in TLS SNI, the certificate checked against it), so a name that
re-resolves elsewhere meanwhile (DNS rebinding) is never followed. Redirects are not followed
(a 3xx is a failure); connect and read are timed out, and the whole POST has a deadline (the two
together); at most ``webhook_max_response_bytes`` of an answer are read; no connection is reused
(each POST resolves and checks anew).

Places: at most ``webhook_max_connections`` POSTs of a worker are open at once, and at most
``webhook_tenant_connections`` of one tenant, so a tenant whose endpoints never answer holds its
share for a deadline at a time and leaves the rest to the others. Waiting for a place has the
same deadline as the POST: past it the attempt fails as ``timeout`` (retried as any other), so
a POST never waits behind a tarpit indefinitely.

Names are resolved by a few threads of this module's own, under the connect timeout, so a slow
resolver neither holds a POST for long nor takes the event loop's shared executor from the rest
of the worker.

Every body is signed with the client's secret by ``standardwebhooks`` (``webhook-id``,
``webhook-timestamp``, ``webhook-signature``), a new timestamp and signature per attempt, and
carries ``X-MCP-Subscription-Id``. Failures are told as the draft's categories only, never the
endpoint's own words (no response oracle).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import ssl
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Final
from urllib.parse import urlsplit

import httpx
from standardwebhooks import Webhook

from broker.config import Settings

__all__ = ["CallbackRefused", "Callbacks", "Outcome", "Target"]

logger = logging.getLogger(__name__)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
#: The longest callback URL accepted.
MAX_URL: Final = 2048
#: Threads resolving callback host names, per worker: lookups beyond them wait (under the same deadline).
RESOLVERS: Final = 4
#: Special-purpose ranges that Python's ``ipaddress`` (3.11) still reads as global: deprecated
#: site-local IPv6, IPv6 documentation (RFC 9637), and the deprecated 6to4 relay anycast.
REFUSED: Final = tuple(ipaddress.ip_network(n) for n in ("fec0::/10", "3fff::/20", "192.88.99.0/24"))


class CallbackRefused(Exception):
    """A callback URL the policy refuses; the message says why (and what to set)."""


@dataclass(frozen=True, slots=True)
class Target:
    """A callback URL, checked: where to connect (``address``) and whether it is allow-listed."""

    url: str
    scheme: str
    host: str
    port: int
    path: str
    address: IPAddress
    allowed: bool

    def pinned(self) -> str:
        """The URL with the checked address in place of the host."""
        host = f"[{self.address}]" if self.address.version == 6 else str(self.address)
        return f"{self.scheme}://{host}:{self.port}{self.path}"

    @property
    def host_header(self) -> str:
        default = 443 if self.scheme == "https" else 80
        name = f"[{self.host}]" if ":" in self.host else self.host
        return name if self.port == default else f"{name}:{self.port}"


@dataclass(frozen=True, slots=True)
class Outcome:
    """One POST: delivered (a 2xx), or the failure's category and whether trying again may help."""

    ok: bool
    error: str | None = None
    retry: bool = True
    body: bytes = b""


def _refused_address(address: IPAddress) -> bool:
    # An IPv4 address inside IPv6 (mapped, or 6to4's 2002::/16) is reached as that IPv4 address.
    if isinstance(address, ipaddress.IPv6Address):
        address = address.ipv4_mapped or address.sixtofour or address
    return (not address.is_global or address.is_multicast or address.is_reserved or address.is_unspecified
            or any(address in network for network in REFUSED))


@dataclass(slots=True)
class _Share:
    """A tenant's places, and how many of its POSTs use them (the share is dropped when none does)."""

    places: asyncio.Semaphore
    users: int = 0


class Callbacks:
    """The callback policy and the HTTP client every delivery of this worker goes through."""

    def __init__(self, settings: Settings) -> None:
        self.hosts = set()
        self.networks: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
        for entry in settings.webhook_allow:
            try:
                self.networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                self.hosts.add(entry.lower().rstrip("."))
        self.max_bytes = settings.webhook_max_response_bytes
        self.resolve_timeout = settings.webhook_connect_timeout
        #: The whole POST, however slowly its answer trickles in (the read timeout is per chunk).
        self.deadline = settings.webhook_connect_timeout + settings.webhook_read_timeout
        timeout = httpx.Timeout(settings.webhook_read_timeout, connect=settings.webhook_connect_timeout)
        self.client = httpx.AsyncClient(follow_redirects=False, timeout=timeout, trust_env=False,
                                        limits=httpx.Limits(max_keepalive_connections=0))
        self.connections = asyncio.Semaphore(settings.webhook_max_connections)
        self.share = settings.webhook_tenant_connections
        self._shares: dict[str, _Share] = {}
        self._resolver = ThreadPoolExecutor(RESOLVERS, thread_name_prefix="webhook-dns")

    async def aclose(self) -> None:
        await self.client.aclose()
        self._resolver.shutdown(wait=False, cancel_futures=True)

    @staticmethod
    def parse(url: str) -> tuple[str, str, int, str]:
        """(scheme, host, port, path and query) of a callback URL. Raises CallbackRefused for a malformed one."""
        if len(url) > MAX_URL or not url.isascii() or any(c <= " " or c == "\x7f" for c in url):
            raise CallbackRefused(f"the callback URL must be an ASCII URL of at most {MAX_URL} characters, "
                                  "with no spaces or control characters")
        try:
            parts = urlsplit(url)
            host = parts.hostname
        except ValueError:  # an unclosed "[" or a bracketed host that is no IPv6 address
            raise CallbackRefused("the callback URL's host is malformed; write a name, an IPv4 address or "
                                  "[an IPv6 address]") from None
        try:
            port = parts.port
        except ValueError:
            raise CallbackRefused("the callback URL's port is not a number from 0 to 65535") from None
        if parts.scheme not in ("https", "http") or not host:
            raise CallbackRefused("the callback URL must be https://host/...")
        if parts.username is not None or parts.password is not None:
            raise CallbackRefused("the callback URL may not carry credentials")
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        return parts.scheme, host.lower().rstrip("."), port or (443 if parts.scheme == "https" else 80), path

    async def _resolve(self, host: str, port: int) -> list[IPAddress]:
        """Every address of ``host``, by this module's threads, within the connect timeout."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.resolve_timeout):
                infos = await loop.run_in_executor(self._resolver, socket.getaddrinfo, host, port, 0,
                                                   socket.SOCK_STREAM)
        except TimeoutError:
            raise CallbackRefused(f"the callback host {host!r} did not resolve in time") from None
        except (OSError, UnicodeError, RuntimeError):  # RuntimeError: the resolver was shut down
            raise CallbackRefused(f"the callback host {host!r} does not resolve") from None
        return list(dict.fromkeys(ipaddress.ip_address(str(info[4][0]).partition("%")[0]) for info in infos))

    async def check(self, url: str) -> Target:
        """Resolve and check a callback URL now. Raises CallbackRefused, saying why.

        The message never names an address a host name resolved to: what the broker's resolver
        sees of internal names is nobody's business.
        """
        scheme, host, port, path = self.parse(url)
        try:
            addresses = [ipaddress.ip_address(host)]
        except ValueError:
            addresses = await self._resolve(host, port)
        if not addresses:
            raise CallbackRefused(f"the callback host {host!r} does not resolve")
        listed_host = host in self.hosts
        listed = [listed_host or any(a in n for n in self.networks) for a in addresses]
        for address, ok in zip(addresses, listed, strict=True):
            if not ok and _refused_address(address):
                raise CallbackRefused(f"the callback host {host!r} is or resolves to a loopback, private, "
                                      "link-local or reserved address; allow it with MCP_BROKER_WEBHOOK_ALLOW")
        allowed = all(listed)
        if scheme != "https" and not allowed:
            raise CallbackRefused("the callback URL must be https (plain http only to MCP_BROKER_WEBHOOK_ALLOW)")
        return Target(url, scheme, host, port, path, addresses[0], allowed)

    async def post(self, url: str, secret: str, message_id: str, body: bytes, subscription_id: str,
                   tenant: str) -> Outcome:
        """POST ``body`` to the callback, checked again now and signed now, in a place of ``tenant``'s share."""
        try:
            target = await self.check(url)
        except CallbackRefused:
            return Outcome(False, "connection_refused")
        now = datetime.now(UTC)
        headers = {
            "Host": target.host_header,
            "Content-Type": "application/json",
            # The answer is read as sent, up to max_bytes: a compressed one could not be read as JSON.
            "Accept-Encoding": "identity",
            "webhook-id": message_id,
            "webhook-timestamp": str(int(now.timestamp())),
            "webhook-signature": Webhook(secret).sign(message_id, now, body.decode()),
            "X-MCP-Subscription-Id": subscription_id,
        }
        extensions = {"sni_hostname": target.host} if target.scheme == "https" else {}
        share = self._shares.setdefault(tenant, _Share(asyncio.Semaphore(self.share)))
        share.users += 1
        try:
            async with contextlib.AsyncExitStack() as places:
                async with asyncio.timeout(self.deadline):
                    await places.enter_async_context(share.places)
                    await places.enter_async_context(self.connections)
                async with asyncio.timeout(self.deadline):
                    status, answer = await self._request(target, body, headers, extensions)
        except (httpx.TimeoutException, TimeoutError):
            return Outcome(False, "timeout")
        except httpx.HTTPError as exc:
            tls = isinstance(exc.__cause__, ssl.SSLError) or "SSL" in str(exc) or "certificate" in str(exc)
            return Outcome(False, "tls_error" if tls else "connection_refused")
        except Exception as exc:  # a request httpx cannot make at all: trying it again cannot help
            logger.warning("a webhook POST of subscription %s could not be made (%s)", subscription_id,
                           type(exc).__name__)
            return Outcome(False, "connection_refused", retry=False)
        finally:
            share.users -= 1
            if not share.users:
                del self._shares[tenant]
        if 200 <= status < 300:
            return Outcome(True, body=answer)
        if status == 413:
            return Outcome(False, "http_4xx", retry=False)  # the draft: never retried
        return Outcome(False, "http_3xx" if status < 400 else "http_4xx" if status < 500 else "http_5xx")

    async def _request(self, target: Target, body: bytes, headers: dict[str, str],
                       extensions: dict[str, str]) -> tuple[int, bytes]:
        async with self.client.stream("POST", target.pinned(), content=body, headers=headers,
                                      extensions=extensions) as response:
            answer = b""
            async for chunk in response.aiter_raw():
                answer += chunk
                if len(answer) >= self.max_bytes:
                    answer = answer[:self.max_bytes]
                    break  # the rest is never read: the connection is closed with the response
            return response.status_code, answer
