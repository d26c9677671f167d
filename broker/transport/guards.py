"""Checks every HTTP entry point shares: the Origin allow-list and bounded request bodies."""

from __future__ import annotations

from urllib.parse import urlsplit

from starlette.requests import Request

__all__ = ["BodyTooLarge", "OriginPolicy", "read_body"]


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


class BodyTooLarge(Exception):
    """The request body exceeds the limit (HTTP 413)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"Request body larger than {limit} bytes")
        self.limit = limit


async def read_body(request: Request, limit: int) -> bytes:
    """The body, read no further than ``limit`` bytes.

    Raises:
        BodyTooLarge: the declared or the actual length exceeds ``limit``.
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
