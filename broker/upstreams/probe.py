"""What each worker learns of its upstreams at start: their era and capabilities, their tool and
prompt names, and (when the map leaves them out) the URI prefixes they own.

An upstream that cannot be reached is asked again every ``PROBE_PAUSE`` seconds; its requests
probe it themselves meanwhile, within their own bounds (``Upstreams.forward``). Prefixes learnt
are settled by the map's order (``Probes.settle_prefixes``), so every worker owns alike.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any, Final

from broker.errors import raise_if_cancelled
from broker.upstreams.client import UpstreamError
from broker.upstreams.spec import overlap
from broker.upstreams.upstream import Upstream

__all__ = ["LEARN_WAIT", "PROBE_PAUSE", "Probes", "prefix_of"]

logger = logging.getLogger(__name__)

#: Seconds the start waits for the upstreams whose prefixes are learnt to answer their first probe.
LEARN_WAIT: Final = 5.0
#: Seconds between two probes of an upstream that could not be reached.
PROBE_PAUSE: Final = 5.0
#: The list methods a probe reads whole: method -> the result's list field.
_FIELDS: Final = {"tools/list": "tools", "prompts/list": "prompts", "resources/list": "resources",
                  "resources/templates/list": "resourceTemplates"}


def prefix_of(uri: str) -> str | None:
    """The prefix a learnt URI (or template) gives its upstream: its scheme and ``//`` when it has them."""
    scheme, colon, rest = uri.partition(":")
    if not colon or not scheme or "{" in scheme:
        return None
    return f"{scheme}://" if rest.startswith("//") else f"{scheme}:"


class Probes:
    """The probes of one worker's upstreams (the map's order is theirs)."""

    def __init__(self, upstreams: Sequence[Upstream]) -> None:
        self.all = list(upstreams)
        self._probes: list[asyncio.Task[None]] = []
        self._warned: set[tuple[str, str, str]] = set()
        self._warned_prefixes: set[tuple[str, str]] = set()

    async def start(self) -> None:
        """Probe every upstream in the background. The start waits for the first answer of those whose
        prefixes are to be learnt, for ``LEARN_WAIT`` seconds at most, so that their URIs are theirs from
        the first request; an upstream that cannot be reached delays nothing longer."""
        self._probes = [asyncio.create_task(self._probe_until_known(upstream), name=f"upstream-probe-{upstream.name}")
                        for upstream in self.all]
        learning = [upstream.learnt for upstream in self.all if upstream.spec.prefixes is None]
        if learning:
            await asyncio.wait([asyncio.ensure_future(event.wait()) for event in learning], timeout=LEARN_WAIT)

    async def close(self) -> None:
        for task in self._probes:
            task.cancel()
        await asyncio.gather(*self._probes, return_exceptions=True)

    async def _probe_until_known(self, upstream: Upstream) -> None:
        while True:
            try:
                await self.probe(upstream)
                return
            except Exception as exc:  # the probe's boundary: an answer that is not what MCP says is logged, asked again
                raise_if_cancelled()
                upstream.learnt.set()  # asked once: the start waits no longer
                upstream.state, upstream.error = "unreachable", str(exc) or type(exc).__name__
                if not isinstance(exc, UpstreamError):
                    logger.exception("upstream %s: its answers to the probe could not be read", upstream.name)
                logger.warning("upstream %s (%s) cannot be reached: %s; asking again in %.0f s", upstream.name,
                               upstream.spec.target, exc, PROBE_PAUSE)
            await asyncio.sleep(PROBE_PAUSE)

    async def probe(self, upstream: Upstream) -> None:
        """Learn the upstream's era and capabilities, its tool and prompt names, and (when the map
        leaves them out) the prefixes it owns. Raises ``UpstreamError``."""
        found = await upstream.client.probe()
        capabilities = found.get("capabilities", found)
        upstream.capabilities = capabilities if isinstance(capabilities, dict) else {}
        for kind, method in (("tools", "tools/list"), ("prompts", "prompts/list")):
            if kind in upstream.capabilities:
                upstream.names[kind] = {item["name"] for item in await self._all(upstream, method)
                                        if isinstance(item, dict) and isinstance(item.get("name"), str)}
        if upstream.spec.prefixes is None and "resources" in upstream.capabilities:
            uris = [item.get("uri") for item in await self._all(upstream, "resources/list") if isinstance(item, dict)]
            uris += [item.get("uriTemplate") for item in await self._all(upstream, "resources/templates/list")
                     if isinstance(item, dict)]
            upstream.found = {p for uri in uris if isinstance(uri, str) if (p := prefix_of(uri)) is not None}
            self.settle_prefixes()
        upstream.state, upstream.error = "ready", ""
        upstream.learnt.set()
        self._check_names(upstream)
        logger.info("upstream %s (%s) ready: %s era, prefixes %s", upstream.name, upstream.spec.target,
                    upstream.client.era, ", ".join(upstream.prefixes) or "none")

    def settle_prefixes(self) -> None:
        """Each learning upstream's prefixes: those it listed, less those that overlap a prefix of an
        upstream before it in the map serving a tenant of its (logged). The map's order decides, so
        every worker settles alike whichever upstream answered first."""
        for index, upstream in enumerate(self.all):
            if upstream.spec.prefixes is not None:
                continue
            kept: list[str] = []
            for prefix in sorted(upstream.found):
                rival = next((other for other in self.all[:index]
                              if set(other.spec.tenants) & set(upstream.spec.tenants)
                              and any(overlap(prefix, theirs) for theirs in other.prefixes)), None)
                if rival is None:
                    kept.append(prefix)
                elif (upstream.name, prefix) not in self._warned_prefixes:
                    self._warned_prefixes.add((upstream.name, prefix))
                    logger.error("upstream %s: its URIs under %r are not served: upstream %s, before it in "
                                 "MCP_BROKER_UPSTREAMS, owns them for a tenant both serve; set \"prefixes\" of both",
                                 upstream.name, prefix, rival.name)
            upstream.prefixes = tuple(kept)

    def _check_names(self, upstream: Upstream) -> None:
        for kind in ("tools", "prompts"):
            mine = {upstream.spec.name_prefix + name for name in upstream.names[kind]}
            for other in self.all:
                if other is upstream or not set(other.spec.tenants) & set(upstream.spec.tenants):
                    continue
                theirs = {other.spec.name_prefix + name for name in other.names[kind]}
                for name in sorted(mine & theirs):
                    first, second = sorted((upstream, other), key=self.all.index)
                    if (kind, name, second.name) not in self._warned:
                        self._warned.add((kind, name, second.name))
                        logger.error("upstreams %s and %s both offer the %s %r to a tenant they share: %s serves it; "
                                     "give one a \"name_prefix\" in MCP_BROKER_UPSTREAMS", first.name, second.name,
                                     kind[:-1], name, first.name)

    async def _all(self, upstream: Upstream, method: str, pages: int = 50) -> list[Any]:
        """Every item of one of the upstream's lists (at most ``pages`` pages)."""
        items: list[Any] = []
        cursor: str | None = None
        for _ in range(pages):
            result, _session = await upstream.client.request(method, {} if cursor is None else {"cursor": cursor})
            found = result.get(_FIELDS[method], [])
            items += found if isinstance(found, list) else []
            cursor = result.get("nextCursor")
            if not isinstance(cursor, str):
                break
        return items
