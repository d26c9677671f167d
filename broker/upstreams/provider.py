"""The upstreams' resources as one provider among the broker's (``broker.resources.base``).

It answers for the URIs under an upstream's prefixes, for the tenants that upstream is mapped to
(``serves``): another tenant's same URI is no business of it, and goes on to the next provider
or, unowned, to ``POST /changes``. Reads are forwarded; a watch is the broker's own, fed by the one
watch of the upstream (``broker.upstreams.demand``). Templates are listed by the methods, which can
wait for the upstream (``Methods``); this provider adds none to the broker's own.
"""

from __future__ import annotations

from typing import Any

from broker.auth import Principal
from broker.upstreams.service import Upstreams

__all__ = ["UpstreamProvider"]


class UpstreamProvider:
    def __init__(self, upstreams: Upstreams) -> None:
        self.upstreams = upstreams

    def owns(self, uri: str) -> bool:
        return self.upstreams.claims(uri)

    def serves(self, principal: Principal, uri: str) -> bool:
        """Whether it answers for ``uri`` to this caller: an upstream of the caller's tenant owns it."""
        return self.upstreams.owner(principal.tenant, uri) is not None

    def can_watch(self, principal: Principal, uri: str) -> bool:
        return self.serves(principal, uri)

    async def list_page(self, principal: Principal, state: str | None,
                        limit: int) -> tuple[list[dict[str, Any]], str | None]:
        if not self.upstreams.of(principal.tenant):
            return [], None
        return await self.upstreams.list_page(principal, "resources/list", state or None)

    async def read(self, principal: Principal, uri: str) -> list[dict[str, Any]]:
        return await self.upstreams.read(principal, uri)

    def templates(self, principal: Principal) -> list[dict[str, Any]]:
        return []
