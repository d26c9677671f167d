"""A fan-out process: consumers of the change log, without HTTP.

Run it when HTTP workers should not spend CPU on fan-out (``MCP_BROKER_EMBEDDED_FANOUT=false``
on them). Any number of these may run: the change log's consumer group gives each change to
one consumer, each partition of the log is read by one consumer at a time (so a URI's changes
keep their order), and the others stand by: they take a partition over when its holder stops
or dies, with the changes it left pending.
"""

from __future__ import annotations

import asyncio
import logging
import signal

from broker.backends import create_backend
from broker.config import Settings
from broker.fanout import Fanout
from broker.runtime import default_tracer
from broker.runtime.tasks import stop_tasks

__all__ = ["main", "run"]

logger = logging.getLogger(__name__)


async def run(consumers: int = 1, settings: Settings | None = None) -> None:
    settings = settings or Settings()
    backend = create_backend(settings)
    await backend.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    tracer = default_tracer()  # traces of the changes it fans out, with OTEL_EXPORTER_OTLP_ENDPOINT set
    tasks = [asyncio.create_task(Fanout(settings, backend, tracer=tracer).run()) for _ in range(consumers)]
    logger.info("fan-out: %d consumer(s) running", consumers)
    await stop.wait()
    await stop_tasks(tasks)
    await backend.close()
    if tracer is not None:
        await asyncio.to_thread(tracer.close)  # the spans not yet exported leave now


def main(consumers: int = 1) -> int:
    asyncio.run(run(consumers))
    return 0
