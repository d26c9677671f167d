"""The Broker: one object per process that builds the backend, the services and the seams, and runs them.

This is the only module that knows every part: it makes the backend (``broker.backends``),
hands each service the stores it uses, and gives the transports the services they serve
(``dispatcher``, ``publisher``, ``records``, ``health``, ``authenticator``). Nothing it builds
reaches back into it. The three seams are set here:

* ``authenticator``: who a request is (``broker.auth``); static API keys by default;
* ``add_source``: code that publishes changes of data elsewhere (``broker.sources``);
* ``metrics``: where counters, gauges and histograms go (``broker.metrics``): Prometheus
  (``broker.ops.prometheus``) unless ``MCP_BROKER_METRICS=false``, then none (``NO_METRICS``, which
  also takes no sample: the session count is never made for it).
"""

from __future__ import annotations

import asyncio
import logging
import os
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from broker import __version__
from broker.auth import Authenticator, Lifecycle, authenticator_for
from broker.auth.keys import KeyAdmin, StoredKeys
from broker.backends import Backend, create_backend
from broker.backends.base import SubscriptionIndex
from broker.changes import ChangeKind, ChangeRules
from broker.config import Settings
from broker.delivery import Hub, ListenIndex, StreamMetrics, Streams
from broker.dispatch import Dispatcher
from broker.errors import BackendUnavailable, raise_if_cancelled
from broker.events.service import Events
from broker.fanout import Fanout
from broker.feeds.listen import ResumableListens
from broker.feeds.service import Feeds
from broker.feeds.session import SessionServices
from broker.methods import Methods
from broker.metrics import NO_METRICS, Instruments, Metrics, TenantCounter, TenantLabels, complete
from broker.ops.console import Console
from broker.ops.health import Health
from broker.ops.tracing import Tracer, enabled
from broker.protocol.messages import SERVER_INFO_KEY
from broker.publisher import Publisher
from broker.quotas import Quotas, TenantQuotas, tenant_share
from broker.resources.base import ClosingProvider, PublishingProvider, ResourceProvider, Resources
from broker.resources.records import Records, RecordsProvider
from broker.runtime.tasks import stop_tasks
from broker.sources import ChangeSource, Extension, SourceRunner
from broker.upstreams.demand import Wants, WatchSource
from broker.upstreams.provider import UpstreamProvider
from broker.upstreams.service import Upstreams

__all__ = ["RUNNING", "Broker"]

logger = logging.getLogger(__name__)

#: Brokers started in this process, so the server can end their streams on SIGTERM.
RUNNING: weakref.WeakSet[Broker] = weakref.WeakSet()

#: Seconds between two counts of the deployment's live sessions and feeds (``mcp_broker_sessions_open``,
#: ``mcp_broker_feeds_open``).
SESSIONS_COUNT_INTERVAL = 5.0


def extension_builders(settings: Settings) -> list[Callable[[Settings], Extension]]:
    """The extensions the settings turn on, each built from the settings (imported only when used)."""
    builders: list[Callable[[Settings], Extension]] = []
    if settings.file_roots:
        from broker.sources.filewatch import build as files

        builders.append(files)
    if settings.postgres_url:
        from broker.sources.postgres import build as postgres

        builders.append(postgres)
    if settings.providers:
        from broker.sources.extensions import build as custom

        builders.append(custom)
    return builders


def default_metrics(settings: Settings) -> Metrics:
    """The binding a Broker uses when it is given none: Prometheus, unless ``settings.metrics`` is off."""
    if not settings.metrics:
        return NO_METRICS
    from broker.ops.prometheus import PrometheusMetrics  # imported only when used: prometheus_client is not small

    return PrometheusMetrics()


def _cards_dir() -> str | None:
    """Where the workers of ``serve --workers N`` leave their console cards: the metrics directory they share."""
    from broker.ops.prometheus import multiprocess_dir  # the directory's owner; prometheus_client is a dependency

    return multiprocess_dir()


def default_tracer() -> Tracer | None:
    """The tracer a Broker uses when it is given none: OpenTelemetry over OTLP/HTTP when the standard
    variables ask for it (``broker.ops.tracing.enabled``), else None, and OpenTelemetry is never imported."""
    if not enabled(os.environ):
        return None
    from broker.ops.otel import OtelTracer  # the [tracing] extra: opentelemetry-sdk and its OTLP/HTTP exporter

    return OtelTracer(__version__)


