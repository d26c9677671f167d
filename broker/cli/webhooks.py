"""``mcp-broker webhooks list|dead-letters``: what the events extension's webhooks are doing, for an operator.

Like ``keys``, it reads the backend the settings name (the Redis of ``MCP_BROKER_REDIS_URL``),
not a running server. ``list`` shows every subscription (never its secret): tenant, principal,
callback URL, lease expiry, delivery position, last delivery and last error. ``dead-letters``
shows the newest events given up on, with the body that was sent. ``--json`` prints JSON lines.

Exit codes: 0 done; 2 no Redis configured; 75 (EX_TEMPFAIL) the backend could not be reached.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
from datetime import UTC, datetime
from typing import Any

from broker.backends import create_backend
from broker.config import Settings
from broker.errors import BackendUnavailable

__all__ = ["add_webhooks_parser"]


def add_webhooks_parser(sub: Any, formatter: type[argparse.HelpFormatter]) -> None:
    webhooks = sub.add_parser("webhooks", help="webhook subscriptions (events extension) and their dead letters",
                              formatter_class=formatter)
    actions = webhooks.add_subparsers(dest="action", required=True)
    actions.add_parser("list", help="every subscription (never its secret)", formatter_class=formatter)
    dead = actions.add_parser("dead-letters", help="the newest events given up on", formatter_class=formatter)
    dead.add_argument("--limit", type=int, default=50)
    for parser in actions.choices.values():
        parser.add_argument("--json", action="store_true", help="print one JSON object a line")
    webhooks.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    settings = Settings()
    if not settings.redis_url:
        print(f"mcp-broker webhooks {args.action}: subscriptions live in the backend the workers share, and the "
              "memory backend lives inside `mcp-broker serve`; set MCP_BROKER_REDIS_URL", file=sys.stderr)
        return 2
    try:
        rows = asyncio.run(_rows(settings, args))
    except BackendUnavailable as exc:
        print(f"mcp-broker webhooks {args.action}: the backend could not be reached: {exc}", file=sys.stderr)
        return 75
    for row in rows:
        print(json.dumps(row) if args.json else "  ".join(f"{k}={v}" for k, v in row.items() if k != "body"))
    if not rows and not args.json:
        print("none", file=sys.stderr)
    return 0


def _when(at: float | None) -> str | None:
    return None if at is None else datetime.fromtimestamp(at, UTC).isoformat(timespec="seconds")


async def _rows(settings: Settings, args: argparse.Namespace) -> list[dict[str, Any]]:
    backend = create_backend(settings)
    await backend.start()
    try:
        if args.action == "dead-letters":
            return [{**dataclasses.asdict(d), "at": _when(d.at)}
                    for d in await backend.webhooks.dead_letters(max(args.limit, 1))]
        rows: list[dict[str, Any]] = []
        after = ""
        while page := await backend.webhooks.page(after, 200):
            rows += [{"id": r.id, "tenant": r.tenant, "principal": r.principal, "url": r.url,
                      "uris": len(r.arguments.get("uris", [])), "expires": _when(r.expires_at),
                      "position": f"{r.epoch}-{r.offset}", "delivered": _when(r.delivered_at),
                      "error": r.last_error, "failing_since": _when(r.failed_since)} for r in page]
            after = page[-1].id
        return rows
    finally:
        await backend.close()
