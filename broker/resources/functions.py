"""Resources declared by decorating Python functions: ``@resources.resource("notes://{id}")``.

A ``ResourceSet`` is a provider (``broker.resources.base.ResourceProvider``) whose resources are
functions::

    resources = ResourceSet()

    @resources.resource("notes://{id}", mime_type="text/markdown")
    async def note(id: str, tenant: str) -> str | None:
        return await load_note(tenant, id)           # None: the note does not exist

    mount_broker(app, resources=resources)         # or broker.register(resources)
    await resources.publish("notes://7", tenant="acme")

A URI without ``{variables}`` declares one resource, listed by ``resources/list``; a URI with
some declares a template (RFC 6570 level 1), listed by ``resources/templates/list``, that
answers every URI it matches. Each variable becomes the keyword argument of the same name; a
value is one path segment (no ``/``, ``?`` or ``#``), passed as the URI spells it.

**Matching.** A variable's value ends where the literal text after it starts: in
``r://{y}-{m}-{d}`` a year holds no ``-``, so ``r://2026-12-07-1`` gives ``d="07-1"``. Matching
is therefore one pass over the URI whatever a client sends, and two variables side by side
(``{a}{b}``), which no literal separates, are refused, as is a variable in the scheme (which
could match the record collections' ``mcpb:`` URIs). A value that could lead a function that
builds a path out of its folder matches nothing: ``.``, ``..``, or one that holds ``/`` or
``\\``, as the URI spells it or percent-encoded (``%2F``, ``%5C``, ``%2E%2E``).

**Who asks.** Resources are per tenant in this broker, the URIs are not: a function that
declares a parameter ``tenant`` receives the caller's tenant, one that declares ``principal``
receives the caller's ``Principal`` (``tenant``, ``subject``, ``scopes``). A function that
declares neither answers every tenant alike. Changes are per tenant too: ``publish`` notifies the
subscribers of one tenant (the broker's default tenant unless ``tenant`` is given).

**What it returns.** ``str``: text (``text/plain`` unless ``mime_type`` says otherwise);
``bytes``: a blob (``application/octet-stream``); a ``dict`` or ``list``: JSON text
(``application/json``). ``None``, or raising ``broker.errors.NotFound``, answers that the resource
does not exist (the era's JSON-RPC error, as for any unknown URI). Any other exception is logged
with its traceback and answered ``-32603 Internal error``, without its details. A plain ``def``
runs on the event loop: keep it quick, and make a function that waits on I/O ``async``.

**Watching.** Any caller may subscribe to a URI the set answers for: a notification only says
that the URI changed for the caller's own tenant, and reading it goes through the function.

**Publishing.** ``publish`` goes through the broker's one ``Publisher`` (``broker.publisher``),
the way ``POST /changes`` and ``Broker.publish`` go: the same rules, quotas, change log, fan-out
to every worker and replay. The broker hands the set its publisher when the set is registered
(``broker.resources.base.PublishingProvider``); a set registered with several brokers publishes through the last.
"""

from __future__ import annotations

import base64
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import unquote

import orjson

from broker.auth import Principal
from broker.changes import ChangeKind, InvalidChange
from broker.errors import NotFound
from broker.publisher import Publisher
from broker.resources.base import BadCursor
from broker.uris import SCHEME, check_uri

__all__ = ["ResourceSet"]

Json = dict[str, Any]
F = TypeVar("F", bound=Callable[..., Any])

#: The parameters a read function may declare to learn who asks, filled by the broker.
INJECTED = ("principal", "tenant")
_VARIABLE = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
#: Long enough for any URI a declaration may hold: the client's URI is bounded when it is read.
_DECLARED_MAX = 1 << 16
#: The longest listing position a cursor may hold: more fixed resources than any set declares.
_POSITION_DIGITS = 9


