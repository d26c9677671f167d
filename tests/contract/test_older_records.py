"""Records an older version wrote, before a feed's kind and filter were fields of their own, read
and refiltered right on Redis (fakeredis and a real server)."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator

import msgpack
import pytest

from broker.auth import Principal
from broker.backends.redis import RedisBackend
from broker.config import Settings
from broker.feeds.model import Cursor, FeedKind, Filter
from broker.feeds.service import Feeds
from tests.contract.conftest import make_backend

ALICE = Principal("t1", "alice")


@pytest.fixture(params=["fakeredis", "redis"])
async def redis_backend(request: pytest.FixtureRequest) -> AsyncIterator[RedisBackend]:
    settings = Settings(_env_file=None, redis_prefix=f"t{secrets.token_hex(4)}")  # type: ignore[call-arg]
    backend = await make_backend(request.param, settings, request)
    assert isinstance(backend, RedisBackend)
    await backend.start()
    yield backend
    await backend.close()


async def as_an_older_version_wrote_it(backend: RedisBackend, feed_id: str, uris: list[str]) -> None:
    """The feed's hash as the version before feeds wrote a resumable listen: no kind, no filter,
    the filter in the capabilities."""
    meta = backend.keys.session(feed_id).meta
    await backend.redis.hdel(meta, "kind", "filter", "since")
    await backend.redis.hset(meta, "caps", msgpack.packb({"dev.mcp-broker/listen": {"uris": uris}}))


async def test_an_older_versions_listen_keeps_the_filter_it_is_refiltered_to(redis_backend: RedisBackend) -> None:
    feeds = Feeds(redis_backend.sessions, redis_backend.inboxes, redis_backend.subscriptions, 100)
    listen = (await feeds.resume(ALICE, None, FeedKind.LISTEN, Filter.of(["a"]))).feed
    await as_an_older_version_wrote_it(redis_backend, listen.id, ["a"])

    refiltered = await feeds.resume(ALICE, Cursor(listen.id, listen.epoch, 0), FeedKind.LISTEN, Filter.of(["b"]))
    assert refiltered.feed.id == listen.id and refiltered.resync

    # Read back as it is now: the new filter, and a resume with it needs no resync again.
    loaded = await feeds.load(listen.id, ALICE, FeedKind.LISTEN)
    assert loaded.filter == Filter.of(["b"]) and loaded.since is not None
    again = await feeds.resume(ALICE, Cursor(listen.id, listen.epoch, loaded.since[1]), FeedKind.LISTEN,
                               Filter.of(["b"]))
    assert again.resumed and not again.resync


async def test_an_older_versions_2025_session_is_a_session_whatever_its_client_declared(
        redis_backend: RedisBackend) -> None:
    feeds = Feeds(redis_backend.sessions, redis_backend.inboxes, redis_backend.subscriptions, 100)
    session = await feeds.create(ALICE, FeedKind.SESSION, version="2025-11-25")
    await as_an_older_version_wrote_it(redis_backend, session.id, ["a"])
    assert (await feeds.load(session.id, ALICE, FeedKind.SESSION)).kind is FeedKind.SESSION
