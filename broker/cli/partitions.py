"""``mcp-broker partitions [set N]``: show or change the change log's partition count on a running deployment.

Like ``keys``, the command talks to the Redis of ``MCP_BROKER_REDIS_URL``, not to a server.
``set`` is the drain and switch of ``broker.backends.redis.partitioning``: it seals the current
partitions, makes a layout of N partitions current, moves the record collections to their new
partitions (record writes answer 503 meanwhile) and waits until the workers have fanned out
everything left in the old layout. Publishing goes on throughout; nothing is lost and no URI's
notifications are reordered. A ``set`` cut short is finished by running it again.

Exit codes: 0 done; 1 the workers had not drained the old layout within ``--wait`` seconds
(they go on; the command may be run again to wait); 2 bad input, no Redis, or a switch that
cannot start; 75 (EX_TEMPFAIL) Redis could not be reached.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from broker.config import Settings
from broker.errors import BackendUnavailable

__all__ = ["add_partitions_parser", "count_problem"]

#: Seconds ``serve`` gives Redis to tell it the deployment's partition count.
CHECK_TIMEOUT = 5.0


def add_partitions_parser(sub: Any, formatter: type[argparse.HelpFormatter]) -> None:
    """The ``partitions`` command, on the CLI's subparsers."""
    command = sub.add_parser("partitions", help="show or change the change log's partition count (Redis)",
                             formatter_class=formatter)
    actions = command.add_subparsers(dest="action")
    change = actions.add_parser("set", help="drain and switch to N partitions, while the deployment runs",
                                formatter_class=formatter)
    change.add_argument("count", type=int, help="the new partition count (1 to 1024)")
    change.add_argument("--wait", type=float, default=60.0, help="seconds to wait for the workers to drain")
    command.set_defaults(func=run)


def count_problem(settings: Settings) -> str | None:
    """The one line ``serve`` stops with when ``MCP_BROKER_CHANGELOG_PARTITIONS`` is not the count of
    the deployment's change log; None when it is, is unset, or Redis cannot be asked now (every
    worker asks again as it starts, and refuses to serve with another count)."""
    if not settings.redis_url or settings.changelog_partitions is None:
        return None
    from broker.backends.redis.partitioning import mismatch

    try:
        count = asyncio.run(asyncio.wait_for(_stored_count(settings), CHECK_TIMEOUT))
    except Exception:  # unreachable, or slow: the workers' own check at start still holds
        return None
    if count is None or count == settings.changelog_partitions:
        return None
    return mismatch(settings.changelog_partitions, count)


async def _stored_count(settings: Settings) -> int | None:
    from broker.backends.redis.connection import open_clients
    from broker.backends.redis.keys import Keys
    from broker.backends.redis.partitioning import Partitioning
    from broker.backends.redis.scripts import Scripts

    clients = open_clients(settings)
    try:
        partitioning = Partitioning(clients.commands, Keys(settings.redis_prefix), Scripts(clients.commands), None)
        return await partitioning.stored_count()
    finally:
        for client in (clients.commands, clients.pubsub):
            await client.aclose()


def run(args: argparse.Namespace) -> int:
    settings = Settings()
    where = f"mcp-broker partitions{' set' if args.action == 'set' else ''}"
    if not settings.redis_url:
        print(f"{where}: the change log is partitioned on Redis only; set MCP_BROKER_REDIS_URL", file=sys.stderr)
        return 2
    if args.action == "set" and not 1 <= args.count <= 1024:
        print(f"{where}: the count must be between 1 and 1024", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_act(settings, args, where))
    except BackendUnavailable as exc:
        print(f"{where}: the backend could not be reached: {exc}", file=sys.stderr)
        return 75


async def _act(settings: Settings, args: argparse.Namespace, where: str) -> int:
    from broker.backends.redis.connection import open_clients, unavailable
    from broker.backends.redis.keys import Keys
    from broker.backends.redis.partitioning import Partitioning, PartitionMismatch
    from broker.backends.redis.scripts import Scripts

    clients = open_clients(settings)
    try:
        partitioning = Partitioning(clients.commands, Keys(settings.redis_prefix), Scripts(clients.commands), None)
        with unavailable("partitions"):
            await partitioning.start()
            if args.action != "set":
                print(_describe(partitioning))
                return 0
            # A set cut short, or one whose wait ran out: finish it (move what is left, wait again).
            resume = (partitioning.moving or partitioning.drain is not None) and partitioning.write.count == args.count
            if not resume:
                try:
                    await partitioning.switch(args.count)
                except PartitionMismatch as exc:
                    print(f"{where}: {exc}", file=sys.stderr)
                    return 2
            print(f"{where}: appends go to {args.count} partitions now; moving records", file=sys.stderr)
            moved = await partitioning.move_records()
            print(f"{where}: {moved} record collections moved; waiting for fan-out to drain", file=sys.stderr)
            drained = await partitioning.wait_drained(args.wait)
        print(_describe(partitioning))
        return 0 if drained else 1
    finally:
        for client in (clients.commands, clients.pubsub):
            await client.aclose()


def _describe(partitioning: Any) -> str:
    write = partitioning.write
    text = f"{write.count} partitions (numbers {write.base}-{write.base + write.count - 1}, by {write.key})"
    if partitioning.drain is not None:
        drain = partitioning.drain
        text += f"; draining {drain.count} partitions (numbers {drain.base}-{drain.base + drain.count - 1})"
    if partitioning.moving:
        text += "; records moving"
    return text
