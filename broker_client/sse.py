"""Server-sent events, read from an httpx response line by line (the fields MCP uses: ``id``, ``data``, ``retry``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass


@dataclass
class Event:
    id: str | None
    data: str
    retry: int | None


async def events(lines: AsyncIterator[str]) -> AsyncIterator[Event]:
    """Every event of the stream, including data-less ones (a priming event carries only an ``id``)."""
    data: list[str] = []
    event_id: str | None = None
    retry: int | None = None
    seen = False
    async for line in lines:
        if line == "":
            if seen:
                yield Event(event_id, "\n".join(data), retry)
            data, event_id, retry, seen = [], None, None, False
            continue
        if line.startswith(":"):
            continue  # a keep-alive comment
        name, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        seen = True
        if name == "data":
            data.append(value)
        elif name == "id":
            event_id = value
        elif name == "retry" and value.isdigit():
            retry = int(value)
    if seen:
        yield Event(event_id, "\n".join(data), retry)
