"""``mcp-broker upstreams``: the MCP servers behind the broker, their state and the watches held.

With ``--url``, from a running deployment (its console's state, ``/console/state.json``; with
authentication on, ``--key`` holds ``console:read``): each upstream as the answering worker sees
it, the URIs the deployment wants watched of it and the worker holding its one watch. Without,
from the settings (``MCP_BROKER_UPSTREAMS``): each upstream probed from here, once.

Exit codes: 0 shown; 2 a bad setting, a bad URL or a refusal; 75 (EX_TEMPFAIL) the server could not
be reached. An upstream that cannot be reached is shown as such, with exit code 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from broker.cli.status import _table, _text, fetch_state

__all__ = ["add_upstreams_parser"]

#: Seconds each upstream may take to answer its probe, without ``--url``.
PROBE_TIMEOUT = 5.0


def add_upstreams_parser(sub: Any, formatter: type[argparse.HelpFormatter]) -> None:
    command = sub.add_parser("upstreams", help="the MCP servers behind the broker: their state and the watches held",
                             formatter_class=formatter)
    command.add_argument("--url", default=None,
                         help="a running server to ask (its console's state); without it, the upstreams of the "
                         "settings are probed from here")
    command.add_argument("--key", default=argparse.SUPPRESS,
                         help="with --url: a credential with the scope console:read (env MCP_BROKER_KEY)")
    command.add_argument("--json", action="store_true", help="print the rows as JSON")
    command.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.url is not None:
        state = fetch_state(args, "upstreams")
        if isinstance(state, int):
            return state
        rows = state.get("upstreams", [])
    else:
        rows = asyncio.run(_probed())
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no upstreams (MCP_BROKER_UPSTREAMS is empty)")
        return 0
    table = [["UPSTREAM", "TARGET", "TENANTS", "PREFIXES", "ERA", "STATE", "WANTED", "WATCH HELD BY"]]
    table += [[row["name"], row["target"], ",".join(row["tenants"]), ",".join(row["prefixes"]) or "-",
               _text(row.get("era")), row["state"] + (f" ({row['error']})" if row.get("error") else ""),
               _text(row.get("wanted")), _text(row.get("watch_holder"))] for row in rows]
    print("\n".join(_table(table)))
    return 0


async def _probed() -> list[dict[str, Any]]:
    from broker import __version__
    from broker.config import Settings
    from broker.upstreams.client import UpstreamError
    from broker.upstreams.service import Upstreams

    upstreams = Upstreams(Settings().upstream_specs, {"name": "mcp-broker-cli", "version": __version__})
    try:
        for upstream in upstreams.all:
            try:
                async with asyncio.timeout(PROBE_TIMEOUT):
                    await upstreams.probe(upstream)
            except (UpstreamError, TimeoutError) as exc:
                upstream.state, upstream.error = "unreachable", str(exc) or "no answer in time"
    finally:
        await upstreams.close()
    return [{"name": upstream.name, "target": upstream.spec.target, "tenants": list(upstream.spec.tenants),
             "prefixes": list(upstream.prefixes), "era": upstream.client.era, "state": upstream.state,
             "error": upstream.error or None, "auth": upstream.spec.auth.type} for upstream in upstreams.all]
