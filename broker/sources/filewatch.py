"""The change source of the file roots: ``watchfiles`` on every root, one notification per file per burst.

``FileWatcher`` is exclusive: one worker of the deployment runs it, under its lease. It keeps the
signature (inode, size, mtime, ctime) of every regular file it has seen, and a change is what
differs between that snapshot and the file now, so the kind is level-triggered from the disk,
not taken from the events: a file written ten times in one burst, or created and written, is one
change (``updated``, or ``created``); one created and removed within the burst is none.

``watchfiles`` collects events until ``step`` ms pass without one (at most ``debounce`` ms), then
yields the set of paths: a save or a ``git checkout`` arrives as one batch. A batch is published
in path order, and the snapshot keeps a file's new signature only once its change is in the
change log: a publish that fails ends the run, and the next run (the ``SourceRunner`` starts it
again) finds the difference still there.

A (re)start compares the disk with the snapshot, once the watcher is known to be running (its
first yield), so nothing that changes meanwhile falls between the two:

* warm (this process ran the source before: a failure, or the lease lost and taken back): every
  difference since the snapshot is published, created, updated and deleted alike; a file that
  did not change publishes nothing. What another worker published meanwhile may be repeated.
* cold (a takeover by a worker that never ran it, or the first start): there is no snapshot, so
  every file whose ctime lies within ``catch_up`` seconds is published (``created`` when its
  directory changed too, else ``updated``), and a directory changed within it with no such file
  publishes ``deleted`` of the directory's URI (``file:///root/dir/``), which tells the tenant's
  sessions that the list changed. Misses: a file deleted while no worker watched tells its own
  subscribers nothing (the list change goes out, if the directory changed within the window), and
  nothing older than ``catch_up`` is caught up (the whole deployment down for longer).
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import time
from collections.abc import Sequence
from typing import NamedTuple

from watchfiles import awatch

from broker.changes import ChangeKind, InvalidChange
from broker.config import Settings
from broker.publisher import Publisher
from broker.sources import Extension
from broker.sources.files import FileRoot, FilesProvider, file_uri, roots_of, scan

__all__ = ["FileWatcher", "build"]

logger = logging.getLogger(__name__)


class Signature(NamedTuple):
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, info: os.stat_result) -> Signature:
        return cls(info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


def _signature(path: str) -> Signature | None:
    """The signature of the regular file at ``path``, or None when there is none (or it is something else)."""
    try:
        info = os.lstat(path)
    except OSError:
        return None
    return Signature.of(info) if stat.S_ISREG(info.st_mode) else None


class FileWatcher:
    """Watches the roots and publishes each file's changes under the tenant of its root."""

    name = "files"
    exclusive = True

    def __init__(self, roots: Sequence[FileRoot], *, catch_up: float = 45.0, debounce_ms: int = 400,
                 step_ms: int = 50) -> None:
        self.roots = sorted(roots, key=lambda r: len(r.path), reverse=True)
        self.catch_up = catch_up
        self.debounce_ms = debounce_ms
        self.step_ms = step_ms
        #: Path -> signature of every file published or seen; None until a first run has scanned.
        self._seen: dict[str, Signature] | None = None

    def _root_of(self, path: str) -> FileRoot | None:
        return next((r for r in self.roots if path.startswith(r.path.rstrip("/") + "/")), None)

    async def run(self, publisher: Publisher) -> None:
        started = False
        async for batch in awatch(*(r.path for r in self.roots), watch_filter=None, debounce=self.debounce_ms,
                                  step=self.step_ms, rust_timeout=200, yield_on_timeout=True, recursive=True):
            if not started:  # the watcher runs: what changes from now on is in a batch
                started = True
                await self._resync(publisher)
            elif batch:
                await self._batch(publisher, {path for _, path in batch})

    async def _publish(self, publisher: Publisher, seen: dict[str, Signature], path: str,
                       now: Signature | None, kind: ChangeKind) -> None:
        root = self._root_of(path)
        if root is not None:
            try:
                await publisher.publish(file_uri(path), kind, tenant=root.tenant, source=self.name)
            except InvalidChange as exc:  # e.g. a path longer than a URI may be: it can never be delivered
                logger.warning("files: %s not published: %s", path, exc)
        if now is None:
            seen.pop(path, None)
        else:
            seen[path] = now

    async def _batch(self, publisher: Publisher, paths: set[str]) -> None:
        seen = self._seen if self._seen is not None else {}
        # The disk is read in a thread, never on the event loop (a root may hold many files); only
        # this task touches ``seen``, so the thread reads it while nothing changes it.
        changed = await asyncio.to_thread(self._changes, paths, seen)
        for path, before, now in changed:
            kind = ChangeKind.CREATED if before is None else ChangeKind.DELETED if now is None else ChangeKind.UPDATED
            await self._publish(publisher, seen, path, now, kind)
        self._seen = seen

    def _changes(self, paths: set[str], seen: dict[str, Signature]) -> list[tuple[str, Signature | None,
                                                                                Signature | None]]:
        """The files a batch of events touched whose signature differs from ``seen``, in path order."""
        candidates: set[str] = set()
        for path in paths:
            candidates.add(path)
            prefix = path.rstrip("/") + "/"
            candidates.update(p for p in seen if p.startswith(prefix))  # a directory removed or renamed away
            root = self._root_of(prefix)
            if root is not None and os.path.isdir(path) and not os.path.islink(path):  # one moved in
                sub = FileRoot(root.tenant, path, os.path.realpath(path))
                candidates.update(os.path.join(path, relative) for relative, _ in scan(sub))
        changed = []
        for path in sorted(candidates):
            before, now = seen.get(path), _signature(path)
            if before != now:
                changed.append((path, before, now))
        return changed

    def _scan_all(self, horizon: int) -> tuple[dict[str, Signature], set[str]]:
        """Every file of the roots with its signature, and the directories changed since ``horizon``
        (in a thread: the walk may be long)."""
        current: dict[str, Signature] = {}
        recent_dirs: set[str] = set()
        for root in self.roots:
            for relative, info in scan(root, dirs=True):
                path = os.path.join(root.path, relative) if relative else root.path
                if self._root_of(path + "/") is not root and relative:
                    continue  # a nested root's own
                if stat.S_ISDIR(info.st_mode):
                    if info.st_ctime_ns >= horizon:
                        recent_dirs.add(path)
                else:
                    current[path] = Signature.of(info)
        return current, recent_dirs

    async def _resync(self, publisher: Publisher) -> None:
        horizon = time.time_ns() - int(self.catch_up * 1e9)
        current, recent_dirs = await asyncio.to_thread(self._scan_all, horizon)
        published = 0
        if self._seen is not None:
            seen = self._seen
            for path in sorted(set(seen) | set(current)):
                before, now = seen.get(path), current.get(path)
                if before != now:
                    kind = (ChangeKind.CREATED if before is None else
                            ChangeKind.DELETED if now is None else ChangeKind.UPDATED)
                    await self._publish(publisher, seen, path, now, kind)
                    published += 1
            mode = "warm"
        else:
            seen = {}
            self._seen = seen
            touched: set[str] = set()
            for path in sorted(current):
                now = current[path]
                if now.ctime_ns < horizon:
                    seen[path] = now
                    continue
                parent = os.path.dirname(path)
                touched.add(parent)
                kind = ChangeKind.CREATED if parent in recent_dirs else ChangeKind.UPDATED
                await self._publish(publisher, seen, path, now, kind)
                published += 1
            for directory in sorted(recent_dirs - touched):
                owner = self._root_of(directory + "/")
                if owner is not None:
                    await publisher.publish(file_uri(directory.rstrip("/") + "/"), ChangeKind.DELETED,
                                            tenant=owner.tenant, source=self.name)
                    published += 1
            mode = "cold"
        logger.info("files: watching %d root(s) (%s start, %d change(s) caught up)", len(self.roots), mode,
                    published)


def build(settings: Settings) -> Extension:
    """The provider of the configured roots and the source that watches them (``MCP_BROKER_FILE_ROOTS``)."""
    roots = roots_of(settings)
    return Extension(providers=[FilesProvider(roots, settings.max_file_bytes, settings.max_read_bytes)],
                     sources=[FileWatcher(roots, catch_up=3 * settings.source_lease_ms / 1000 + 30)])
