"""``UpstreamWatch`` against a real SDK server in each era: updates, a changed set of URIs, breaks and gaps."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncIterator, Iterator

import pytest

from broker.upstreams.client import UpstreamClient
from broker.upstreams.watch import UpstreamWatch
from tests.upstreams.conftest import CLIENT_INFO, ERAS, UpstreamProcess, eventually, spec_for


class Recorder:
    """The watch's events, in order; ``fail_once`` makes the first ``updated`` raise."""

    def __init__(self, *, fail_once: bool = False) -> None:
        self.log: list[tuple[str, object]] = []
        self.fail_once = fail_once

    async def updated(self, uri: str) -> None:
        self.log.append(("updated", uri))
        if self.fail_once:
            self.fail_once = False
            raise RuntimeError("a subscriber's publish failed")

    async def list_changed(self, what: str) -> None:
        self.log.append(("list_changed", what))

    async def gap(self, uris: frozenset[str]) -> None:
        self.log.append(("gap", uris))

    def updates(self, uri: str) -> int:
        return self.log.count(("updated", uri))

    def gaps(self) -> list[object]:
        return [uris for kind, uris in self.log if kind == "gap"]


def notes(*keys: str) -> frozenset[str]:
    return frozenset(f"note://{key}" for key in keys)


@contextlib.asynccontextmanager
async def watching(upstream: UpstreamProcess, uris: frozenset[str],
                   recorder: Recorder | None = None) -> AsyncIterator[tuple[UpstreamWatch, Recorder]]:
    """A watch of ``uris`` running in a task, once the upstream confirmed them (and said they are a gap)."""
    client = UpstreamClient(spec_for(upstream.mcp_url, timeout=5.0), client_info=CLIENT_INFO)
    events = recorder or Recorder()
    watch = UpstreamWatch(client, events)
    watch.want(uris)
    task = asyncio.create_task(watch.run())
    try:
        await eventually(lambda: task.done() or (watch.state == "watching" and watch.watched == uris),
                         "the watch to be up")
        assert not task.done(), task
        await eventually(lambda: uris in events.gaps() or not uris, "the first gap")
        yield watch, events
    finally:
        task.cancel()
        await asyncio.wait([task])
        await client.aclose()


@pytest.fixture
def fresh(request: pytest.FixtureRequest) -> Iterator[UpstreamProcess]:
    """An upstream of its own in the era of the test's parameter, for a test that stops it or breaks its streams."""
    proc = UpstreamProcess(era=request.param)
    yield proc
    proc.stop()


async def test_updates_of_wanted_uris_are_told(upstream: UpstreamProcess) -> None:
    a, b, other = (secrets.token_hex(3) for _ in range(3))
    async with watching(upstream, notes(a, b)) as (watch, events):
        await upstream.set_note(other, "not watched")  # new: the resource list changed, too
        await upstream.set_note(a, "1")
        await eventually(lambda: events.updates(f"note://{a}") == 1, "the update of a")
        await eventually(lambda: ("list_changed", "resources") in events.log, "the list change")
        assert events.updates(f"note://{other}") == 0
        assert watch.received >= 2 and watch.reconnects == 0


async def test_a_changed_set_of_uris_keeps_the_others_watched(upstream: UpstreamProcess) -> None:
    a, b, c = (secrets.token_hex(3) for _ in range(3))
    async with watching(upstream, notes(a, b)) as (watch, events):
        watch.want(notes(b, c))
        await eventually(lambda: watch.watched == notes(b, c), "c to be watched")
        assert events.gaps()[-1] == notes(c)  # only the new one may have been missed
        for key in (a, b, c):
            await upstream.set_note(key, "changed")
        await eventually(lambda: events.updates(f"note://{b}") == 1 and events.updates(f"note://{c}") == 1,
                         "the updates of b and c")
        stats = await upstream.stats()
        if upstream.era == "legacy":
            assert f"note://{a}" not in stats["watchers"] and stats["get_streams"] >= 1
        else:
            assert f"note://{a}" not in stats["listening"] and f"note://{b}" in stats["listening"]
        assert events.updates(f"note://{a}") == 0 and watch.reconnects == 0


async def test_a_failing_callback_does_not_break_the_watch(upstream: UpstreamProcess) -> None:
    a = secrets.token_hex(3)
    async with watching(upstream, notes(a), Recorder(fail_once=True)) as (watch, events):
        await upstream.set_note(a, "1")
        await eventually(lambda: events.updates(f"note://{a}") == 1, "the first update")
        await upstream.set_note(a, "2")
        await eventually(lambda: events.updates(f"note://{a}") == 2, "the second update")
        assert watch.reconnects == 0


@pytest.mark.parametrize("fresh", ERAS, indirect=True)
async def test_a_restarted_upstream_is_a_gap_of_every_uri_then_updates_again(fresh: UpstreamProcess) -> None:
    a, b = (secrets.token_hex(3) for _ in range(2))
    async with watching(fresh, notes(a, b)) as (watch, events):
        fresh.stop()
        await eventually(lambda: watch.state == "broken", "the watch to see the upstream gone")
        await asyncio.to_thread(fresh.start)  # the watch keeps trying meanwhile
        await eventually(lambda: events.gaps().count(notes(a, b)) == 2, "the gap after the restart")
        await fresh.set_note(a, "after")
        await eventually(lambda: events.updates(f"note://{a}") == 1, "an update after the restart")
        assert watch.state == "watching" and watch.reconnects >= 1


@pytest.mark.parametrize("fresh", ["legacy"], indirect=True)
async def test_a_broken_2025_stream_is_resumed_and_nothing_is_missed(fresh: UpstreamProcess) -> None:
    a = secrets.token_hex(3)
    async with watching(fresh, notes(a)) as (watch, events):
        await fresh.set_note(a, "1")  # an event with an id: the stream can be resumed from it
        await eventually(lambda: events.updates(f"note://{a}") == 1, "the first update")
        await fresh.side("POST", "/streams/drop", {"hold": True})  # no new stream until released
        await eventually(lambda: watch.state == "broken", "the watch to see its stream dropped")
        await fresh.set_note(a, "2")  # while no stream is open
        await fresh.side("POST", "/streams/release")
        await eventually(lambda: events.updates(f"note://{a}") == 2, "the update sent while the stream was down")
        assert events.gaps() == [notes(a)]  # the first one only
        assert watch.state == "watching"


@pytest.mark.parametrize("fresh", ["legacy"], indirect=True)
async def test_a_2025_stream_that_cannot_be_resumed_is_a_gap(fresh: UpstreamProcess) -> None:
    """Dropped before it sent any event: there is no id to resume from, and what was sent meanwhile is lost."""
    a = secrets.token_hex(3)
    async with watching(fresh, notes(a)) as (watch, events):
        await fresh.side("POST", "/streams/drop", {"hold": False})
        await eventually(lambda: events.gaps() == [notes(a), notes(a)], "a gap after the break")
        await fresh.set_note(a, "after")
        await eventually(lambda: events.updates(f"note://{a}") == 1, "an update on the new stream")
        assert watch.reconnects == 1
