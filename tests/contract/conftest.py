"""The Backend contract runs against every implementation: ``backend`` is parametrized by name."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator

import pytest

from broker.backends.base import Backend
from broker.backends.memory import MemoryBackend
from broker.config import Settings

#: Implementations under contract. The Redis backend joins as "fakeredis" and "redis".
BACKENDS = ["memory"]


async def make_backend(name: str, settings: Settings, request: pytest.FixtureRequest) -> Backend:
    if name == "memory":
        return MemoryBackend(settings)
    raise ValueError(name)


@pytest.fixture(params=BACKENDS)
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    settings = Settings(_env_file=None, redis_prefix=f"t{secrets.token_hex(4)}",  # type: ignore[call-arg]
                        inbox_maxlen=50, session_ttl=30.0)
    impl = await make_backend(request.param, settings, request)
    await impl.start()
    yield impl
    await impl.close()