class CountedSubscriptions:
    """The subscription index as the MCP methods use it, counting each subscription made per tenant.

    Only the methods get it: fan-out and streams use the index itself, with nothing in between.
    Without metrics the count is a call that does nothing, once per subscribe.
    """

    def __init__(self, index: SubscriptionIndex, made: TenantCounter) -> None:
        self.index = index
        self._made = made
        #: Told of each subscription made, when upstreams are configured (``broker.upstreams.demand.Wants``):
        #: every feed subscribes through here, so an upstream's URI is watched for all of them.
        self.wants: Wants | None = None

    async def add(self, session_id: str, tenant: str, uri: str, limit: int = 0) -> int:
        if self.wants is not None:  # first: past an upstream's max_watches, nothing is subscribed
            await self.wants.want(tenant, (uri,))
        count = await self.index.add(session_id, tenant, uri, limit)
        if count:
            self._made.inc(tenant)
        return count

    async def remove(self, session_id: str, tenant: str, uri: str) -> None:
        await self.index.remove(session_id, tenant, uri)

    async def of_session(self, session_id: str) -> set[str]:
        return await self.index.of_session(session_id)

    async def subscribers(self, tenant: str, uris: Sequence[str]) -> dict[str, list[str]]:
        return await self.index.subscribers(tenant, uris)

    async def tenant_sessions(self, tenant: str) -> list[str]:
        return await self.index.tenant_sessions(tenant)


