"""A change source the change log's bound refuses backs off quietly and loses nothing."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from broker.errors import QuotaExceeded
from broker.sources import SourceRunner
from broker.sources.files import FileRoot
from broker.sources.filewatch import FileWatcher


class Refusing:
    """A publisher that refuses its ``refuse``-th change as the tenant's change-log bound does."""

    def __init__(self, refuse: int | None = None) -> None:
        self.refuse = refuse
        self.published: list[tuple[str, str]] = []

    async def publish(self, uri: str, kind: Any, **fields: Any) -> str:
        if self.refuse is not None and len(self.published) + 1 == self.refuse:
            raise QuotaExceeded("acme", 1, 1, 1)
        self.published.append((uri, str(kind)))
        return "1-0"


class Once:
    name = "once"
    exclusive = False

    def __init__(self) -> None:
        self.runs = 0

    async def run(self, publisher: Any) -> None:
        self.runs += 1
        if self.runs == 1:
            raise QuotaExceeded("acme", 10, 10, 1)


async def test_a_refused_source_is_started_again_without_a_traceback(caplog: pytest.LogCaptureFixture) -> None:
    source = Once()
    with caplog.at_level(logging.INFO, logger="broker.sources"):
        await SourceRunner(source, Refusing(), None, 1000).run()  # type: ignore[arg-type]
    assert source.runs == 2
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert any("the change log refused" in r.getMessage() for r in caplog.records)


async def test_the_file_watcher_publishes_what_was_refused_when_it_starts_again(tmp_path: Path) -> None:
    watcher = FileWatcher([FileRoot("acme", str(tmp_path), str(tmp_path))])
    await watcher._resync(Refusing())  # the snapshot: nothing yet
    paths = [tmp_path / f"f{n}.txt" for n in range(4)]
    for path in paths:
        path.write_text("x")
    refused = Refusing(refuse=3)
    with pytest.raises(QuotaExceeded):
        await watcher._batch(refused, {str(p) for p in paths})
    again = Refusing()
    await watcher._resync(again)  # the warm start of the next run
    assert sorted(uri for uri, _ in refused.published + again.published) == sorted(p.as_uri() for p in paths)
