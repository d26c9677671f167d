"""A subscriber for any MCP server: watch resources and always hold their current content.

>>> async with Watcher("http://127.0.0.1:8080/mcp") as watcher:
...     async for update in watcher.watch(["mcpb://default/products/42"]):
...         print(update.uri, update.text)

Nothing here imports the server (``broker``): the client runs anywhere httpx does.
"""

from broker_client.errors import GaveUp, NotSupported, RpcError, WatchError
from broker_client.watcher import Backoff, Status, Update, Watcher

__all__ = ["Backoff", "GaveUp", "NotSupported", "RpcError", "Status", "Update", "Watcher", "WatchError"]
