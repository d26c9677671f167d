"""Stopping background tasks: cancel, wait in rounds, and say which would not end."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection
from typing import Any, Final

__all__ = ["stop_tasks"]

logger = logging.getLogger(__name__)

#: Rounds of cancel-and-wait (a second each) before shutdown gives up on a task that will not end.
STOP_ATTEMPTS: Final = 5


async def stop_tasks(tasks: Collection[asyncio.Task[Any]]) -> None:
    """Cancel ``tasks`` and wait for them, in rounds; log any that failed or would not end.

    A task that died of its own error must not keep the backend open, and one that did not end
    when cancelled (see ``broker.errors.raise_if_cancelled``) must not keep the process from exiting.
    """
    running = set(tasks)
    for _ in range(STOP_ATTEMPTS):
        if not running:
            break
        for task in running:
            task.cancel()
        _, running = await asyncio.wait(running, timeout=1.0)
    if running:
        logger.error("tasks still running at shutdown: %s", ", ".join(t.get_name() for t in running))
    for task in tasks:
        if task.done() and not task.cancelled() and task.exception() is not None:
            logger.error("task %s had failed", task.get_name(), exc_info=task.exception())
