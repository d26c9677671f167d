"""Subscriptions in memory: ``base.SubscriptionIndex``.

A session's set and the URI -> subscribers index are changed together, and the session's
watcher woken, in one step: every method runs on the event loop without awaiting.
"""

from __future__ import annotations

from collections.abc import Sequence

from broker.backends.memory.state import SessionState
from broker.backends.types import Wake

__all__ = ["MemorySubscriptions"]


class MemorySubscriptions:
    """A session's subscribed URIs and each URI's subscribers, per tenant."""

    def __init__(self, state: SessionState) -> None:
        self._state = state

    async def add(self, session_id: str, tenant: str, uri: str, limit: int = 0) -> int:
        return self._state.subscribe(session_id, tenant, uri, limit)

    async def remove(self, session_id: str, tenant: str, uri: str) -> None:
        state = self._state
        subs = state.subs.get(session_id)
        if subs is not None and uri in subs:
            subs.discard(uri)
            state.unindex(tenant, uri, session_id)
            state.wake(session_id, Wake("unsubscribe", uri=uri))

    async def of_session(self, session_id: str) -> set[str]:
        return set(self._state.subs.get(session_id, ()))

    async def subscribers(self, tenant: str, uris: Sequence[str]) -> dict[str, list[str]]:
        index = self._state.index
        found: dict[str, list[str]] = {}
        for uri in uris:
            members = index.get((tenant, uri))
            if members:
                found[uri] = list(members)
        return found

    async def tenant_sessions(self, tenant: str) -> list[str]:
        return list(self._state.by_tenant.get(tenant, ()))
