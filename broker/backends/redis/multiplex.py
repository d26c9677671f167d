"""One pipelined connection to a single Redis server, shared by every batch of a process.

Fan-out and publishing make a few round trips per change, each a handful of commands that never
block. Through redis-py's pool a batch of one EVALSHA cost the client about 173,000 instructions
(a checkout, a retry wrapper, a timer per reply, four layers of reading), where an
``asyncio.Protocol`` that writes a command and resolves a future from its reply costs about
12,000 for the exchange itself (callgrind; bench/NOTES.md). This connection is such a protocol:
requests are written as they come, each with a future; hiredis parses the replies as bytes
arrive and they resolve the requests in order, so many tasks share one connection and none
waits for a checkout. The same batch through it: about 70,000.

Used by ``Batch`` on a plain TCP server (``redis://``): a Sentinel master (whose address moves),
TLS, Unix sockets and Cluster keep redis-py's connections. Never for a blocking command: one
would hold up every request behind it.

Failures keep the rules of the other connections (``connection`` module):

* the socket resets when dropped (``SO_LINGER`` 0), and every request in flight hears of the
  failure only once the socket is closed, so a command given up on is not sent later;
* no reply for ``socket_timeout`` while requests wait: the connection is dropped and every
  waiting request fails with ``TimeoutError`` (the caller retries a batch on a new connection,
  under the client's retry policy, as on redis-py's connections);
* a request cancelled after its bytes went to the kernel leaves the connection as it is: its
  reply is read and dropped when it comes, so the next request gets its own. Cancelled while
  some of its bytes still wait in this process (the server is not reading), it drops the
  connection, as redis-py does, so those bytes never go out.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections import deque
from collections.abc import Callable
from typing import Any, cast

import hiredis
from redis import exceptions as rexc
from redis._parsers import _AsyncHiredisParser

__all__ = ["Multiplexed", "Server"]

_NOT_ENOUGH = object()
#: ``struct linger`` with ``l_onoff=1, l_linger=0``: close() resets the connection and drops its send queue.
_RESET_ON_CLOSE = struct.pack("ii", 1, 0)


class Server:
    """Where and how to connect: from the keyword arguments of a redis-py pool of one server."""

    __slots__ = ("connect_timeout", "db", "host", "keepalive", "password", "port", "protocol", "timeout", "username")

    def __init__(self, kwargs: dict[str, Any], protocol: int) -> None:
        self.host: str = kwargs.get("host", "localhost")
        self.port = int(kwargs.get("port", 6379))
        self.db = int(kwargs.get("db", 0) or 0)
        self.username: str | None = kwargs.get("username")
        self.password: str | None = kwargs.get("password")
        self.timeout: float | None = kwargs.get("socket_timeout")
        self.connect_timeout: float | None = kwargs.get("socket_connect_timeout") or self.timeout
        self.keepalive = bool(kwargs.get("socket_keepalive"))
        self.protocol = protocol


class _Wire(asyncio.Protocol):
    """One TCP connection: requests in order, each resolved by its replies."""

    def __init__(self, timeout: float | None) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = asyncio.get_running_loop().create_future()
        #: The waiting requests, oldest first: the future, the replies it waits for, those come.
        self.waiting: deque[tuple[asyncio.Future[list[Any]], int, list[Any]]] = deque()
        self.error: Exception | None = None
        self._reader = hiredis.Reader(protocolError=rexc.InvalidResponse, replyError=_AsyncHiredisParser.parse_error,
                                      notEnoughData=_NOT_ENOUGH)
        self._push = getattr(hiredis, "PushNotification", None)
        self._timeout = timeout
        self._timer: asyncio.TimerHandle | None = None
        #: When bytes last came (or, with nothing waiting before, the oldest request was sent).
        self._progress = 0.0
        self._paused = False
        self._resumed: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast("asyncio.Transport", transport)  # uvloop's is no subclass of asyncio's
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET_ON_CLOSE)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def send(self, packed: list[bytes], count: int) -> asyncio.Future[list[Any]]:
        """Write ``packed`` (commands in RESP); the future of their ``count`` replies, in order."""
        transport = self.transport
        if self.error is not None or transport is None or transport.is_closing():
            raise self.error or rexc.ConnectionError("the connection to Redis is closed")
        future: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
        if not self.waiting:
            self._progress = asyncio.get_running_loop().time()
        self.waiting.append((future, count, []))
        transport.writelines(packed)
        if self._timer is None and self._timeout:
            self._timer = asyncio.get_running_loop().call_at(self._progress + self._timeout, self._check)
        return future

    def unsent(self) -> bool:
        """Whether bytes wait in this process to be written (the server is not reading)."""
        return self.transport is not None and self.transport.get_write_buffer_size() > 0

    async def writable(self) -> None:
        """Until the transport takes more (its buffer below the high-water mark)."""
        while self._paused and self.error is None:
            if self._resumed is None:
                self._resumed = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._resumed)

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self._resumed is not None and not self._resumed.done():
            self._resumed.set_result(None)
        self._resumed = None

    def data_received(self, data: bytes) -> None:
        reader, waiting = self._reader, self.waiting
        reader.feed(data)
        self._progress = asyncio.get_running_loop().time()
        while True:
            try:
                reply = reader.gets()
            except rexc.InvalidResponse as exc:
                self.drop(rexc.ConnectionError(f"Redis sent what is not RESP: {exc}"))
                return
            if reply is _NOT_ENOUGH:
                return
            if self._push is not None and isinstance(reply, self._push):
                continue  # RESP3 out-of-band (tracking, maintenance): no request's reply
            if not waiting:
                self.drop(rexc.ConnectionError("Redis sent a reply no request waits for"))
                return
            future, count, replies = waiting[0]
            replies.append(reply)
            if len(replies) == count:
                waiting.popleft()
                if not future.done():  # its caller may have been cancelled: the reply is dropped
                    future.set_result(replies)

    def _check(self) -> None:
        """The socket timeout: no byte for ``timeout`` seconds while requests wait drops the connection."""
        self._timer = None
        if not self.waiting or self.error is not None:
            return
        loop = asyncio.get_running_loop()
        assert self._timeout
        if loop.time() - self._progress >= self._timeout:
            self.drop(rexc.TimeoutError(f"Timeout reading from Redis: no reply in {self._timeout}s"))
        else:
            self._timer = loop.call_at(self._progress + self._timeout, self._check)

    def drop(self, error: Exception) -> None:
        """Reset the connection; waiting requests fail with ``error`` once the socket is closed."""
        if self.error is None:
            self.error = error
        if self.transport is not None:
            self.transport.abort()  # the unsent buffer is dropped; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        if self.error is None:
            lost = f"Connection to Redis lost: {exc}" if exc else "Connection closed by server."
            self.error = rexc.ConnectionError(lost)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self.waiting:
            future, _, _ = self.waiting.popleft()
            if not future.done():
                future.set_exception(self.error)
        self.resume_writing()
        if not self.closed.done():
            self.closed.set_result(None)


class Multiplexed:
    """The shared connection of one process to one server, connected on first use and after a failure."""

    def __init__(self, server: Server, pack: Callable[..., list[bytes]]) -> None:
        self.server = server
        #: Packs one command in RESP, as the broker's pooled connections do (``connection._DiscardUnsent``).
        self.pack = pack
        self._wire: _Wire | None = None
        self._connecting: asyncio.Future[_Wire] | None = None

    async def request(self, packed: list[bytes], count: int) -> list[Any]:
        """The ``count`` replies to ``packed``, as the server sent them (errors as exceptions, in place).

        Raises ``ConnectionError`` or ``TimeoutError`` (redis-py's) when the connection fails
        before every reply came; the connection is reset and closed by then.
        """
        wire = self._wire
        if wire is None or wire.error is not None:
            wire = await self._connect()
        try:
            future = wire.send(packed, count)
            if wire._paused:
                await wire.writable()
            return await future
        except asyncio.CancelledError:
            if wire.unsent():
                wire.drop(rexc.ConnectionError("a request was cancelled before Redis read it"))
                await asyncio.shield(wire.closed)
            raise
        except (rexc.ConnectionError, rexc.TimeoutError):
            await asyncio.shield(wire.closed)
            raise

    async def _connect(self) -> _Wire:
        """A new connection, shared by whoever asks while it is being made."""
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._open())
        connecting = self._connecting
        try:
            wire = await asyncio.shield(connecting)
        finally:
            if connecting.done():
                self._connecting = None
        return wire

    async def _open(self) -> _Wire:
        server = self.server
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(server.connect_timeout):
                _, wire = await loop.create_connection(lambda: _Wire(server.timeout), server.host, server.port)
        except (OSError, TimeoutError) as exc:
            raise rexc.ConnectionError(f"Error connecting to {server.host}:{server.port}: {exc}") from exc
        if server.keepalive and (sock := wire.transport.get_extra_info("socket") if wire.transport else None):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        hello: list[Any] = []
        if server.protocol == 3:
            auth = ["AUTH", server.username or "default", server.password] if server.password else []
            hello.append(("HELLO", 3, *auth))
        elif server.password:
            hello.append(("AUTH", *((server.username,) if server.username else ()), server.password))
        if server.db:
            hello.append(("SELECT", server.db))
        if hello:
            replies = await _first_replies(wire, [hiredis.pack_command(command) for command in hello], len(hello))
            for reply in replies:
                if isinstance(reply, Exception):  # WRONGPASS is an AuthenticationError, a ConnectionError
                    refused = reply if isinstance(reply, rexc.ConnectionError) else rexc.ConnectionError(
                        f"Redis refused the connection's setup: {reply}")
                    wire.drop(refused)
                    await wire.closed
                    raise refused
        self._wire = wire
        return wire

    async def close(self) -> None:
        wire, self._wire = self._wire, None
        if wire is not None and wire.transport is not None:
            wire.drop(rexc.ConnectionError("the connection to Redis was closed"))
            await wire.closed


async def _first_replies(wire: _Wire, packed: list[bytes], count: int) -> list[Any]:
    try:
        return await wire.send(packed, count)
    except (rexc.ConnectionError, rexc.TimeoutError):
        await wire.closed
        raise
