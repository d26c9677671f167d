"""``mcp-broker keys create|list|revoke``: the operator's runtime API keys, straight in the backend.

Like ``postgres install``, the command talks to what the settings name, not to a running
server: the Redis of ``MCP_BROKER_REDIS_URL``, which every worker reads its keys from. The
operator manages any tenant's keys (a tenant's admin uses the admin REST API instead). The key
made by ``create`` is printed once, alone on stdout, so ``KEY=$(mcp-broker keys create ...)``
keeps it; what it is goes to stderr. ``--json`` prints one JSON document instead.

Exit codes: 0 done; 1 no such key, or revoked already; 2 bad input or no Redis configured;
75 (EX_TEMPFAIL) the backend could not be reached.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from datetime import UTC, datetime
from typing import Any

from broker.auth.keys import GRANTABLE, MAX_PAGE, KeyAdmin, KeyRefused, key_view, parse_duration
from broker.backends import create_backend
from broker.config import Settings
from broker.errors import BackendUnavailable

__all__ = ["add_keys_parser"]


def add_keys_parser(sub: Any, formatter: type[argparse.HelpFormatter]) -> None:
    """The ``keys`` command and its three actions, on the CLI's subparsers."""
    keys = sub.add_parser("keys", help="runtime API keys (mcpb_...): create, list, revoke, in the backend",
                          formatter_class=formatter)
    actions = keys.add_subparsers(dest="action", required=True)
    create = actions.add_parser("create", help="make a key; it is printed once", formatter_class=formatter)
    create.add_argument("--tenant", required=True)
    create.add_argument("--subject", required=True, help="who the key stands for (its principal: tenant/subject)")
    create.add_argument("--scopes", default=None,
                        help=f"comma list among {', '.join(GRANTABLE)} (default: all but keys:admin and console:read)")
    create.add_argument("--expires-in", default=None, help="a lifetime: seconds, or 90s, 15m, 12h, 30d (default: none)")
    listing = actions.add_parser("list", help="the keys (never their secrets)", formatter_class=formatter)
    listing.add_argument("--tenant", default=None, help="only this tenant's keys (default: every tenant's)")
    revoke = actions.add_parser("revoke", help="revoke a key by id: every worker refuses it within seconds",
                                formatter_class=formatter)
    revoke.add_argument("id")
    for parser in (create, listing, revoke):
        parser.add_argument("--json", action="store_true", help="print JSON")
    keys.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    settings = Settings()
    where = f"mcp-broker keys {args.action}"
    if not settings.redis_url:
        print(f"{where}: keys live in the backend the workers share, and the memory backend lives inside "
              "`mcp-broker serve`; set MCP_BROKER_REDIS_URL to the Redis its workers use", file=sys.stderr)
        return 2
    if "keys" not in settings.auth_methods:
        print(f"{where}: note: MCP_BROKER_AUTH does not include keys, so servers with these settings accept "
              "no stored key", file=sys.stderr)
    try:
        return asyncio.run(_act(settings, args, where))
    except KeyRefused as exc:
        print(f"{where}: {exc.message}", file=sys.stderr)
        return 2 if exc.status in (403, 422) else 1
    except BackendUnavailable as exc:
        print(f"{where}: the backend could not be reached: {exc}", file=sys.stderr)
        return 75


async def _act(settings: Settings, args: argparse.Namespace, where: str) -> int:
    backend = create_backend(settings)
    await backend.start()
    try:
        keys = KeyAdmin(backend.credentials)
        if args.action == "create":
            return await _create(keys, args, where)
        if args.action == "list":
            return await _list(keys, args)
        record = await keys.revoke(args.id, None)
        if args.json:
            print(json.dumps(key_view(record)))
        else:
            print(f"revoked {record.id} ({record.tenant}/{record.subject}); every worker refuses it within seconds")
        return 0
    finally:
        await backend.close()


async def _create(keys: KeyAdmin, args: argparse.Namespace, where: str) -> int:
    scopes = None if args.scopes is None else [s.strip() for s in args.scopes.split(",") if s.strip()]
    lifetime = None
    if args.expires_in is not None:
        try:
            lifetime = parse_duration(args.expires_in)
        except ValueError as exc:
            raise KeyRefused(422, f"--expires-in: {exc}") from exc
    issued = await keys.create(args.tenant, args.subject, scopes, lifetime)
    record = issued.record
    if args.json:
        print(json.dumps({**key_view(record), "key": issued.key}))
        return 0
    print(issued.key)
    expiry = "never expires" if record.expires_at is None else f"expires {_when(record.expires_at)}"
    print(f"{where}: key {record.id} for {record.tenant}/{record.subject}, scopes {','.join(record.scopes)}, "
          f"{expiry}; it is shown this once", file=sys.stderr)
    return 0


async def _list(keys: KeyAdmin, args: argparse.Namespace) -> int:
    records, after = [], ""
    while page := await keys.list(args.tenant, after, MAX_PAGE):
        records.extend(page)
        after = page[-1].id
    views = [key_view(record) for record in sorted(records, key=lambda r: (r.created_at, r.id))]
    if args.json:
        print(json.dumps({"keys": views}))
        return 0
    rows = [("ID", "TENANT", "SUBJECT", "STATE", "CREATED", "EXPIRES", "SCOPES")]
    rows += [(v["id"], v["tenant"], v["subject"], v["state"], _when(v["created_at"]), _when(v["expires_at"]),
              ",".join(v["scopes"])) for v in views]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False)) + "  " + row[-1])
    return 0


def _when(at: float | None) -> str:
    return "-" if at is None else datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
