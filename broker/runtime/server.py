"""uvicorn's Server, taught to end the broker's streams before it waits for connections to close.

uvicorn waits for every open response to finish before it runs the lifespan shutdown, and
an SSE stream never finishes on its own. So on SIGTERM: ``/readyz`` answers 503 at once, and
for ``MCP_BROKER_READINESS_DELAY`` seconds the worker serves as before while a balancer or
Kubernetes takes it out of rotation; then the broker's streams are ended (legacy streams get
``retry:`` and listens their ``complete`` result), then uvicorn drains, giving open requests
``MCP_BROKER_GRACEFUL_TIMEOUT`` seconds.

Behind a load balancer that keeps connections to the workers open (nginx's upstream
``keepalive``), the side that closes an idle connection must be the balancer: a request it
sends on a connection the worker has just closed fails, and a POST that was sent is never
retried, so the client gets a 502. Two things keep the worker from ever being that side:
its idle timeout (``MCP_BROKER_HTTP_KEEPALIVE_TIMEOUT``) is longer than the balancer's, and on
SIGTERM it drains (``MCP_BROKER_SHUTDOWN_DRAIN`` seconds): it stops accepting, so a new
connection is refused and the balancer sends the request elsewhere, and it keeps answering
requests on the connections already open, each with ``Connection: close``, so the balancer
stops reusing them. Only what is still open at the end of the drain is closed by uvicorn.

It also tunes the cyclic garbage collector once the app has started. A worker holds many
long-lived objects per open stream, and with CPython's default thresholds full collections
kept running while 10,000 sessions connected and streamed, each one longer than the last:
18 ms, 48 ms ... 538 ms with 10,000 GET streams, stalling every stream for that long (the
p99 of the targeted benchmark was 519 ms). With a first-generation threshold of 50,000,
young objects die before they are promoted, and the same run had no full collection at all.
The objects alive at startup (imports, settings) are frozen out of every later collection.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import socket

import uvicorn
from uvicorn.supervisors import multiprocess

from broker.runtime import RUNNING

__all__ = ["BrokerServer", "run_workers", "tune_collector"]

logger = logging.getLogger(__name__)


def tune_collector(thresholds: tuple[int, ...]) -> None:
    """What a worker does to the cyclic garbage collector once its app has started (see above):
    what is alive is frozen out of later collections, and ``thresholds`` (``MCP_BROKER_GC_THRESHOLDS``;
    empty: CPython's own) apply from then on."""
    if thresholds:
        gc.collect()
        gc.freeze()
        gc.set_threshold(*thresholds)


class BrokerServer(uvicorn.Server):
    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        thresholds = [b.settings.gc_thresholds for b in RUNNING]
        if thresholds:
            tune_collector(thresholds[0])

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        brokers = list(RUNNING)
        # Not ready from the first moment: a balancer (or Kubernetes) stops sending new work while
        # everything still works, for ``readiness_delay`` seconds, before anything is cut.
        for broker in brokers:
            broker.health.drain()
        delay = max((b.settings.readiness_delay for b in brokers), default=0.0)
        if delay > 0:
            logger.info("SIGTERM: /readyz answers 503; streams end in %.1fs", delay)
            await self._wait(delay)
        drain = max((b.settings.shutdown_drain for b in brokers), default=0.0)
        if drain > 0:
            self._close_after_each_reply()
        for broker in brokers:
            await broker.end_streams()
        if drain > 0:
            await self._drain(drain)
        await super().shutdown(sockets)

    async def _wait(self, seconds: float) -> None:
        """Sleep ``seconds``, unless a second signal asks for an exit now."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while not self.force_exit and loop.time() < deadline:
            await asyncio.sleep(min(0.05, deadline - loop.time()))

    def _close_after_each_reply(self) -> None:
        """Refuse new connections, and end every open one after its next response."""
        for server in self.servers:
            server.close()  # uvicorn closes them again later; closing twice does nothing
        # uvicorn puts these headers first in every response it starts from now on, and a
        # ``Connection: close`` among them makes it close the connection once the response is
        # sent. The list is replaced, not changed: responses already started keep the old one.
        state = self.server_state
        state.default_headers = [*state.default_headers, (b"connection", b"close")]
        # A request already read but not yet answered keeps the old list: it is told to close
        # too, and says so in its response. One whose response has started is left alone: its
        # headers did not say "close", so closing after it would race the balancer's next
        # request on the connection (a 502); the balancer closes it when idle, or the drain ends.
        for connection in state.connections:
            cycle = getattr(connection, "cycle", None)
            if cycle is not None and not cycle.response_started:
                cycle.keep_alive = False

    async def _drain(self, seconds: float) -> None:
        """Wait until every connection is closed (by its client, or after a response), at most ``seconds``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while self.server_state.connections and not self.force_exit and loop.time() < deadline:
            await asyncio.sleep(0.05)


class _WorkerProcess(multiprocess.Process):
    """A uvicorn worker process that runs a BrokerServer instead of a plain Server."""

    @property
    def server(self) -> uvicorn.Server:
        if self._server is None:
            self._server = BrokerServer(config=self.config)
        return self._server

    def join(self) -> None:
        """Wait for the worker; once it is gone, however it went, its live gauges stop counting."""
        pid = self.pid
        super().join()
        if pid is not None:
            from broker.ops.prometheus import process_exited  # the supervisor's side of the metrics

            process_exited(pid)


class _Supervisor(multiprocess.Multiprocess):
    """uvicorn's supervisor, which lets go of the listening socket as soon as it stops.

    The workers share the socket the supervisor bound, and it listens while any process holds
    it: a worker that drains closes its copy, but the supervisor kept its own until every
    worker had exited. The kernel went on completing connections nobody would accept, and
    reset them at the exit, after a balancer had sent its requests on them (a 502 for a POST).
    With the supervisor's copy closed first, the socket closes when the last worker starts its
    drain, and from then on a connection is refused, which a balancer retries elsewhere.
    """

    def terminate_all(self) -> None:
        for sock in self.sockets:
            sock.close()
        super().terminate_all()


def run_workers(config: uvicorn.Config) -> None:
    """uvicorn's multi-process supervisor with BrokerServer workers.

    The supervisor builds its processes from the module-level name ``Process``; it is pointed
    at the subclass in this (parent) process only. Workers are spawned, and the subclass
    travels to them by pickling, so each worker builds a BrokerServer.
    """
    multiprocess.Process = _WorkerProcess  # type: ignore[misc]
    sock = config.bind_socket()
    _Supervisor(config, sockets=[sock]).run()