@dataclass(frozen=True, slots=True)
class _Declared:
    """One decorated function: a fixed URI (no variables) or a template."""

    uri: str
    function: Callable[..., Any]
    variables: tuple[str, ...]
    injected: tuple[str, ...]
    pattern: re.Pattern[str]
    name: str
    description: str | None
    mime_type: str | None

    def listing(self) -> Json:
        item: Json = {"uriTemplate" if self.variables else "uri": self.uri, "name": self.name}
        if self.description:
            item["description"] = self.description
        if self.mime_type:
            item["mimeType"] = self.mime_type
        return item

    async def read(self, principal: Principal, uri: str, arguments: dict[str, str]) -> list[Json]:
        """Raises NotFound when the function returns None (or raises it); TypeError for a result of another kind."""
        given: dict[str, Any] = {"principal": principal, "tenant": principal.tenant}
        result = self.function(**arguments, **{name: given[name] for name in self.injected})
        if inspect.isawaitable(result):
            result = await result
        if result is None:
            raise NotFound(uri)
        if isinstance(result, str):
            return [{"uri": uri, "mimeType": self.mime_type or "text/plain", "text": result}]
        if isinstance(result, bytes | bytearray | memoryview):
            return [{"uri": uri, "mimeType": self.mime_type or "application/octet-stream",
                     "blob": base64.b64encode(bytes(result)).decode()}]
        if isinstance(result, dict | list):
            return [{"uri": uri, "mimeType": self.mime_type or "application/json",
                     "text": orjson.dumps(result).decode()}]
        raise TypeError(f"resource function {self.name!r} returned {type(result).__name__} for {uri}: "
                        "return str, bytes, a dict or a list (or None when it does not exist)")


def _pattern(uri: str) -> re.Pattern[str]:
    """The template as a regular expression that matches in one pass: each variable also stops at the first
    character of the literal after it, so where it ends is never in doubt and nothing backtracks far
    (``[^/?#]+-[^/?#]+-[^/?#]+/x`` against a run of dashes tries every way to split the run)."""
    parts = _VARIABLE.split(uri)  # literal, variable, literal, ...: never two variables side by side
    pattern = ""
    for i, part in enumerate(parts):
        if i % 2 == 0:
            pattern += re.escape(part)
        else:
            stop = parts[i + 1][:1] if parts[i + 1][:1] not in "/?#" else ""
            pattern += f"(?P<{part}>[^/?#{re.escape(stop)}]+)"
    return re.compile(pattern)


def _confined(value: str) -> bool:
    """Can ``value`` name nothing outside the folder a function joins it to, even percent-decoded?"""
    decoded = unquote(value)
    return decoded not in (".", "..") and "/" not in decoded and "\\" not in decoded


def _declare(uri: str, function: Callable[..., Any], name: str | None, description: str | None,
             mime_type: str | None) -> _Declared:
    """Check a declaration against its function. Raises ValueError naming what does not fit."""
    variables = tuple(_VARIABLE.findall(uri))
    label = getattr(function, "__name__", repr(function))
    try:
        check_uri(_VARIABLE.sub("x", uri), _DECLARED_MAX)
    except ValueError as exc:
        raise ValueError(f"resource {uri!r}: {exc}") from exc
    if "{" in _VARIABLE.sub("", uri) or "}" in _VARIABLE.sub("", uri):
        raise ValueError(f"resource {uri!r}: a variable is written {{name}}: ASCII letters, digits and _, "
                         "not a digit first")
    if "}{" in uri:
        raise ValueError(f"resource {uri!r}: two variables side by side: put a literal between them")
    scheme = uri.partition(":")[0]
    if "{" in scheme:
        raise ValueError(f"resource {uri!r}: the scheme must be written out, not a variable")
    if scheme.lower() == SCHEME:
        raise ValueError(f"resource {uri!r}: {SCHEME}: URIs are the record collections'; choose a scheme of your own")
    if len(set(variables)) != len(variables):
        raise ValueError(f"resource {uri!r}: a variable appears twice")
    if taken := set(variables) & set(INJECTED):
        raise ValueError(f"resource {uri!r}: {{{min(taken)}}} cannot be a URI variable: a parameter of that name "
                         "receives the caller's own")
    parameters = inspect.signature(function).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    for variable in variables:
        if variable not in parameters and not takes_any:
            raise ValueError(f"resource {uri!r}: {label}() has no parameter {variable!r} for {{{variable}}}")
    for parameter in parameters.values():
        if parameter.kind is parameter.POSITIONAL_ONLY:
            raise ValueError(f"resource {uri!r}: {label}() takes {parameter.name!r} by position only; "
                             "the broker passes every argument by name")
        if (parameter.default is parameter.empty and parameter.kind not in (parameter.VAR_POSITIONAL,
                                                                            parameter.VAR_KEYWORD)
                and parameter.name not in variables and parameter.name not in INJECTED):
            raise ValueError(f"resource {uri!r}: {label}() needs {parameter.name!r}, which is not a variable "
                             f"of the URI (nor one of {', '.join(INJECTED)})")
    injected = tuple(name for name in INJECTED if name in parameters)
    return _Declared(uri, function, variables, injected, _pattern(uri), name or label,
                     description if description is not None else inspect.getdoc(function), mime_type)


