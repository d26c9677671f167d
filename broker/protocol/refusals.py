"""Why the broker refuses a request, and how each reason is spelled as a JSON-RPC error, once.

The core raises a ``broker.errors.Refusal`` (``OverQuota``, ``LimitExceeded``,
``BackendUnavailable``, the ``PublishRefused`` family) naming its ``Reason``; it never picks a
code, a text or a status. ``rpc_error`` is the one place a refusal becomes a JSON-RPC error, for
every transport: the dispatcher's in-band replies and batch members, stdio, and a whole reply on
HTTP, whose status ``broker.transport.rpc`` reads from the error's code. The REST answers
(``{"detail": ...}``) are spelled in ``broker.transport.edge``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final, Protocol

from broker.protocol import jsonrpc as rpc

__all__ = ["SPELLING", "Reason", "Refused", "Spelling", "rpc_error"]


class Reason(StrEnum):
    """What a refusal is about."""

    #: One of a tenant's quotas (``MCP_BROKER_QUOTAS``, its share of a global bound, its publish rate).
    QUOTA = "quota"
    #: ``MCP_BROKER_MAX_SESSIONS`` live sessions (a poll's, webhook's or resumable listen's included).
    SESSIONS = "sessions"
    #: ``MCP_BROKER_MAX_LISTENS`` open listens on this worker.
    LISTENS = "listens"
    #: ``MCP_BROKER_MAX_SUBSCRIPTIONS_PER_SESSION`` subscriptions of one session.
    SUBSCRIPTIONS = "subscriptions"
    #: ``MCP_BROKER_WEBHOOK_MAX_SUBSCRIPTIONS`` webhook subscriptions of the deployment (the events extension).
    WEBHOOKS = "webhooks"
    #: A tenant's records, by count or bytes (``MCP_BROKER_MAX_RECORDS_PER_TENANT``, ``..._BYTES_PER_TENANT``).
    RECORDS = "records"
    #: The backend cannot be reached, or could not confirm a write in time.
    UNAVAILABLE = "unavailable"
    #: A tenant's changes waiting for fan-out in a partition (``MCP_BROKER_CHANGELOG_TENANT_MAX``).
    BACKLOG = "backlog"
    #: More changes in one request than the tenant may ever have waiting: retrying cannot help.
    TOO_LARGE = "too_large"
    #: A change-log partition is full (``MCP_BROKER_CHANGELOG_MAXLEN``).
    LOG_FULL = "log_full"
    #: An upstream (``MCP_BROKER_UPSTREAMS``) cannot be reached, refused the broker's credentials or
    #: answered something that is not MCP.
    UPSTREAM_UNREACHABLE = "upstream_unreachable"
    #: An upstream took longer than its ``timeout``.
    UPSTREAM_TIMEOUT = "upstream_timeout"
    #: An upstream has its ``concurrency`` requests in flight from this worker.
    UPSTREAM_BUSY = "upstream_busy"
    #: An upstream's one watch covers its ``max_watches`` URIs: no more can be subscribed.
    WATCHES = "watches"


class Refused(Protocol):
    """What ``rpc_error`` reads of a refusal (``broker.errors.Refusal``)."""

    @property
    def reason(self) -> Reason: ...
    @property
    def message(self) -> str: ...
    @property
    def retry_after(self) -> int | None: ...
    @property
    def data(self) -> dict[str, Any] | None: ...


@dataclass(frozen=True, slots=True)
class Spelling:
    """A reason's JSON-RPC error: its code and message (``{message}`` is the refusal's own, the
    other fields its ``data``'s)."""

    code: int
    text: str


#: The one table. A whole reply's HTTP status follows from the code (``broker.transport.rpc``):
#: -31000 is 503, -31002 and -32013 are 429, -31004 is 502, -31005 is 504, the others travel in a 200 answer.
SPELLING: Final[dict[Reason, Spelling]] = {
    Reason.QUOTA: Spelling(rpc.QUOTA_EXCEEDED, "Quota reached: {message}"),
    Reason.SESSIONS: Spelling(rpc.SERVICE_UNAVAILABLE, "Too many sessions; retry later"),
    Reason.LISTENS: Spelling(rpc.INTERNAL_ERROR, "Subscription limit reached: too many open listens on this worker"),
    Reason.SUBSCRIPTIONS: Spelling(rpc.INVALID_PARAMS, "Subscription limit reached: {limit} URIs per session"),
    Reason.WEBHOOKS: Spelling(rpc.EVENTS_EXHAUSTED, "Too many webhook subscriptions"),
    Reason.RECORDS: Spelling(rpc.QUOTA_EXCEEDED, "Quota reached: {message}"),
    Reason.UNAVAILABLE: Spelling(rpc.SERVICE_UNAVAILABLE, "Service unavailable: the backend cannot be reached; retry"),
    Reason.BACKLOG: Spelling(rpc.QUOTA_EXCEEDED, "Quota reached: {message}"),
    Reason.TOO_LARGE: Spelling(rpc.INVALID_PARAMS, "{message}"),
    Reason.LOG_FULL: Spelling(rpc.SERVICE_UNAVAILABLE, "Service unavailable: {message}"),
    Reason.UPSTREAM_UNREACHABLE: Spelling(rpc.UPSTREAM_UNREACHABLE, "Bad gateway: {message}"),
    Reason.UPSTREAM_TIMEOUT: Spelling(rpc.UPSTREAM_TIMEOUT, "Gateway timeout: {message}"),
    Reason.UPSTREAM_BUSY: Spelling(rpc.SERVICE_UNAVAILABLE, "Service unavailable: {message}"),
    Reason.WATCHES: Spelling(rpc.INVALID_PARAMS, "Subscription limit reached: {message}"),
}


def rpc_error(refusal: Refused) -> rpc.RpcError:
    """The JSON-RPC error of ``refusal``: its reason's code and message, its ``data`` and ``retry_after``."""
    spelling = SPELLING[refusal.reason]
    data = refusal.data
    return rpc.RpcError(spelling.code, spelling.text.format(message=refusal.message, **(data or {})), data,
                        retry_after=refusal.retry_after)
