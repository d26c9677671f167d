"""The broker's error hierarchy. Library errors are translated into these once, at the boundary."""

from __future__ import annotations

__all__ = [
    "BackendUnavailable",
    "BrokerError",
    "LimitExceeded",
    "NotFound",
    "SessionNotFound",
    "WriteConflict",
]


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
