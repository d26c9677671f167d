"""The live console's figures (``GET /console/state.json``), and the page that shows them (package data here).

Two kinds of figure, and the page says which is which:

* **deployment-wide**, asked of the backend: the live sessions (``SessionStore.count``), every
  change-log partition with the fan-out consumer holding it and its lag (``ChangeLog.overview``),
  the holder of each exclusive change source's lease (``Leases.holder``), webhook subscriptions,
  the failing ones and the dead letters;
* **per worker**, from the worker's own objects: its open streams and listens, the changes it
  accepted per second, the name of its fan-out consumer and of its sources' lease owners (so a
  holder on this host is named by its worker), and its tenants' places under a ``streams`` or
  ``listens`` quota.
  Each worker of ``serve --workers N`` writes this as a small *card* (a JSON file in the
  multiprocess metrics directory, ``cards_dir``) every ``CARD_INTERVAL`` seconds, and the answer
  to a request merges the cards of every live worker of the host. Workers on other hosts (other
  pods) are not seen from here: each host's console shows its own workers.

Cheap by construction: a state is computed at most once per ``CACHE_SECONDS`` per worker however
many pages poll it (concurrent requests share one computation), it costs a few backend reads (one
count, one overview, a lease per exclusive source, and every ``WEBHOOK_SECONDS`` a bounded scan of
webhooks and dead letters), a card costs no backend read at all,
nothing is counted per frame or per request, and every list in it is bounded (``TOP_TENANTS``,
``WEBHOOK_SCAN``, ...).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Final

import orjson

from broker.backends.base import ChangeLog, Leases, SessionStore, Webhooks
from broker.delivery.stream import Streams
from broker.errors import BackendUnavailable
from broker.publisher import Publisher
from broker.quotas import Quotas
from broker.sources import SourceRunner

__all__ = ["CACHE_SECONDS", "CARD_INTERVAL", "FIGURES", "Console"]

logger = logging.getLogger(__name__)

#: Seconds a computed state is served again before the next is computed.
CACHE_SECONDS: Final = 1.0
#: Seconds between two cards of a worker (several workers on a host), or two samples of its rate (one).
CARD_INTERVAL: Final = 1.0
#: A card older than this is a worker that stopped without removing it (killed): not shown.
STALE_SECONDS: Final = 5.0
#: Tenants shown, the busiest first.
TOP_TENANTS: Final = 20
#: Webhook subscriptions read per state at most (in id order), and failing ones listed.
WEBHOOK_SCAN: Final = 1000
FAILING_SHOWN: Final = 20
#: Seconds a scan of the webhooks and dead letters is shown again before the next (a page of records each).
WEBHOOK_SECONDS: Final = 5.0
#: Dead letters counted per state at most (the store keeps a bounded list), and the newest shown.
DEAD_LETTER_SCAN: Final = 100
DEAD_LETTERS_SHOWN: Final = 5
#: Seconds over which a worker's changes per second are measured.
RATE_WINDOW: Final = 5.0
#: The live figures of the page (``data-metric``) and of ``mcp-broker status``, in the state's ``figures``.
FIGURES: Final = ("sessions", "streams", "listens", "changes_per_second", "partitions", "workers", "webhooks",
                  "webhooks_failing", "dead_letters")


class Console:
    """This worker's card and the merged state; ``run`` writes the card while several workers share a host."""

    def __init__(self, *, streams: Streams, quotas: Quotas, publisher: Publisher, changelog: ChangeLog,
                 sessions: SessionStore, webhooks: Webhooks, leases: Leases, runners: Sequence[SourceRunner],
                 consumer: Callable[[], str | None], cards_dir: str | None = None,
                 clock: Callable[[], float] = time.time,
                 upstreams: Callable[[], Awaitable[list[dict[str, Any]]]] | None = None) -> None:
        """``consumer``: the name of this worker's fan-out consumer (None: it runs none); ``cards_dir``:
        where the workers of a host leave their cards (None: this worker is alone); ``upstreams``: the
        MCP servers behind the broker as this worker sees them (``Broker.upstream_rows``)."""
        self.upstreams = upstreams
        self.streams = streams
        self.quotas = quotas
        self.publisher = publisher
        self.changelog = changelog
        self.sessions = sessions
        self.webhooks = webhooks
        self.leases = leases
        self.runners = runners
        self.consumer = consumer
        self.clock = clock
        self.pid = os.getpid()
        self.host = socket.gethostname()
        self.started_at = clock()
        self._card_path = None if cards_dir is None else Path(cards_dir) / f"console-{self.pid}-{id(self):x}.json"
        self._accepted: deque[tuple[float, int]] = deque(maxlen=64)
        self._state: dict[str, Any] | None = None
        self._state_at = float("-inf")
        self._webhooks: dict[str, Any] | None = None
        self._webhooks_at = float("-inf")
        self._lock = asyncio.Lock()

    # -- this worker -------------------------------------------------------------------------------
    def _rate(self, now: float) -> float:
        """Changes this worker accepted per second, over the last ``RATE_WINDOW`` seconds of samples."""
        samples = self._accepted
        samples.append((now, self.publisher.accepted))
        while len(samples) > 2 and now - samples[1][0] >= RATE_WINDOW:
            samples.popleft()
        first_at, first = samples[0]
        return 0.0 if now - first_at <= 0 else round((self.publisher.accepted - first) / (now - first_at), 2)

    def card(self) -> dict[str, Any]:
        """What this worker holds now, from its own objects (no backend read)."""
        now = self.clock()
        streams = self.streams
        tenants: Counter[tuple[str, str]] = Counter()
        for lease in self.quotas.held:
            tenants[(lease.tenant, lease.kind)] += 1
        return {
            "pid": self.pid, "host": self.host, "started_at": round(self.started_at, 3), "at": round(now, 3),
            "streams": streams.sessions, "listens": streams.all_listens,
            "changes_per_second": self._rate(now),
            "consumer": self.consumer(),
            # Each source's lease owner while it runs here (None: it does not run here now).
            "sources": {runner.source.name: runner.owner if runner.running else None for runner in self.runners},
            "tenants": [[tenant, kind, n] for (tenant, kind), n in tenants.most_common(TOP_TENANTS * 2)],
        }

    async def run(self) -> None:
        """Until cancelled, every ``CARD_INTERVAL`` seconds: write this worker's card (with ``cards_dir``), or
        only sample its count of accepted changes, so that the rate is of the last seconds whenever asked."""
        while True:
            if self._card_path is None:
                self._rate(self.clock())
            else:
                try:
                    self._write(self.card())
                except OSError as exc:  # the directory went away (the parent exits): nothing to show anyway
                    logger.debug("could not write the console card: %s", exc)
            await asyncio.sleep(CARD_INTERVAL)

    def _write(self, card: dict[str, Any]) -> None:
        assert self._card_path is not None
        partial = self._card_path.with_suffix(".part")
        partial.write_bytes(orjson.dumps(card))
        os.replace(partial, self._card_path)  # a reader sees the old card or the new one, never half of one

    def close(self) -> None:
        """This worker stops: its card leaves the host's figures."""
        if self._card_path is not None:
            self._card_path.unlink(missing_ok=True)

    def _cards(self) -> list[dict[str, Any]]:
        """Every live worker's card of this host, this worker's freshly made."""
        own = self.card()
        if self._card_path is None:
            return [own]
        cards = [own]
        now = self.clock()
        for path in self._card_path.parent.glob("console-*.json"):
            if path == self._card_path:
                continue
            try:
                card = orjson.loads(path.read_bytes())
            except (OSError, orjson.JSONDecodeError):
                continue  # removed meanwhile
            if isinstance(card, dict) and now - float(card.get("at", 0)) <= STALE_SECONDS:
                cards.append(card)
        return sorted(cards, key=lambda card: int(card["pid"]))

    # -- the state ---------------------------------------------------------------------------------
    async def state(self) -> dict[str, Any]:
        """The console's JSON: computed at most once per ``CACHE_SECONDS``, shared by concurrent callers."""
        async with self._lock:
            now = self.clock()
            if self._state is None or now - self._state_at >= CACHE_SECONDS:
                self._state = await self._compute()
                self._state_at = now
            return self._state

    async def _compute(self) -> dict[str, Any]:
        cards = self._cards()
        deployment = await self._deployment()
        partitions = self._partitions(cards, deployment.get("overview", {}))
        figures = {
            "sessions": deployment.get("sessions"),
            "streams": sum(int(card["streams"]) for card in cards),
            "listens": sum(int(card["listens"]) for card in cards),
            "changes_per_second": round(sum(float(card["changes_per_second"]) for card in cards), 2),
            "partitions": self.changelog.partitions,
            "workers": len(cards),
            "webhooks": deployment.get("webhooks"),
            "webhooks_failing": deployment.get("webhooks_failing"),
            "dead_letters": deployment.get("dead_letters"),
        }
        return {
            "generated_at": round(self.clock(), 3),
            "answered_by": {"pid": self.pid, "host": self.host},
            "backend": "unavailable" if deployment.get("unavailable") else "ok",
            "figures": figures,
            "workers": [{key: card[key] for key in ("pid", "host", "started_at", "streams", "listens",
                                                     "changes_per_second")}
                        | {"partitions": sum(p["holder"] == _worker(card) for p in partitions),
                           "sources": sorted(name for name, owner in card["sources"].items() if owner)}
                        for card in cards],
            "partitions": partitions,
            "sources": self._sources(cards, deployment.get("source_owners", {})),
            "webhooks": {"failing": deployment.get("failing", []), "dead_letters": deployment.get("letters", []),
                         "scanned": deployment.get("scanned", 0), "complete": deployment.get("complete", True)},
            "tenants": self._tenants(cards, deployment.get("per_tenant", {})),
            "upstreams": await self._upstreams(deployment.get("source_owners", {})),
        }

    async def _upstreams(self, owners: dict[str, str | None]) -> list[dict[str, Any]]:
        """Each upstream, with the worker that holds its watch (the owner of its source's lease)."""
        if self.upstreams is None:
            return []
        try:
            rows = await self.upstreams()
        except BackendUnavailable:
            return []
        return [row | {"watch_holder": owners.get(f"upstream-{row['name']}")} for row in rows]

    async def _deployment(self) -> dict[str, Any]:
        """The figures asked of the backend; ``unavailable`` when it does not answer."""
        try:
            sessions = await self.sessions.count_sessions()
            overview = await self.changelog.overview()
            owners = {runner.source.name: await self.leases.holder(runner.lease_name)
                      for runner in self.runners if runner.source.exclusive}
            now = self.clock()
            if self._webhooks is None or now - self._webhooks_at >= WEBHOOK_SECONDS:
                self._webhooks = await self._scan_webhooks()
                self._webhooks_at = now
        except BackendUnavailable:
            return {"unavailable": True}
        return {"sessions": sessions, "overview": overview, "source_owners": owners, **self._webhooks}

    async def _scan_webhooks(self) -> dict[str, Any]:
        """The webhook subscriptions (the first ``WEBHOOK_SCAN``), the failing ones and the dead letters."""
        records = await self.webhooks.page("", WEBHOOK_SCAN + 1)
        letters = await self.webhooks.dead_letters(DEAD_LETTER_SCAN)
        complete = len(records) <= WEBHOOK_SCAN
        records = records[:WEBHOOK_SCAN]
        failing = [record for record in records if record.failed_since is not None]
        return {
            "webhooks": len(records), "webhooks_failing": len(failing),
            "dead_letters": len(letters), "scanned": len(records), "complete": complete,
            "per_tenant": Counter(record.tenant for record in records),
            "failing": [{"id": r.id, "tenant": r.tenant, "error": r.last_error, "failing_since": r.failed_since}
                        for r in sorted(failing, key=lambda r: r.failed_since or 0)[:FAILING_SHOWN]],
            "letters": [{"subscription": d.subscription, "tenant": d.tenant, "event": d.event_id,
                         "attempts": d.attempts, "error": d.error, "at": d.at} for d in letters[:DEAD_LETTERS_SHOWN]],
        }

    def _partitions(self, cards: list[dict[str, Any]],
                    overview: dict[int, tuple[str | None, int, float]]) -> list[dict[str, Any]]:
        """Every partition fan-out reads, with its holder (a worker of this host by its name, another
        consumer by its own, None: nobody now) and its lag."""
        workers = {card["consumer"]: _worker(card) for card in cards if card.get("consumer")}
        return [{"partition": partition, "holder": workers.get(holder, holder) if holder else None,
                 "lag_entries": entries, "lag_seconds": round(seconds, 3)}
                for partition, (holder, entries, seconds) in sorted(overview.items())]

    def _sources(self, cards: list[dict[str, Any]], owners: dict[str, str | None]) -> list[dict[str, Any]]:
        """Each change source and where it runs: an exclusive one under its lease's holder (a worker of this
        host by its name, another by its owner's), any other on each worker of this host running it."""
        by_owner = {owner: _worker(card) for card in cards for owner in card["sources"].values() if owner}
        rows = []
        for name in sorted({name for card in cards for name in card["sources"]}):
            if name in owners:
                owner = owners[name]
                holders = [] if owner is None else [by_owner.get(owner, owner)]
            else:
                holders = [_worker(card) for card in cards if card["sources"].get(name)]
            rows.append({"name": name, "exclusive": name in owners, "holders": holders})
        return rows

    def _tenants(self, cards: list[dict[str, Any]], webhooks: dict[str, int]) -> list[dict[str, Any]]:
        """The busiest ``TOP_TENANTS`` tenants: their places under quota here and their webhooks, against
        their limits (None: no limit)."""
        usage: dict[str, Counter[str]] = {}
        for card in cards:
            for tenant, kind, n in card["tenants"]:
                usage.setdefault(tenant, Counter())[kind] += n
        for tenant, n in webhooks.items():
            usage.setdefault(tenant, Counter())["webhooks"] += n
        busiest = sorted(usage, key=lambda tenant: (-sum(usage[tenant].values()), tenant))[:TOP_TENANTS]
        rows = []
        for tenant in busiest:
            limits = self.quotas.limits(tenant)
            rows.append({"tenant": tenant, **{kind: [usage[tenant][kind], getattr(limits, kind)]
                                              for kind in ("streams", "listens", "webhooks")},
                         "sessions_limit": limits.sessions, "publish_per_second": limits.publish_per_second})
        return rows


def _worker(card: dict[str, Any]) -> str:
    return f"{card['pid']}@{card['host']}"
