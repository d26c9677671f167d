"""Keys derived from sessions expire by themselves, whether or not the expiry sweep keeps up."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator

import pytest

from broker.backends.redis import RedisBackend
from broker.config import Settings
from tests.contract.conftest import open_session
from tests.contract.test_backend_contract import eventually
from tests.support import RedisProcess

TTL = 0.5


@pytest.fixture
async def short_lived(redis_server: RedisProcess) -> AsyncIterator[RedisBackend]:
    """Sessions live half a second without a touch; nothing runs ``expire_sessions``."""
    settings = Settings(_env_file=None, redis_url=redis_server.url,  # type: ignore[call-arg]
                        redis_prefix=f"t{secrets.token_hex(4)}", session_ttl=TTL, session_index_grace=0.5)
    backend = RedisBackend(settings)
    await backend.start()
    yield backend
    await backend.close()


async def test_index_and_tenant_sets_of_dead_sessions_expire_without_the_sweep(short_lived: RedisBackend) -> None:
    backend = short_lived
    uris = [f"x:{n}" for n in range(5)]
    for _ in range(3):
        sid = await open_session(backend, "t1")
        for uri in uris:
            await backend.subscriptions.add(sid, "t1", uri)
    derived = [backend.keys.index("t1", uri) for uri in uris] + [backend.keys.tenant_sessions("t1")]
    assert await backend.redis.exists(*derived) == len(derived)

    async def gone() -> bool:
        return await backend.redis.exists(*derived) == 0

    # Dead after TTL; their sets after 1.25 TTL plus the grace, with nothing sweeping them.
    await eventually(gone, "the derived keys to expire", timeout=TTL * 1.25 + 0.5 + 3)


async def test_the_sets_of_a_session_kept_alive_by_touches_do_not_expire(short_lived: RedisBackend) -> None:
    backend = short_lived
    sid = await open_session(backend, "t1")
    await backend.subscriptions.add(sid, "t1", "x:kept")
    deadline = time.monotonic() + TTL * 1.25 + 0.5 + 1.5  # well past when an unrefreshed set would expire
    while time.monotonic() < deadline:
        await backend.sessions.touch([sid])  # as the keep-alive timer of its open stream does
        await asyncio.sleep(TTL / 5)
    assert await backend.subscriptions.subscribers("t1", ["x:kept"]) == {"x:kept": [sid]}
    assert await backend.subscriptions.tenant_sessions("t1") == [sid]
