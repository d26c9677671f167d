"""A non-transactional pipeline that runs scripts by EVALSHA and reloads any the server forgot."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

__all__ = ["Batch"]


class Batch:
    """Commands and script calls sent in one round trip (per Cluster node), replies in order.

    A script missing from the server's cache (it restarted, or this is a new Cluster node)
    fails with NOSCRIPT without running; that call alone is repeated through ``AsyncScript``,
    which loads the script first. Any other error reply is raised.
    """

    def __init__(self, client: Any) -> None:
        self.pipe: Any = client.pipeline(transaction=False)
        self._scripts: dict[int, tuple[AsyncScript, Sequence[str], Sequence[Any]]] = {}

    def call(self, script: AsyncScript, keys: Sequence[str], args: Sequence[Any]) -> None:
        self._scripts[len(self.pipe)] = (script, keys, args)
        self.pipe.evalsha(script.sha, len(keys), *keys, *args)

    def __len__(self) -> int:
        return len(self.pipe)

    async def execute(self) -> list[Any]:
        if not len(self.pipe):
            return []
        results: list[Any] = list(await self.pipe.execute(raise_on_error=False))
        for i, result in enumerate(results):
            if isinstance(result, NoScriptError) and i in self._scripts:
                script, keys, args = self._scripts[i]
                results[i] = await script(keys=keys, args=args)
            elif isinstance(result, Exception):
                raise result
        return results
