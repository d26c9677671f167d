"""``MCP_BROKER_UPSTREAMS``: the MCP servers the broker stands in front of, read and checked once.

A JSON map of upstream name to its description::

    {"notes": {"url": "https://notes.internal/mcp", "tenants": ["acme"], "prefixes": ["note://"],
               "auth": {"type": "bearer", "token_env": "NOTES_TOKEN"}}}

Each entry: ``url`` (http or https, the upstream's MCP endpoint) or ``command`` (a list: a stdio
upstream the broker starts), ``tenants`` (who sees it; default: the default tenant), ``prefixes`` (the
URIs it owns; left out: learnt from its own listings), ``auth`` (how the broker calls it, never
with the client's credential): ``{"type": "none"}``, ``{"type": "bearer", "token_file": …}`` or
``"token_env"``, or ``{"type": "client_credentials", "client_id": …, "client_secret_file"`` or
``"client_secret_env": …, "token_url"?: …, "scope"?: …}``. Optional: ``timeout`` (seconds a
forwarded request may take, default 30), ``concurrency`` (requests in flight to it per worker,
default 32), ``name_prefix`` (put before its tool and prompt names, to keep two upstreams' names
apart), ``caller`` (what the upstream learns of the caller in ``_meta``: ``["tenant", "subject"]``,
default nothing), ``watch_grace`` (seconds a watch outlives its last subscriber, default 30) and
``max_watches`` (URIs watched at once, default 10,000).

Every problem is one line naming the setting and what to write instead (``UpstreamsError``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import urlsplit

from broker.tenants import tenant_problem

__all__ = ["AUTH_TYPES", "CALLER_FIELDS", "SETTING", "AuthSpec", "UpstreamSpec", "UpstreamsError", "parse_upstreams"]

SETTING: Final = "MCP_BROKER_UPSTREAMS"
AUTH_TYPES: Final = ("none", "bearer", "client_credentials")
CALLER_FIELDS: Final = frozenset({"tenant", "subject"})
_NAME: Final = re.compile(r"[a-z0-9][a-z0-9_-]{0,62}")
#: A prefix is a URI's beginning: a scheme and what follows it (``note://``, ``https://api.example/``).
_PREFIX: Final = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*:\S*")
_VARIABLE: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NAME_PREFIX: Final = re.compile(r"[A-Za-z0-9_.-]{0,32}")
_KEYS: Final = frozenset({"url", "command", "env", "tenants", "prefixes", "auth", "timeout", "concurrency",
                          "name_prefix", "caller", "watch_grace", "max_watches"})
_AUTH_KEYS: Final = {
    "none": frozenset({"type"}),
    "bearer": frozenset({"type", "token_file", "token_env"}),
    "client_credentials": frozenset({"type", "client_id", "client_secret_file", "client_secret_env", "token_url",
                                     "scope", "resource"}),
}
_EXAMPLE: Final = '{"notes": {"url": "https://notes.internal/mcp", "tenants": ["acme"], "prefixes": ["note://"]}}'


class UpstreamsError(ValueError):
    """A problem with ``MCP_BROKER_UPSTREAMS``; the message is one line, naming the setting."""


@dataclass(frozen=True, slots=True)
class AuthSpec:
    """How the broker authenticates itself to an upstream (``type`` one of ``AUTH_TYPES``).

    Secrets are named, never written in the map: a file to read or a variable of the environment.
    """

    type: str = "none"
    token_file: str | None = None
    token_env: str | None = None
    client_id: str | None = None
    client_secret_file: str | None = None
    client_secret_env: str | None = None
    #: The authorization server's token endpoint; None: found from the upstream's protected
    #: resource metadata (RFC 9728) and its authorization server's metadata (RFC 8414).
    token_url: str | None = None
    scope: str | None = None
    #: The ``resource`` asked for (RFC 8707); None: the upstream's ``url``.
    resource: str | None = None


@dataclass(frozen=True, slots=True)
class UpstreamSpec:
    """One upstream as configured."""

    name: str
    url: str | None = None
    command: tuple[str, ...] | None = None
    tenants: tuple[str, ...] = ("default",)
    #: None: learnt from the upstream's ``resources/list`` and ``resources/templates/list``.
    prefixes: tuple[str, ...] | None = None
    auth: AuthSpec = field(default_factory=AuthSpec)
    timeout: float = 30.0
    concurrency: int = 32
    name_prefix: str = ""
    caller: frozenset[str] = frozenset()
    #: A ``command`` upstream: names of the broker's environment variables its process is given.
    env: tuple[str, ...] = ()
    watch_grace: float = 30.0
    max_watches: int = 10_000

    @property
    def target(self) -> str:
        """Where it is, for logs and listings: its URL, or its command."""
        return self.url if self.url is not None else " ".join(self.command or ())


def _fail(name: str | None, problem: str) -> UpstreamsError:
    where = f"{SETTING}: " if name is None else f"{SETTING}: upstream {name!r}: "
    return UpstreamsError(where + problem)


def _strings(name: str, key: str, value: Any, *, empty: bool = False) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(item, str) and item for item in value):
        raise _fail(name, f'"{key}" must be a JSON list of strings, e.g. {_key_example(key)}')
    if not value and not empty:
        raise _fail(name, f'"{key}" is empty; write at least one, e.g. {_key_example(key)}')
    return tuple(dict.fromkeys(value))


def _key_example(key: str) -> str:
    return {"tenants": '["acme"]', "prefixes": '["note://"]', "command": '["python", "-m", "notes_server"]',
            "env": '["NOTES_DB_URL"]',
            "caller": '["tenant", "subject"]'}.get(key, "[]")


def _number(name: str, key: str, value: Any, *, integer: bool, low: float, high: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or (integer and not isinstance(value, int)):
        raise _fail(name, f'"{key}" must be a{"n integer" if integer else " number"} from {low:g} to {high:g}')
    if not low <= value <= high:
        raise _fail(name, f'"{key}" is {value}; write a number from {low:g} to {high:g}')
    return float(value)


def _url(name: str, value: Any, key: str = "url") -> str:
    if not isinstance(value, str):
        raise _fail(name, f'"{key}" must be a string, an http(s) URL such as "https://notes.internal/mcp"')
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.fragment or parts.username:
        raise _fail(name, f'"{key}" is {value!r}, not an http(s) URL with a host (and no fragment or user); '
                          'write e.g. "https://notes.internal/mcp"')
    try:
        parts.port  # noqa: B018 -- a port that is not a number raises here
    except ValueError as exc:
        raise _fail(name, f'"{key}" is {value!r}, whose port is not a number') from exc
    return value


def _auth(name: str, value: Any) -> AuthSpec:
    if value is None:
        return AuthSpec()
    if not isinstance(value, dict) or value.get("type") not in AUTH_TYPES:
        raise _fail(name, '"auth" must be an object whose "type" is none, bearer or client_credentials, e.g. '
                          '{"type": "bearer", "token_env": "NOTES_TOKEN"}')
    kind = value["type"]
    unknown = sorted(set(value) - _AUTH_KEYS[kind])
    if unknown:
        raise _fail(name, f'"auth" of type {kind} takes no {", ".join(unknown)}; it takes '
                          f'{", ".join(sorted(_AUTH_KEYS[kind] - {"type"})) or "nothing else"}')
    for key, item in value.items():
        if not isinstance(item, str) or not item:
            raise _fail(name, f'"auth".{key} must be a non-empty string')
    if kind == "bearer" and ("token_file" in value) == ("token_env" in value):
        raise _fail(name, '"auth" of type bearer needs one of "token_file" (a file holding the token) or '
                          '"token_env" (a variable holding it)')
    if kind == "client_credentials":
        if "client_id" not in value:
            raise _fail(name, '"auth" of type client_credentials needs "client_id"')
        if ("client_secret_file" in value) == ("client_secret_env" in value):
            raise _fail(name, '"auth" of type client_credentials needs one of "client_secret_file" or '
                              '"client_secret_env"')
        for key in ("token_url", "resource"):
            if key in value:
                _url(name, value[key], f"auth.{key}")
    return AuthSpec(**value)


def _prefixes(name: str, value: Any) -> tuple[str, ...] | None:
    if value is None:
        return None
    prefixes = _strings(name, "prefixes", value)
    for prefix in prefixes:
        if not _PREFIX.fullmatch(prefix):
            raise _fail(name, f'the prefix {prefix!r} is not the beginning of a URI; write a scheme and what '
                              'follows it, e.g. "note://" or "https://api.example/notes/"')
    return prefixes


def _one(name: Any, entry: Any, default_tenant: str) -> UpstreamSpec:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise _fail(None, f"the name {name!r} is not one; write lower-case letters, digits, - and _ (at most 63), "
                          'e.g. "notes"')
    if not isinstance(entry, dict):
        raise _fail(name, f"write an object, e.g. {_EXAMPLE}")
    unknown = sorted(set(entry) - _KEYS)
    if unknown:
        raise _fail(name, f'{", ".join(unknown)} is not a field; the fields are {", ".join(sorted(_KEYS))}')
    if ("url" in entry) == ("command" in entry):
        raise _fail(name, 'write one of "url" (its MCP endpoint, e.g. "https://notes.internal/mcp") or "command" '
                          '(a stdio server to start, e.g. ["python", "-m", "notes_server"])')
    url = _url(name, entry["url"]) if "url" in entry else None
    command = _strings(name, "command", entry["command"]) if "command" in entry else None
    tenants = _strings(name, "tenants", entry.get("tenants", [default_tenant]))
    for tenant in tenants:
        problem = tenant_problem(tenant)
        if problem:
            raise _fail(name, f'"tenants": {problem}')
    caller = _strings(name, "caller", entry.get("caller", []), empty=True)
    env = _strings(name, "env", entry.get("env", []), empty=True)
    if env and command is None:
        raise _fail(name, '"env" names variables for a "command" upstream\'s process; an upstream at a "url" has none')
    for variable in env:
        if not _VARIABLE.fullmatch(variable):
            raise _fail(name, f'"env": {variable!r} is not a variable name; write names, e.g. ["NOTES_DB_URL"]')
    if set(caller) - CALLER_FIELDS:
        raise _fail(name, f'"caller" may name tenant and subject, not {", ".join(sorted(set(caller) - CALLER_FIELDS))}')
    name_prefix = entry.get("name_prefix", "")
    if not isinstance(name_prefix, str) or not _NAME_PREFIX.fullmatch(name_prefix):
        raise _fail(name, '"name_prefix" must be at most 32 letters, digits, _, . or -, e.g. "notes_"')
    return UpstreamSpec(
        name=name, url=url, command=command, tenants=tenants, prefixes=_prefixes(name, entry.get("prefixes")),
        auth=_auth(name, entry.get("auth")),
        timeout=_number(name, "timeout", entry.get("timeout", 30.0), integer=False, low=0.1, high=3600),
        concurrency=int(_number(name, "concurrency", entry.get("concurrency", 32), integer=True, low=1, high=10_000)),
        name_prefix=name_prefix, caller=frozenset(caller), env=env,
        watch_grace=_number(name, "watch_grace", entry.get("watch_grace", 30.0), integer=False, low=0, high=86_400),
        max_watches=int(_number(name, "max_watches", entry.get("max_watches", 10_000), integer=True, low=1,
                                high=1_000_000)),
    )


def overlap(one: str, other: str) -> bool:
    """Whether two prefixes can claim one URI (one begins the other)."""
    return one.startswith(other) or other.startswith(one)


def parse_upstreams(raw: Any, default_tenant: str = "default") -> tuple[UpstreamSpec, ...]:
    """The upstreams of ``raw`` (the setting's JSON, decoded), in the order written; ``tenants`` left out
    is ``[default_tenant]`` (``MCP_BROKER_DEFAULT_TENANT``).

    Raises:
        UpstreamsError: a bad map, entry or URL, or two upstreams whose prefixes overlap for a tenant both see.
    """
    if not isinstance(raw, dict):
        raise _fail(None, f"write a JSON object of upstream name to its description, e.g. {_EXAMPLE}")
    specs = tuple(_one(name, entry, default_tenant) for name, entry in raw.items())
    for index, spec in enumerate(specs):
        for other in specs[:index]:
            shared = sorted(set(spec.tenants) & set(other.tenants))
            if not shared or spec.prefixes is None or other.prefixes is None:
                continue
            for mine in spec.prefixes:
                for theirs in other.prefixes:
                    if overlap(mine, theirs):
                        raise _fail(spec.name, f"its prefix {mine!r} overlaps {theirs!r} of upstream {other.name!r} "
                                               f"for tenant {shared[0]!r}; give each upstream prefixes of its own")
    return specs
