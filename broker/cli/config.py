"""``mcp-broker config check``: the effective settings, as TOML, each with where it was written, secrets masked.

The settings are read as ``serve`` reads them: the defaults, then the file of ``--config`` (or
``MCP_BROKER_CONFIG``), then the ``MCP_BROKER_*`` variables over it. A bad one stops the command
before anything is printed, with the same line ``serve`` would write, and exit code 2; right, they
are printed one ``name = value`` a line (a file of settings can start from it) and it exits 0.
Masked: API keys (their tenant and subject are shown), every setting named for a secret, and the
password of any URL (or ``password=`` of a connection string).
"""

from __future__ import annotations

import argparse
import json
import os
import re
from typing import Any, Final
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from broker import __version__
from broker.config import CONFIG_ENV, Settings, config_file

__all__ = ["MASK", "add_config_option", "add_config_parser", "effective_settings", "masked"]

#: What a secret is shown as.
MASK: Final = "***"
#: A setting whose name holds one of these is a secret whole.
_SECRET_NAMES: Final = ("secret", "password", "token")
_SECRET_PARAMS: Final = re.compile(r"(?i)(password|passwd|secret|token|sslpassword)")
_KEYWORD_PASSWORD: Final = re.compile(r"(?i)\b(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)")


def add_config_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, metavar="FILE",
                        help='a TOML file of settings, e.g. redis_url = "redis://..."; the environment wins over '
                             f"it (env {CONFIG_ENV})")


def add_config_parser(sub: Any, formatter: type[argparse.HelpFormatter]) -> None:
    """The ``config`` command and its ``check`` action, on the CLI's subparsers."""
    config = sub.add_parser("config", help="the settings: `config check` prints the effective ones, secrets masked",
                            formatter_class=formatter)
    actions = config.add_subparsers(dest="action", required=True)
    actions.add_parser("check", formatter_class=formatter,
                       help="check the settings (environment and --config file) and print them, masked")
    config.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # A bad setting never gets here: every command checks them first (broker.cli.main), exit code 2.
    print(effective_settings(Settings()))
    return 0


def effective_settings(settings: Settings) -> str:
    """``settings`` as TOML lines, secrets masked, each value not a default followed by where it was written."""
    path, in_file = config_file()
    lines = [f"# mcp-broker {__version__}: the effective settings (defaults, then "
             f"{path or 'no settings file'}, then MCP_BROKER_* variables), secrets masked"]
    for name in Settings.model_fields:
        value = masked(name, getattr(settings, name))
        variable = "MCP_BROKER_" + name.upper()
        origin = variable if variable in os.environ else (f"{path}: {name}" if name in (in_file or {}) else "")
        if value is None:
            lines.append(f"# {name}: unset" + (f" ({origin})" if origin else ""))
        else:
            lines.append(f"{name} = {_toml(value)}" + (f"  # {origin}" if origin else ""))
    return "\n".join(lines)


def masked(name: str, value: Any) -> Any:
    """``value`` of the setting ``name`` as it may be shown: no key, secret or password in it."""
    if name == "api_keys" and isinstance(value, dict):
        return {f"{MASK}{index}": binding for index, binding in enumerate(value.values(), 1)}
    if any(word in name for word in _SECRET_NAMES):
        return MASK if value else value
    return _without_passwords(value)


def _without_passwords(value: Any) -> Any:
    if isinstance(value, str):
        return _url_without_password(value)
    if isinstance(value, list | tuple):
        return [_without_passwords(item) for item in value]
    if isinstance(value, dict):
        return {key: _without_passwords(item) for key, item in value.items()}
    return value


def _url_without_password(text: str) -> str:
    if "://" not in text:
        return _KEYWORD_PASSWORD.sub(rf"\g<1>{MASK}", text)  # a libpq keyword/value string, or anything else
    # The host part follows the last "@": a password may hold a raw "#", "?" or "/", which would end
    # the address early for urlsplit and show the rest of the password as a fragment, query or path.
    scheme, _, rest = text.partition("://")
    userinfo, at, rest = rest.rpartition("@")
    if not (at and ":" in userinfo) and not _SECRET_PARAMS.search(rest.partition("?")[2]):
        return text  # nothing to hide: as written (rebuilt, "note://" would lose its empty host)
    if at and ":" in userinfo:
        userinfo = f"{userinfo.partition(':')[0]}:{MASK}"
    try:
        parts = urlsplit(f"{scheme}://{rest}")
    except ValueError:
        return MASK  # not a URL Python can read: it might hold anything
    netloc = userinfo + at + parts.netloc
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode([(key, MASK if _SECRET_PARAMS.search(key) else item) for key, item in pairs], safe="*")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def _toml(value: Any) -> str:
    """A value as TOML: JSON's strings are TOML basic strings; a table is written inline."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{json.dumps(str(key), ensure_ascii=False)} = {_toml(item)}"
                               for key, item in value.items()) + "}"
    return json.dumps(str(value), ensure_ascii=False)
