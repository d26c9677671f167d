"""``mcp-broker``: serve HTTP, serve stdio, run fan-out, publish a change."""

from __future__ import annotations

import argparse
import asyncio
import difflib
import logging
import os
import re
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from broker.config import Settings

__all__ = ["main"]

logger = logging.getLogger(__name__)


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from broker.config import Settings
    from broker.server import BrokerServer, run_workers
    from broker.transport.wire import WireLimits, protocol_factory

    os.environ["MCP_BROKER_HOST"] = args.host
    os.environ["MCP_BROKER_PORT"] = str(args.port)
    if args.demo:
        os.environ["MCP_BROKER_DEMO"] = "true"
    if problem := _settings_problem():  # --host and --port, as MCP_BROKER_HOST and _PORT, may be bad
        print(f"mcp-broker: bad setting, not started: {problem}", file=sys.stderr)
        return 2
    settings = Settings()
    if (warning := rebinding_warning(settings)) is not None:
        logger.warning(warning)
    config = uvicorn.Config(
        "broker.app:app_from_env",
        factory=True,
        host=args.host,
        port=args.port,
        # Header size, head and body deadlines and a connection cap (broker/transport/wire.py).
        http=protocol_factory(WireLimits.from_settings(settings)),
        workers=args.workers,
        log_level=args.log_level,
        access_log=False,
        timeout_graceful_shutdown=10,
        timeout_keep_alive=settings.http_keepalive_timeout,
        # Forwarded headers only matter behind a proxy; the broker trusts none by default.
        proxy_headers=False,
    )
    if args.workers > 1:
        run_workers(config)
    else:
        BrokerServer(config).run()
    return 0


def rebinding_warning(settings: Settings) -> str | None:
    """What to set, when a non-loopback bind answers to any Host and lets anyone in.

    With neither an explicit host list nor API keys, a page on a name rebound to this server's
    address can read every record (a same-origin GET carries no ``Origin``).
    """
    from broker.transport.guards import HostPolicy

    if settings.allowed_hosts is not None or settings.api_keys or not HostPolicy(None, settings.host).any:
        return None
    return (f"serving on {settings.host} to any Host header, without API keys: a web page on a DNS-rebound "
            "name can read every record. Set MCP_BROKER_ALLOWED_HOSTS to the names clients use, e.g. "
            '\'["broker.example.com"]\' (or MCP_BROKER_API_KEYS)')


def _stdio(args: argparse.Namespace) -> int:
    from broker.runtime import Broker
    from broker.transport.stdio import serve_stdio

    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr)
    asyncio.run(serve_stdio(Broker()))
    return 0


def _fanout(args: argparse.Namespace) -> int:
    from workers.fanout import main as fanout_main

    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr)
    return fanout_main(args.consumers)


def _publish(args: argparse.Namespace) -> int:
    import orjson

    from broker.backends import create_backend
    from broker.changes import ChangeKind, ChangeRules, InvalidChange
    from broker.config import Settings
    from broker.errors import PublishRefused
    from broker.publisher import Publisher
    from broker.tenants import tenant_problem

    problem = tenant_problem(args.tenant) if args.tenant is not None else None
    if problem:
        print(f"mcp-broker publish: {problem}", file=sys.stderr)
        return 2

    try:
        meta = orjson.loads(args.meta) if args.meta is not None else None
    except orjson.JSONDecodeError as exc:
        print(f"mcp-broker publish: --meta is not valid JSON: {exc}", file=sys.stderr)
        return 2

    async def run() -> str:
        # Only the change log and the one publisher: no sessions, streams or fan-out to start.
        settings = Settings()
        backend = create_backend(settings)
        publisher = Publisher(backend.changelog, ChangeRules.from_settings(settings),
                              default_tenant=settings.default_tenant, max_waiting=settings.changelog_tenant_max)
        await backend.start()
        try:
            return await publisher.publish(args.uri, ChangeKind(args.kind), tenant=args.tenant, meta=meta,
                                           source="cli")
        finally:
            await backend.close()

    try:
        print(asyncio.run(run()))
    except InvalidChange as exc:
        print(f"mcp-broker publish: {exc}", file=sys.stderr)
        return 2
    except PublishRefused as exc:
        # Not acknowledged: nothing was appended. EX_TEMPFAIL: try again later.
        print(f"mcp-broker publish: refused, not published: {exc}", file=sys.stderr)
        return 75
    return 0


