"""The connection pool of a single server: redis-py's blocking pool, with a short way through."""

from __future__ import annotations

from typing import Any

from redis.asyncio import BlockingConnectionPool

from broker.backends.redis.multiplex import Multiplexed

__all__ = ["QuickPool"]


class QuickPool(BlockingConnectionPool):
    """redis-py's blocking pool, with a short way for the common case: an idle connection is there.

    redis-py's own checkout and release take an ``asyncio.Condition``, an ``asyncio.timeout``,
    the pool's lock, a deprecation check of the arguments and four observability records for
    every command: measured on one server (``EVALSHA`` of ``return 1``, one at a time), a call
    cost 129-139 µs of client CPU through redis-py's pool and 85-92 µs through this one, the
    round trip itself included (bench/NOTES.md). The short way takes an idle connection and
    still has redis-py check it (``ensure_connection``: connected, nothing unread); a release
    puts it back. Whenever a task waits for a connection (the pool is exhausted), or the pool
    is in maintenance (redis-py's handling of a server's MOVING notices), both go through
    redis-py's own methods, which wake the waiters. Left out on the short way: redis-py's pool
    observability (not used here) and its connection-released event (used by streaming
    credential providers, which the broker does not configure).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        #: Tasks inside redis-py's checkout, some of which may wait for a release.
        self._entered = 0
        #: The pipelined connection batches share (``multiplex``), on a plain TCP server; None otherwise.
        self.multiplexed: Multiplexed | None = None

    def _quick(self) -> bool:
        return not self._entered and not self._in_maintenance

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        available = self._available_connections
        if available and self._quick():
            connection = available.pop()
            self._in_use_connections.add(connection)
            try:
                await self.ensure_connection(connection)
            except BaseException:
                await self.release(connection)
                raise
            return connection
        self._entered += 1
        try:
            return await super().get_connection()  # type: ignore[no-untyped-call]
        finally:
            self._entered -= 1

    def put_back(self, connection: Any) -> bool:
        """The short way of ``release``, which never waits; False when the long way must be taken
        (a task waits for a connection, the pool is in maintenance, or redis-py wants the
        connection reconnected)."""
        if self._quick() and not connection.should_reconnect():
            self._in_use_connections.remove(connection)
            self._available_connections.append(connection)
            return True
        return False

    async def release(self, connection: Any) -> None:
        if not self.put_back(connection):
            await super().release(connection)

    async def disconnect(self, inuse_connections: bool = True) -> None:
        await super().disconnect(inuse_connections)
        if self.multiplexed is not None:
            await self.multiplexed.close()
