"""Your own code as a resource provider, with its own change stream (``MCP_BROKER_PROVIDERS``).

A *live provider* is a ``ResourceProvider`` (``broker.resources.base``: ``owns``, ``can_watch``,
``list_page``, ``read``, ``templates``) that also says when its data changes: ``subscribe()``
yields ``ProviderChange(tenant, uri, kind, meta)`` (or plain 4-tuples) for as long as it runs::

    class Tickets:
        name, exclusive = "tickets", True      # both optional: "custom-Tickets", True
        def owns(self, uri): return uri.startswith("tickets://")
        ...                                     # can_watch, list_page, read, templates
        async def subscribe(self):
            async for ticket_id in my_queue():
                yield ProviderChange("default", f"tickets://{ticket_id}")

    broker.extend(live_extension(Tickets()))    # or register_live(broker, Tickets())

``live_extension`` registers the provider (it answers before the built-in record collections)
and adds a change source (``LiveSource``) that publishes each change through the broker's one
``Publisher`` (``source`` = the provider's ``name``). The source is ``exclusive`` unless the
provider says ``exclusive = False``: one worker of the deployment runs ``subscribe`` at a time
(under a lease, ``broker.sources``), so a change is published once however many workers run;
set it to False when each worker sees only its own changes. A ``subscribe`` that fails, or
whose changes the change log keeps refusing, is started again after a pause; one that returns
is done.

``MCP_BROKER_PROVIDERS`` (a JSON list of ``package.module:factory``) does the same without code
in the broker: each factory is called (with the ``Settings`` when it takes an argument) and may
return a provider, a live provider, a change source, an ``Extension``, or a list of those. A name
that is a provider object itself (a module's ``ResourceSet``) is used as it is. A
module that cannot be imported, or a name it lacks, stops ``mcp-broker`` at start with one line
naming the setting (checked at start by ``load_provider_factory``).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import os
import sys
from collections.abc import AsyncIterator, Callable, Iterable
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from broker.changes import ChangeKind, InvalidChange
from broker.config import FACTORY_SPEC
from broker.errors import BackendUnavailable, PublishRefused
from broker.publisher import Publisher
from broker.resources.base import ResourceProvider
from broker.sources import ChangeSource, Extension

if TYPE_CHECKING:
    from broker.config import Settings

__all__ = ["ExtensionError", "LiveProvider", "LiveSource", "ProviderChange", "build", "live_extension",
           "load_factory", "load_provider_factory", "register_live"]

logger = logging.getLogger(__name__)

SETTING = "MCP_BROKER_PROVIDERS"
#: The longest pause before a refused change is offered to the change log again, in seconds.
MAX_RETRY_PAUSE = 5.0


class ExtensionError(ValueError):
    """A ``module:factory`` of ``MCP_BROKER_PROVIDERS`` that cannot be used; the message is one line."""


class Extensible(Protocol):
    """What ``register_live`` adds to: a ``Broker``."""

    def extend(self, extension: Extension) -> None: ...


class ProviderChange(NamedTuple):
    """One change a live provider yields: ``kind`` is ``updated``, ``created`` or ``deleted``; ``meta``
    is copied into the notification's ``params._meta``."""

    tenant: str
    uri: str
    kind: ChangeKind | str = ChangeKind.UPDATED
    meta: dict[str, Any] | None = None


class LiveProvider(ResourceProvider, Protocol):
    """A ``ResourceProvider`` with its own change stream.

    Optional attributes: ``name`` (the source's name in logs, metrics and its lease; by default
    ``custom-<class name>``) and ``exclusive`` (default True: one worker of the deployment runs
    ``subscribe`` at a time).
    """

    def subscribe(self) -> AsyncIterator[ProviderChange | tuple[str, str, str, dict[str, Any] | None]]:
        """The provider's changes, as they happen (an ``async def`` with ``yield``); cancelled at stop."""


def source_name(provider: object) -> str:
    name = getattr(provider, "name", None)
    return name if isinstance(name, str) and name else f"custom-{type(provider).__name__}"


class LiveSource:
    """The ``ChangeSource`` of a live provider: publishes what its ``subscribe`` yields."""

    def __init__(self, provider: LiveProvider, *, name: str | None = None, exclusive: bool | None = None) -> None:
        self.provider = provider
        self.name = name or source_name(provider)
        self.exclusive = bool(getattr(provider, "exclusive", True)) if exclusive is None else exclusive

    async def run(self, publisher: Publisher) -> None:
        # Closed when the source stops (cancelled, or its lease lost), not whenever it is collected:
        # the provider's own ``finally`` (a queue, a LISTEN) runs at once.
        changes = self.provider.subscribe()
        try:
            async for change in changes:
                tenant, uri, kind, meta = change
                await self._publish(publisher, tenant, uri, kind, meta)
        finally:
            close = getattr(changes, "aclose", None)  # an async generator has one; any iterator may not
            if close is not None:
                await close()

    async def _publish(self, publisher: Publisher, tenant: str, uri: str, kind: Any, meta: Any) -> None:
        """Publish one change; a refused one (a full log, an unreachable backend) is offered again
        until it is taken, so the provider's stream keeps its order; an undeliverable one is skipped."""
        pause = 0.1
        while True:
            try:
                await publisher.publish(uri, kind, tenant=tenant, meta=meta, source=self.name)
                return
            except InvalidChange as exc:
                logger.warning("change source %s: skipped a change of %r it cannot deliver: %s", self.name, uri, exc)
                return
            except (PublishRefused, BackendUnavailable) as exc:
                logger.info("change source %s: the change log refused a change (%s); again in %.1fs",
                            self.name, type(exc).__name__, pause)
                await asyncio.sleep(pause)
                pause = min(pause * 2, MAX_RETRY_PAUSE)


