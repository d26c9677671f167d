"""Watch a record of a running broker with the official MCP Python SDK (``pip install mcp``).

    make run                      # in one shell
    .venv/bin/python examples/watch.py   # in another: prints a line each time the demo clock ticks
    .venv/bin/python examples/watch.py http://broker.example.com/mcp mcpb://acme/products/42

The first argument is the server's MCP URL (``http://127.0.0.1:8080/mcp`` when none is given),
the second the URI to watch, e.g. ``mcpb://default/products/42``; change it with
``curl -X PUT localhost:8080/collections/products/42 -H 'content-type: application/json' -d '{"price": 3}'``.
"""

from __future__ import annotations

import asyncio
import sys
import warnings

from mcp import types
from mcp.client.client import Client

URL = "http://127.0.0.1:8080/mcp"


async def main(url: str, uri: str) -> None:
    changed = asyncio.Queue[str]()

    async def on_message(message: object) -> None:
        if isinstance(message, types.ResourceUpdatedNotification):
            changed.put_nowait(str(message.params.uri))

    async with Client(url, mode="legacy", message_handler=on_message) as client:
        with warnings.catch_warnings():  # resources/subscribe is deprecated only by the 2026-07-28 era
            warnings.simplefilter("ignore")
            await client.subscribe_resource(uri)
        print(f"subscribed to {uri}; waiting for changes (Ctrl-C to stop)")
        while True:
            await changed.get()
            result = await client.read_resource(uri, cache_mode="bypass")
            content = result.contents[0]
            print(getattr(content, "text", content))


if __name__ == "__main__":
    try:
        args = sys.argv[1:]
        asyncio.run(main(args[0] if args else URL, args[1] if len(args) > 1 else "mcpb://default/demo/clock"))
    except KeyboardInterrupt:
        pass
