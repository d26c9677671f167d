"""The official SDK server of ``bench/sdk_server.py``, given resources to read, for the client tier.

The bench server subscribes and notifies but serves no ``resources/read``; a watcher needs one.
This one keeps a text per URI: ``PUT /content`` with ``{"uri": …, "text": …}`` stores it and
notifies (legacy subscribers on their GET stream, listens through the stock ``ListenHandler``).
Everything else is the stock SDK: its session manager, event store replay and ``server/discover``.

Run: ``python -m tests.client.sdk_target --port 8100`` (Streamable HTTP), or ``--stdio`` (MCP on
stdin/stdout, with ``PUT /content`` still served on ``--port`` so a test can change the data);
``--no-subscribe`` leaves out subscriptions, for a server that cannot notify.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import anyio
import mcp_types as types
import orjson
import uvicorn
from mcp.server.lowlevel import Server
from mcp.server.session import ServerSession
from mcp.server.stdio import stdio_server
from mcp.server.subscriptions import InMemorySubscriptionBus, ListenHandler, ResourceUpdated
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from bench.sdk_server import InMemoryEventStore


class Target:
    """The SDK server and the texts it serves."""

    def __init__(self, *, subscribe: bool = True) -> None:
        self.texts: dict[str, str] = {}
        self.subscribers: dict[str, set[ServerSession]] = {}
        self.bus = InMemorySubscriptionBus()
        watch: dict[str, Any] = {
            "on_subscribe_resource": self._subscribe, "on_unsubscribe_resource": self._unsubscribe,
            "on_subscriptions_listen": ListenHandler(self.bus, max_subscriptions=1000, max_buffered_events=1024),
        } if subscribe else {}
        self.server: Server[Any] = Server("sdk-target", version="0", on_list_resources=self._list,
                                          on_read_resource=self._read, **watch)

    async def _list(self, ctx: Any, params: Any) -> types.ListResourcesResult:
        return types.ListResourcesResult(resources=[types.Resource(uri=uri, name=uri) for uri in self.texts])

    async def _read(self, ctx: Any, params: types.ReadResourceRequestParams) -> types.ReadResourceResult:
        uri = str(params.uri)
        if uri not in self.texts:
            raise ValueError(f"Resource not found: {uri}")
        return types.ReadResourceResult(contents=[types.TextResourceContents(uri=uri, text=self.texts[uri])])

    async def _subscribe(self, ctx: Any, params: types.SubscribeRequestParams) -> types.EmptyResult:
        self.subscribers.setdefault(str(params.uri), set()).add(ctx.session)
        return types.EmptyResult()

    async def _unsubscribe(self, ctx: Any, params: types.UnsubscribeRequestParams) -> types.EmptyResult:
        self.subscribers.get(str(params.uri), set()).discard(ctx.session)
        return types.EmptyResult()

    async def put(self, request: Request) -> Response:
        body = orjson.loads(await request.body())
        uri = body["uri"]
        self.texts[uri] = body["text"]
        for session in list(self.subscribers.get(uri, ())):
            note = types.ResourceUpdatedNotification(params=types.ResourceUpdatedNotificationParams(uri=uri))
            try:
                await session.send_notification(note)
            except Exception:  # a closed session: forget it
                self.subscribers[uri].discard(session)
        await self.bus.publish(ResourceUpdated(uri=uri))
        return Response(status_code=204)

    def routes(self) -> list[Route]:
        async def healthz(request: Request) -> Response:
            return PlainTextResponse("ok")

        return [Route("/content", self.put, methods=["PUT"]), Route("/healthz", healthz, methods=["GET"])]

    def http_app(self) -> Starlette:
        return self.server.streamable_http_app(event_store=InMemoryEventStore(10_000), session_idle_timeout=None,
                                               custom_starlette_routes=self.routes())


async def _serve_stdio(target: Target, port: int) -> None:
    side = uvicorn.Server(uvicorn.Config(Starlette(routes=target.routes()), host="127.0.0.1", port=port,
                                         log_level="warning", access_log=False))
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(side.serve)
        async with stdio_server() as (read, write):
            await target.server.run(read, write, target.server.create_initialization_options())
        side.should_exit = True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--stdio", action="store_true")
    parser.add_argument("--no-subscribe", action="store_true", help="a server that cannot notify")
    args = parser.parse_args()
    target = Target(subscribe=not args.no_subscribe)
    if args.stdio:
        anyio.run(_serve_stdio, target, args.port)
        sys.exit(0)
    uvicorn.run(target.http_app(), host="127.0.0.1", port=args.port, log_level="warning", access_log=False,
                timeout_graceful_shutdown=1)


if __name__ == "__main__":
    main()
