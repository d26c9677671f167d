"""JSON-RPC batches of the 2025-03-26 era, answered the same way on HTTP and stdio."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from broker.protocol import jsonrpc as rpc
from broker.protocol.jsonrpc import Message

__all__ = ["answer_batch", "encode_batch"]


async def answer_batch(items: list[Any], handle: Callable[[Message], Awaitable[bytes | None]]) -> list[bytes]:
    """The replies to a batch, in order: ``handle`` answers each valid message (None for notifications).

    An invalid member gets its own error reply; ``initialize`` must not be batched (2025-03-26).
    """
    replies: list[bytes] = []
    for item in items:
        try:
            msg = rpc.parse_message(item)
        except rpc.RpcError as exc:
            replies.append(rpc.encode_error(rpc.request_id_of(item), exc))
            continue
        if msg.method == "initialize":
            refused = rpc.RpcError(rpc.INVALID_REQUEST, "initialize must not be batched")
            replies.append(rpc.encode_error(msg.id, refused))
            continue
        reply = await handle(msg)
        if reply is not None:
            replies.append(reply)
    return replies


def encode_batch(replies: list[bytes]) -> bytes:
    return b"[" + b",".join(replies) + b"]"
