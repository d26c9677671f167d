"""uvicorn's Server, taught to end the broker's streams before it waits for connections to close.

uvicorn waits for every open response to finish before it runs the lifespan shutdown, and
an SSE stream never finishes on its own. So on SIGTERM the broker's streams are ended first:
legacy streams get ``retry:`` and listens their ``complete`` result, then uvicorn drains.

It also tunes the cyclic garbage collector once the app has started. A worker holds many
long-lived objects per open stream, and with CPython's default thresholds full collections
kept running while 10,000 sessions connected and streamed, each one longer than the last:
18 ms, 48 ms ... 538 ms with 10,000 GET streams, stalling every stream for that long (the
p99 of the targeted benchmark was 519 ms). With a first-generation threshold of 50,000,
young objects die before they are promoted, and the same run had no full collection at all.
The objects alive at startup (imports, settings) are frozen out of every later collection.
"""

from __future__ import annotations

import gc
import socket

import uvicorn
from uvicorn.supervisors import multiprocess

from broker.core import RUNNING

__all__ = ["BrokerServer", "run_workers"]


class BrokerServer(uvicorn.Server):
    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        thresholds = [b.settings.gc_thresholds for b in RUNNING]
        if thresholds and thresholds[0]:
            gc.collect()
            gc.freeze()
            gc.set_threshold(*thresholds[0])

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
