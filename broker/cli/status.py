"""``mcp-broker status``: the live console's figures in a terminal, from a running server's ``/console/state.json``.

The same figures as the page (``broker.ops.console``): the deployment's sessions, partitions and
webhooks, the answering host's workers, streams, listens and changes per second, then the
partitions with their holders and lag, the change sources and the tenants against their quotas. ``--json`` prints the
state document as the server gave it. With authentication on, ``--key`` (or ``MCP_BROKER_KEY``)
is a credential holding ``console:read``, of a tenant of ``MCP_BROKER_CONSOLE_TENANTS``.

Exit codes: 0 shown; 2 refused (no credential, or one without the scope), a bad URL, a redirect
(never followed: the key goes nowhere else) or an answer that is not the console's figures; 75
(EX_TEMPFAIL) the server could not be reached or answered with an error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

__all__ = ["add_status_parser", "fetch_state", "render"]

#: The figures shown first, with their labels, in the order of the page.
_FIGURES = (("sessions", "sessions (deployment)"), ("streams", "open streams (host)"),
            ("listens", "open listens (host)"), ("changes_per_second", "changes/second (host)"),
            ("partitions", "partitions (deployment)"), ("workers", "workers (host)"),
            ("webhooks", "webhooks"), ("webhooks_failing", "failing webhooks"), ("dead_letters", "dead letters"))


def add_status_parser(sub: Any, formatter: type[argparse.HelpFormatter]) -> None:
    """The ``status`` command, on the CLI's subparsers."""
    command = sub.add_parser("status", help="the live console's figures of a running server, in the terminal",
                             formatter_class=formatter)
    command.add_argument("--url", default=os.environ.get("MCP_BROKER_URL", "http://127.0.0.1:8080"),
                         help="the server (env MCP_BROKER_URL)")
    command.add_argument("--key", default=argparse.SUPPRESS,
                         help="a credential with the scope console:read, when authentication is on "
                         "(env MCP_BROKER_KEY)")
    command.add_argument("--json", action="store_true", help="print the state document as JSON")
    command.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    state = fetch_state(args, "status")
    if isinstance(state, int):
        return state
    print(json.dumps(state, indent=2) if args.json else render(state))
    return 0


def fetch_state(args: argparse.Namespace, command: str) -> dict[str, Any] | int:
    """The console's state document from ``args.url`` (with ``args.key``), or the exit code after
    one line saying why not (see the module's exit codes)."""
    import urllib.error
    import urllib.request
    from urllib.parse import urlsplit

    from broker.cli.remote import BadAnswer, error_detail, request_json

    parts = urlsplit(args.url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        print(f"mcp-broker {command}: --url {args.url!r} is not an http(s) address, e.g. http://127.0.0.1:8080",
              file=sys.stderr)
        return 2
    key = getattr(args, "key", None) or os.environ.get("MCP_BROKER_KEY")
    url = args.url.rstrip("/") + "/console/state.json"
    try:
        request = urllib.request.Request(url, headers={"accept": "application/json",
                                                       **({"authorization": f"Bearer {key}"} if key else {})})
        state = request_json(request)
        if not isinstance(state.get("figures"), dict):
            raise BadAnswer("no figures in it")
        if not args.json:
            render(state)  # a document that cannot be shown is not the console's figures
    except urllib.error.HTTPError as exc:  # a redirect too: the key goes to the address given, nowhere else
        hint = " (give --key, a credential with the scope console:read)" if exc.code == 401 else ""
        print(f"mcp-broker {command}: {exc.code} {error_detail(exc)}{hint}".rstrip(), file=sys.stderr)
        return 2 if exc.code in (401, 403, 404, 421) or 300 <= exc.code < 400 else 75
    except (BadAnswer, KeyError, TypeError, AttributeError, IndexError) as exc:
        # Not the console's figures: not a broker, or a proxy's page.
        reason = exc if isinstance(exc, BadAnswer) else f"{type(exc).__name__} {exc}"
        print(f"mcp-broker {command}: {args.url} did not answer with the console's figures: {reason}",
              file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"mcp-broker {command}: {args.url} could not be reached: {exc}", file=sys.stderr)
        return 75
    return state


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(value.ljust(width) for value, width in zip(row, widths, strict=True)).rstrip() for row in rows]


def _text(value: Any) -> str:
    return "-" if value is None else str(value)


def render(state: dict[str, Any]) -> str:
    """The state as text: the figures, then a table of each list that has rows."""
    figures = state["figures"]
    who = state["answered_by"]
    lines = [f"mcp-broker at {who['pid']}@{who['host']}, backend {state['backend']}"]
    lines += _table([[label, _text(figures.get(name))] for name, label in _FIGURES])
    sections: list[tuple[str, list[list[str]]]] = [
        ("workers of this host", [["WORKER", "STREAMS", "LISTENS", "CHANGES/S", "PARTITIONS", "SOURCES"]]
         + [[f"{w['pid']}@{w['host']}", str(w["streams"]), str(w["listens"]), str(w["changes_per_second"]),
             str(w["partitions"]), ",".join(w["sources"]) or "-"] for w in state["workers"]]),
        ("partitions", [["PARTITION", "HOLDER", "LAG", "OLDEST(S)"]]
         + [[str(p["partition"]), _text(p["holder"]), str(p["lag_entries"]), str(p["lag_seconds"])]
            for p in state["partitions"]]),
        ("change sources", [["SOURCE", "RUNNING ON"]]
         + [[s["name"], ",".join(s["holders"]) or "-"] for s in state["sources"]]),
        ("failing webhooks", [["SUBSCRIPTION", "TENANT", "ERROR"]]
         + [[f["id"], f["tenant"], _text(f["error"])] for f in state["webhooks"]["failing"]]),
        ("tenants against their quotas", [["TENANT", "STREAMS", "LISTENS", "WEBHOOKS"]]
         + [[t["tenant"], *(f"{t[k][0]}/{_text(t[k][1])}" for k in ("streams", "listens", "webhooks"))]
            for t in state["tenants"]]),
    ]
    for title, rows in sections:
        if len(rows) > 1:
            lines += ["", title + ":", *_table(rows)]
    return "\n".join(lines)
