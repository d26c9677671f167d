"""The broker's error hierarchy. Library errors are translated into these once, at the boundary."""

from __future__ import annotations

import asyncio

__all__ = [
    "BackendUnavailable",
    "BrokerError",
    "LimitExceeded",
    "NotFound",
    "SessionNotFound",
    "WriteConflict",
    "raise_if_cancelled",
]


def raise_if_cancelled() -> None:
    """Re-raise a cancellation that reached a loop's error boundary as some other error.

    A task cancelled inside a Redis call can see a timeout or connection error instead of
    ``CancelledError`` (the client's own timeouts race the cancellation), which a loop that
    survives errors would catch and retry forever: a worker whose fan-out task swallowed its
    cancellation that way never finished shutting down. Every such loop calls this first.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


class BrokerError(Exception):
    """Base of every error the broker raises on purpose."""


class BackendUnavailable(BrokerError):
    """The shared backend (Redis) cannot be reached; the request may be retried later."""


class SessionNotFound(BrokerError):
    """No live session has this id for this principal (unknown, expired, deleted or foreign)."""


class NotFound(BrokerError):
    """A resource, record or collection does not exist."""


class LimitExceeded(BrokerError):
    """A configured bound (sessions, listens, URIs, sizes) would be exceeded."""


class WriteConflict(BrokerError):
    """A conditional write found another value than the one it was based on."""
