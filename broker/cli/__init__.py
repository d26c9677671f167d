"""``mcp-broker``: serve HTTP, serve stdio, run fan-out, publish a change, manage API keys and more.

The commands that are more than a few lines live in modules of their own (``publish_cli``,
``keys_cli``, ``webhooks_cli``, ``partitions_cli``, and the client's ``broker_client.watch_cli``).

Every option that has a setting says so in ``--help`` (the ``MCP_BROKER_*`` variable); an
option given on the command line wins over the variable, and a variable over the settings file
(``--config FILE``, ``MCP_BROKER_CONFIG``; ``mcp-broker config check`` prints the result). A bad
setting stops any command with one line per bad setting, saying what to write instead, and exit
code 2.
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import logging
import os
import re
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from broker.config import Settings

__all__ = ["main"]

logger = logging.getLogger(__name__)


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from broker.cli.partitions import count_problem
    from broker.config import Settings
    from broker.ops import logs
    from broker.runtime.server import BrokerServer, run_workers
    from broker.transport.wire import WireLimits, protocol_factory

    # Worker processes read their settings from the environment: the options given travel there,
    # over the settings file (a default must not hide the file's host or port).
    given: set[str] = getattr(args, "given", set())
    if "host" in given:
        os.environ["MCP_BROKER_HOST"] = args.host
    if "port" in given:
        os.environ["MCP_BROKER_PORT"] = str(args.port)
    if args.demo:
        os.environ["MCP_BROKER_DEMO"] = "true"
    if problems := _settings_problems():  # --host and --port, as MCP_BROKER_HOST and _PORT, may be bad
        _say_bad(problems)
        return 2
    settings = Settings()
    if (mismatch := count_problem(settings)) is not None:  # misrouted changes otherwise, said once here
        _say_bad([mismatch])
        return 2
    logs.configure(settings)
    if (warning := rebinding_warning(settings)) is not None:
        logger.warning(warning)
    if args.workers > 1:
        from broker.ops.prometheus import prepare_processes

        prepare_processes(args.workers)
    config = uvicorn.Config(
        "broker.runtime.app:app_from_env",
        factory=True,
        host=settings.host,
        port=settings.port,
        # Header size, head and body deadlines and a connection cap (broker/transport/wire.py).
        http=protocol_factory(WireLimits.from_settings(settings)),
        workers=args.workers,
        # Logging is the broker's (broker/ops/logs.py, in every worker): uvicorn's own would print twice.
        log_config=None,
        log_level=settings.log_level,
        access_log=False,
        timeout_graceful_shutdown=int(settings.graceful_timeout) or 1,
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

    if settings.allowed_hosts is not None or settings.auth_methods or not HostPolicy(None, settings.host).any:
        return None
    return (f"serving on {settings.host} to any Host header, without API keys: a web page on a DNS-rebound "
            "name can read every record. Set MCP_BROKER_ALLOWED_HOSTS to the names clients use, e.g. "
            '\'["broker.example.com"]\' (or MCP_BROKER_API_KEYS)')


def _stdio(args: argparse.Namespace) -> int:
    from broker.config import Settings
    from broker.ops import logs
    from broker.runtime import Broker
    from broker.transport.stdio import serve_stdio

    settings = Settings()
    logs.configure(settings)  # on stderr: stdout is the MCP channel
    asyncio.run(serve_stdio(Broker(settings)))
    return 0


def _watch(args: argparse.Namespace) -> int:
    from broker_client.watch_cli import run

    return run(args)


def _fanout(args: argparse.Namespace) -> int:
    from broker.config import Settings
    from broker.ops import logs
    from workers.fanout import main as fanout_main

    settings = Settings()
    if not settings.redis_url:
        print("mcp-broker fanout: nothing to fan out: the memory backend lives inside `mcp-broker serve`, which "
              "fans out itself; set MCP_BROKER_REDIS_URL to the Redis the HTTP workers use", file=sys.stderr)
        return 2
    logs.configure(settings)
    return fanout_main(args.consumers)


def _postgres(args: argparse.Namespace) -> int:
    import psycopg

    from broker.config import Settings
    from broker.sources.postgres import check_tables, install

    settings = Settings()
    try:
        if not settings.postgres_url:
            raise ValueError("MCP_BROKER_POSTGRES_URL is not set; write postgresql://user@host:5432/db")
        check_tables(settings.postgres_tables)
        lines = asyncio.run(install(settings.postgres_url, settings.postgres_tables))
    except (ValueError, psycopg.Error) as exc:
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"mcp-broker postgres {args.action}: {message}", file=sys.stderr)
        return 2
    for line in lines:
        print(line)
    return 0


def _redis_url() -> str:
    from broker.config import Settings

    return Settings().redis_url


def _say_bad(problems: list[str]) -> None:
    for problem in problems:
        print(f"mcp-broker: bad setting, not started: {problem}", file=sys.stderr)


def _settings_problems() -> list[str]:
    """One line for each thing wrong with the settings, of the environment and of the file (none when right)."""
    from pydantic import ValidationError
    from pydantic_settings import SettingsError

    from broker.config import CONFIG_ENV, Settings, config_file

    known = {"MCP_BROKER_" + name.upper() for name in Settings.model_fields}
    # Ignored silently, a misspelled MCP_BROKER_REDIS_URL started a worker on its own in-memory
    # backend, with nothing saying so.
    problems = [f"{name} is not a setting{_did_you_mean(name, known)}" for name in sorted(os.environ)
                if name.startswith("MCP_BROKER_") and name not in known and name != CONFIG_ENV]
    try:
        path, in_file = config_file()
    except SettingsError as exc:
        return [*problems, str(exc)]
    fields = set(Settings.model_fields)  # the same in the file: a typo there must not leave a default
    problems += [f"{path}: {key} is not a setting{_did_you_mean(key, fields)}" for key in sorted(in_file or ())
                 if key not in fields]
    if problems:
        return problems
    where = _Origin(path, in_file or {})
    try:
        from broker.quotas import quota_problems

        problems.extend(where.said(line) for line in quota_problems(Settings()))
    except ValidationError as exc:
        for error in exc.errors():
            field = "_".join(str(part) for part in error["loc"][:1])
            message = str(error["msg"]).removeprefix("Value error, ")
            problems.append(where.said(message) if message.startswith("MCP_BROKER_")
                            else f"{where.name(field)}: {message}")
    except SettingsError as exc:  # a value that is not the JSON its setting needs
        found = re.search(r'field "([a-z_]+)"', str(exc))
        name = "MCP_BROKER_" + found.group(1).upper() if found else "a setting"
        example = _JSON_EXAMPLES.get(name, "")
        problems.append(f"{name}: not valid JSON; write a JSON value of the setting's type{example} "
                        "(see docs/CONFIGURATION.md)")
    return problems


def _did_you_mean(name: str, known: set[str]) -> str:
    close = [name.lower()] if name.lower() in known else difflib.get_close_matches(name, known, n=1)
    return f"; did you mean {close[0]}?" if close else " (see docs/CONFIGURATION.md)"


@dataclass(frozen=True)
class _Origin:
    """Where a setting was written: its variable, or, when only the file has it, the file and its key."""

    path: str
    in_file: dict[str, Any]

    def name(self, field: str) -> str:
        variable = "MCP_BROKER_" + field.upper()
        if variable in os.environ or field not in self.in_file:
            return variable
        return f"{self.path}: {field}"

    def said(self, message: str) -> str:
        """A message that starts with the variable of its setting, starting with where it was written instead."""
        named = re.match(r"MCP_BROKER_([A-Z0-9_]+)", message)
        return self.name(named.group(1).lower()) + message[named.end():] if named else message


def _provider_problems(settings: Settings) -> list[str]:
    """One line for each ``MCP_BROKER_PROVIDERS`` entry that cannot be imported (checked before a start)."""
    from broker.sources.extensions import load_provider_factory

    problems = []
    for spec in settings.providers:
        try:
            load_provider_factory(spec)
        except ValueError as exc:
            problems.append(str(exc))
    return problems


def _tracing_problems() -> list[str]:
    """A line when an OTLP endpoint asks for traces that the installed packages cannot export."""
    import importlib.util

    from broker.ops.tracing import enabled

    if not enabled(os.environ):
        return []
    for module in ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http"):
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # a parent package is missing
            found = False
        if not found:
            return ["OTEL_EXPORTER_OTLP_ENDPOINT asks for traces, but OpenTelemetry's SDK and OTLP/HTTP exporter "
                    "are not installed: pip install 'mcp-broker[tracing]' (docs/TRACING.md)"]
    return []


#: What a JSON setting looks like, for the line that says one is not JSON.
_JSON_EXAMPLES = {
    "MCP_BROKER_API_KEYS": ', e.g. \'{"k3y": "acme/alice"}\'',
    "MCP_BROKER_ALLOWED_ORIGINS": ', e.g. \'["https://app.example.com"]\'',
    "MCP_BROKER_ALLOWED_HOSTS": ', e.g. \'["broker.example.com"]\'',
    "MCP_BROKER_TRUSTED_PROXIES": ', e.g. \'["10.0.0.5", "10.1.0.0/16"]\'',
    "MCP_BROKER_UPSTREAMS": ', e.g. \'{"notes": {"url": "https://notes.internal/mcp", "tenants": ["acme"]}}\'',
    "MCP_BROKER_QUOTAS": ', e.g. \'{"default": {"sessions": 10000}, "acme": {"publish_per_second": 500}}\'',
}


def _env_int(name: str, default: int) -> int:
    """An integer from the environment for a command-line default; a bad one is left to the settings check."""
    value = os.environ.get(name, "")
    return int(value) if value.strip().isdigit() else default


def build_parser() -> argparse.ArgumentParser:
    from broker import __version__

    formatter = _HelpFormatter
    parser = argparse.ArgumentParser(prog="mcp-broker", description=__doc__.splitlines()[0], formatter_class=formatter)
    parser.add_argument("--version", action="version", version=f"mcp-broker {__version__}")
    parser.add_argument("--log-level", default=None, choices=["debug", "info", "warning", "error"],
                        help="the broker's log level (env MCP_BROKER_LOG_LEVEL, default info)")
    parser.add_argument("--log-format", default=None, choices=["text", "json"],
                        help="text, or one JSON object a line (env MCP_BROKER_LOG_FORMAT, default text)")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="serve MCP over Streamable HTTP on /mcp, plus the REST API",
                           formatter_class=formatter)
    serve.add_argument("--host", default=os.environ.get("MCP_BROKER_HOST", "127.0.0.1"), action=_Given,
                       help="address to listen on (env MCP_BROKER_HOST)")
    serve.add_argument("--port", type=int, default=_env_int("MCP_BROKER_PORT", 8080), action=_Given,
                       help="port to listen on (env MCP_BROKER_PORT)")
    serve.add_argument("--workers", type=int, default=1, help="worker processes sharing the port (Redis backend)")
    serve.add_argument("--demo", action="store_true",
                       help="create a demo collection whose record changes (env MCP_BROKER_DEMO)")
    serve.set_defaults(func=_serve)

    stdio = sub.add_parser("stdio", help="serve one MCP client on stdin/stdout", formatter_class=formatter)
    stdio.set_defaults(func=_stdio)

    from broker_client.watch_cli import add_arguments as add_watch_arguments

    watch = sub.add_parser("watch", help="watch resources of any MCP server and show each change (a client)",
                           formatter_class=formatter)
    add_watch_arguments(watch)
    watch.set_defaults(func=_watch)

    fanout = sub.add_parser(
        "fanout", help="run fan-out consumers only (Redis; set MCP_BROKER_EMBEDDED_FANOUT=false on HTTP workers)",
        formatter_class=formatter)
    fanout.add_argument("--consumers", type=int, default=1, help="consumers in this process")
    fanout.set_defaults(func=_fanout)

    publish = sub.add_parser("publish", help="publish a change for a URI, to a running server or to Redis",
                             formatter_class=formatter)
    publish.add_argument("uri")
    publish.add_argument("--kind", default="updated", choices=["updated", "created", "deleted"])
    publish.add_argument("--tenant", default=None,
                         help="the tenant to publish for, straight into Redis (default: MCP_BROKER_DEFAULT_TENANT)")
    publish.add_argument("--meta", default=None, help="a JSON object for the notification's params._meta")
    publish.add_argument("--url", default=None,
                         help="a running server to publish through (POST /changes), e.g. http://127.0.0.1:8080")
    publish.add_argument("--key", default=None, help="an API key for --url (Authorization: Bearer)")
    from broker.cli.publish import publish_main

    publish.set_defaults(func=publish_main)

    postgres = sub.add_parser("postgres", help="PostgreSQL tables as resources (MCP_BROKER_POSTGRES_URL, _TABLES)",
                              formatter_class=formatter)
    postgres.add_argument("action", choices=["install"],
                          help="install: create the outbox, the cursor table and a trigger on each table")
    postgres.set_defaults(func=_postgres)

    from broker.cli.config import add_config_parser
    from broker.cli.keys import add_keys_parser
    from broker.cli.partitions import add_partitions_parser
    from broker.cli.status import add_status_parser
    from broker.cli.upstreams import add_upstreams_parser
    from broker.cli.webhooks import add_webhooks_parser

    add_keys_parser(sub, formatter)
    add_webhooks_parser(sub, formatter)
    add_partitions_parser(sub, formatter)
    add_config_parser(sub, formatter)
    add_status_parser(sub, formatter)
    add_upstreams_parser(sub, formatter)
    for name, command in sub.choices.items():
        if name not in _CLIENTS:  # a client: it reads no settings
            _add_config_options(command)
    return parser


#: The commands that are clients of a server (of any MCP server, or of a broker's console): no settings.
_CLIENTS: Final = frozenset({"watch", "status"})


def _add_config_options(parser: argparse.ArgumentParser) -> None:
    """``--config`` on a command, or on each action of a command that has actions (``keys create``)."""
    from broker.cli.config import add_config_option

    actions = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
    if not actions:
        add_config_option(parser)
    for action in actions:
        for child in action.choices.values():
            _add_config_options(child)


class _Given(argparse.Action):
    """Stores the value and notes that it was given (``args.given``): given, it wins over the settings file."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        namespace.given = {*getattr(namespace, "given", ()), self.dest}


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default in its help, unless it has none to show (the help says it, or there is none)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or isinstance(action, argparse._StoreTrueAction):
            return action.help
        return super()._get_help_string(action)


def main(argv: list[str] | None = None) -> int:
    args: Any = build_parser().parse_args(argv)
    if getattr(args, "config", None):  # where every process of the command reads it, as the other settings
        from broker.config import CONFIG_ENV

        os.environ[CONFIG_ENV] = os.path.abspath(args.config)
    # The options that are settings go where every process of the command reads them: the environment.
    if args.log_level is not None:
        os.environ["MCP_BROKER_LOG_LEVEL"] = args.log_level
    if args.log_format is not None:
        os.environ["MCP_BROKER_LOG_FORMAT"] = args.log_format
    client = args.command in _CLIENTS or (args.command == "upstreams" and args.url is not None)
    problems = [] if client else _settings_problems()  # clients: no server settings
    if not problems and args.command in ("serve", "stdio", "config"):  # the commands that load the providers
        from broker.config import Settings

        problems = _provider_problems(Settings()) + _tracing_problems()
    if problems:
        _say_bad(problems)
        return 2
    if args.command == "serve" and args.workers > 1 and not _redis_url():
        print("mcp-broker: --workers > 1 needs MCP_BROKER_REDIS_URL: the memory backend lives in one process",
              file=sys.stderr)
        return 2
    return int(args.func(args))

