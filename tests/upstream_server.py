"""An MCP server built with the official SDK, for the broker to stand in front of (``broker/upstreams``).

Notes ``note://<id>`` are its resources (listed, read, and the template ``note://{id}``), watched in
both eras: ``resources/subscribe`` with the session's GET stream (an event store, so
``Last-Event-ID`` resumes it) and 2026-07-28 ``subscriptions/listen`` through the stock
``ListenHandler``. Tools: ``set_note(id, text)`` (changes a note and tells its watchers; a new
note also changes the resource list), ``slow(seconds)`` (progress each tenth of the way when the
caller gave a progress token; a cancelled call is recorded) and ``echo_meta()`` (the ``_meta`` it
was sent). A prompt ``greet(name)`` whose argument completes from a few names.

Side doors a test drives, outside MCP:

* ``GET /stats``: what it saw: each request's method, path and headers, the GET streams and
  listens open now, the watchers of each note, the calls cancelled;
* ``PUT /notes/{id}`` ``{"text": ...}``: what ``set_note`` does, without a session;
* ``POST /streams/drop`` ``{"hold": bool}``: close every session's GET stream (the session and
  the events stored for it stay); ``hold`` answers new GETs 503 until ``POST /streams/release``;
* ``PUT /tokens`` ``{"tokens": [...]}``: the bearer tokens accepted from now on.

Run: ``python -m tests.upstream_server --port N`` with ``--token T`` (repeatable: requests must
carry ``Authorization: Bearer T``), ``--issuer URL`` (also accept the JWTs of that authorization
server whose audience is this server's MCP URL; its protected resource metadata names it) and
``--era legacy`` (refuse 2026-07-28, as a server of the 2025 protocol does). ``--stdio``: MCP on
stdin and stdout instead, the side doors still on ``--port`` (``/stats`` names the process's pid).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import deque
from typing import Any

import anyio
import jwt
import mcp_types as types
import orjson
import uvicorn
from mcp.server.lowlevel import Server
from mcp.server.session import ServerSession
from mcp.server.stdio import stdio_server
from mcp.server.subscriptions import (
    InMemorySubscriptionBus,
    ListenHandler,
    ResourcesListChanged,
    ResourceUpdated,
)
from mcp.shared.exceptions import MCPError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from bench.sdk_server import InMemoryEventStore

#: The protocol versions of the initialize handshake; a legacy-only server refuses any other.
HANDSHAKE_VERSIONS = frozenset({"2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25"})
NAMES = ("Ada", "Alan", "Alonzo", "Grace", "Barbara")
TOOLS = [
    types.Tool(name="set_note", description="Write a note", input_schema={
        "type": "object", "properties": {"id": {"type": "string"}, "text": {"type": "string"}},
        "required": ["id", "text"]}),
    types.Tool(name="slow", description="Take a while, reporting progress", input_schema={
        "type": "object", "properties": {"seconds": {"type": "number"}}, "required": ["seconds"]}),
    types.Tool(name="echo_meta", description="The _meta this call carried",
               input_schema={"type": "object", "properties": {}}),
]


class Upstream:
    """The SDK server, its notes and what it saw."""

    def __init__(self, *, tokens: list[str], issuer: str | None, legacy_only: bool, base: str) -> None:
        self.base = base
        self.tokens = set(tokens)
        self.issuer = issuer
        self.legacy_only = legacy_only
        self.keys = jwt.PyJWKClient(issuer + "/jwks") if issuer else None
        self.notes: dict[str, str] = {"1": "one", "2": "two"}
        #: Legacy watchers: URI -> session id -> the session to notify.
        self.watchers: dict[str, dict[str, ServerSession]] = {}
        #: Sessions that watched anything, told of list changes; and how to close their GET streams.
        self.sessions: dict[str, ServerSession] = {}
        self.closers: dict[str, Any] = {}
        self.requests: deque[dict[str, Any]] = deque(maxlen=2000)
        self.cancelled: list[dict[str, Any]] = []
        self.get_streams = 0
        self.listens: dict[int, list[str]] = {}
        self.hold = False
        self.bus = InMemorySubscriptionBus()
        self.listen = ListenHandler(self.bus, max_subscriptions=1000, max_buffered_events=1024)
        self.server: Server[Any] = Server(
            "upstream", version="1.0", instructions="Notes, for the broker to stand in front of.",
            on_list_resources=self._list, on_list_resource_templates=self._templates, on_read_resource=self._read,
            on_subscribe_resource=self._subscribe, on_unsubscribe_resource=self._unsubscribe,
            on_subscriptions_listen=self._listen, on_list_tools=self._tools, on_call_tool=self._call,
            on_list_prompts=self._prompts, on_get_prompt=self._prompt, on_completion=self._complete)

    # -- MCP -----------------------------------------------------------------------------------
    async def _list(self, ctx: Any, params: Any) -> types.ListResourcesResult:
        return types.ListResourcesResult(resources=[types.Resource(uri=f"note://{key}", name=f"note {key}",
                                                                   mime_type="text/plain") for key in self.notes])

    async def _templates(self, ctx: Any, params: Any) -> types.ListResourceTemplatesResult:
        return types.ListResourceTemplatesResult(resource_templates=[
            types.ResourceTemplate(name="note", uri_template="note://{id}", mime_type="text/plain")])

    async def _read(self, ctx: Any, params: types.ReadResourceRequestParams) -> types.ReadResourceResult:
        uri = str(params.uri)
        key = uri.removeprefix("note://")
        if not uri.startswith("note://") or key not in self.notes:
            raise MCPError(-32002, f"Resource not found: {uri}", {"uri": uri})
        return types.ReadResourceResult(contents=[types.TextResourceContents(uri=uri, text=self.notes[key],
                                                                             mime_type="text/plain")])

    @staticmethod
    def _session_id(ctx: Any) -> str:
        request = ctx.request
        return str(request.headers.get("mcp-session-id", "")) if request is not None else ""

    async def _subscribe(self, ctx: Any, params: types.SubscribeRequestParams) -> types.EmptyResult:
        session_id = self._session_id(ctx)
        self.watchers.setdefault(str(params.uri), {})[session_id] = ctx.session
        self.sessions[session_id] = ctx.session
        if ctx.close_standalone_sse_stream is not None:
            self.closers[session_id] = ctx.close_standalone_sse_stream
        return types.EmptyResult()

    async def _unsubscribe(self, ctx: Any, params: types.UnsubscribeRequestParams) -> types.EmptyResult:
        self.watchers.get(str(params.uri), {}).pop(self._session_id(ctx), None)
        return types.EmptyResult()

    async def _listen(self, ctx: Any, params: types.SubscriptionsListenRequestParams) -> Any:
        key = id(ctx)
        self.listens[key] = list(params.notifications.resource_subscriptions or ())
        try:
            return await self.listen(ctx, params)
        finally:
            del self.listens[key]

    async def _tools(self, ctx: Any, params: Any) -> types.ListToolsResult:
        return types.ListToolsResult(tools=TOOLS)

    async def _call(self, ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        arguments = params.arguments or {}
        if params.name == "set_note":
            await self.set_note(str(arguments["id"]), str(arguments["text"]))
            return _text(f"note://{arguments['id']} set")
        if params.name == "echo_meta":
            meta = dict(params.meta or {})
            return types.CallToolResult(content=[types.TextContent(type="text", text=orjson.dumps(meta).decode())],
                                        structured_content={"meta": meta})
        if params.name == "slow":
            return await self._slow(ctx, float(arguments.get("seconds", 1)))
        raise MCPError(-32602, f"Unknown tool: {params.name}")

    async def _slow(self, ctx: Any, seconds: float) -> types.CallToolResult:
        try:
            for step in range(1, 11):
                await anyio.sleep(seconds / 10)
                await ctx.session.report_progress(step, 10, f"step {step}")
        except anyio.get_cancelled_exc_class():
            self.cancelled.append({"request_id": ctx.request_id, "session": self._session_id(ctx)})
            raise
        return _text(f"slept {seconds}")

    async def _prompts(self, ctx: Any, params: Any) -> types.ListPromptsResult:
        return types.ListPromptsResult(prompts=[types.Prompt(name="greet", description="A greeting", arguments=[
            types.PromptArgument(name="name", required=True)])])

    async def _prompt(self, ctx: Any, params: types.GetPromptRequestParams) -> types.GetPromptResult:
        if params.name != "greet":
            raise MCPError(-32602, f"Unknown prompt: {params.name}")
        name = (params.arguments or {}).get("name", "you")
        return types.GetPromptResult(description="A greeting", messages=[
            types.PromptMessage(role="user", content=types.TextContent(type="text", text=f"Hello, {name}!"))])

    async def _complete(self, ctx: Any, params: types.CompleteRequestParams) -> types.CompleteResult:
        typed = params.argument.value
        values = [name for name in NAMES if name.lower().startswith(typed.lower())]
        return types.CompleteResult(completion=types.Completion(values=values, total=len(values), has_more=False))

    async def set_note(self, key: str, text: str) -> None:
        uri, new = f"note://{key}", key not in self.notes
        self.notes[key] = text
        for session_id, session in list(self.watchers.get(uri, {}).items()):
            try:
                await session.send_resource_updated(uri)
            except Exception:  # a session that ended: forget it
                self.watchers[uri].pop(session_id, None)
        await self.bus.publish(ResourceUpdated(uri=uri))
        if new:
            for session in list(self.sessions.values()):
                try:
                    await session.send_resource_list_changed()
                except Exception:
                    continue
            await self.bus.publish(ResourcesListChanged())

    # -- side doors ------------------------------------------------------------------------------
    async def stats(self, request: Request) -> Response:
        return JSONResponse({
            "requests": list(self.requests), "get_streams": self.get_streams, "listens": len(self.listens),
            "listening": sorted(uri for uris in self.listens.values() for uri in uris),
            "watchers": {uri: len(sessions) for uri, sessions in self.watchers.items() if sessions},
            "cancelled": self.cancelled, "notes": self.notes, "pid": os.getpid(),
        })

    async def put_note(self, request: Request) -> Response:
        await self.set_note(request.path_params["key"], str(orjson.loads(await request.body())["text"]))
        return Response(status_code=204)

    async def drop_streams(self, request: Request) -> Response:
        self.hold = bool(orjson.loads(await request.body() or b"{}").get("hold", False))
        for close in list(self.closers.values()):
            await close()
        return Response(status_code=204)

    async def release_streams(self, request: Request) -> Response:
        self.hold = False
        return Response(status_code=204)

    async def put_tokens(self, request: Request) -> Response:
        self.tokens = set(orjson.loads(await request.body())["tokens"])
        return Response(status_code=204)

    async def resource_metadata(self, request: Request) -> Response:
        return JSONResponse({"resource": self.base + "/mcp", "authorization_servers": [self.issuer],
                             "bearer_methods_supported": ["header"]})

    def routes(self) -> list[Route]:
        async def healthz(request: Request) -> Response:
            return PlainTextResponse("ok")

        routes = [Route("/healthz", healthz), Route("/stats", self.stats),
                  Route("/notes/{key}", self.put_note, methods=["PUT"]),
                  Route("/streams/drop", self.drop_streams, methods=["POST"]),
                  Route("/streams/release", self.release_streams, methods=["POST"]),
                  Route("/tokens", self.put_tokens, methods=["PUT"])]
        if self.issuer:
            routes.append(Route("/.well-known/oauth-protected-resource/mcp", self.resource_metadata))
        return routes

    def app(self) -> ASGIApp:
        inner = self.server.streamable_http_app(event_store=InMemoryEventStore(10_000), session_idle_timeout=None,
                                                custom_starlette_routes=self.routes())
        return _Gate(self, inner)

    def authorized(self, value: str) -> bool:
        scheme, _, token = value.partition(" ")
        if scheme.lower() != "bearer" or not token:
            return False
        if token in self.tokens:
            return True
        if self.keys is None:
            return False
        try:
            key = self.keys.get_signing_key_from_jwt(token)
            jwt.decode(token, key.key, algorithms=["RS256", "ES256"], audience=self.base + "/mcp", issuer=self.issuer)
        except jwt.PyJWTError:
            return False
        return True


class _Gate:
    """Before the SDK: records each request, counts GET streams, and refuses what the flags say."""

    def __init__(self, upstream: Upstream, app: ASGIApp) -> None:
        self.upstream = upstream
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != "/mcp":
            await self.app(scope, receive, send)
            return
        up = self.upstream
        headers = {name.decode("latin-1"): value.decode("latin-1") for name, value in scope["headers"]}
        up.requests.append({"method": scope["method"], "headers": headers})
        if (up.tokens or up.keys is not None) and not up.authorized(headers.get("authorization", "")):
            challenge = f'Bearer resource_metadata="{up.base}/.well-known/oauth-protected-resource/mcp"'
            await JSONResponse({"error": "invalid_token"}, 401, {"WWW-Authenticate": challenge})(scope, receive, send)
            return
        version = headers.get("mcp-protocol-version")
        if up.legacy_only and version is not None and version not in HANDSHAKE_VERSIONS:
            body = {"jsonrpc": "2.0", "id": None,
                    "error": {"code": -32600, "message": "Bad Request: Unsupported protocol version"}}
            await JSONResponse(body, 400)(scope, receive, send)
            return
        if scope["method"] != "GET":
            await self.app(scope, receive, send)
            return
        if up.hold:
            await PlainTextResponse("held", 503)(scope, receive, send)
            return
        up.get_streams += 1
        try:
            await self.app(scope, receive, send)
        finally:
            up.get_streams -= 1


def _text(text: str) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)])


async def _serve_stdio(upstream: Upstream, port: int) -> None:
    side = uvicorn.Server(uvicorn.Config(Starlette(routes=upstream.routes()), host="127.0.0.1", port=port,
                                         log_level="warning", access_log=False))
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(side.serve)
        async with stdio_server() as (read, write):
            await upstream.server.run(read, write, upstream.server.create_initialization_options())
        side.should_exit = True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token", action="append", default=[], help="a bearer token to require (repeatable)")
    parser.add_argument("--issuer", help="also accept this authorization server's JWTs")
    parser.add_argument("--era", choices=["both", "legacy"], default="both")
    parser.add_argument("--stdio", action="store_true", help="MCP on stdin and stdout")
    args = parser.parse_args()
    upstream = Upstream(tokens=args.token, issuer=args.issuer, legacy_only=args.era == "legacy",
                        base=f"http://127.0.0.1:{args.port}")
    if args.stdio:
        anyio.run(_serve_stdio, upstream, args.port)
        sys.exit(0)
    uvicorn.run(upstream.app(), host="127.0.0.1", port=args.port, log_level="warning", access_log=False,
                timeout_graceful_shutdown=1)


if __name__ == "__main__":
    main()
