"""What a watch can fail with: the caller sees ``WatchError`` subclasses only."""

from __future__ import annotations

from typing import Any


class WatchError(Exception):
    """Base of every error a ``Watcher`` raises to its caller."""


class NotSupported(WatchError):
    """The server cannot notify these URIs (no ``resources.subscribe``, or the listen ack left them out).

    Raised instead of watching anyway: without the capability no update would ever arrive, and a
    watcher that silently shows stale content is worse than one that refuses.
    """


class GaveUp(WatchError):
    """Every retry of a broken connection failed; ``__cause__`` is the last failure."""


class RpcError(WatchError):
    """A JSON-RPC error answer."""

    def __init__(self, code: int, message: str, data: Any = None) -> None:
        super().__init__(f"{message} ({code})")
        self.code = code
        self.data = data


class Dropped(Exception):
    """The transport broke, or the server ended the stream: recover and carry on (internal).

    ``complete`` is a clean end the server asked for (a listen's ``complete`` result, a draining
    server): not an error, yet the stream is gone all the same. ``retry_after``: the seconds the
    server asked the client to wait before it tries again (``Retry-After`` of a 429 or a 503).
    """

    def __init__(self, reason: str, *, complete: bool = False, retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.complete = complete
        self.retry_after = retry_after


class SessionGone(Dropped):
    """The server no longer knows the session (HTTP 404, or the stdio process exited): start over."""
