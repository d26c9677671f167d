"""mcp-broker inside an existing FastAPI or Starlette app, in one call: ``mount_broker(app, "/broker")``.

Mounting the ASGI app alone (``app.mount("/broker", create_app())``) is not enough, for two
reasons ``mount_broker`` takes care of:

* **Lifespan.** Starlette runs only the host's lifespan, never a mounted app's, so the broker
  would never start. ``mount_broker`` wraps the host router's ``lifespan_context`` so that the
  broker starts before the host's own startup code (which may then publish) and stops after
  its shutdown. With a server or framework where that cannot be done, enter
  ``broker_lifespan(broker)`` in the host's lifespan yourself. A broker that is not running
  answers every request 503 (``BrokerApp._not_started``), with an ERROR line once.
* **Shutdown under the host's server.** ``mcp-broker serve`` runs ``BrokerServer``, which ends
  the SSE streams (``retry:``, the listens' ``complete``) when SIGTERM arrives. A plain
  ``uvicorn.run(host_app)`` sets ``should_exit`` on SIGTERM, stops accepting and then waits for
  every open response to finish, and runs the lifespan shutdown only after that: an SSE stream
  never finishes by itself, so without help the process hangs until every client leaves. So
  ``broker_lifespan`` finds the running ``uvicorn.Server`` (see ``running_uvicorn``) and watches
  its ``should_exit`` flag (every ``EXIT_POLL`` seconds): once it is set, ``/readyz`` answers 503
  and the broker ends its streams, which lets uvicorn's wait end. Polling the flag, rather than
  replacing uvicorn's signal handler, works for every way uvicorn is asked to stop (SIGTERM,
  SIGINT, ``server.should_exit = True`` in code) and leaves its handler, and its re-raising of
  the signal at exit, untouched. Under another server, call ``await broker.end_streams()``
  when it begins to stop.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import uvicorn
from starlette.applications import Starlette

from broker.config import Settings
from broker.ops import logs
from broker.resources.base import ResourceProvider
from broker.runtime import Broker
from broker.runtime.app import BrokerApp, create_app
from broker.runtime.server import BrokerServer
from broker.runtime.tasks import stop_tasks

__all__ = ["broker_lifespan", "mount_broker", "running_uvicorn"]

logger = logging.getLogger(__name__)


#: Seconds between two looks at the running uvicorn server's ``should_exit``.
EXIT_POLL = 0.1


def mount_broker(app: Starlette, path: str = "/broker", *, settings: Settings | None = None,
                 broker: Broker | None = None,
                 resources: ResourceProvider | Sequence[ResourceProvider] = ()) -> BrokerApp:
    """Serve a broker (``broker``, or a new one from ``settings``) under ``path`` of ``app``, started
    and stopped with ``app``'s lifespan. Returns the mounted app; its broker is ``.broker``
    (``register``, ``extend``, ``publish``).

    ``resources``: a ``ResourceSet`` (``broker.resources``), or any provider, or a list of them,
    registered with the broker (``broker.register``): they answer before the record collections,
    the first given first.

    ``/mcp``, ``/changes``, ``/collections/...`` and the probes answer under ``path``
    (``/broker/mcp``). Give the host its own lifespan before this call (``FastAPI(lifespan=...)``):
    this call wraps ``app.router.lifespan_context`` as it is then.
    """
    mounted = create_app(settings, broker)
    providers = list(resources) if isinstance(resources, Sequence) else [resources]
    for provider in reversed(providers):  # each registered answers first: the first given ends up first
        mounted.broker.register(provider)
    app.mount(path.rstrip("/"), mounted)
    host_lifespan: Callable[[Any], AbstractAsyncContextManager[Any]] = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(host: Any) -> AsyncIterator[Any]:
        async with broker_lifespan(mounted.broker), host_lifespan(host) as state:
            yield state

    app.router.lifespan_context = lifespan
    return mounted


@asynccontextmanager
async def broker_lifespan(broker: Broker) -> AsyncIterator[Broker]:
    """Start ``broker``, and stop it at exit; meanwhile, end its streams as soon as the uvicorn server
    running this process is asked to stop (module docstring)."""
    logger.info(logs.startup_line(broker.settings))
    await broker.start()
    tasks: list[asyncio.Task[None]] = []
    server = running_uvicorn()
    if server is not None and not isinstance(server, BrokerServer):  # BrokerServer ends the streams itself
        tasks.append(asyncio.create_task(_end_streams_on_exit(server, broker), name="broker-exit-watch"))
    elif server is None:
        logger.debug("no uvicorn server found: call broker.end_streams() when the server begins to stop")
    try:
        yield broker
    finally:
        await stop_tasks(tasks)
        await broker.stop()


async def _end_streams_on_exit(server: uvicorn.Server, broker: Broker) -> None:
    while not server.should_exit:
        await asyncio.sleep(EXIT_POLL)
    broker.health.drain()  # /readyz: 503 from the first moment
    delay = broker.settings.readiness_delay
    if delay > 0:
        logger.info("stopping: /readyz answers 503; streams end in %.1fs", delay)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + delay
        while not server.force_exit and loop.time() < deadline:
            await asyncio.sleep(min(EXIT_POLL, deadline - loop.time()))
    logger.info("stopping: ending the broker's streams (retry: / complete)")
    await broker.end_streams()


def running_uvicorn() -> uvicorn.Server | None:
    """The ``uvicorn.Server`` serving this event loop, if one does.

    Two ways, the first that finds it: uvicorn (in the main thread) installs its bound
    ``Server.handle_exit`` as the SIGTERM and SIGINT handler while it serves; and
    ``uvicorn.run`` and ``Server.serve`` run as a task whose coroutine (or one it awaits) is
    ``Server.serve`` / ``Server._serve``, with the server as ``self`` (also in another thread).
    """
    for sig in (signal.SIGTERM, signal.SIGINT):
        owner = getattr(signal.getsignal(sig), "__self__", None)
        if isinstance(owner, uvicorn.Server):
            return owner
    try:
        tasks = asyncio.all_tasks()
    except RuntimeError:
        return None
    for task in tasks:
        coro: Any = task.get_coro()
        for _ in range(8):  # the chain of awaited coroutines: serve -> _serve -> ...
            frame = getattr(coro, "cr_frame", None)
            owner = frame.f_locals.get("self") if frame is not None else None
            if isinstance(owner, uvicorn.Server):
                return owner
            coro = getattr(coro, "cr_await", None)
            if coro is None:
                break
    return None
