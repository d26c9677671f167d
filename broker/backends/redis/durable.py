"""Durable mode (``MCP_BROKER_REDIS_DURABLE_REPLICAS``): a write acknowledged once replicas have it.

Redis replicates asynchronously: a master acknowledges a write before any replica has it, and
a failover to a replica loses what the replica had not received (docs/GUARANTEES.md).
In durable mode the scripts whose effects a client is told of (a published change, a record
written or deleted, an API key created or revoked) are followed by ``WAIT <replicas>
<timeout>`` on the same connection, in the same round trip; fewer replicas than asked within
the timeout, and the write is answered 503, not acknowledged (it may have been applied, as
any 503's). A master that lost its replicas, or an old master that Sentinel has not demoted
yet, therefore acknowledges nothing. ``min-replicas-to-write`` on the server
(docs/OPERATIONS.md) makes such a master refuse the write itself, after ``min-replicas-max-lag``.

Writes of the broker's own (sessions, inboxes, fan-out's acknowledgements) are not waited for:
what a failover takes of them is covered by the gap rule (``lineage.lua``) and by fan-out
redoing changes it had not acknowledged on the surviving server.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

from broker.backends.redis.batch import run_script
from broker.backends.redis.connection import Client
from broker.config import Settings
from broker.errors import BackendUnavailable

__all__ = ["Durability"]


@dataclass(frozen=True, slots=True)
class Durability:
    """How many replicas must have a client's write before it is acknowledged (0: none)."""

    replicas: int = 0
    timeout_ms: int = 0

    @classmethod
    def of(cls, settings: Settings) -> Durability:
        return cls(settings.redis_durable_replicas, int(settings.redis_durable_timeout * 1000))

    async def run(self, client: Client, script: AsyncScript, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """One call of ``script``, its reply once ``replicas`` replicas have its effects.

        Raises:
            BackendUnavailable: fewer replicas acknowledged it within the timeout.
        """
        if not self.replicas:
            return await run_script(client, script, keys, args)
        assert isinstance(client, Redis)  # refused on Cluster at start (config)
        for attempt in range(2):
            # One pipeline, one connection: WAIT counts the writes of the connection it is sent on.
            pipe = client.pipeline(transaction=False)
            pipe.evalsha(script.sha, len(keys), *keys, *args)
            pipe.execute_command("WAIT", self.replicas, self.timeout_ms)
            reply, acked = await pipe.execute(raise_on_error=False)
            if isinstance(reply, NoScriptError) and attempt == 0:
                # Not run (a new master's cache is empty): load it, and send both again.
                await client.script_load(script.script)
                continue
            for outcome in (reply, acked):
                if isinstance(outcome, Exception):
                    raise outcome
            if int(acked) < self.replicas:
                raise BackendUnavailable(f"{acked} of {self.replicas} replicas acknowledged the write within "
                                         f"{self.timeout_ms} ms (MCP_BROKER_REDIS_DURABLE_REPLICAS): not acknowledged")
            return reply
        raise AssertionError("unreachable")