def is_live(obj: object) -> bool:
    return is_provider(obj) and callable(getattr(obj, "subscribe", None))


def is_provider(obj: object) -> bool:
    return all(callable(getattr(obj, m, None)) for m in ("owns", "can_watch", "list_page", "read", "templates"))


def is_instance_provider(obj: object) -> bool:
    """A provider object itself, to be used as it is; a provider class is a factory, called."""
    return is_provider(obj) and not isinstance(obj, type)


def is_source(obj: object) -> bool:
    return callable(getattr(obj, "run", None)) and isinstance(getattr(obj, "name", None), str) \
        and hasattr(obj, "exclusive")


def live_extension(provider: LiveProvider, *, name: str | None = None, exclusive: bool | None = None) -> Extension:
    """The provider and its change source, for ``broker.extend(...)``."""
    return Extension(providers=[provider], sources=[LiveSource(provider, name=name, exclusive=exclusive)])


def register_live(broker: Extensible, provider: LiveProvider) -> None:
    """``broker.extend(live_extension(provider))``: the provider answers, its changes are published."""
    broker.extend(live_extension(provider))


def as_extension(obj: object, origin: str = "") -> Extension:
    """What a factory returned, as an ``Extension``. Raises ``ExtensionError`` for anything else."""
    if isinstance(obj, Extension):
        return obj
    if is_live(obj):
        return live_extension(obj)  # type: ignore[arg-type]
    if is_provider(obj):
        return Extension(providers=[obj])  # type: ignore[list-item]
    if is_source(obj):
        return Extension(sources=[obj])  # type: ignore[list-item]
    if isinstance(obj, Iterable) and not isinstance(obj, str | bytes | dict):
        providers: list[ResourceProvider] = []
        sources: list[ChangeSource] = []
        for item in obj:
            part = as_extension(item, origin)
            providers += part.providers
            sources += part.sources
        return Extension(providers, sources)
    raise ExtensionError(f"{SETTING}: {origin or 'a factory'} returned {type(obj).__name__}, not a provider, "
                         "a live provider, a change source or an Extension (see docs/sources/custom.md)")


def load_provider_factory(spec: str) -> Callable[..., Any]:
    """The callable an ``MCP_BROKER_PROVIDERS`` entry (``package.module:name``) names, imported; or the
    provider it names (a ``ResourceSet`` of the module), which is used as it is.

    Raises ValueError, one line naming the setting, when ``spec`` is not of that form, its module
    cannot be imported, or it has no such callable. The working directory is importable, as it
    is for ``python -m`` and ``uvicorn`` (``broker/sources/extensions.py`` calls the factories).
    """
    if not FACTORY_SPEC.match(spec):
        raise ValueError(f"MCP_BROKER_PROVIDERS: {spec!r} is not of the form package.module:factory")
    module_name, _, attribute = spec.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    try:
        target: Any = importlib.import_module(module_name)
    except Exception as exc:  # whatever the module raises while it is imported: one line that names it
        first = (str(exc).strip().splitlines() or [""])[0]
        raise ValueError(f"MCP_BROKER_PROVIDERS: {spec!r}: importing {module_name} failed: "
                         f"{type(exc).__name__}: {first}") from exc
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ValueError(f"MCP_BROKER_PROVIDERS: {spec!r}: {module_name} has no {attribute!r}")
        target = getattr(target, part)
    if not callable(target) and not is_instance_provider(target):
        raise ValueError(f"MCP_BROKER_PROVIDERS: {spec!r} is a {type(target).__name__}, not a callable factory "
                         "nor a provider")
    return target  # type: ignore[no-any-return]


def load_factory(spec: str) -> Callable[..., Any]:
    """The callable ``spec`` (``package.module:name``) names. Raises ``ExtensionError`` (one line) when
    it is not of that form, its module cannot be imported, or it has no such callable."""
    try:
        return load_provider_factory(spec)
    except ValueError as exc:
        raise ExtensionError(str(exc)) from exc


def _call(factory: Callable[..., Any], settings: Settings) -> Any:
    """``factory(settings)`` when it takes a positional argument, else ``factory()``."""
    try:
        parameters = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature
        return factory()
    takes = any(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL) for p in parameters)
    return factory(settings) if takes else factory()


def build(settings: Settings) -> Extension:
    """Every ``module:factory`` of ``settings.providers``, called, as one ``Extension``.

    Raises:
        ExtensionError: a spec cannot be loaded, its factory failed, or it returned something else
            than a provider, a live provider, a change source or an ``Extension`` (one line).
    """
    providers: list[ResourceProvider] = []
    sources: list[ChangeSource] = []
    for spec in settings.providers:
        factory = load_factory(spec)
        try:
            made = factory if is_instance_provider(factory) else _call(factory, settings)
        except Exception as exc:  # the factory's own failure, named by the setting
            raise ExtensionError(f"{SETTING}: {spec!r} failed: {type(exc).__name__}: {exc}") from exc
        part = as_extension(made, repr(spec))
        providers += part.providers
        sources += part.sources
    names = [s.name for s in sources]
    if len(set(names)) != len(names):  # two sources of one name would share one lease: one would never run
        raise ExtensionError(f"{SETTING}: two change sources are named alike ({', '.join(sorted(names))}); "
                             "give each provider a name of its own")
    return Extension(providers, sources)
