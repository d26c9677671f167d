"""Every connection the broker opens to Redis resets when dropped, so nothing it had not sent goes out later."""

from __future__ import annotations

import asyncio
import secrets
import socket
import struct
from typing import Any

import pytest
from redis.asyncio import BlockingConnectionPool
from redis.asyncio.connection import SSLConnection
from redis.asyncio.sentinel import SentinelManagedConnection, SentinelManagedSSLConnection

from broker.backends.redis.connection import _DiscardUnsent, open_clients
from broker.config import Settings
from tests.support import RedisProcess


def settings_for(url: str) -> Settings:
    return Settings(_env_file=None, redis_url=url)  # type: ignore[call-arg]


async def test_a_dropped_connection_resets_and_is_closed_before_the_caller_hears_of_it(
        redis_server: RedisProcess) -> None:
    clients = open_clients(settings_for(redis_server.url))
    try:
        for client in (clients.commands, clients.pubsub):
            connection = await client.connection_pool.get_connection()
            sock = connection._writer.get_extra_info("socket")
            assert struct.unpack("ii", sock.getsockopt(socket.SOL_SOCKET, socket.SO_LINGER, 8)) == (1, 0)
            await connection.disconnect(nowait=True)  # as redis-py drops it on a timeout, before raising
            assert sock.fileno() == -1  # closed (so reset, its send queue gone), not closing
            await client.connection_pool.release(connection)
    finally:
        await clients.commands.aclose()
        await clients.pubsub.aclose()


@pytest.mark.parametrize(("url", "kind"), [
    ("rediss://127.0.0.1:1/0", SSLConnection),
    ("redis+sentinel://127.0.0.1:1/mymaster", SentinelManagedConnection),
    ("rediss+sentinel://127.0.0.1:1/mymaster", SentinelManagedSSLConnection),
])
async def test_tls_and_sentinel_connections_reset_too(url: str, kind: type[Any]) -> None:
    clients = open_clients(settings_for(url))
    try:
        for client in (clients.commands, clients.pubsub):
            connection_class = client.connection_pool.connection_class
            assert issubclass(connection_class, _DiscardUnsent) and issubclass(connection_class, kind)
    finally:
        await clients.commands.aclose()
        await clients.pubsub.aclose()


async def test_cluster_connections_reset_too() -> None:
    clients = open_clients(settings_for("redis+cluster://127.0.0.1:1,127.0.0.1:2"))
    try:
        for client in (clients.commands, clients.pubsub):
            # The nodes a cluster client discovers are built from these kwargs.
            assert issubclass(client.nodes_manager.connection_kwargs["connection_class"], _DiscardUnsent)
            assert all(issubclass(node.connection_class, _DiscardUnsent)
                       for node in client.nodes_manager.startup_nodes.values())
    finally:
        await clients.commands.aclose()
        await clients.pubsub.aclose()


async def test_more_concurrent_commands_than_connections_wait_their_turn_and_all_succeed(
        redis_server: RedisProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool's short way must not strand a command waiting for a connection, nor lose one."""
    s = Settings(_env_file=None, redis_url=redis_server.url, redis_max_connections=2)  # type: ignore[call-arg]
    clients = open_clients(s)
    client = clients.commands
    key = f"q{secrets.token_hex(4)}"
    try:
        # Each holds its connection until Redis answers: 50 at once need 25 turns of the two.
        replies = await asyncio.wait_for(asyncio.gather(*(client.blpop([key], timeout=0.05) for _ in range(10)),
                                                        *(client.incr(key + "n") for _ in range(40))), 30)
        assert replies[:10] == [None] * 10
        assert sorted(replies[10:]) == list(range(1, 41))
        pool = client.connection_pool
        assert len(pool._in_use_connections) == 0 and len(pool._available_connections) <= 2
        assert await client.get(key + "n") == b"40"
        # One command at a time never needs redis-py's own checkout: the short way serves it.
        long_way = 0
        checkout = BlockingConnectionPool.get_connection

        async def counted(self: BlockingConnectionPool, *args: Any, **kwargs: Any) -> Any:
            nonlocal long_way
            long_way += 1
            return await checkout(self, *args, **kwargs)

        monkeypatch.setattr(BlockingConnectionPool, "get_connection", counted)
        for _ in range(5):
            await client.incr(key + "n")
        assert long_way == 0 and await client.get(key + "n") == b"45"
    finally:
        await client.aclose(close_connection_pool=True)  # type: ignore[union-attr]
        await clients.pubsub.aclose()
