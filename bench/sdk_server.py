"""Baseline server on the official `mcp` Python SDK (2.x), for side-by-side runs.

It speaks the same wire API as mcp-broker as far as the load generator needs it:

- streamable HTTP on ``/mcp`` (stateful sessions, SSE mode, an in-memory
  ``EventStore`` so ``Last-Event-ID`` replay works);
- legacy ``resources/subscribe``: the session is remembered per URI and each
  change is sent with ``ServerSession.send_notification`` on the standalone GET
  stream, with the change's ``meta`` copied into ``params._meta``;
- 2026-07-28 ``subscriptions/listen`` through the SDK's stock ``ListenHandler``
  and ``InMemorySubscriptionBus``.  The stock handler stamps only the
  subscription id into ``_meta`` (``ResourceUpdated`` carries just the URI), so
  listen frames carry no ``seq``/``ts``; the load generator then matches frames
  to publishes by URI and arrival order (the SDK never coalesces);
- ``POST /changes`` with one change object or a list of them, answered 202
  after every local send has been queued, and ``GET /healthz``.

Run: ``python bench/sdk_server.py --port 8100`` (uvloop + httptools, one worker).
"""

from __future__ import annotations

import argparse
import logging
from collections import deque
from dataclasses import dataclass
from typing import Any
from uuid import uuid4

import mcp_types as types
import orjson
import uvicorn
from mcp.server.lowlevel import Server
from mcp.server.session import ServerSession
from mcp.server.streamable_http import EventCallback, EventId, EventMessage, EventStore, StreamId
from mcp.server.subscriptions import InMemorySubscriptionBus, ListenHandler, ResourceUpdated
from mcp_types import JSONRPCMessage
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

log = logging.getLogger("sdk_server")


@dataclass
class _Entry:
    event_id: EventId
    stream_id: StreamId
    message: JSONRPCMessage | None


class InMemoryEventStore(EventStore):
    """The SDK example's in-memory event store: a bounded deque per stream plus an id index.

    Note: the SDK keys every session's standalone GET stream as ``"_GET_stream"``
    and the session manager shares one store between sessions, so all legacy
    notifications land in one deque.  A replay after an event id therefore also
    returns later events of other sessions ("foreign" frames, which the client
    filters by URI), and the cap is shared by all sessions, hence the large
    default here.
    """

    def __init__(self, max_events_per_stream: int = 1000) -> None:
        self.max_events_per_stream = max_events_per_stream
        self.streams: dict[StreamId, deque[_Entry]] = {}
        self.index: dict[EventId, _Entry] = {}

    async def store_event(self, stream_id: StreamId, message: JSONRPCMessage | None) -> EventId:
        event_id = str(uuid4())
        entry = _Entry(event_id, stream_id, message)
        stream = self.streams.get(stream_id)
        if stream is None:
            stream = self.streams[stream_id] = deque(maxlen=self.max_events_per_stream)
        if len(stream) == self.max_events_per_stream:
            self.index.pop(stream[0].event_id, None)
        stream.append(entry)
        self.index[event_id] = entry
        return event_id

    async def replay_events_after(self, last_event_id: EventId, send_callback: EventCallback) -> StreamId | None:
        entry = self.index.get(last_event_id)
        if entry is None:
            return None
        found = False
        # a snapshot: other sessions append to the same stream while this replay awaits
        for e in list(self.streams.get(entry.stream_id, ())):
            if found:
                if e.message is not None:
                    await send_callback(EventMessage(e.message, e.event_id))
            elif e.event_id == last_event_id:
                found = True
        return entry.stream_id


def build_app(*, max_events_per_stream: int = 100_000) -> Any:
    subscribers: dict[str, set[ServerSession]] = {}
    bus = InMemorySubscriptionBus()
    listen = ListenHandler(bus, max_subscriptions=100_000, max_buffered_events=1024)

    async def list_resources(ctx: Any, params: Any) -> types.ListResourcesResult:
        return types.ListResourcesResult(resources=[])

    async def subscribe(ctx: Any, params: types.SubscribeRequestParams) -> types.EmptyResult:
        subscribers.setdefault(str(params.uri), set()).add(ctx.session)
        return types.EmptyResult()

    async def unsubscribe(ctx: Any, params: types.UnsubscribeRequestParams) -> types.EmptyResult:
        subs = subscribers.get(str(params.uri))
        if subs is not None:
            subs.discard(ctx.session)
        return types.EmptyResult()

    server: Server[Any] = Server(
        "sdk-baseline",
        version="0",
        on_list_resources=list_resources,
        on_subscribe_resource=subscribe,
        on_unsubscribe_resource=unsubscribe,
        on_subscriptions_listen=listen,
    )

    async def publish_one(change: dict[str, Any]) -> None:
        uri = change["uri"]
        meta = change.get("meta")
        for session in list(subscribers.get(uri, ())):
            note = types.ResourceUpdatedNotification(
                params=types.ResourceUpdatedNotificationParams(uri=uri, _meta=meta)
            )
            try:
                await session.send_notification(note)
            except Exception:  # a closed session: forget it
                subscribers[uri].discard(session)
        await bus.publish(ResourceUpdated(uri=uri))

    async def changes(request: Request) -> Response:
        body = orjson.loads(await request.body())
        for change in body if isinstance(body, list) else (body,):
            await publish_one(change)
        return Response(status_code=202)

    async def healthz(request: Request) -> Response:
        return PlainTextResponse("ok")

    return server.streamable_http_app(
        event_store=InMemoryEventStore(max_events_per_stream),
        session_idle_timeout=None,
        max_sessions=None,
        custom_starlette_routes=[
            Route("/changes", changes, methods=["POST"]),
            Route("/healthz", healthz, methods=["GET"]),
        ],
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8100)
    ap.add_argument("--max-events-per-stream", type=int, default=100_000)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    uvicorn.run(
        build_app(max_events_per_stream=args.max_events_per_stream),
        host=args.host,
        port=args.port,
        loop="uvloop",
        http="httptools",
        log_level="warning",
        access_log=False,
        backlog=4096,
    )


if __name__ == "__main__":
    main()
