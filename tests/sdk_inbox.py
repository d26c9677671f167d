"""What the official SDK client's message handler received, waited on by condition (no sleeping)."""

from __future__ import annotations

import asyncio

from mcp import types

TIMEOUT = 10.0


class Inbox:
    def __init__(self) -> None:
        self.messages: list[object] = []
        self._changed = asyncio.Condition()

    async def handler(self, message: object) -> None:
        async with self._changed:
            self.messages.append(message)
            self._changed.notify_all()

    async def wait_for(self, kind: type, uri: str | None = None) -> object:
        """The first message of ``kind`` (about ``uri``), once it has arrived."""

        def match() -> object | None:
            for message in self.messages:
                if isinstance(message, kind) and (uri is None or str(message.params.uri) == uri):  # type: ignore[attr-defined]
                    return message
            return None

        async with asyncio.timeout(TIMEOUT), self._changed:
            await self._changed.wait_for(lambda: match() is not None)
            return match()

    def updated(self) -> list[str]:
        return [str(m.params.uri) for m in self.messages if isinstance(m, types.ResourceUpdatedNotification)]
