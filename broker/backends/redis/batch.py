"""A non-transactional pipeline that runs scripts by EVALSHA and reloads any the server forgot.

On a plain TCP server a batch goes over the connection every batch of the process shares
(``multiplex``); on TLS, a Unix socket or Sentinel's master, over a connection of redis-py's pool.

On Redis Cluster, redis-py refuses EVALSHA inside a cluster pipeline, so a batch there sends
its commands and script calls concurrently instead (each on the node of its keys) and returns
the replies in the order they were added. The commands of one batch never depend on each
other's effects; on Cluster their order of execution is not fixed, so "the index is written
before the session's set" holds per round trip only on a single server.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.client import EMPTY_RESPONSE, NEVER_DECODE
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError

from broker.backends.redis.connection import Client
from broker.backends.redis.multiplex import Multiplexed
from broker.backends.redis.pool import QuickPool

__all__ = ["Batch", "run_script"]

#: The name a pre-packed command stands under in a batch's pipeline (``Batch.call_packed``):
#: no reply callback has it, so its reply comes back as the server sent it.
PREPACKED = "(packed EVALSHA)"

#: At most this many calls of one Cluster batch are in flight at once. redis-py refuses a
#: call at once (MaxConnectionsError, not retried) when a node's pool is exhausted, so a
#: batch of one call per session must not open one connection per session.
CLUSTER_CONCURRENCY = 32

#: Options of a pipeline's command that ``parse_response`` takes for itself rather than pass on.
_NOT_FOR_CALLBACKS = frozenset({EMPTY_RESPONSE, NEVER_DECODE, "keys"})


class _Calls:
    """Stands in for a pipeline on Cluster: records ``pipe.<command>(...)`` calls to await later."""

    def __init__(self, client: RedisCluster) -> None:
        self.client = client
        self.calls: list[Callable[[], Awaitable[Any]]] = []

    def __getattr__(self, name: str) -> Callable[..., None]:
        command = getattr(self.client, name)

        def record(*args: Any, **kwargs: Any) -> None:
            self.calls.append(lambda: command(*args, **kwargs))

        return record

    def __len__(self) -> int:
        return len(self.calls)


class Batch:
    """Commands and script calls sent in one round trip (per Cluster node), replies in order.

    A script missing from the server's cache (it restarted, or this is a new Cluster node)
    fails with NOSCRIPT without running; that call alone is repeated through ``AsyncScript``,
    which loads the script first. Any other error reply is raised.
    """

    def __init__(self, client: Client) -> None:
        # ``isinstance(client, Redis)``, not ``RedisCluster``: the latter is a typing Protocol's
        # check, some 0.5 µs, and a batch is made for every round trip of fan-out.
        server = client if isinstance(client, Redis) else None
        self._cluster = server is None
        #: The client of a single server (or of Sentinel's master): None on Cluster.
        self._server: Redis | None = server
        #: A pipeline, or on Cluster its stand-in: commands are added as ``pipe.<command>(...)``.
        self.pipe: Any = _Calls(client) if server is None else server.pipeline(transaction=False)  # type: ignore[arg-type]
        self._scripts: dict[int, tuple[AsyncScript, Callable[[], tuple[Sequence[str], Sequence[Any]]]]] = {}

    def call(self, script: AsyncScript, keys: Sequence[str], args: Sequence[Any]) -> None:
        if self._cluster:
            self.pipe.calls.append(lambda: script(keys=keys, args=args))
            return
        stack = self.pipe.command_stack
        self._scripts[len(stack)] = (script, lambda: (keys, args))
        stack.append((("EVALSHA", script.sha, len(keys), *keys, *args), {}))  # as ``pipe.evalsha`` records it

    def call_packed(self, script: AsyncScript, command: bytes,
                    arguments: Callable[[], tuple[Sequence[str], Sequence[Any]]]) -> None:
        """A single server's EVALSHA of ``script`` already packed in RESP (``command``), sent as it is;
        ``arguments`` gives its keys and arguments, should the server have to load the script."""
        assert not self._cluster
        stack = self.pipe.command_stack
        self._scripts[len(stack)] = (script, arguments)
        stack.append(((PREPACKED, command), {}))  # as ``pipe.execute_command`` records it

    def packed(self, command: bytes) -> None:
        """A single server's command already packed in RESP (``command``), sent as it is; its reply
        comes back as the server sent it, through no response callback."""
        assert not self._cluster
        self.pipe.command_stack.append(((PREPACKED, command), {}))

    @property
    def cluster(self) -> bool:
        """Whether the batch is a Cluster's (no pre-packed commands there)."""
        return self._cluster

    def __len__(self) -> int:
        return len(self.pipe)

    async def execute(self, raise_errors: bool = True) -> list[Any]:
        """The replies in order; with ``raise_errors`` False a call that failed has its exception
        in its place (on a single server a dropped connection still fails the whole batch)."""
        if not len(self.pipe):
            return []
        if self._cluster:
            limit = asyncio.Semaphore(CLUSTER_CONCURRENCY)

            async def bounded(call: Callable[[], Awaitable[Any]]) -> Any:
                async with limit:
                    return await call()

            replies = await asyncio.gather(*(bounded(call) for call in self.pipe.calls), return_exceptions=True)
            for reply in replies:
                if isinstance(reply, BaseException) and (raise_errors or not isinstance(reply, Exception)):
                    raise reply
            return list(replies)
        multiplexed = getattr(self._server.connection_pool, "multiplexed", None)  # type: ignore[union-attr]
        if multiplexed is not None:
            results = await self._exchange_multiplexed(multiplexed)
        else:
            results = await self._exchange_on_one_connection()
        if not _has_error(results):
            return results
        for i, result in enumerate(results):
            if isinstance(result, NoScriptError) and i in self._scripts:
                script, arguments = self._scripts[i]
                keys, args = arguments()
                try:
                    results[i] = result = await script(keys=keys, args=args)
                except ResponseError as exc:  # the script's own error, once it is loaded
                    results[i] = result = exc
            if isinstance(result, Exception) and raise_errors:
                raise result
        return results

    async def _exchange_multiplexed(self, multiplexed: Multiplexed) -> list[Any]:
        """The pipeline's commands and their replies over the server's shared connection (``multiplex``).

        As on a pooled connection (below): the replies through the client's response callbacks,
        errors in their place; a connection error, a timeout or a reply that is one (``LOADING``)
        sends the whole batch again on a new connection, under the client's retry policy.
        """
        server = self._server
        assert server is not None
        stack, self.pipe.command_stack = self.pipe.command_stack, []  # sent once, as redis-py's pipeline
        pack = multiplexed.pack
        packed: list[bytes] = []
        for args, _ in stack:
            if args[0] is PREPACKED:
                packed.append(args[1])
            else:
                packed += pack(*args)
        count = len(stack)

        async def exchange() -> list[Any]:
            raw = await multiplexed.request(packed, count)
            if _has_error(raw):
                for reply in raw:
                    if isinstance(reply, RedisConnectionError):
                        raise reply
            return raw

        retry: Retry | None = server.connection_pool.connection_kwargs.get("retry")
        raw = await (exchange() if retry is None else retry.call_with_retry(exchange, _nothing_to_undo))
        return await _parsed(server, stack, raw)

    async def _exchange_on_one_connection(self) -> list[Any]:
        """The pipeline's commands in one write and their replies, errors in their place.

        What redis-py's ``Pipeline.execute`` does for a pipeline that is no transaction, without
        the machinery around it that these batches never use: WATCH state, scripts loaded ahead,
        HIMPORT fieldsets, observability records, and a task to shield every release. That
        machinery cost about a third of a batch's client CPU: 108-123 µs per three-command batch
        through ``Pipeline.execute`` against 67-97 µs this way (bench/NOTES.md). As there, the
        commands are recorded by redis-py's pipeline, each reply goes through the client's
        response callbacks (``parse_response``), a connection error or timeout is retried on a
        new connection under the connection's retry policy (every command of the batch again;
        the batches' scripts and broadcasts are made to be repeated), and a read or write that
        fails or is cancelled midway drops the connection (redis-py), so it goes back to the pool
        with no reply left in it. A release that must wait (another task is waiting for a
        connection, or the pool is Sentinel's) is shielded, as redis-py shields it, so a
        cancellation cannot leave the connection counted in use; a single server's common one
        (``QuickPool.put_back``) does not wait at all.
        """
        server = self._server
        assert server is not None
        stack, self.pipe.command_stack = self.pipe.command_stack, []  # sent once, as redis-py's pipeline
        pool = server.connection_pool
        connection = await pool.get_connection()  # type: ignore[no-untyped-call]

        packed: list[bytes] = []
        plain: list[Any] = []
        for args, _ in stack:
            if args[0] is PREPACKED:
                if plain:
                    packed += connection.pack_commands(plain)
                    plain = []
                packed.append(args[1])
            else:
                plain.append(args)
        if plain:
            packed += connection.pack_commands(plain)

        async def exchange() -> list[Any]:
            await connection.send_packed_command(packed)
            parse = server.parse_response
            replies: list[Any] = []
            for args, options in stack:
                try:
                    replies.append(await parse(connection, args[0], **options))
                except ResponseError as exc:
                    replies.append(exc)
            return replies

        async def failed(error: Exception, failures: int) -> None:
            await connection.disconnect(error=error, failure_count=failures)

        try:
            replies: list[Any] = await connection.retry.call_with_retry(exchange, failed, with_failure_count=True)
            return replies
        finally:
            if not (isinstance(pool, QuickPool) and pool.put_back(connection)):
                await asyncio.shield(pool.release(connection))


