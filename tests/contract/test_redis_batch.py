"""A batch on one server: its replies in order through the client's callbacks, errors in their place,
a dropped connection retried, and a batch cancelled midway leaving nothing for the next one."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from broker.backends.redis.batch import Batch
from broker.backends.redis.connection import open_clients
from broker.config import Settings
from tests.support import RedisProcess


@contextlib.asynccontextmanager
async def client_for(url: str, **settings: object) -> AsyncIterator[Redis]:
    clients = open_clients(Settings(_env_file=None, redis_url=url, **settings))  # type: ignore[arg-type, call-arg]
    assert isinstance(clients.commands, Redis)
    try:
        yield clients.commands
    finally:
        await clients.commands.aclose(close_connection_pool=True)
        await clients.pubsub.aclose(close_connection_pool=True)  # type: ignore[call-arg]


async def test_replies_come_in_order_through_the_callbacks_with_errors_in_place_and_forgotten_scripts_reloaded(
        ) -> None:
    with RedisProcess() as server:
        async with client_for(server.url) as client:
            key = f"b{secrets.token_hex(4)}"
            fails = client.register_script("return redis.error_reply('no such thing')")
            echo = client.register_script("return ARGV[1]")
            await client.script_flush()  # as after a restart: every script is unknown to the server
            batch = Batch(client)
            batch.pipe.hset(key + "h", mapping={"a": "1", "b": "2"})
            batch.pipe.hgetall(key + "h")
            batch.pipe.sadd(key + "s", "x", "y")
            batch.pipe.smembers(key + "s")
            batch.call(fails, [key], [])
            batch.call(echo, [key], ["hello"])
            batch.pipe.incr(key + "h")  # a hash: WRONGTYPE
            batch.pipe.exists(key + "h")
            replies = await batch.execute(raise_errors=False)
            assert replies[:4] == [2, {b"a": b"1", b"b": b"2"}, 2, {b"x", b"y"}]
            assert isinstance(replies[4], ResponseError) and "no such thing" in str(replies[4])
            assert replies[5] == b"hello"
            assert isinstance(replies[6], ResponseError) and "WRONGTYPE" in str(replies[6])
            assert replies[7] == 1
            assert len(batch) == 0 and await batch.execute() == []  # sent once

            raising = Batch(client)
            raising.pipe.incr(key + "n")
            raising.call(fails, [key], [])
            with pytest.raises(ResponseError, match="no such thing"):
                await raising.execute()
            assert await client.get(key + "n") == b"1"  # the commands around the error ran


async def test_a_batch_on_a_connection_the_server_dropped_is_sent_again_once_on_a_new_one(
        redis_server: RedisProcess) -> None:
    key = f"b{secrets.token_hex(4)}"
    async with client_for(redis_server.url, redis_max_connections=1) as client, \
            client_for(redis_server.url) as other:
        first = Batch(client)
        first.pipe.client_id()
        (connection_id,) = await first.execute()
        await other.client_kill_filter(_id=connection_id)  # the pooled connection dies
        batch = Batch(client)
        batch.pipe.incr(key)
        batch.pipe.client_id()
        count, new_id = await batch.execute()
        assert count == 1 and new_id != connection_id  # the dead connection never ran it


async def test_a_batch_cancelled_while_waiting_for_its_replies_leaves_none_for_the_next_batch(
        redis_server: RedisProcess) -> None:
    key = f"b{secrets.token_hex(4)}"
    async with client_for(redis_server.url, redis_max_connections=1) as client, \
            client_for(redis_server.url) as watcher:
        # Through the pool, as on TLS or Sentinel (the shared connection of a plain server keeps a
        # cancelled batch's command running: tests/contract/test_redis_multiplex.py).
        client.connection_pool.multiplexed = None  # type: ignore[attr-defined]
        waiting = Batch(client)
        waiting.pipe.incr(key)
        waiting.pipe.blpop([key + "list"], timeout=30)  # its reply would come only after a push
        task = asyncio.create_task(waiting.execute())
        async with asyncio.timeout(10):  # until Redis has the batch: its connection blocks in BLPOP
            while not any(c.get("cmd") == "blpop" for c in await watcher.client_list()):
                await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        async with asyncio.timeout(10):  # the cancelled batch's connection is dropped, not kept for the next
            while any(c.get("cmd") == "blpop" for c in await watcher.client_list()):
                await asyncio.sleep(0.01)
        await watcher.rpush(key + "list", "late")
        after = Batch(client)  # the pool's only connection: made anew
        after.pipe.get(key)
        after.pipe.lrange(key + "list", 0, -1)
        assert await after.execute() == [b"1", [b"late"]]
