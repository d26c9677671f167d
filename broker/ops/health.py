"""Health: whether this worker can serve, and what it holds, for probes and ``/healthz``."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from broker.delivery.stream import Streams
from broker.errors import BackendUnavailable

__all__ = ["Health"]


class Health:
    """``check`` pings the backend; the report names this worker's open streams, never tenants' numbers."""

    def __init__(self, ping: Callable[[], Awaitable[None]], streams: Streams) -> None:
        self.ping = ping
        self.streams = streams
        self._draining = False

    @property
    def draining(self) -> bool:
        """The worker is stopping (``drain`` was called, or its streams have ended): not ready for more."""
        return self._draining or self.streams.closing

    def drain(self) -> None:
        """The worker stops taking new work from now on (SIGTERM): readiness fails first, streams end later."""
        self._draining = True

    async def check(self) -> tuple[bool, dict[str, Any]]:
        """(whether the backend answers, the report)."""
        try:
            await self.ping()
        except BackendUnavailable:
            return False, {"status": "unavailable"}
        streams = self.streams
        return True, {"status": "ok", "streams": streams.sessions, "listens": streams.all_listens}
