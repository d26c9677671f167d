"""``MCP_BROKER_FILE_ROOTS``: each tenant's directory its own, once symlinks are resolved."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import unquote

import pytest
from pydantic import ValidationError

from broker.auth import Principal
from broker.config import Settings
from broker.sources.files import FileRoot, FilesProvider


def settings(roots: dict[str, str]) -> Settings:
    return Settings(_env_file=None, file_roots=roots)  # type: ignore[call-arg]


def test_roots_of_two_tenants_may_not_nest_or_meet(tmp_path: Path) -> None:
    outer, inner, other = tmp_path / "data", tmp_path / "data" / "b", tmp_path / "other"
    inner.mkdir(parents=True)
    other.mkdir()
    (tmp_path / "alias").symlink_to(inner)
    for roots in ({"acme": str(outer), "beta": str(inner)},
                  {"acme": str(inner), "beta": str(tmp_path / "alias")},  # the same directory, by a link
                  {"acme": str(inner), "beta": str(outer)}):
        with pytest.raises(ValidationError, match="overlap"):
            settings(roots)
    assert settings({"acme": str(inner), "beta": str(other)}).file_roots["beta"] == str(other)


def test_a_providers_entry_is_checked_for_its_form_without_being_imported() -> None:
    with pytest.raises(ValidationError, match="package.module:factory"):
        Settings(_env_file=None, providers=["not a spec"])  # type: ignore[call-arg]
    # Well formed but missing: not imported here (only `serve` and `stdio` import it, at start).
    assert Settings(_env_file=None, providers=["no_such_module:factory"]).providers == [  # type: ignore[call-arg]
        "no_such_module:factory"]


class CountingScandir:
    """``os.scandir`` that counts the directory entries read through it."""

    def __init__(self) -> None:
        self.entries = 0
        self._scandir = os.scandir

    @contextmanager
    def __call__(self, path: str) -> Iterator[Iterator[os.DirEntry[str]]]:
        with self._scandir(path) as entries:
            yield self._counted(entries)

    def _counted(self, entries: Iterator[os.DirEntry[str]]) -> Iterator[os.DirEntry[str]]:
        for entry in entries:
            self.entries += 1
            yield entry


def test_a_page_of_a_large_root_reads_what_leads_to_it_not_the_whole_tree(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """20,000 files in 100 directories, paged at the default size: each page reads the directories on
    the way to its cursor and those it lists, and every file comes exactly once, in path order."""
    root = tmp_path / "root"
    for d in range(100):
        (root / f"d{d:02}").mkdir(parents=True)
        for f in range(200):
            (root / f"d{d:02}" / f"f{f:03}.txt").touch()
    (root / "a").mkdir()
    for name in ("a/x.txt", "a-b.txt", "a.txt", "a0.txt"):  # a string's order is not the paths' order
        (root / name).touch()
    expected = sorted((str(p) for p in root.rglob("*") if p.is_file()), key=lambda p: Path(p).parts)
    provider, alice = FilesProvider([FileRoot.of("acme", str(root))], 1024), Principal("acme", "alice")
    limit = Settings(_env_file=None).page_size  # type: ignore[call-arg]
    counter = CountingScandir()
    monkeypatch.setattr(os, "scandir", counter)  # type: ignore[arg-type]
    listed: list[str] = []
    state: str | None = None
    pages = 0
    while True:
        counter.entries = 0
        started = time.perf_counter()
        items, state = provider._list_page(alice, state, limit)
        elapsed = time.perf_counter() - started
        print(f"page {pages}: {len(items)} files, {counter.entries} entries read, {elapsed * 1000:.1f} ms")
        assert counter.entries <= 104 + 2 * 200  # the root, and at most two of its directories
        assert len(items) <= limit
        listed.extend(unquote(item["uri"].removeprefix("file://")) for item in items)
        pages += 1
        if state is None:
            break
    assert listed == expected
    assert pages == -(-len(expected) // limit)
