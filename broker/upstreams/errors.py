"""What can go wrong talking to an upstream, as the MCP methods map it (``client`` re-exports them).

Each names the upstream; none carries a credential or a body the upstream sent beyond its own
JSON-RPC error, which is passed through as it came.
"""

from __future__ import annotations

from typing import Any

__all__ = ["UpstreamBusy", "UpstreamError", "UpstreamRpcError", "UpstreamSessionGone", "UpstreamTimeout",
           "UpstreamUnavailable"]


class UpstreamError(Exception):
    """A request to the upstream ``upstream`` (its name) did not get its answer."""

    def __init__(self, upstream: str, message: str) -> None:
        super().__init__(f"upstream {upstream!r}: {message}")
        self.upstream = upstream


class UpstreamUnavailable(UpstreamError):
    """It cannot be reached, failed (5xx), refused the broker's credentials, or answered something that is
    not MCP: a 502 to the client. ``status``: the HTTP status it answered, if it answered one."""

    def __init__(self, upstream: str, message: str, *, status: int | None = None) -> None:
        super().__init__(upstream, message)
        self.status = status


class UpstreamSessionGone(UpstreamUnavailable):
    """It no longer knows the 2025 session a request named (404): that session has to be opened again."""


class UpstreamTimeout(UpstreamError):
    """The request took longer than the upstream's ``timeout``: a 504 to the client."""


class UpstreamBusy(UpstreamError):
    """This worker has ``concurrency`` requests in flight to it already; the request was not sent."""


class UpstreamRpcError(UpstreamError):
    """The upstream's own JSON-RPC error, to be passed on to the client as it is."""

    def __init__(self, upstream: str, code: int, message: str, data: Any = None) -> None:
        super().__init__(upstream, f"error {code}: {message}")
        self.code = code
        self.message = message
        self.data = data