class ResourceSet:
    """Resources and templates answered by functions (module docstring); a provider for ``Broker.register``."""

    def __init__(self) -> None:
        self._fixed: dict[str, _Declared] = {}
        self._templates: list[_Declared] = []
        self._publisher: Publisher | None = None

    def resource(self, uri: str, *, name: str | None = None, description: str | None = None,
                 mime_type: str | None = None) -> Callable[[F], F]:
        """Declare ``uri`` (with ``{variables}``: a template) answered by the decorated function, which
        is returned unchanged. ``name`` defaults to the function's name, ``description`` to its docstring.

        Raises:
            ValueError: ``uri`` is not an absolute URI, is declared already, has a variable in its
                scheme or two side by side, is an ``mcpb:`` URI, or does not fit the function (a
                variable without its parameter, a parameter without a default that is neither a
                variable nor ``principal``/``tenant``).
        """
        def decorate(function: F) -> F:
            self.add(uri, function, name=name, description=description, mime_type=mime_type)
            return function

        return decorate

    def add(self, uri: str, function: Callable[..., Any], *, name: str | None = None,
            description: str | None = None, mime_type: str | None = None) -> None:
        """``resource(uri, ...)(function)`` without the decorator. Raises ValueError as ``resource``."""
        declared = _declare(uri, function, name, description, mime_type)
        if uri in self._fixed or any(t.uri == uri for t in self._templates):
            raise ValueError(f"resource {uri!r} is declared already")
        if declared.variables:
            self._templates.append(declared)
        else:
            self._fixed[uri] = declared

    def bind_publisher(self, publisher: Publisher) -> None:
        """Publish through ``publisher`` from now on (the broker calls it when the set is registered)."""
        self._publisher = publisher

    async def publish(self, uri: str, *, tenant: str | None = None, kind: ChangeKind | str = ChangeKind.UPDATED,
                      meta: dict[str, Any] | None = None) -> str:
        """Tell ``tenant``'s subscribers of ``uri`` (the default tenant's unless given) that it changed;
        returns the change's id once it is in the change log.

        Raises:
            RuntimeError: the set was never registered with a broker.
            InvalidChange: ``uri`` is none of this set's resources, or the change breaks the broker's rules.
            QuotaExceeded, PublishRateLimited, LogFull, BackendUnavailable: as ``Broker.publish``
                (the change was not accepted; publish again later).
        """
        if self._publisher is None:
            raise RuntimeError("this ResourceSet is not registered with a broker: mount_broker(app, resources=...) "
                               "or broker.register(...) first")
        if not self.owns(uri):
            raise InvalidChange(f"{uri} is none of this set's resources")
        return await self._publisher.publish(uri, kind, tenant=tenant, meta=meta, source="python")

    def _find(self, uri: str) -> tuple[_Declared, dict[str, str]] | None:
        if (fixed := self._fixed.get(uri)) is not None:
            return fixed, {}
        for template in self._templates:
            found = template.pattern.fullmatch(uri)
            if found is not None and all(_confined(value) for value in found.groupdict().values()):
                return template, found.groupdict()
        return None

    # -- ResourceProvider --------------------------------------------------------------------
    def owns(self, uri: str) -> bool:
        return self._find(uri) is not None

    def can_watch(self, principal: Principal, uri: str) -> bool:
        return True

    async def list_page(self, principal: Principal, state: str | None, limit: int) -> tuple[list[Json], str | None]:
        fixed = list(self._fixed.values())
        if not state:
            start = 0
        elif state.isascii() and state.isdigit() and len(state) <= _POSITION_DIGITS:
            start = int(state)
        else:
            raise BadCursor(state)
        page = fixed[start : start + limit]
        end = start + len(page)
        return [item.listing() for item in page], (str(end) if end < len(fixed) else None)

    async def read(self, principal: Principal, uri: str) -> list[Json]:
        """The function's answer. Raises NotFound (it returned None, or raised it), or what it raised."""
        found = self._find(uri)
        if found is None:
            raise NotFound(uri)
        declared, arguments = found
        return await declared.read(principal, uri, arguments)

    def templates(self, principal: Principal) -> list[Json]:
        return [template.listing() for template in self._templates]
