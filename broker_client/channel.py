"""What the watcher needs of a connection, whatever the transport and era."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from broker_client.errors import Dropped

RESUMED = "resumed"
RESYNCED = "resynced"


class Channel:
    """One live subscription to a set of URIs: changes in, reads out.

    A channel is started (subscribed and confirmed) by the function that opens it. Its stream
    runs in a task of its own that queues the URIs it hears of; a failure of the stream is
    queued too, as a ``Dropped``, so the watcher meets it in order, after the changes before it.
    """

    era = ""

    def __init__(self, uris: list[str]) -> None:
        self.uris = uris
        self.watched = frozenset(uris)
        self.queue: asyncio.Queue[str | Dropped] = asyncio.Queue()
        #: Frames received so far (any event, even a priming one): a stream that delivers is healthy.
        self.progress = 0
        #: Extension identifiers the server advertised (2026-07-28 ``server/discover``).
        self.extensions: frozenset[str] = frozenset()
        self._reader: asyncio.Task[None] | None = None

    def heard(self, uri: str) -> None:
        if uri in self.watched:
            self.queue.put_nowait(uri)

    async def changes(self) -> set[str]:
        """The URIs changed since last asked (waits for one); raises the stream's ``Dropped``.

        Everything queued is taken at once: updates are level triggers, one read covers them all.
        """
        found: set[str] = set()
        item = await self.queue.get()
        while True:
            if isinstance(item, Dropped):
                if found:  # the changes first; the failure stays queued for the next call
                    requeue = [item, *self._drain()]
                    for later in requeue:
                        self.queue.put_nowait(later)
                    return found
                raise item
            found.add(item)
            if self.queue.empty():
                return found
            item = self.queue.get_nowait()

    def _drain(self) -> list[str | Dropped]:
        items = []
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        return items

    def reading(self) -> bool:
        return self._reader is not None and not self._reader.done()

    def run_reader(self, reader: Any) -> None:
        """Start the stream's task; when it fails, its ``Dropped`` is queued."""

        async def guarded() -> None:
            try:
                await reader
            except Dropped as exc:
                self.queue.put_nowait(exc)

        self._reader = asyncio.create_task(guarded())

    async def stop_reader(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
            self._reader = None
        self._drain_failures()

    def _drain_failures(self) -> None:
        """Forget queued failures of a stream that is being replaced (its changes stay)."""
        for item in self._drain():
            if not isinstance(item, Dropped):
                self.queue.put_nowait(item)

    async def recover(self) -> str:
        """Reconnect after a ``Dropped``: ``RESUMED`` when nothing was lost, ``RESYNCED`` when all must be re-read."""
        raise NotImplementedError

    async def read(self, uri: str) -> list[dict[str, Any]]:
        raise NotImplementedError

    async def close(self) -> None:
        """Unsubscribe and end the session, best effort: the server may be gone already."""
        raise NotImplementedError
