"""A non-transactional pipeline that runs scripts by EVALSHA and reloads any the server forgot.

On Redis Cluster, redis-py refuses EVALSHA inside a cluster pipeline, so a batch there sends
its commands and script calls concurrently instead (each on the node of its keys) and returns
the replies in the order they were added. The commands of one batch never depend on each
other's effects; on Cluster their order of execution is not fixed, so "the index is written
before the session's set" holds per round trip only on a single server.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from redis.asyncio.cluster import RedisCluster
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

from broker.backends.redis.connection import Client

__all__ = ["Batch"]

#: At most this many calls of one Cluster batch are in flight at once. redis-py refuses a
#: call at once (MaxConnectionsError, not retried) when a node's pool is exhausted, so a
#: batch of one call per session must not open one connection per session.
CLUSTER_CONCURRENCY = 32


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
        self._cluster = isinstance(client, RedisCluster)
        #: A pipeline, or on Cluster its stand-in: commands are added as ``pipe.<command>(...)``.
        self.pipe: Any = _Calls(client) if isinstance(client, RedisCluster) else client.pipeline(transaction=False)
        self._scripts: dict[int, tuple[AsyncScript, Sequence[str], Sequence[Any]]] = {}

    def call(self, script: AsyncScript, keys: Sequence[str], args: Sequence[Any]) -> None:
        if self._cluster:
            self.pipe.calls.append(lambda: script(keys=keys, args=args))
            return
        self._scripts[len(self.pipe)] = (script, keys, args)
        self.pipe.evalsha(script.sha, len(keys), *keys, *args)

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
        results: list[Any] = list(await self.pipe.execute(raise_on_error=False))
        for i, result in enumerate(results):
            if isinstance(result, NoScriptError) and i in self._scripts:
                script, keys, args = self._scripts[i]
                results[i] = await script(keys=keys, args=args)
            elif isinstance(result, Exception) and raise_errors:
                raise result
        return results