class Broker:
    """Everything a worker process runs, minus the transports.

    ``start`` brings up the backend, the delivery hub, (by default) an embedded fan-out
    consumer and the change sources; ``stop`` ends every stream gracefully and releases the
    backend.
    """

    def __init__(self, settings: Settings | None = None, backend: Backend | None = None, *,
                 metrics: Instruments | None = None, authenticator: Authenticator | None = None,
                 tracer: Tracer | None = None) -> None:
        """``metrics``: by default Prometheus (``GET /metrics``), or none with ``settings.metrics`` off;
        a binding given is completed with the defaults of what it lacks (``broker.metrics.complete``).
        ``tracer``: by default OpenTelemetry when ``OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT`` is set
        (``default_tracer``)."""
        self.settings = settings = settings or Settings()
        self.metrics = metrics = default_metrics(settings) if metrics is None else complete(metrics)
        self.tracer = tracer = default_tracer() if tracer is None else tracer
        #: One per process: a tenant has the same label in every per-tenant counter.
        self.tenant_labels = tenants = TenantLabels(settings.metrics_tenant_limit)
        #: For wiring and tests only: the services below are what the rest of the broker uses.
        self.backend = backend = backend or create_backend(settings, metrics)
        #: Runtime API keys (the admin API) when ``MCP_BROKER_AUTH`` has ``keys``; None otherwise.
        self.keys = KeyAdmin(backend.credentials) if "keys" in settings.auth_methods else None
        stored = None if self.keys is None else StoredKeys(backend.credentials, settings.key_cache_seconds)
        self.authenticator = authenticator or authenticator_for(settings, stored)
        self.server_info = {"name": settings.server_name, "version": __version__}
        #: Per-tenant quotas (``MCP_BROKER_QUOTAS``; a bad value raises ValueError here).
        self.quotas = Quotas(backend.quotas, TenantQuotas.from_settings(settings))
        self.publisher = Publisher(backend.changelog, ChangeRules.from_settings(settings),
                                   default_tenant=settings.default_tenant, max_waiting=settings.changelog_tenant_max,
                                   metrics=metrics, tenant_labels=tenants, quotas=self.quotas, tracer=tracer)
        self.resources = Resources([RecordsProvider(backend.records)])
        self.records = Records(backend.records, settings, self.publisher)
        self.streams = Streams()
        subscriptions = TenantCounter(metrics, "mcp_broker_tenant_subscriptions_total", tenants)
        listen_metrics = StreamMetrics(metrics, "modern", tracer)
        self.listens = ListenIndex(self.streams, settings.max_listens, {SERVER_INFO_KEY: self.server_info},
                                   listen_metrics, subscriptions, tenant_share(settings, settings.max_listens))
        self._hub = Hub(settings, self.streams, self.listens, backend.broadcast, touch=backend.sessions.touch,
                        ping=backend.ping, metrics=metrics, revoked=None if stored is None else stored.invalid)
        index = CountedSubscriptions(backend.subscriptions, subscriptions)
        #: The MCP servers behind the broker (``MCP_BROKER_UPSTREAMS``), None when there are none.
        self.upstreams: Upstreams | None = None
        self.wants: Wants | None = None
        self.watches: list[WatchSource] = []
        if settings.upstreams:
            self.upstreams = Upstreams(settings.upstream_specs, self.server_info, metrics=metrics,
                                       sessions=backend.sessions)
            self.resources.providers.append(UpstreamProvider(self.upstreams))  # listed after the broker's own
            self.wants = index.wants = Wants(self.upstreams, backend.demand)
        self.methods = Methods(settings, self.resources, index, self.server_info, self.quotas.quotas, metrics=metrics,
                               tracer=tracer, upstreams=self.upstreams)
        self.methods.wants = self.wants
        #: Every feed: 2025 sessions, resumable listens, poll and webhook subscriptions.
        self.feeds = Feeds(backend.sessions, backend.inboxes, index, settings.max_sessions, metrics=metrics,
                           tenant_labels=tenants, quotas=self.quotas.quotas,
                           tenant_max=tenant_share(settings, settings.max_sessions))
        legacy = SessionServices(backend.inboxes, self.feeds.reader, backend.sessions, backend.subscriptions,
                                 self.streams, StreamMetrics(metrics, "legacy", tracer),
                                 inbox_batch=settings.inbox_batch, stream_buffer=settings.stream_buffer)
        #: The events extension (experimental): its methods, and this worker's webhook deliveries.
        self.events = Events(settings, self.methods, self.feeds, backend.inboxes, backend.webhooks,
                             backend.leases, backend.sessions.touch, authenticator=self.authenticator,
                             quotas=self.quotas.quotas, revoked=None if stored is None else stored.invalid,
                             buckets=self.quotas)
        self.events.install(self.methods)
        resumables = ResumableListens(self.feeds, legacy, listen_metrics, {SERVER_INFO_KEY: self.server_info})
        self.dispatcher = Dispatcher(self.methods, self.feeds, self.listens, legacy,
                                     max_batch_items=settings.max_batch_items,
                                     max_response_bytes=settings.max_response_bytes,
                                     max_read_bytes=settings.max_read_bytes, quotas=self.quotas,
                                     resumables=resumables)
        self.health = Health(backend.ping, self.streams)
        self._sessions_open = metrics.gauge("mcp_broker_sessions_open")
        self._feeds_open = metrics.gauge("mcp_broker_feeds_open")
        self.fanout: Fanout | None = None
        self._sources: list[ChangeSource] = []
        self._runners: list[SourceRunner] = []
        #: The live console's figures (``/console/``); its workers' cards meet in the metrics directory.
        self.console = Console(streams=self.streams, quotas=self.quotas, publisher=self.publisher,
                               changelog=backend.changelog, sessions=backend.sessions, webhooks=backend.webhooks,
                               leases=backend.leases, runners=self._runners, consumer=self._consumer_name,
                               cards_dir=_cards_dir(), upstreams=self.upstream_rows if self.upstreams else None)
        self._tasks: list[asyncio.Task[None]] = []
        self.started = False
        if settings.demo:
            from broker.sources.demo import DemoSource, demo_provider  # the demo imports the record service

            self.register(demo_provider())
            self.add_source(DemoSource(self.records, settings.default_tenant, settings.demo_interval))
        for build in extension_builders(settings):
            self.extend(build(settings))
        for upstream in self.upstreams.all if self.upstreams is not None else ():
            watch = WatchSource(upstream, backend.demand, backend.subscriptions, metrics=metrics)
            self.watches.append(watch)
            self.add_source(watch)

    def extend(self, extension: Extension) -> None:
        """Add an extension's providers (answering before the built-ins) and its change sources."""
        for provider in extension.providers:
            self.register(provider)
        for source in extension.sources:
            self.add_source(source)

    def register(self, provider: ResourceProvider) -> None:
        """Add a custom resource provider; it answers before the built-in record collections."""
        if isinstance(provider, PublishingProvider):  # a ResourceSet publishes through this broker
            provider.bind_publisher(self.publisher)
        self.resources.register(provider)

    def add_source(self, source: ChangeSource) -> None:
        """Run ``source`` from ``start`` to ``stop`` (on one worker at a time when it is exclusive)."""
        self._sources.append(source)
        if self.started:
            self._start_source(source)

    async def publish(self, uri: str, kind: ChangeKind = ChangeKind.UPDATED, *, tenant: str | None = None,
                      meta: dict[str, Any] | None = None) -> str:
        """Append a change to the change log (of the default tenant unless ``tenant`` is given); returns its id.

        Raises:
            InvalidChange: the change breaks ``ChangeRules`` (a URI or ``meta`` that could not be
                delivered, a record URI of another tenant, a tenant name that is not one).
            QuotaExceeded: the tenant has ``changelog_tenant_max`` changes not yet fanned out
                (the change was refused; publish again later).
            LogFull: its partition of the change log holds ``changelog_maxlen`` changes not yet
                fanned out (refused; publish again later).
            BackendUnavailable: the change could not be stored (it was not accepted).
        """
        return await self.publisher.publish(uri, kind, tenant=tenant, meta=meta, source="python")

    async def start(self) -> None:
        """Raises ``BackendUnavailable`` when the backend cannot be reached."""
        await self.backend.start()
        await self._hub.start()
        if isinstance(self.authenticator, Lifecycle):
            await self.authenticator.start()  # OAuth fetches its authorization server's keys, in the background
        if self.settings.embedded_fanout:
            self.fanout = Fanout(self.settings, self.backend, metrics=self.metrics, tenant_labels=self.tenant_labels,
                                 tracer=self.tracer)
            self._tasks.append(asyncio.create_task(self.fanout.run(), name="fanout"))
        self._tasks.append(asyncio.create_task(self._expire_loop(), name="session-expiry"))
        self._tasks.append(asyncio.create_task(self.quotas.run(), name="quota-leases"))
        self._tasks.append(asyncio.create_task(self.events.delivery.run(), name="webhook-delivery"))
        self._tasks.append(asyncio.create_task(self.metrics.sample_every(SESSIONS_COUNT_INTERVAL, self._count_sessions),
                                               name="sessions-count"))
        self._tasks.append(asyncio.create_task(self.console.run(), name="console-card"))
        if self.upstreams is not None and self.wants is not None:
            await self.upstreams.start()  # probes them; at most a few seconds for those whose prefixes are learnt
            self._tasks.append(asyncio.create_task(self.wants.run(self.listens), name="upstream-wants"))
        self.started = True
        for source in self._sources:
            self._start_source(source)
        RUNNING.add(self)

    def _start_source(self, source: ChangeSource) -> None:
        runner = SourceRunner(source, self.publisher, self.backend.leases, self.settings.source_lease_ms,
                              metrics=self.metrics)
        self._runners.append(runner)
        self._tasks.append(asyncio.create_task(runner.run(), name=f"source-runner-{source.name}"))

    async def end_streams(self) -> None:
        """End every stream of this process (``retry:`` / ``complete``); new ones end at once from now on."""
        await self._hub.shutdown()

    async def stop(self) -> None:
        RUNNING.discard(self)
        try:
            await self._hub.shutdown()
            await stop_tasks(self._tasks)
            self._tasks.clear()
            self._runners.clear()
            self.console.close()
            await self.backend.close()
            if self.upstreams is not None:
                await self.upstreams.close()
            if isinstance(self.authenticator, Lifecycle):
                await self.authenticator.close()
            for provider in self.resources.providers:  # a provider's connections (broker/sources/postgres.py)
                if isinstance(provider, ClosingProvider):
                    await provider.aclose()
        finally:
            self.started = False
        self.metrics.close()  # e.g. a worker's live gauges leave the merged figures (broker.ops.prometheus)
        if self.tracer is not None:
            await asyncio.to_thread(self.tracer.close)  # the spans not yet exported leave now

    async def upstream_rows(self) -> list[dict[str, Any]]:
        """Each upstream as this worker sees it, and the URIs the deployment wants watched of it: the
        console's and ``mcp-broker upstreams``' rows. Raises ``BackendUnavailable``."""
        rows: list[dict[str, Any]] = []
        for upstream, watch in zip(self.upstreams.all if self.upstreams else (), self.watches, strict=True):
            wanted = await self.backend.demand.wanted(upstream.name, upstream.spec.max_watches)
            held = watch.watch
            rows.append({"name": upstream.name, "target": upstream.spec.target, "tenants": list(upstream.spec.tenants),
                         "prefixes": list(upstream.prefixes), "era": upstream.client.era, "state": upstream.state,
                         "error": upstream.error or None, "wanted": len(wanted),
                         "watching": None if held is None else len(held.watched),
                         "watch_state": None if held is None else held.state})
        return rows

    def _consumer_name(self) -> str | None:
        return None if self.fanout is None else self.fanout.name

    async def _count_sessions(self) -> None:
        """``mcp_broker_feeds_open`` (every feed, what ``max_sessions`` bounds) and ``mcp_broker_sessions_open``
        (the 2025 sessions among them), sampled every ``SESSIONS_COUNT_INTERVAL`` seconds (the first at once):
        two counts of the store, off every request's path."""
        try:
            self._feeds_open.set(await self.backend.sessions.count())
            self._sessions_open.set(await self.backend.sessions.count_sessions())
        except BackendUnavailable:
            pass  # the figure stays as last counted
        except Exception:  # the sample's boundary: counting must go on after any one failure
            raise_if_cancelled()
            logger.exception("counting the open sessions failed")

    async def _expire_loop(self) -> None:
        interval = max(min(self.settings.session_ttl / 4, 60.0), 0.05)
        sessions = self.backend.sessions
        while True:
            await asyncio.sleep(interval)
            try:
                expired = await sessions.expire()
                if expired:
                    logger.info("expired %d idle sessions", expired)
            except Exception as exc:  # the loop's boundary: expiry must go on after any one failure
                raise_if_cancelled()
                if isinstance(exc, BackendUnavailable):
                    logger.warning("session expiry skipped: backend unavailable")
                else:
                    logger.exception("session expiry failed")
