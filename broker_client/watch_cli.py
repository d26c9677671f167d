"""``mcp-broker watch <url> <uri>...``: a terminal on ``Watcher``, for people (rich) or scripts (``--json``).

On a terminal, a live status line at the bottom and, above it, each URI's content when first
read and a unified diff of it on every change. With ``--json``, one object per line:
``{"event": "update", "uri", "content", "error", "initial"}`` or ``{"event": "status", "status",
"era", "detail"}``. ``<url>`` may also be a command that serves MCP on stdin/stdout. When the
reader of the output goes away (``watch --json | head``), the watch ends quietly with exit code
141, as a Unix tool killed by SIGPIPE does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import difflib
import json
import os
import signal
import sys
import time
from typing import Any

__all__ = ["add_arguments", "main", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", help="the MCP endpoint (http://host:port/mcp), or a command serving MCP on stdio")
    parser.add_argument("uris", nargs="+", metavar="uri", help="the resources to watch")
    parser.add_argument("--json", action="store_true", help="one JSON object per line, for scripts")
    parser.add_argument("--header", action="append", default=[], metavar="NAME:VALUE",
                        help="an HTTP header for every request (repeatable)")
    parser.add_argument("--token", default=None, help="a bearer token (Authorization: Bearer TOKEN)")
    parser.add_argument("--era", default="auto", choices=["auto", "modern", "legacy"],
                        help="2026-07-28 (modern) when the server offers it, or 2025 (legacy)")
    parser.add_argument("--retries", type=int, default=8, help="failed reconnects in a row before giving up")


def _headers(values: list[str]) -> dict[str, str]:
    headers = {}
    for value in values:
        name, sep, content = value.partition(":")
        if not sep or not name.strip():
            raise ValueError(f"--header {value!r}: write NAME:VALUE")
        headers[name.strip()] = content.strip()
    return headers


def _readable(text: str | None) -> str:
    """JSON indented (a one-line record diffs badly), anything else as it is."""
    if text is None:
        return ""
    try:
        return json.dumps(json.loads(text), indent=2, ensure_ascii=False)
    except ValueError:
        return text


class _Terminal:
    """The rich view: content and diffs printed above a live status line."""

    def __init__(self, uris: list[str]) -> None:
        from rich.console import Console
        from rich.live import Live
        from rich.text import Text

        self.Text = Text
        self.console = Console()
        self.uris = uris
        self.previous: dict[str, str] = {}
        self.updates = 0
        self.state = "connecting"
        self.live = Live(self._line(), console=self.console, auto_refresh=False, transient=True)

    def _line(self) -> Any:
        return self.Text(f"● {self.state} · {len(self.uris)} URI(s) · {self.updates} update(s)", style="dim")

    def status(self, status: Any) -> None:
        era = f" ({status.era})" if status.era else ""
        self.state = f"{status.kind}{era}" + (f": {status.detail}" if status.detail else "")
        if status.kind in ("resumed", "resynced", "reinitialized", "completed", "gave_up"):
            self.console.print(self.Text(f"{time.strftime('%H:%M:%S')} {self.state}", style="yellow"))
        self.live.update(self._line(), refresh=True)

    def update(self, update: Any) -> None:
        self.updates += 1
        stamp = time.strftime("%H:%M:%S")
        new = _readable(update.text) if update.error is None else f"(unreadable: {update.error})"
        old = self.previous.get(update.uri)
        self.console.print(self.Text(f"{stamp} {update.uri}" + (" (initial)" if old is None else ""), style="bold"))
        if old is None:
            self.console.print(self.Text(new))
        else:
            for line in difflib.unified_diff(old.splitlines(), new.splitlines(), "before", "after", lineterm="", n=2):
                style = "green" if line.startswith("+") else "red" if line.startswith("-") else "cyan" \
                    if line.startswith("@@") else ""
                self.console.print(self.Text(line, style=style))
        self.previous[update.uri] = new
        self.live.update(self._line(), refresh=True)


class _Json:
    def status(self, status: Any) -> None:
        self._emit({"event": "status", "status": status.kind, "era": status.era, "detail": status.detail})

    def update(self, update: Any) -> None:
        self._emit({"event": "update", "uri": update.uri, "content": update.text, "error": update.error,
                    "initial": update.initial})

    @staticmethod
    def _emit(line: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(line, ensure_ascii=False) + "\n")
        sys.stdout.flush()


async def _watch(args: argparse.Namespace, headers: dict[str, str]) -> int:
    from broker_client import Backoff, GaveUp, Watcher, WatchError

    view: _Terminal | _Json = _Json() if args.json else _Terminal(args.uris)
    live = view.live if isinstance(view, _Terminal) else contextlib.nullcontext()
    with live:
        try:
            async with Watcher(args.url, headers=headers, token=args.token, era=args.era,
                               backoff=Backoff(retries=args.retries), on_status=view.status) as watcher:
                async for update in watcher.watch(args.uris):
                    view.update(update)
        except GaveUp as exc:
            print(f"mcp-broker watch: {exc}", file=sys.stderr)
            return 1
        except WatchError as exc:
            print(f"mcp-broker watch: {exc}", file=sys.stderr)
            return 2
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        headers = _headers(args.header)
    except ValueError as exc:
        print(f"mcp-broker watch: {exc}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_watch(args, headers))
    except KeyboardInterrupt:
        return 0  # Ctrl-C is how a watch ends
    except BrokenPipeError:
        # The reader went away (`watch --json | head`): end quietly, as Unix tools do. Output still
        # buffered goes nowhere, so the interpreter's last flush raises nothing either.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mcp-broker watch", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
