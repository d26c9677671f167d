"""Fan-out's inbox appends as RESP, packed by hand (``RedisInboxes.appends`` on a single node).

hiredis formats every argument's length with ``sprintf`` and copies every argument into a
command of its own; an append carries seven per session of one frame. Here a session's three keys are packed
once and kept, and every frame's three arguments are packed once for all its subscribers
(``bulk``), so a call is a join of ready parts. ``bench.instructions`` (batched, the worker's
side of a Redis frame): 109,406 instructions with hiredis packing, 95,339 this way (bench/NOTES.md).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence, Sized

from broker.backends.redis.keys import Keys

__all__ = ["ONE_FRAME", "AppendPacker", "bulk"]

#: Sessions whose keys, packed, a worker keeps for its next appends (about 200 bytes each).
KEYS_KEPT = 65_536


def bulk(value: bytes) -> bytes:
    """One RESP bulk string."""
    return b"$%d\r\n%b\r\n" % (len(value), value)


#: A session's frame count as a script argument, for a session with one frame (most, in a batch).
ONE_FRAME = bulk(b"1")


class AppendPacker:
    """The EVALSHA of ``inbox_append.lua`` in RESP, from its sessions and their frames' packed arguments."""

    def __init__(self, keys: Keys, sha: str) -> None:
        self._sha = bulk(sha.encode())
        #: The RESP of a session's three inbox keys, as a template to fill with (length, session
        #: id) three times, and each key's length less the session id's.
        template, fixed = b"", []
        for name in keys.inbox_keys("\0"):
            raw = name.encode()
            if raw.count(b"\0") != 1:
                raise ValueError(f"an inbox key names its session once: {name!r}")
            fixed.append(len(raw) - 1)
            template += b"$%d\r\n" + raw.replace(b"%", b"%%").replace(b"\0", b"%b") + b"\r\n"
        self._template, self._fixed = template, (fixed[0], fixed[1], fixed[2])
        #: Per session appended to lately, its keys packed (cleared past KEYS_KEPT).
        self._known: dict[str, bytes] = {}

    def know(self, sids: Mapping[str, object]) -> None:
        """Pack the keys of the sessions (``sids``' keys) not packed yet, before ``command`` is asked for them."""
        known = self._known
        missing: Collection[str] = sids.keys() - known.keys()  # a set difference, in C
        if len(known) + len(missing) > KEYS_KEPT:
            known.clear()
            missing = sids.keys()
        meta, inbox, wake = self._fixed
        template = self._template
        for sid in missing:
            raw = sid.encode()
            n = len(raw)
            known[sid] = template % (meta + n, raw, inbox + n, raw, wake + n, raw)

    def command(self, head: bytes, head_args: int, sids: Sequence[str], frames: Mapping[str, Sized],
                resp_args: Mapping[str, bytes]) -> bytes:
        """The call for ``sids``, whose keys are known (``know``): ``head``, the packed ``head_args``
        arguments every call begins with, then per session its frame count and its frames'
        arguments (``resp_args``, in RESP; ``frames`` says how many each has)."""
        keys = 3 * len(sids)
        args = head_args + len(sids) + 3 * sum(map(len, map(frames.__getitem__, sids)))
        # The sessions' parts are looked up by ``map`` (in C): no Python step per session.
        return b"".join([b"*%d\r\n$7\r\nEVALSHA\r\n%b%b" % (3 + keys + args, self._sha, bulk(b"%d" % keys)),
                         *map(self._known.__getitem__, sids), head, *map(resp_args.__getitem__, sids)])
