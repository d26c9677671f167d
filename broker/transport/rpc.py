"""The HTTP status of a JSON-RPC error that is the whole reply, decided here once.

The core raises ``RpcError`` with a code (and ``invalid`` for a request that cannot be served as
sent) or a domain ``Refusal``; neither says HTTP. When the error is the whole answer (a lone
2026-07-28 request, ``initialize``, a refused stream, a legacy request refused by a quota), its
status is its code's in ``STATUS``, or 400 for an invalid request; any other code travels in a
200, the way every error inside a legacy reply or a batch does (docs/PROTOCOL.md, "Error statuses
on 2026-07-28"). ``broker.transport.edge.rpc_error`` builds the response (with ``Retry-After``);
stdio writes the same error and needs no status.
"""

from __future__ import annotations

from typing import Final

from broker.errors import Refusal
from broker.protocol import jsonrpc as rpc
from broker.protocol.refusals import rpc_error

__all__ = ["STATUS", "as_rpc", "status_of"]

#: The HTTP status of a whole reply carrying an error of this code.
STATUS: Final[dict[int, int]] = {
    rpc.PARSE_ERROR: 400,
    rpc.INVALID_REQUEST: 400,
    rpc.METHOD_NOT_FOUND: 404,
    rpc.HEADER_MISMATCH: 400,
    rpc.MISSING_CLIENT_CAPABILITY: 400,
    rpc.UNSUPPORTED_PROTOCOL_VERSION: 400,
    rpc.INSUFFICIENT_SCOPE: 403,
    rpc.SERVICE_UNAVAILABLE: 503,
    rpc.QUOTA_EXCEEDED: 429,
    rpc.UPSTREAM_UNREACHABLE: 502,
    rpc.UPSTREAM_TIMEOUT: 504,
    rpc.EVENTS_NOT_FOUND: 404,
    rpc.EVENTS_FORBIDDEN: 403,
    rpc.EVENTS_EXHAUSTED: 429,
    rpc.EVENTS_UNSUPPORTED: 400,
    rpc.EVENTS_CALLBACK_ERROR: 400,
}


def status_of(error: rpc.RpcError) -> int:
    """The status of ``error`` as the whole reply."""
    return 400 if error.invalid else STATUS.get(error.code, 200)


def as_rpc(error: rpc.RpcError | Refusal) -> rpc.RpcError:
    """``error`` as a JSON-RPC error (a refusal spelled by ``broker.protocol.refusals``)."""
    return rpc_error(error) if isinstance(error, Refusal) else error

