"""fakeredis, corrected where it answers otherwise than Redis, so the backend is written for Redis alone.

Each difference the contract met is answered here as Redis answers it; the backend has no branch
for the test double. A new one belongs here too, with the command and what Redis does instead.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import fakeredis
from fakeredis._helpers import SimpleError
from fakeredis.aioredis import AsyncFakeSocket

try:  # fakeredis 2.41 (redis-py 8.2); before it, the class had this name, now a deprecated function's
    from fakeredis.aioredis import FakeAsyncRedisConnection as _FakeConnection
except ImportError:
    from fakeredis.aioredis import FakeConnection as _FakeConnection

_STREAM_READS = {b"XREAD", b"XREADGROUP"}


class _Socket(AsyncFakeSocket):
    """A connection's fake server side; what a script's ``redis.call`` gets back, as Redis gives it."""

    _stream_read = False

    def _lua_redis_call(self, lua_runtime: Any, expected_globals: Any, op: bytes, *args: Any) -> Any:
        name = bytes(op).upper()
        self._stream_read = name in _STREAM_READS
        try:
            result = super()._lua_redis_call(lua_runtime, expected_globals, op, *args)
        finally:
            self._stream_read = False
        if name == b"XPENDING" and len(args) == 2 and not (result and len(result)):
            # XPENDING's summary of a missing stream or group: Redis answers NOGROUP, fakeredis
            # 2.32 an empty list.
            key, group = (bytes(arg).decode() for arg in args)
            raise SimpleError(f"NOGROUP No such key '{key}' or consumer group '{group}'")
        return result

    def _lua_redis_pcall(self, lua_runtime: Any, expected_globals: Any, op: bytes, *args: Any) -> Any:
        # redis.pcall's error: Redis hands the script a table whose 'err' is a string; fakeredis
        # a Python str, which its Lua runtime (no encoding) passes as userdata.
        try:
            return self._lua_redis_call(lua_runtime, expected_globals, op, *args)
        except Exception as exc:
            return lua_runtime.table_from({b"err": str(exc).encode()})

    def _convert_redis_result(self, lua_runtime: Any, result: Any) -> Any:
        # XREAD / XREADGROUP in a script: Redis answers {{stream, entries}, ...}; fakeredis a map,
        # which it flattens into {stream, entries, ...} (2.32), or that flat list itself (2.41).
        if self._stream_read:
            self._stream_read = False
            if isinstance(result, list) and len(result) == 1 and isinstance(result[0], dict):
                result = result[0]
            if isinstance(result, dict):
                result = [[stream, entries] for stream, entries in result.items()]
            elif isinstance(result, list) and result and isinstance(result[0], bytes | str):
                result = [[result[i], result[i + 1]] for i in range(0, len(result), 2)]
        return super()._convert_redis_result(lua_runtime, result)


class _Connection(_FakeConnection):
    async def _connect(self) -> None:
        await super()._connect()
        # The server side fakeredis made (its arguments differ between versions), answering as
        # Redis does: ``_Socket`` adds behaviour only, no state of its own.
        self._sock.__class__ = _Socket


class FakeRedis(fakeredis.FakeAsyncRedis):
    """A client of a fake server that answers as Redis does where fakeredis does not."""

    def __init__(self, server: fakeredis.FakeServer) -> None:
        with warnings.catch_warnings():
            # fakeredis passes redis-py a deprecated argument (retry_on_timeout) itself.
            warnings.simplefilter("ignore", DeprecationWarning)
            super().__init__(server=server)
        self.connection_pool.connection_class = _Connection

    async def xautoclaim(self, name: Any, groupname: Any, consumername: Any, min_idle_time: int,
                         start_id: Any = "0-0", count: int | None = None, justid: bool = False) -> Any:
        """XAUTOCLAIM's cursor as Redis answers it: the next pending entry to scan, ``0-0`` when none is left
        (fakeredis answers the last id it claimed, or the start again)."""
        reply = await super().xautoclaim(name, groupname, consumername, min_idle_time, start_id=start_id, count=count,
                                         justid=justid)
        claimed = reply[1]
        if not claimed:
            reply[0] = b"0-0"
            return reply
        last = claimed[-1] if justid else claimed[-1][0]
        ms, _, seq = (last.decode() if isinstance(last, bytes) else last).partition("-")
        after = f"{ms}-{int(seq) + 1}"
        pending = await self.xpending_range(name, groupname, min=after, max="+", count=1)
        reply[0] = pending[0]["message_id"] if pending else b"0-0"
        return reply


def fakeredis_factory() -> Callable[[], Any]:
    """Clients of one private in-process fake server (each call: a new client of the same server)."""
    server = fakeredis.FakeServer()
    return lambda: FakeRedis(server)
