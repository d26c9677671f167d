"""The reader's one loop: frames in batches, the gap rule from the head, and one rule per kind for a feed gone."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from broker.auth import Principal
from broker.backends.memory import MemoryBackend
from broker.backends.types import Frame, SessionRecord
from broker.config import Settings
from broker.feeds.model import FeedKind, Filter, Owner
from broker.feeds.reader import Batch, Gone, OnGone, View, on_gone
from broker.feeds.service import Feeds

ALICE = Principal("t", "alice")


@pytest.fixture
async def backend() -> AsyncIterator[MemoryBackend]:
    impl = MemoryBackend(Settings(_env_file=None, inbox_maxlen=4))  # type: ignore[call-arg]
    await impl.start()
    yield impl
    await impl.close()


class Recorder(View):
    """A view that notes what the loop told it."""

    __slots__ = ("after", "feed", "filter", "kind", "seen")

    def __init__(self, kind: FeedKind, feed: SessionRecord, after: int = 0) -> None:
        self.kind = kind
        self.feed = feed
        self.after = after
        self.filter = feed.filter
        self.seen: list[tuple[str, object]] = []

    def position(self) -> tuple[str, str, int]:
        return self.feed.id, self.feed.epoch, self.after

    async def send(self, batch: Batch) -> None:
        self.seen.append(("frames", [offset for offset, _ in batch.frames]))
        if batch.frames:
            self.after = batch.frames[-1][0]

    async def resync(self, epoch: str, head: int) -> None:
        self.feed.epoch, self.after = epoch, head
        self.seen.append(("resync", head))

    async def over(self, gone: Gone) -> None:
        self.seen.append(("over", gone))

    def renewal(self) -> tuple[Owner, Filter | None]:
        return ALICE, self.filter

    async def renewed(self, fresh: SessionRecord) -> None:
        self.seen.append(("renewed", fresh.kind))
        self.feed = fresh


def test_sessions_and_listens_come_back_after_a_loss_polls_and_webhooks_get_a_new_feed() -> None:
    assert [on_gone(kind, Gone.LOST) for kind in FeedKind] == [OnGone.RESTORE, OnGone.RESTORE, OnGone.RENEW,
                                                               OnGone.RENEW]
    assert [on_gone(kind, Gone.ENDED) for kind in FeedKind] == [OnGone.END, OnGone.END, OnGone.RENEW, OnGone.RENEW]


async def test_frames_come_in_batches_until_a_short_read(backend: MemoryBackend) -> None:
    feeds = Feeds(backend.sessions, backend.inboxes, backend.subscriptions, 10)
    feed = await feeds.create(ALICE, FeedKind.POLL, Filter.of(["u:a"]))
    await backend.inboxes.append([(feed.id, Frame(f"u:{n}", b"{}")) for n in range(3)])
    view = Recorder(FeedKind.POLL, feed)

    await feeds.reader.drain(view, 2)

    assert view.seen == [("frames", [1, 2]), ("frames", [3])]


async def test_a_position_trimmed_from_the_inbox_gets_the_gap_rule_from_the_head(backend: MemoryBackend) -> None:
    feeds = Feeds(backend.sessions, backend.inboxes, backend.subscriptions, 10)
    feed = await feeds.create(ALICE, FeedKind.LISTEN, Filter.of(["u:a"]))
    await backend.inboxes.append([(feed.id, Frame(f"u:{n}", b"{}")) for n in range(8)])
    view = Recorder(FeedKind.LISTEN, feed)

    await feeds.reader.drain(view, 10)

    assert view.seen == [("resync", 8), ("frames", [])]


async def test_an_ended_session_is_over_and_an_ended_poll_is_renewed(backend: MemoryBackend) -> None:
    feeds = Feeds(backend.sessions, backend.inboxes, backend.subscriptions, 10)
    session = await feeds.create(ALICE, FeedKind.SESSION)
    poll = await feeds.create(ALICE, FeedKind.POLL, Filter.of(["u:a"]))
    await feeds.end(session.id)
    await feeds.end(poll.id)
    ended, renewed = Recorder(FeedKind.SESSION, session), Recorder(FeedKind.POLL, poll)

    await feeds.reader.drain(ended, 10)
    await feeds.reader.drain(renewed, 10)

    assert ended.seen == [("over", Gone.ENDED)]
    assert renewed.seen == [("renewed", FeedKind.POLL)] and renewed.feed.id != poll.id
    assert await backend.subscriptions.of_session(renewed.feed.id) == {"u:a"}
