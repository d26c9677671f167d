"""``Feeds``: one creation with every bound, lookups by kind, and one rule for a cursor it cannot honour."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from broker.auth import Principal
from broker.backends.memory import MemoryBackend
from broker.backends.types import Frame
from broker.config import Settings
from broker.errors import BackendUnavailable, LimitExceeded, OverQuota, SessionNotFound
from broker.feeds.model import Cursor, FeedKind, Filter
from broker.feeds.service import SUBSCRIBE_CHUNK, Feeds
from broker.quotas import Limits, TenantQuotas

ALICE = Principal("t", "alice")


@pytest.fixture
async def backend() -> AsyncIterator[MemoryBackend]:
    impl = MemoryBackend(Settings(_env_file=None))  # type: ignore[call-arg]
    await impl.start()
    yield impl
    await impl.close()


def feeds_of(backend: MemoryBackend, max_sessions: int = 100, **limits: Any) -> Feeds:
    quotas = TenantQuotas({"default": Limits(**limits)}) if limits else None
    return Feeds(backend.sessions, backend.inboxes, backend.subscriptions, max_sessions, quotas=quotas)


async def test_a_feed_is_created_subscribed_to_its_whole_filter(backend: MemoryBackend) -> None:
    uris = [f"mcpb://t/items/r{n}" for n in range(SUBSCRIBE_CHUNK * 2 + 3)]
    feed = await feeds_of(backend).create(ALICE, FeedKind.POLL, Filter.of(uris, event="e"))
    assert await backend.subscriptions.of_session(feed.id) == set(uris)
    stored = await backend.sessions.get(feed.id)
    assert stored is not None and stored.kind is FeedKind.POLL and stored.filter == Filter.of(uris, event="e")


async def test_every_bound_refuses_before_anything_is_made(backend: MemoryBackend) -> None:
    with pytest.raises(OverQuota):
        await feeds_of(backend, subscriptions=2).create(ALICE, FeedKind.LISTEN, Filter.of(["a", "b", "c"]))
    with pytest.raises(OverQuota):
        await feeds_of(backend, subscriptions=2).resume(ALICE, None, FeedKind.LISTEN, Filter.of(["a", "b", "c"]))
    feeds = feeds_of(backend, max_sessions=1)
    await feeds.create(ALICE, FeedKind.SESSION)
    with pytest.raises(LimitExceeded):
        await feeds.create(ALICE, FeedKind.POLL, Filter.of(["a"]))
    assert await backend.sessions.count() == 1


async def test_a_feed_that_cannot_be_subscribed_is_removed(backend: MemoryBackend,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    added: list[str] = []

    async def add(session_id: str, tenant: str, uri: str, limit: int = 0) -> int:
        added.append(session_id)
        raise BackendUnavailable("subscriptions.add")

    monkeypatch.setattr(backend.subscriptions, "add", add)
    with pytest.raises(BackendUnavailable):
        await feeds_of(backend).create(ALICE, FeedKind.POLL, Filter.of(["a"]))
    assert added and await backend.sessions.get(added[0]) is None


async def test_a_feed_is_found_only_by_its_principal_and_as_its_kind(backend: MemoryBackend) -> None:
    feeds = feeds_of(backend)
    session = await feeds.create(ALICE, FeedKind.SESSION, capabilities={"dev.mcp-broker/listen": {"uris": ["a"]}})
    listen = await feeds.create(ALICE, FeedKind.LISTEN, Filter.of(["a"]))
    assert (await feeds.load(session.id, ALICE, FeedKind.SESSION)).id == session.id
    for feed_id, kind, who in [(listen.id, FeedKind.SESSION, ALICE), (session.id, FeedKind.LISTEN, ALICE),
                               (session.id, FeedKind.SESSION, Principal("t", "bob")), ("x" * 200, FeedKind.SESSION,
                                                                                       ALICE)]:
        with pytest.raises(SessionNotFound):
            await feeds.load(feed_id, who, kind)


async def test_a_cursor_it_cannot_honour_starts_at_the_head_with_the_gap_rule(backend: MemoryBackend) -> None:
    feeds = feeds_of(backend)
    wanted = Filter.of(["a"], event="e")
    first = await feeds.resume(ALICE, None, FeedKind.POLL, wanted)
    feed = first.feed
    assert first.new and not first.resync

    honoured = await feeds.resume(ALICE, Cursor(feed.id, feed.epoch, 3), FeedKind.POLL, wanted)
    assert (honoured.feed.id, honoured.after, honoured.resumed) == (feed.id, 3, True)

    other_epoch = await feeds.resume(ALICE, Cursor(feed.id, "0ther", 3), FeedKind.POLL, wanted)
    assert (other_epoch.feed.id, other_epoch.resync, other_epoch.new) == (feed.id, True, False)

    # Another filter, another kind or principal: a poll gets a new feed, with the gap rule.
    for cursor, kind, who in [(Cursor(feed.id, feed.epoch, 3), FeedKind.POLL, Principal("t", "bob")),
                              (Cursor(feed.id, feed.epoch, 3), FeedKind.LISTEN, ALICE)]:
        replaced = await feeds.resume(who, cursor, kind, wanted)
        assert replaced.feed.id != feed.id and replaced.resync and replaced.new
    replaced = await feeds.resume(ALICE, Cursor(feed.id, feed.epoch, 3), FeedKind.POLL, Filter.of(["b"], event="e"))
    assert replaced.feed.id != feed.id and replaced.resync


async def test_a_listen_with_another_filter_is_kept_refiltered_and_older_positions_get_the_gap_rule(
        backend: MemoryBackend) -> None:
    feeds = feeds_of(backend)
    listen = (await feeds.resume(ALICE, None, FeedKind.LISTEN, Filter.of(["a", "b"]))).feed
    await backend.inboxes.append([(listen.id, Frame("u:a", b"{}")), (listen.id, Frame("u:b", b"{}"))])

    refiltered = await feeds.resume(ALICE, Cursor(listen.id, listen.epoch, 1), FeedKind.LISTEN, Filter.of(["b", "c"]))

    assert (refiltered.feed.id, refiltered.resync, refiltered.new) == (listen.id, True, False)
    assert await backend.subscriptions.of_session(listen.id) == {"b", "c"}
    before = await feeds.resume(ALICE, Cursor(listen.id, listen.epoch, 1), FeedKind.LISTEN, Filter.of(["b", "c"]))
    assert before.resync
    after = await feeds.resume(ALICE, Cursor(listen.id, listen.epoch, 2), FeedKind.LISTEN, Filter.of(["b", "c"]))
    assert after.resumed and after.after == 2