def _settings_problem() -> str | None:
    """One line naming what is wrong with the ``MCP_BROKER_*`` settings, or None."""
    from pydantic import ValidationError
    from pydantic_settings import SettingsError

    from broker.config import Settings

    known = {"MCP_BROKER_" + name.upper() for name in Settings.model_fields}
    for name in sorted(os.environ):
        if name.startswith("MCP_BROKER_") and name not in known:
            # Ignored silently, a misspelled MCP_BROKER_REDIS_URL started a worker on its own
            # in-memory backend, with nothing saying so.
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"; did you mean {close[0]}?" if close else " (see README, Configuration)"
            return f"{name} is not a setting{hint}"
    try:
        Settings()
    except ValidationError as exc:
        error = exc.errors()[0]
        name = "MCP_BROKER_" + "_".join(str(part) for part in error["loc"][:1]).upper()
        message = str(error["msg"]).removeprefix("Value error, ")
        return message if message.startswith("MCP_BROKER_") else f"{name}: {message}"
    except SettingsError as exc:  # a value that is not the JSON its setting needs
        field = re.search(r'field "([a-z_]+)"', str(exc))
        name = "MCP_BROKER_" + field.group(1).upper() if field else "a setting"
        return f"{name}: not valid JSON; write a JSON value of the setting's type (see README, Configuration)"
    return None


def _env_int(name: str, default: int) -> int:
    """An integer from the environment for a command-line default; a bad one is left to the settings check."""
    value = os.environ.get(name, "")
    return int(value) if value.strip().isdigit() else default


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mcp-broker", description=__doc__)
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve MCP over Streamable HTTP on /mcp, plus the REST API")
    serve.add_argument("--host", default=os.environ.get("MCP_BROKER_HOST", "127.0.0.1"))
    serve.add_argument("--port", type=int, default=_env_int("MCP_BROKER_PORT", 8080))
    serve.add_argument("--workers", type=int, default=1, help="worker processes sharing the port (Redis backend)")
    serve.add_argument("--demo", action="store_true", help="create a demo collection whose record changes")
    serve.set_defaults(func=_serve)

    stdio = sub.add_parser("stdio", help="serve one MCP client on stdin/stdout")
    stdio.set_defaults(func=_stdio)

    fanout = sub.add_parser(
        "fanout", help="run fan-out consumers only (set MCP_BROKER_EMBEDDED_FANOUT=false on HTTP workers)")
    fanout.add_argument("--consumers", type=int, default=1)
    fanout.set_defaults(func=_fanout)

    publish = sub.add_parser("publish", help="publish a change for a URI")
    publish.add_argument("uri")
    publish.add_argument("--kind", default="updated", choices=["updated", "created", "deleted"])
    publish.add_argument("--tenant", default=None)
    publish.add_argument("--meta", default=None, help="a JSON object for the notification's params._meta")
    publish.set_defaults(func=_publish)
    return parser


def main(argv: list[str] | None = None) -> int:
    args: Any = build_parser().parse_args(argv)
    problem = _settings_problem()
    if problem:
        print(f"mcp-broker: bad setting, not started: {problem}", file=sys.stderr)
        return 2
    if args.command == "serve" and args.workers > 1 and not os.environ.get("MCP_BROKER_REDIS_URL"):
        print("--workers > 1 needs MCP_BROKER_REDIS_URL: the memory backend lives in one process", file=sys.stderr)
        return 2
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
