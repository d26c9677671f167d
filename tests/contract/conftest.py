"""The Backend contract runs against every implementation: ``backend`` is parametrized by name."""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator

import pytest

from broker.backends.base import Backend, SessionRecord
from broker.backends.memory import MemoryBackend
from broker.config import Settings
from tests.contract.fake_redis import fakeredis_factory

#: Implementations under contract: the reference, the Redis backend on fakeredis (in process,
#: Lua through lupa, corrected to Redis's answers by ``fake_redis``) and on a real ``redis-server``
#: started for the test session.
BACKENDS = ["memory", "fakeredis", "redis"]


async def make_backend(name: str, settings: Settings, request: pytest.FixtureRequest) -> Backend:
    if name == "memory":
        return MemoryBackend(settings)
    from broker.backends.redis import RedisBackend

    if name == "fakeredis":
        return RedisBackend(settings, client_factory=fakeredis_factory())
    if name == "redis":
        server = request.getfixturevalue("redis_server")
        return RedisBackend(settings.model_copy(update={"redis_url": server.url}))
    raise ValueError(name)


@pytest.fixture(params=BACKENDS)
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    settings = Settings(_env_file=None, redis_prefix=f"t{secrets.token_hex(4)}",  # type: ignore[call-arg]
                        inbox_maxlen=50, session_ttl=30.0)
    impl = await make_backend(request.param, settings, request)
    await impl.start()
    yield impl
    await impl.close()


def new_session(backend: Backend, tenant: str = "t1", principal: str | None = None) -> SessionRecord:
    """A session record of ``tenant`` (its principal ``<tenant>/alice`` unless given), not yet stored."""
    return SessionRecord(id=secrets.token_urlsafe(16), tenant=tenant, principal=principal or f"{tenant}/alice",
                         protocol_version="2025-11-25", epoch=backend.sessions.epoch, created_at=time.time(),
                         client_info={"name": "test", "version": "1"}, client_capabilities={"roots": {}})


async def open_session(backend: Backend, tenant: str = "t1") -> str:
    """A new session of ``tenant``, stored; its id."""
    record = new_session(backend, tenant)
    await backend.sessions.create(record)
    return record.id
