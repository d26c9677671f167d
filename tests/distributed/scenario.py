"""What the distributed tests share: proxy-log queries and the basic any-worker scenario.

The scenario runs on whatever deployment it is given (one Redis, or a Redis Cluster): a session
whose every request lands on a different worker is notified of changes published through yet
other workers, and resumes on a fourth with exactly what it missed.
"""

from __future__ import annotations

import secrets
from typing import Any

import httpx

from tests.integration.mcp_http import McpSession, publish

UPDATED = "notifications/resources/updated"
LIST_CHANGED = "notifications/resources/list_changed"


def uris(count: int) -> list[str]:
    tag = secrets.token_hex(3)
    return [f"https://example.com/{tag}/{n}" for n in range(count)]


def served(log: list[dict[str, Any]], session: str, method: str | None = None) -> list[int]:
    """The workers that served the requests of one session (oldest first)."""
    return [e["upstream"] for e in log if e["session"] == session and (method is None or e["method"] == method)]


async def steer(http: httpx.AsyncClient, avoid: set[int]) -> int:
    """Make the proxy's next request go to a worker not in ``avoid`` (by sending health checks); returns it."""
    while (upcoming := int((await http.get("/__proxy/next")).json())) in avoid:
        assert (await http.get("/healthz")).status_code == 200
    return upcoming


async def any_worker_scenario(http: httpx.AsyncClient, log: Any) -> None:
    """Initialize, subscribe, GET and reconnect each on another worker; ``log()`` is the proxy's log."""
    seen, missed, later = uris(3), uris(4), uris(1)
    mcp = await McpSession(http).initialize()
    assert mcp.id is not None
    initialized_on = served(log(), mcp.id, "POST")[-1]  # notifications/initialized
    subscribed_on = await steer(http, {initialized_on})
    await mcp.subscribe(*seen[:1])
    await steer(http, {subscribed_on})
    await mcp.subscribe(*seen[1:], *missed, *later)
    streamed_on = await steer(http, {initialized_on, subscribed_on})
    async with mcp.stream() as stream:
        await stream.next_event()  # priming: the stream is claimed and reading
        await publish(http, *seen)
        received = await stream.messages(len(seen))
    # Several fan-out consumers share the log, so changes of one burst may arrive in any order.
    assert sorted(e.uri or "" for e in received) == sorted(seen)
    await publish(http, *missed)  # no stream open: the inbox keeps them
    resumed_on = await steer(http, {streamed_on})
    async with mcp.stream(last_event_id=received[-1].id) as stream:
        replayed = await stream.messages(len(missed))
        await publish(http, *later)
        live = await stream.next_message()
    assert sorted(e.uri or "" for e in replayed) == sorted(missed)
    assert live.uri == later[0]
    ids = [e.id for e in [*received, *replayed, live]]
    assert len(set(ids)) == len(ids)
    assert served(log(), mcp.id, "GET") == [streamed_on, resumed_on]
