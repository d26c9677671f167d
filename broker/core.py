"""The Broker: one object per process that wires the backend, resources, delivery and fan-out."""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Collection
from typing import Any

from broker import __version__
from broker.backends import Backend, create_backend
from broker.changes import ChangeKind, ChangeRules, InvalidChange
from broker.config import Settings
from broker.errors import BackendUnavailable, raise_if_cancelled
from broker.fanout import Fanout
from broker.hub import Hub
from broker.methods import Methods
from broker.protocol.messages import SERVER_INFO_KEY
from broker.resources.base import ResourceProvider, Resources
from broker.resources.records import RecordsProvider, RecordStore
from broker.sessions import Sessions
from broker.tenants import tenant_problem

__all__ = ["RUNNING", "Broker"]

logger = logging.getLogger(__name__)

#: Rounds of cancel-and-wait (a second each) before shutdown gives up on a task that will not end.
STOP_ATTEMPTS = 5


async def stop_tasks(tasks: Collection[asyncio.Task[Any]]) -> None:
    """Cancel ``tasks`` and wait for them, in rounds; log any that failed or would not end.

    A task that died of its own error must not keep the backend open, and one that did not end
    when cancelled (see ``raise_if_cancelled``) must not keep the process from exiting.
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

#: Brokers started in this process, so the server can end their streams on SIGTERM.
RUNNING: weakref.WeakSet[Broker] = weakref.WeakSet()


class Broker:
    """Everything a worker process runs, minus the transports.

    ``start`` brings up the backend, the delivery hub and (by default) an embedded fan-out
    consumer; ``stop`` ends every stream gracefully and releases the backend.
    """

    def __init__(self, settings: Settings | None = None, backend: Backend | None = None) -> None:
        self.settings = settings or Settings()
        self.backend = backend or create_backend(self.settings)
        self.server_info = {"name": self.settings.server_name, "version": __version__}
        self.resources = Resources([RecordsProvider(self.backend)])
        self.rules = ChangeRules.from_settings(self.settings)
        self.records = RecordStore(self.backend, self.settings, self.rules)
        self.sessions = Sessions(self.settings, self.backend)
        self.hub = Hub(self.settings, self.backend, {SERVER_INFO_KEY: self.server_info})
        self.methods = Methods(self)
        self.fanout: Fanout | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.started = False

    def register(self, provider: ResourceProvider) -> None:
        """Add a custom resource provider; it answers before the built-in record collections."""
        self.resources.providers.insert(0, provider)

    async def publish(self, uri: str, kind: ChangeKind = ChangeKind.UPDATED, *, tenant: str | None = None,
                      meta: dict[str, Any] | None = None) -> str:
        """Append a change to the change log; returns its id.

        Raises:
            InvalidChange: the change breaks ``ChangeRules`` (a URI or ``meta`` that could not be
                delivered, a record URI of another tenant, a tenant name that is not one).
            QuotaExceeded: the tenant has ``changelog_tenant_max`` changes not yet fanned out
                (the change was refused; publish again later).
            LogFull: its partition of the change log holds ``changelog_maxlen`` changes not yet
                fanned out (refused; publish again later).
            BackendUnavailable: the change could not be stored (it was not accepted).
        """
        tenant = self.settings.default_tenant if tenant is None else tenant
        if (problem := tenant_problem(tenant)) is not None:
            raise InvalidChange(problem)
        return await self.backend.publish(self.rules.change(tenant, uri, kind, meta))

    async def start(self) -> None:
        await self.backend.start()
        await self.hub.start()
        if self.settings.embedded_fanout:
            self.fanout = Fanout(self.settings, self.backend)
            self._tasks.append(asyncio.create_task(self.fanout.run(), name="fanout"))
        self._tasks.append(asyncio.create_task(self._expire_loop(), name="session-expiry"))
        if self.settings.demo:
            from broker.demo import demo_provider, run_demo

            self.register(demo_provider())
            self._tasks.append(asyncio.create_task(run_demo(self), name="demo"))
        self.started = True
        RUNNING.add(self)

    async def stop(self) -> None:
        RUNNING.discard(self)
        await self.hub.shutdown()
        await stop_tasks(self._tasks)
        self._tasks.clear()
        await self.backend.close()
        self.started = False

    async def _expire_loop(self) -> None:
        interval = max(min(self.settings.session_ttl / 4, 60.0), 0.05)
        while True:
            await asyncio.sleep(interval)
            try:
                expired = await self.backend.expire_sessions()
                if expired:
                    logger.info("expired %d idle sessions", expired)
            except Exception as exc:  # the loop's boundary: expiry must go on after any one failure
                raise_if_cancelled()
                if isinstance(exc, BackendUnavailable):
                    logger.warning("session expiry skipped: backend unavailable")
                else:
                    logger.exception("session expiry failed")
