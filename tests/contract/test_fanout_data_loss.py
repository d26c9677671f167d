"""A fan-out batch read before the store lost its data adds nothing to a session made after the loss.

Fan-out reads a batch, looks its subscribers up and appends in later calls; when Redis is emptied
(a restart without data, a FLUSHALL) in between, those calls land on the emptied store. A feed made
there meanwhile (a stream restoring its session, a poll or webhook subscription answering
``truncated``) already stands for every change before it, so the old batch's frames must not follow
in its inbox, after the truncation that stands for them.
"""

from __future__ import annotations

import pytest

from broker.backends.base import Backend
from broker.changes import Change
from broker.config import Settings
from broker.fanout import Fanout
from broker.notifications import update_frame
from tests.contract.conftest import open_session


async def test_a_batch_read_before_the_store_was_emptied_adds_nothing_to_a_session_made_after(
        backend: Backend) -> None:
    if not hasattr(backend, "redis"):
        pytest.skip("the memory backend never loses its data")
    fanout = Fanout(Settings(_env_file=None), backend, "c1")  # type: ignore[call-arg]
    before = await open_session(backend)
    await backend.subscriptions.add(before, "t1", "polled/a")
    await backend.changelog.publish(Change("t1", "polled/a"))
    read_under = backend.sessions.epoch
    batch = await backend.changelog.read("c1", 10, 100)
    assert len(batch) == 1

    await backend.redis.flushall()  # type: ignore[attr-defined]
    after = await open_session(backend)
    await backend.subscriptions.add(after, "t1", "polled/a")
    await fanout.process(batch, read_under)

    read = await backend.inboxes.read(after, backend.sessions.epoch, 0, 10)
    assert (read.gap, read.frames) == (False, []), "a change from before the loss follows the feed made after it"

    # A change published after the loss reaches the new session, even from a worker that read
    # it before it noticed the loss (its epoch still the old one).
    change = Change("t1", "polled/a", meta={"n": 2})
    await fanout.process([(await backend.changelog.publish(change), change)], read_under)
    read = await backend.inboxes.read(after, backend.sessions.epoch, 0, 10)
    assert [frame.data for _, frame in read.frames] == [update_frame("polled/a", {"n": 2}).data]
