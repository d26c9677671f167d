"""Files on a volume as resources: ``file://<absolute path>`` of the tenant whose root holds them.

``MCP_BROKER_FILE_ROOTS`` maps tenants to directories. A file under a tenant's root is a resource
of that tenant only: for any other principal it does not exist, exactly as a missing file. Its
URI is ``file://`` and its absolute path, percent-encoded byte by byte (``urllib.parse.quote``
with ``/`` kept), and only that one spelling names it: URIs are compared as exact strings, so a
second spelling would subscribe to changes that are never published under it.

Nothing outside a root is ever read. A URI is refused as not found when its path has ``.``,
``..`` or empty segments, a percent-encoded ``/``, ``.`` or NUL (any spelling but the canonical
one), or resolves (``os.path.realpath``: symlinks of the file or of a parent directory) outside
its root. The resolved path is then opened one segment at a time from the root's own descriptor
with ``O_NOFOLLOW``, so a symlink swapped in after the check is refused, not followed. What is
there but is not a regular file (a directory, FIFO, socket, device) is ``NotAFile``, a file above
``max_file_bytes`` is ``FileTooLarge``, one above ``max_read_bytes`` (the bound of an encoded answer)
``AnswerTooLarge``: each JSON-RPC -32602 with data (``broker/methods.py``).

The changes are published by ``FileWatcher`` (``broker/sources/filewatch.py``), one worker of the
deployment at a time. ``docs/sources/files.md`` describes the whole feature.
"""

from __future__ import annotations

import asyncio
import base64
import heapq
import mimetypes
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from typing import TYPE_CHECKING, Any, Final
from urllib.parse import quote, unquote_to_bytes

from broker.auth import Principal
from broker.errors import AnswerTooLarge, NotFound, ResourceRefused

if TYPE_CHECKING:
    from broker.config import Settings

__all__ = ["FileRefused", "FileRoot", "FileTooLarge", "FilesProvider", "NotAFile", "file_uri", "roots_of", "scan"]

Json = dict[str, Any]
PREFIX: Final = "file://"
_OPEN_FLAGS: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0)
_DIR_FLAGS: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_DIRECTORY
#: Bytes orjson writes as two (``\\"``, ``\\n``...), and the control bytes it writes as six (``\\u0001``).
_ESCAPED_SHORT: Final = b'"\\\b\t\n\f\r'
_ESCAPED_LONG: Final = bytes(c for c in range(32) if c not in b"\b\t\n\f\r")


class FileRefused(ResourceRefused):
    """A file that exists and may be seen, but is not served; ``data`` goes into the JSON-RPC error."""


class FileTooLarge(FileRefused):
    """A file larger than ``max_file_bytes``."""

    def __init__(self, uri: str, size: int, limit: int) -> None:
        super().__init__(f"File too large: {uri} is {size} bytes, more than the limit of {limit} bytes",
                         {"uri": uri, "size": size, "maxBytes": limit})


class NotAFile(FileRefused):
    """A directory, FIFO, socket or device: only regular files are resources."""

    def __init__(self, uri: str, kind: str) -> None:
        super().__init__(f"Not a regular file: {uri} is a {kind}", {"uri": uri, "kind": kind})


