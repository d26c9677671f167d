"""Fan-out's inbox appends as RESP, packed by hand (``RedisInboxes.appends`` on a single node).

hiredis formats every argument's length with ``sprintf`` and copies every argument into a
command of its own; an append carries seven per session of one frame. Here a session's three keys are packed
once and kept, and every frame's three arguments are packed once for all its subscribers
(``bulk``), so a call is a join of ready parts. ``bench.instructions`` (batched, the worker's
side of a Redis frame): 109,406 instructions with hiredis packing, 95,339 this way (bench/NOTES.md).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from broker.backends.redis.keys import Keys
from broker.backends.types import Frame

__all__ = ["AppendPacker", "bulk"]

#: Sessions whose keys, packed, a worker keeps for its next appends (about 200 bytes each).
KEYS_KEPT = 65_536


def bulk(value: bytes) -> bytes:
    """One RESP bulk string."""
    return b"$%d\r\n%b\r\n" % (len(value), value)


#: A session's frame count as a script argument, for the counts most sessions have.
_COUNTS = tuple(bulk(b"%d" % n) for n in range(17))


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

    def _session_keys(self, sid: str) -> bytes:
        meta, inbox, wake = self._fixed
        raw = sid.encode()
        n = len(raw)
        if len(self._known) >= KEYS_KEPT:
            self._known.clear()
        packed = self._known[sid] = self._template % (meta + n, raw, inbox + n, raw, wake + n, raw)
        return packed

    def command(self, head: bytes, head_args: int, sids: Sequence[str], frames: Mapping[str, Sequence[Frame]],
                packed: Mapping[int, tuple[str, str, bytes, bytes]]) -> bytes:
        """The call for ``sids``: ``head``, the packed ``head_args`` arguments every call begins
        with, then per session its frame count and per frame the RESP of its three arguments (the
        last of the frame's ``packed`` entry, found by ``id``)."""
        known = self._known
        parts = [b""]
        parts += [known.get(sid) or self._session_keys(sid) for sid in sids]
        parts.append(head)
        args = head_args
        for sid in sids:
            listed = frames[sid]
            count = len(listed)
            parts.append(_COUNTS[count] if count < len(_COUNTS) else bulk(b"%d" % count))
            if count == 1:
                parts.append(packed[id(listed[0])][3])
            else:
                parts.extend(packed[id(frame)][3] for frame in listed)
            args += 1 + 3 * count
        keys = 3 * len(sids)
        parts[0] = b"*%d\r\n$7\r\nEVALSHA\r\n%b%b" % (3 + keys + args, self._sha, bulk(b"%d" % keys))
        return b"".join(parts)
