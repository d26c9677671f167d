"""The provider seam and the registry that pages across providers.

A provider answers for the URIs it owns. Changes never flow through a provider's return
values: a provider whose data changes comes with a change source (``broker.sources``) that
publishes them, or calls ``Broker.publish`` (the record collections publish with each write).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import orjson

from broker.auth import Principal
from broker.errors import NotFound

if TYPE_CHECKING:
    from broker.publisher import Publisher

__all__ = ["BadCursor", "ClosingProvider", "PublishingProvider", "ResourceProvider", "Resources"]

Json = dict[str, Any]


class BadCursor(ValueError):
    """A pagination cursor the broker did not issue, or one from another listing."""


class ResourceProvider(Protocol):
    """Answers list, read and templates for the URIs it owns; the same access rule for read and watch."""

    def owns(self, uri: str) -> bool:
        """True when this provider answers for ``uri`` (it may still not exist)."""

    def can_watch(self, principal: Principal, uri: str) -> bool:
        """May ``principal`` read (and therefore watch) ``uri``? Same predicate as ``read``'s access check."""

    async def list_page(self, principal: Principal, state: str | None, limit: int) -> tuple[list[Json], str | None]:
        """Up to ``limit`` resources after ``state`` (None: from the start) and the state of the next page."""

    async def read(self, principal: Principal, uri: str) -> list[Json]:
        """The contents of ``uri``. Raises NotFound when it does not exist for this principal."""

    def templates(self, principal: Principal) -> list[Json]: ...


@runtime_checkable
class ClosingProvider(Protocol):
    """A provider that holds connections (a database pool): the broker closes it as it stops."""

    async def aclose(self) -> None: ...


@runtime_checkable
class PublishingProvider(Protocol):
    """A provider that publishes its own changes (``broker.resources.functions.ResourceSet``): the broker
    hands it its ``Publisher`` when it is registered, so its changes pass the same rules as every other."""

    def bind_publisher(self, publisher: Publisher) -> None: ...


def _encode_cursor(index: int, state: str) -> str:
    return base64.urlsafe_b64encode(orjson.dumps([index, state])).decode()


def _decode_cursor(cursor: str) -> tuple[int, str | None]:
    try:
        index, state = orjson.loads(base64.urlsafe_b64decode(cursor.encode()))
    except (binascii.Error, orjson.JSONDecodeError, ValueError, TypeError) as exc:
        raise BadCursor(cursor) from exc
    if not isinstance(index, int) or not (state is None or isinstance(state, str)):
        raise BadCursor(cursor)
    return index, state


class Resources:
    """The registered providers, in order; the first that owns a URI answers for it."""

    def __init__(self, providers: Sequence[ResourceProvider] = ()) -> None:
        self.providers: list[ResourceProvider] = list(providers)

    def register(self, provider: ResourceProvider) -> None:
        """Add a provider that answers before those registered earlier (custom ones before the built-ins)."""
        self.providers.insert(0, provider)

    def owner(self, uri: str, principal: Principal | None = None) -> ResourceProvider | None:
        """The provider that answers for ``uri`` (to ``principal``: a provider that serves some tenants
        only, the upstreams', says so with ``serves(principal, uri)``)."""
        for provider in self.providers:
            if provider.owns(uri):
                serves = getattr(provider, "serves", None) if principal is not None else None
                if serves is None or serves(principal, uri):
                    return provider
        return None

    async def list_page(self, principal: Principal, cursor: str | None, limit: int) -> tuple[list[Json], str | None]:
        """One page across all providers.

        Raises:
            BadCursor: the cursor is not one this listing issued.
        """
        index, state = (0, None) if cursor is None else _decode_cursor(cursor)
        if not 0 <= index < max(len(self.providers), 1):
            raise BadCursor(cursor or "")
        page: list[Json] = []
        while index < len(self.providers) and len(page) < limit:
            items, state = await self.providers[index].list_page(principal, state, limit - len(page))
            page.extend(items)
            if state is None:
                index += 1
        if index >= len(self.providers):
            return page, None
        return page, _encode_cursor(index, state or "")

    async def read(self, principal: Principal, uri: str) -> list[Json]:
        provider = self.owner(uri, principal)
        if provider is None:
            raise NotFound(uri)
        return await provider.read(principal, uri)

    def can_watch(self, principal: Principal, uri: str) -> bool:
        """URIs no provider owns may be watched: their changes arrive through ``POST /changes``."""
        provider = self.owner(uri, principal)
        return provider is None or provider.can_watch(principal, uri)

    def templates(self, principal: Principal) -> list[Json]:
        return [t for provider in self.providers for t in provider.templates(principal)]
