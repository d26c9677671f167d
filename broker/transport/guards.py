"""Checks every HTTP entry point shares: the Origin allow-list and bounded request bodies."""

from __future__ import annotations

from urllib.parse import urlsplit

from starlette.requests import Request

__all__ = ["LOOPBACK_HOSTS", "NO_SNIFF_NO_STORE", "BodyTooLarge", "HostPolicy", "OriginPolicy", "read_body"]

#: Sent with every JSON and SSE answer: a browser must not sniff an answer into another type
#: (a record's JSON rendered as HTML), and no cache may keep one (answers are per principal).
NO_SNIFF_NO_STORE: list[tuple[bytes, bytes]] = [
    (b"x-content-type-options", b"nosniff"),
    (b"cache-control", b"no-store"),
]

#: The Host names a server bound to a loopback address answers to when no list is configured.
LOOPBACK_HOSTS = ["localhost", "127.0.0.1", "[::1]"]
_LOOPBACK_BINDS = {"localhost", "127.0.0.1", "::1", "[::1]"}


class OriginPolicy:
    """DNS-rebinding protection: a browser's ``Origin`` must be on the allow-list.

    Requests without ``Origin`` are not from a browser and pass. An allowed origin matches any
    port unless it names one.
    """

    def __init__(self, origins: list[str]) -> None:
        self._rules: set[tuple[str, str, int | None]] = set()
        for origin in origins:
            parts = urlsplit(origin)
            if parts.scheme and parts.hostname:
                self._rules.add((parts.scheme, parts.hostname, parts.port))

    def allows(self, origin: str | None) -> bool:
        if origin is None:
            return True
        try:
            parts = urlsplit(origin)
            port = parts.port
        except ValueError:
            return False
        if not parts.scheme or not parts.hostname:
            return False
        return (parts.scheme, parts.hostname, port) in self._rules or (
            (parts.scheme, parts.hostname, None) in self._rules
        )


def _host_port(value: str) -> tuple[str, int | None] | None:
    """``name`` or ``name:port`` (IPv6 in brackets) as a lower-case host name and a port."""
    try:
        parts = urlsplit("//" + value.strip())
        port = parts.port
    except ValueError:
        return None
    return (parts.hostname, port) if parts.hostname else None


class HostPolicy:
    """DNS-rebinding protection for what ``Origin`` cannot cover: a browser sends no ``Origin``
    on a same-origin GET, so a page on a rebound name could read a local server's REST API.
    The ``Host`` header must then name this server.

    ``hosts`` None: a server bound to a loopback address answers to loopback names only (any
    port), any other accepts every Host (a deployment behind a proxy names its own). ``"*"``
    accepts every Host. Requests without ``Host`` (HTTP/1.0) pass.
    """

    def __init__(self, hosts: list[str] | None, bind: str) -> None:
        if hosts is None:
            hosts = LOOPBACK_HOSTS if bind in _LOOPBACK_BINDS else ["*"]
        self.any = "*" in hosts
        self._rules = {rule for rule in map(_host_port, hosts) if rule is not None}

    def allows(self, host: str | None) -> bool:
        if self.any or host is None:
            return True
        found = _host_port(host)
        return found is not None and (found in self._rules or (found[0], None) in self._rules)


class BodyTooLarge(Exception):
    """The request body exceeds the limit (HTTP 413)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"Request body larger than {limit} bytes")
        self.limit = limit


async def read_body(request: Request, limit: int) -> bytes:
    """The body, read no further than ``limit`` bytes.

    Raises:
        BodyTooLarge: the declared or the actual length exceeds ``limit``.
        starlette.requests.ClientDisconnect: the client left (or its body deadline passed, see
            ``broker.transport.wire``) before the body was complete; ``BrokerApp`` ends the
            request without an answer or a traceback.
    """
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise BodyTooLarge(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        chunks.append(chunk)
    return b"".join(chunks)
