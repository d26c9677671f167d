"""A round-robin reverse proxy for the distributed tier: each HTTP request goes to the next worker.

No stickiness of any kind: two requests on one client connection, or of one MCP session, go
to different workers. Responses stream through unbuffered (SSE), and a client that goes away
closes its upstream request. A worker that refuses the connection is skipped, as a load
balancer's health check would (the request was never sent, so retrying it is safe).

``GET /__proxy/log`` returns, in order, which worker served each request, and
``GET /__proxy/next`` the worker the next request goes to (so a test can steer a request to
another worker by sending others first); every response carries ``x-upstream: <worker index>``.

Run: ``python -m tests.distributed.proxy --port 8000 http://127.0.0.1:8001 http://127.0.0.1:8002``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from typing import Any

import httpx
import orjson
import uvicorn

HOP_BY_HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"te", b"trailer", b"upgrade",
              b"proxy-connection", b"host"}


class RoundRobin:
    def __init__(self, upstreams: list[str]) -> None:
        self.upstreams = upstreams
        self.turn = 0
        self.log: list[dict[str, Any]] = []
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=2.0),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=50))

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await self.client.aclose()
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["path"] in ("/__proxy/log", "/__proxy/next"):
            body = self.log if scope["path"] == "/__proxy/log" else self.turn % len(self.upstreams)
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": orjson.dumps(body)})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in HOP_BY_HOP]
        query = scope.get("query_string", b"").decode()
        target = scope["path"] + ("?" + query if query else "")
        response, index = await self._connect(scope["method"], target, headers, body)
        session = dict(scope["headers"]).get(b"mcp-session-id", b"").decode()
        self.log.append({"method": scope["method"], "path": scope["path"], "session": session,
                         "upstream": index, "status": response.status_code if response else 502,
                         "last_event_id": dict(scope["headers"]).get(b"last-event-id", b"").decode()})
        if response is None:
            await send({"type": "http.response.start", "status": 502, "headers": []})
            await send({"type": "http.response.body", "body": b"no upstream"})
            return
        await self._relay(response, index, receive, send)

    async def _connect(self, method: str, target: str, headers: list[tuple[bytes, bytes]],
                       body: bytes) -> tuple[httpx.Response | None, int]:
        for _ in range(len(self.upstreams)):
            index = self.turn % len(self.upstreams)
            self.turn += 1
            request = self.client.build_request(method, self.upstreams[index] + target, headers=headers,
                                                content=body)
            try:
                return await self.client.send(request, stream=True), index
            except httpx.ConnectError:
                continue  # a dead worker: the request never left, try the next one
            except httpx.HTTPError:
                return None, index  # it died with the request: the client cannot know whether it was served
        return None, -1

    async def _relay(self, response: httpx.Response, index: int, receive: Any, send: Any) -> None:
        headers = [(k, v) for k, v in response.headers.raw if k.lower() not in HOP_BY_HOP]
        headers.append((b"x-upstream", str(index).encode()))
        await send({"type": "http.response.start", "status": response.status_code, "headers": headers})

        async def pump() -> None:
            with contextlib.suppress(httpx.HTTPError):  # a worker that died mid-response ends it here
                async for chunk in response.aiter_raw():
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})

        async def client_gone() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        pumping = asyncio.ensure_future(pump())
        watching = asyncio.ensure_future(client_gone())
        try:
            await asyncio.wait({pumping, watching}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (pumping, watching):
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            await response.aclose()
        with contextlib.suppress(OSError):
            await send({"type": "http.response.body", "body": b"", "more_body": False})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("upstreams", nargs="+")
    args = parser.parse_args()
    uvicorn.run(RoundRobin(args.upstreams), host="127.0.0.1", port=args.port, log_level="warning",
                access_log=False, timeout_graceful_shutdown=1)


if __name__ == "__main__":
    main()
