"""JSON-RPC batches of the 2025-03-26 era, answered the same way on HTTP and stdio.

A batch is one small request that asks for many answers, so it is bounded twice: by its
number of members (``max_batch_items``, refused whole before anything runs) and by the bytes
of its answer (``max_response_bytes``). Once the answers would pass that bound, the remaining
requests are not answered and each gets a short error saying so (the one whose reply
crossed the bound did run; the later ones do not); room for those errors is kept
from the start, so the whole answer stays under the bound (a 90 kB batch of reads of one
large record would otherwise be answered with hundreds of megabytes, all held in memory).
Between members the batch yields to the event loop, so other clients' requests on the same
worker are answered while a long batch runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from broker.protocol import jsonrpc as rpc
from broker.protocol.jsonrpc import Message

__all__ = ["answer_batch", "check_batch", "encode_batch"]


def check_batch(items: list[Any], max_items: int) -> None:
    """Refuse an empty batch or one with more than ``max_items`` members.

    Raises:
        RpcError: -32600 with HTTP status 400 (a batch that is invalid as a whole).
    """
    if not items:
        raise rpc.RpcError(rpc.INVALID_REQUEST, "Invalid Request: empty batch")
    if len(items) > max_items:
        raise rpc.RpcError(rpc.INVALID_REQUEST,
                           f"Invalid Request: a batch may hold at most {max_items} messages, this one has {len(items)}",
                           {"limit": max_items, "items": len(items)})


def _not_run(id_: rpc.Id | None, max_bytes: int) -> bytes:
    error = rpc.RpcError(rpc.NOT_RUN_RESPONSE_TOO_LARGE,
                         f"Not answered: the batch's answer reached {max_bytes} bytes; send this request again",
                         {"limit": max_bytes})
    return rpc.encode_error(id_, error)


async def answer_batch(items: list[Any], handle: Callable[[Message], Awaitable[bytes | None]],
                       max_bytes: int) -> list[bytes]:
    """The replies to a batch, in order: ``handle`` answers each valid message (None for notifications).

    An invalid member gets its own error reply; ``initialize`` must not be batched (2025-03-26).
    The encoded answer (``encode_batch``) stays within ``max_bytes`` unless the error replies
    alone exceed it: a request whose reply would pass the bound, and every request after it,
    gets a -31001 error instead: that one ran and its reply is dropped, the later ones do not run.
    Notifications still run (they add no bytes).
    """
    # First pass: what each member costs at least (its error, or the refusal kept in reserve).
    plan: list[tuple[Message | None, bytes | None]] = []
    reserved = 0
    for item in items:
        try:
            msg = rpc.parse_message(item)
        except rpc.RpcError as exc:
            plan.append((None, rpc.encode_error(rpc.request_id_of(item), exc)))
        else:
            if msg.method == "initialize":
                refused = rpc.RpcError(rpc.INVALID_REQUEST, "initialize must not be batched")
                plan.append((None, rpc.encode_error(msg.id, refused)))
            else:
                plan.append((msg, _not_run(msg.id, max_bytes) if msg.is_request else None))
        fixed = plan[-1][1]
        reserved += 0 if fixed is None else len(fixed) + 1  # each reply after the first adds a comma
    replies: list[bytes] = []
    spent = 1  # "[" and "]", less the comma the first reply does not need
    full = False
    for member, fixed in plan:
        reply = fixed
        if fixed is not None:
            reserved -= len(fixed) + 1
        if member is not None and not (full and member.is_request):
            await asyncio.sleep(0)  # let other requests on this worker run between members
            answer = await handle(member)
            if answer is not None and spent + len(answer) + 1 + reserved <= max_bytes:
                reply = answer
            elif answer is not None:
                full = True
        if reply is not None:
            spent += len(reply) + 1
            replies.append(reply)
    return replies


def encode_batch(replies: list[bytes]) -> bytes:
    return b"[" + b",".join(replies) + b"]"
