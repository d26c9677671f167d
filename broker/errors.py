"""The broker's error hierarchy. Library errors are translated into these once, at the boundary."""

from __future__ import annotations

import asyncio
from typing import Any

from broker.protocol.refusals import Reason

__all__ = [
    "AnswerTooLarge",
    "BackendUnavailable",
    "BrokerError",
    "LimitExceeded",
    "LogFull",
    "NotFound",
    "OverQuota",
    "PublishRateLimited",
    "PublishRefused",
    "QuotaExceeded",
    "Reason",
    "Refusal",
    "ResourceRefused",
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


class Refusal(BrokerError):
    """The broker declines a request for a ``reason`` (``broker.protocol.refusals.Reason``); nothing was done.

    The core raises it and lets it pass; each boundary spells it once: JSON-RPC in
    ``broker.protocol.refusals.rpc_error`` (with the HTTP status of its code in
    ``broker.transport.rpc``), REST in ``broker.transport.edge.refused``. ``retry_after`` is a hint
    in seconds (None: none), ``data`` what a JSON-RPC error carries of it. ``message`` is for
    people (the REST ``detail``, logs); a reason with a fixed JSON-RPC text does not show it there.
    """

    reason: Reason
    retry_after: int | None = None

    def __init__(self, message: str = "", *, reason: Reason | None = None, retry_after: int | None = None,
                 data: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        if reason is not None:
            self.reason = reason
        if retry_after is not None:
            self.retry_after = retry_after
        self._data = data

    @property
    def data(self) -> dict[str, Any] | None:
        return self._data


class BackendUnavailable(Refusal):
    """The shared backend (Redis) cannot be reached; the request may be retried later."""

    reason = Reason.UNAVAILABLE
    retry_after = 1


class SessionNotFound(BrokerError):
    """No live session has this id for this principal (unknown, expired, deleted or foreign)."""


class NotFound(BrokerError):
    """A resource, record or collection does not exist."""


class ResourceRefused(BrokerError):
    """A resource that exists and may be seen, but is not served (too large, not a regular file);
    ``data`` goes into the JSON-RPC error (-32602) a provider's caller gets."""

    def __init__(self, message: str, data: dict[str, object]) -> None:
        super().__init__(message)
        self.message = message
        self.data = data


class AnswerTooLarge(ResourceRefused):
    """An answer that would be more than ``max_read_bytes`` encoded (``MCP_BROKER_MAX_READ_BYTES``).

    Raised by a provider that can tell before it builds the answer (a file's size on disk, a row's
    size in PostgreSQL), and made by the dispatcher for any other reply it measures too large.
    """

    def __init__(self, uri: str | None, limit: int, what: str = "resources/read") -> None:
        subject = f"{what} of {uri}" if uri is not None else what
        super().__init__(f"Answer too large: {subject} would be more than {limit} bytes encoded, the limit "
                         "(MCP_BROKER_MAX_READ_BYTES)", {"maxBytes": limit} if uri is None else
                         {"uri": uri, "maxBytes": limit})


class LimitExceeded(Refusal):
    """A configured bound would be exceeded; ``reason`` names which (sessions, listens, a session's
    subscriptions, webhook subscriptions, a tenant's records)."""

    def __init__(self, message: str, *, reason: Reason, retry_after: int | None = None,
                 data: dict[str, Any] | None = None) -> None:
        super().__init__(message, reason=reason, retry_after=retry_after, data=data)


class WriteConflict(BrokerError):
    """A conditional write found another value than the one it was based on."""


class PublishRefused(Refusal):
    """A change was refused before it was acknowledged because the change log could not keep it.

    Nothing of the refused call was appended. ``retry_after`` is a hint in seconds: the bound
    frees up as fan-out works through the log.
    """

    reason = Reason.LOG_FULL
    retry_after = 1


class QuotaExceeded(PublishRefused):
    """The tenant already has ``limit`` changes not yet fanned out (``changelog_tenant_max``)."""

    def __init__(self, tenant: str, limit: int, pending: int, asked: int) -> None:
        self.tenant = tenant
        self.limit = limit
        self.pending = pending
        self.asked = asked
        if asked > limit:
            message = f"{asked} changes at once are more than tenant {tenant!r} may have waiting ({limit})"
        else:
            message = (f"tenant {tenant!r} has {pending} changes not yet delivered (at most {limit}); "
                       f"{asked} more refused")
        super().__init__(message, reason=Reason.TOO_LARGE if asked > limit else Reason.BACKLOG)


class OverQuota(Refusal):
    """A tenant's quota (``MCP_BROKER_QUOTAS``, ``broker.quotas``) would be exceeded; nothing was done.

    ``limit`` names the quota (``sessions``, ``subscriptions``, ``streams``, ``listens``,
    ``publish_per_second``), ``quota`` its value for ``tenant``; ``retry_after`` is a hint in seconds.
    """

    reason = Reason.QUOTA

    def __init__(self, limit: str, tenant: str, quota: int, retry_after: int = 5, message: str = "") -> None:
        self.limit = limit
        self.tenant = tenant
        self.quota = quota
        self.retry_after = retry_after
        self.message = message or f"tenant {tenant!r} is at its {limit} quota ({quota}); retry later"
        super().__init__(self.message)

    @property
    def data(self) -> dict[str, Any]:
        """What a JSON-RPC error carries of it."""
        return {"limit": self.limit, "tenant": self.tenant, "quota": self.quota}


class PublishRateLimited(OverQuota, PublishRefused):
    """The tenant's ``publish_per_second`` bucket holds too few tokens: refused before anything was appended."""

    def __init__(self, tenant: str, rate: int, retry_after: int) -> None:
        super().__init__("publish_per_second", tenant, rate, retry_after,
                         f"tenant {tenant!r} publishes faster than its quota of {rate} changes a second "
                         f"(publish_per_second); retry in {retry_after} s")


class LogFull(PublishRefused):
    """The tenant's change-log partition holds ``limit`` changes not yet fanned out (``changelog_maxlen``)."""

    def __init__(self, partition: int, limit: int) -> None:
        self.partition = partition
        self.limit = limit
        super().__init__(f"the change log is full ({limit} changes not yet delivered); publish again later")