def file_uri(path: str) -> str:
    """The one URI of the absolute ``path``: ``file://`` and its bytes, percent-encoded except ``/``."""
    return PREFIX + quote(os.fsencode(path), safe="/")


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"),
                       (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"), (stat.S_ISLNK, "symlink")):
        if test(mode):
            return name
    return "special file"


@dataclass(frozen=True, slots=True)
class FileRoot:
    """One tenant's directory: ``path`` as configured (absolute, normalised), ``real`` resolved."""

    tenant: str
    path: str
    real: str

    @classmethod
    def of(cls, tenant: str, path: str) -> FileRoot:
        norm = os.path.normpath(path)
        return cls(tenant, norm, os.path.realpath(norm))

    @property
    def uri_prefix(self) -> str:
        return file_uri(self.path.rstrip("/") + "/")

    def uri(self, relative: str) -> str:
        return file_uri(os.path.join(self.path, relative))


def scan(root: FileRoot, *, dirs: bool = False) -> Iterator[tuple[str, os.stat_result]]:
    """Every regular file under ``root`` (not following symlinks), as (path relative to it, its lstat);
    with ``dirs``, its directories too (the root itself as ``""``)."""
    stack = [""]
    if dirs:
        try:
            yield "", os.stat(root.path)
        except OSError:
            return
    while stack:
        relative = stack.pop()
        try:
            with os.scandir(os.path.join(root.path, relative)) as entries:
                found = [(os.path.join(relative, e.name), e) for e in entries]
        except OSError:
            continue
        for path, entry in sorted(found, key=lambda item: item[0], reverse=True):
            try:
                info = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISDIR(info.st_mode):
                stack.append(path)
                if dirs:
                    yield path, info
            elif stat.S_ISREG(info.st_mode):
                yield path, info


def _walk(directory: str, parts: tuple[str, ...], after: tuple[str, ...],
          skip: frozenset[str]) -> Iterator[tuple[tuple[str, ...], os.DirEntry[str]]]:
    """The regular files under ``directory`` (whose path components are ``parts``) with their
    components, in component order, those after ``after`` (components relative to it) only.

    One directory is read when the walk reaches it, and the names before the cursor's are passed
    over without a descent: the caller decides how far the walk goes. Symlinks are not followed,
    nor are the directories in ``skip`` entered.
    """
    try:
        with os.scandir(directory) as found:
            entries = sorted(found, key=lambda e: e.name)
    except OSError:
        return
    for entry in entries:
        if after and entry.name < after[0]:
            continue
        on_cursor = bool(after) and entry.name == after[0]  # the cursor's file itself, or a directory above it
        try:
            if entry.is_dir(follow_symlinks=False):
                if entry.path not in skip:
                    yield from _walk(entry.path, (*parts, entry.name), after[1:] if on_cursor else (), skip)
            elif entry.is_file(follow_symlinks=False) and not on_cursor:
                yield (*parts, entry.name), entry
        except OSError:
            continue


class FilesProvider:
    """Answers for ``file://`` URIs under the configured roots, each to its own tenant only."""

    def __init__(self, roots: list[FileRoot], max_bytes: int, max_answer_bytes: int | None = None) -> None:
        """``max_answer_bytes``: a file larger than this on disk is refused before it is read, since its
        answer could only be larger (text as long at least, base64 a third longer)."""
        self.roots = sorted(roots, key=lambda r: len(r.path), reverse=True)  # the deepest root answers
        self.max_bytes = max_bytes
        self.max_answer_bytes = max_answer_bytes
        self._prefixes = tuple(r.uri_prefix for r in self.roots)

    def owns(self, uri: str) -> bool:
        return uri.startswith(self._prefixes)

    def _root_of(self, uri: str) -> FileRoot | None:
        return next((r for r in self.roots if uri.startswith(r.uri_prefix)), None)

    def locate(self, principal: Principal, uri: str) -> tuple[FileRoot, list[str]]:
        """The root and the path segments (relative to it) that ``uri`` names, after every lexical check.

        Raises:
            NotFound: another tenant's root, or a URI that is not the canonical spelling of a path
                under the root (``..``, ``.``, ``//``, encoded separators, dots or NUL).
        """
        root = self._root_of(uri)
        if root is None or root.tenant != principal.tenant:
            raise NotFound(uri)
        encoded = uri[len(PREFIX):]
        if "?" in encoded or "#" in encoded:
            raise NotFound(uri)
        raw = unquote_to_bytes(encoded)
        if b"\x00" in raw:
            raise NotFound(uri)
        path = os.fsdecode(raw)
        if file_uri(path) != uri:  # %2e, %2f, %41, lower-case hex: not the one spelling
            raise NotFound(uri)
        relative = path[len(root.path.rstrip("/")) + 1:]
        parts = relative.split("/")
        if not relative or any(p in ("", ".", "..") for p in parts):
            raise NotFound(uri)
        return root, parts

    def _resolve(self, uri: str, root: FileRoot, parts: list[str]) -> list[str]:
        """The segments of the resolved path, relative to the resolved root. Raises NotFound when it escapes."""
        real = os.path.realpath(os.path.join(root.path, *parts))
        if os.path.commonpath([real, root.real]) != root.real or real == root.real:
            raise NotFound(uri)
        return os.path.relpath(real, root.real).split(os.sep)

    def can_watch(self, principal: Principal, uri: str) -> bool:
        """The lexical and tenant checks of ``read``: a file that does not exist yet may be watched."""
        try:
            root, parts = self.locate(principal, uri)
            self._resolve(uri, root, parts)
        except NotFound:
            return False
        return True

    async def list_page(self, principal: Principal, state: str | None, limit: int) -> tuple[list[Json], str | None]:
        return await asyncio.to_thread(self._list_page, principal, state, limit)

    def _list_page(self, principal: Principal, state: str | None, limit: int) -> tuple[list[Json], str | None]:
        """Up to ``limit`` files after the path ``state``, in the order of their path components.

        The walk is lazy (``_walk``) and stops after ``limit + 1`` files, so a page reads the
        directories on the way to its cursor and those it lists, not the whole tree. The order is
        by component (``a/x`` before ``a-b``) because that is the order a walk yields them in; the
        state is only compared with the names read, never opened.
        """
        after = tuple(state.split("/")) if state else ()
        walks = []
        for root in self.roots:
            if root.tenant != principal.tenant:
                continue
            top = tuple(root.path.rstrip("/").split("/"))
            if after[:len(top)] == top or after < top:  # a root wholly before the cursor is skipped
                nested = frozenset(r.path for r in self.roots if r is not root)  # their files are theirs
                walks.append(_walk(root.path, top, after[len(top):] if after[:len(top)] == top else (), nested))
        found = list(islice(heapq.merge(*walks, key=lambda item: item[0]), limit + 1))
        items: list[Json] = []
        for _, entry in found[:limit]:
            try:
                size = entry.stat(follow_symlinks=False).st_size
            except OSError:
                continue  # gone since it was read
            items.append({"uri": file_uri(entry.path), "name": entry.name,
                          "mimeType": mimetypes.guess_type(entry.path)[0] or "application/octet-stream",
                          "size": size})
        return items, (found[limit - 1][1].path if len(found) > limit else None)

    async def read(self, principal: Principal, uri: str) -> list[Json]:
        root, parts = self.locate(principal, uri)
        data = await asyncio.to_thread(self._read_bytes, uri, root, parts)
        mime = mimetypes.guess_type(os.path.join(root.path, *parts))[0] or "application/octet-stream"
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            self._check_answer(uri, 4 * ((len(data) + 2) // 3))
            return [{"uri": uri, "mimeType": mime, "blob": base64.b64encode(data).decode()}]
        self._check_answer(uri, _json_size(data))
        if mime == "application/octet-stream":
            mime = "text/plain"
        return [{"uri": uri, "mimeType": mime, "text": text}]

    def _check_answer(self, uri: str, size: int) -> None:
        """Refuse contents of ``size`` bytes as JSON before they are encoded: a file of control
        characters is six times its size as an answer, and building one only to drop it would cost
        the worker that much for each such read."""
        if self.max_answer_bytes is not None and size > self.max_answer_bytes:
            raise AnswerTooLarge(uri, self.max_answer_bytes)

    def _read_bytes(self, uri: str, root: FileRoot, parts: list[str]) -> bytes:
        """Open the resolved path from the root's descriptor, one segment at a time without following links."""
        segments = self._resolve(uri, root, parts)
        try:
            fd = os.open(root.real, _DIR_FLAGS)
        except OSError as exc:
            raise NotFound(uri) from exc
        try:
            for segment in segments[:-1]:
                try:
                    parent, fd = fd, os.open(segment, _DIR_FLAGS, dir_fd=fd)
                except OSError as exc:  # missing, not a directory, or a symlink swapped in (ELOOP)
                    raise NotFound(uri) from exc
                os.close(parent)
            try:
                info = os.stat(segments[-1], dir_fd=fd, follow_symlinks=False)
            except OSError as exc:
                raise NotFound(uri) from exc
            if not stat.S_ISREG(info.st_mode):
                raise NotAFile(uri, _kind(info.st_mode))  # stat first: opening a FIFO or device is itself an act
            try:
                file_fd = os.open(segments[-1], _OPEN_FLAGS, dir_fd=fd)
            except OSError as exc:
                raise NotFound(uri) from exc
        finally:
            os.close(fd)
        with os.fdopen(file_fd, "rb") as handle:
            info = os.fstat(handle.fileno())
            if not stat.S_ISREG(info.st_mode):  # swapped between the stat and the open
                raise NotAFile(uri, _kind(info.st_mode))
            if info.st_size > self.max_bytes:
                raise FileTooLarge(uri, info.st_size, self.max_bytes)
            if self.max_answer_bytes is not None and info.st_size > self.max_answer_bytes:
                raise AnswerTooLarge(uri, self.max_answer_bytes)
            data = handle.read(self.max_bytes + 1)
        if len(data) > self.max_bytes:  # it grew since the fstat
            raise FileTooLarge(uri, len(data), self.max_bytes)
        return data

    def templates(self, principal: Principal) -> list[Json]:
        return [{"uriTemplate": root.uri_prefix + "{path}", "name": f"files under {root.path}",
                 "description": "A file under this directory (path segments percent-encoded)"}
                for root in sorted(self.roots, key=lambda r: r.path) if root.tenant == principal.tenant]


def _json_size(data: bytes) -> int:
    """Bytes of the UTF-8 ``data`` inside a JSON string, as orjson writes it (two passes, no copy kept)."""
    short = len(data) - len(data.translate(None, _ESCAPED_SHORT))
    long = len(data) - len(data.translate(None, _ESCAPED_LONG))
    return len(data) + short + 5 * long


def roots_of(settings: Settings) -> list[FileRoot]:
    """The configured roots. Raises ValueError naming ``MCP_BROKER_FILE_ROOTS`` for one that is not a directory."""
    roots = []
    for tenant, path in settings.file_roots.items():
        if not os.path.isabs(path) or not os.path.isdir(path):
            raise ValueError(f"MCP_BROKER_FILE_ROOTS: {path!r} (tenant {tenant!r}) is not an absolute path "
                             "to an existing directory")
        roots.append(FileRoot.of(tenant, path))
    return roots
