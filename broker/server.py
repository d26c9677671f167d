"""uvicorn's Server, taught to end the broker's streams before it waits for connections to close.

uvicorn waits for every open response to finish before it runs the lifespan shutdown, and
an SSE stream never finishes on its own. So on SIGTERM the broker's streams are ended first:
legacy streams get ``retry:`` and listens their ``complete`` result, then uvicorn drains.
"""

from __future__ import annotations

import socket

import uvicorn
from uvicorn.supervisors import multiprocess

from broker.core import RUNNING

__all__ = ["BrokerServer", "run_workers"]


class BrokerServer(uvicorn.Server):
    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for broker in list(RUNNING):
            await broker.hub.shutdown()
        await super().shutdown(sockets)


class _WorkerProcess(multiprocess.Process):
    """A uvicorn worker process that runs a BrokerServer instead of a plain Server."""

    @property
    def server(self) -> uvicorn.Server:
        if self._server is None:
            self._server = BrokerServer(config=self.config)
        return self._server


def run_workers(config: uvicorn.Config) -> None:
    """uvicorn's multi-process supervisor with BrokerServer workers.

    The supervisor builds its processes from the module-level name ``Process``; it is pointed
    at the subclass in this (parent) process only. Workers are spawned, and the subclass
    travels to them by pickling, so each worker builds a BrokerServer.
    """
    multiprocess.Process = _WorkerProcess  # type: ignore[misc]
    sock = config.bind_socket()
    multiprocess.Multiprocess(config, sockets=[sock]).run()