async def _parsed(server: Redis, stack: list[Any], raw: list[Any]) -> list[Any]:
    """The replies of a pipeline's commands as redis-py's ``parse_response`` gives them, from the
    replies as the server sent them: an error in its place (or the command's ``EMPTY_RESPONSE``),
    the rest through the client's response callback for the command."""
    callbacks = server.response_callbacks
    replies: list[Any] = []
    for (args, options), reply in zip(stack, raw, strict=True):
        if args[0] is PREPACKED and not isinstance(reply, ResponseError):
            replies.append(reply)  # no callback has that name: the reply as the server sent it
            continue
        if isinstance(reply, ResponseError):
            replies.append(options.get(EMPTY_RESPONSE, reply))
            continue
        callback = callbacks.get(args[0])
        if callback is not None:
            extra = {k: v for k, v in options.items() if k not in _NOT_FOR_CALLBACKS}
            reply = callback(reply, **extra)
            if inspect.isawaitable(reply):
                reply = await reply
        replies.append(reply)
    return replies


def _has_error(replies: list[Any]) -> bool:
    """Whether any reply is an error: by their types, a handful per batch, looked at once each."""
    return any(issubclass(kind, Exception) for kind in set(map(type, replies)))


async def _nothing_to_undo(error: Exception) -> None:
    """A failed exchange's connection is reset and closed already (``multiplex``)."""


async def run_script(client: Client, script: AsyncScript, keys: Sequence[str], args: Sequence[Any]) -> Any:
    """One call of ``script``: a batch of one on a single server (its shared connection, where it
    has one), ``AsyncScript`` on Cluster. Raises the script's error."""
    if not isinstance(client, Redis):
        return await script(keys=keys, args=args)
    batch = Batch(client)
    batch.call(script, keys, args)
    return (await batch.execute())[0]
