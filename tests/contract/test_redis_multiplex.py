"""The connection batches share on a plain TCP server (``multiplex``): many batches at once in order on
one connection, a cancelled batch's reply never given to the next, a server that stops answering
reset within the socket timeout, the server's ACL user and database used."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import socket
import struct

import pytest
from redis.asyncio import Redis
from redis.exceptions import AuthenticationError, TimeoutError

from broker.backends.redis.batch import Batch, run_script
from broker.backends.redis.connection import open_clients
from broker.backends.redis.pool import QuickPool
from broker.config import Settings
from tests.contract.test_redis_batch import client_for
from tests.support import RedisProcess

#: Spins for ARGV[1] microseconds of the server's clock, then returns ARGV[2].
SLOW = """
local t0 = redis.call('TIME')
repeat
  local t = redis.call('TIME')
until (t[1] - t0[1]) * 1000000 + (t[2] - t0[2]) >= tonumber(ARGV[1])
return ARGV[2]
"""


def shared(client: Redis) -> object:
    pool = client.connection_pool
    assert isinstance(pool, QuickPool) and pool.multiplexed is not None, "a plain TCP server's batches share one"
    return pool.multiplexed


async def connection_id(client: Redis) -> int:
    batch = Batch(client)
    batch.pipe.client_id()
    (found,) = await batch.execute()
    return int(found)


async def test_many_batches_at_once_share_one_connection_and_each_gets_its_own_replies(
        redis_server: RedisProcess) -> None:
    key = f"m{secrets.token_hex(4)}"
    async with client_for(redis_server.url, redis_max_connections=2) as client:
        shared(client)
        echo = client.register_script("return ARGV[1]")

        async def one(i: int) -> list[object]:
            batch = Batch(client)
            batch.pipe.incr(key)
            batch.call(echo, [key], [f"reply {i}"])
            batch.pipe.sadd(f"{key}:s", i)
            batch.pipe.client_id()
            return await batch.execute()

        replies = await asyncio.gather(*(one(i) for i in range(300)))  # far more than the pool's 2 connections
        assert [reply[1] for reply in replies] == [f"reply {i}".encode() for i in range(300)]
        assert sorted(reply[0] for reply in replies) == list(range(1, 301))  # every INCR ran once
        assert len({reply[3] for reply in replies}) == 1  # all on one connection
        assert await client.scard(f"{key}:s") == 300


async def test_a_batch_cancelled_while_its_command_runs_leaves_its_reply_behind_not_to_the_next(
        redis_server: RedisProcess) -> None:
    key = f"m{secrets.token_hex(4)}"
    async with client_for(redis_server.url) as client:
        mux = shared(client)
        slow = client.register_script(SLOW)
        before = await connection_id(client)
        wire = mux._wire  # type: ignore[attr-defined]
        waiting = Batch(client)
        waiting.call(slow, [key], [300_000, "the slow one's"])
        task = asyncio.create_task(waiting.execute())
        while not (wire.waiting and not wire.unsent()):  # sent, its bytes with the kernel: the case at hand
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        after = Batch(client)
        after.pipe.incr(key)
        after.call(slow, [key], [0, "mine"])
        after.pipe.client_id()
        assert await after.execute() == [1, b"mine", before]  # its own replies, on the same connection


async def test_a_server_that_stops_answering_is_reset_within_the_socket_timeout(redis_server: RedisProcess) -> None:
    key = f"m{secrets.token_hex(4)}"
    async with client_for(redis_server.url, redis_socket_timeout=0.5, redis_retries=0) as client:
        mux = shared(client)
        first = await connection_id(client)
        wire = mux._wire  # type: ignore[attr-defined]
        sock = wire.transport.get_extra_info("socket")
        assert struct.unpack("ii", sock.getsockopt(socket.SOL_SOCKET, socket.SO_LINGER, 8)) == (1, 0)
        assert redis_server.proc is not None
        os.kill(redis_server.proc.pid, signal.SIGSTOP)  # the server stops answering, its socket open
        try:
            stalled = Batch(client)
            stalled.pipe.incr(key)
            loop = asyncio.get_running_loop()
            began = loop.time()
            with pytest.raises(TimeoutError):
                await stalled.execute()
            assert 0.4 <= loop.time() - began < 2  # within the socket timeout (0.5 s), give or take the loop
            assert wire.closed.done() and sock.fileno() == -1  # reset and closed before the caller heard of it
        finally:
            os.kill(redis_server.proc.pid, signal.SIGCONT)
        second = await connection_id(client)  # a new connection
        assert second != first
        # The INCR reached the server's socket before the reset, so it ran once it woke, or the
        # reset dropped it first: never more than once.
        assert await client.get(key) in (None, b"1")


async def test_a_connection_the_server_dropped_is_made_anew_and_the_batch_sent_again_once(
        redis_server: RedisProcess) -> None:
    key = f"m{secrets.token_hex(4)}"
    async with client_for(redis_server.url) as client, client_for(redis_server.url) as admin:
        shared(client)
        first = await connection_id(client)
        await admin.client_kill_filter(_id=first)
        batch = Batch(client)
        batch.pipe.incr(key)
        batch.pipe.client_id()
        count, second = await batch.execute()
        assert count == 1 and second != first


async def test_the_urls_user_password_and_database_are_those_of_the_shared_connection() -> None:
    key = f"m{secrets.token_hex(4)}"
    with RedisProcess(extra=["--user", "alice", "on", ">secret", "~*", "&*", "+@all"]) as server:
        url = f"redis://alice:secret@127.0.0.1:{server.port}/3"
        async with client_for(url) as client:
            shared(client)
            echo = client.register_script("return redis.call('INCR', KEYS[1])")
            batch = Batch(client)
            batch.pipe.acl_whoami()
            batch.call(echo, [key], [])
            assert await batch.execute() == ["alice", 1]  # (redis-py's callback decodes the name)
            assert await run_script(client, echo, [key], []) == 2
        plain = Redis(port=server.port, db=3)
        try:
            assert await plain.get(key) == b"2"  # database 3, as the URL says
        finally:
            await plain.aclose()
        async with client_for(f"redis://alice:wrong@127.0.0.1:{server.port}/3", redis_retries=0) as refused:
            batch = Batch(refused)
            batch.pipe.ping()
            with pytest.raises(AuthenticationError):
                await batch.execute()


async def test_tls_unix_sockets_and_the_pub_sub_client_keep_pooled_connections() -> None:
    for url in ("rediss://127.0.0.1:1/0", "unix:///tmp/no-such-redis.sock"):
        clients = open_clients(Settings(_env_file=None, redis_url=url))  # type: ignore[call-arg]
        try:
            assert isinstance(clients.commands.connection_pool, QuickPool)
            assert clients.commands.connection_pool.multiplexed is None
        finally:
            await clients.commands.aclose()
            await clients.pubsub.aclose()
    clients = open_clients(Settings(_env_file=None, redis_url="redis://127.0.0.1:1/0"))  # type: ignore[call-arg]
    try:
        assert clients.pubsub.connection_pool.multiplexed is None  # type: ignore[union-attr]
    finally:
        await clients.commands.aclose()
        await clients.pubsub.aclose()
