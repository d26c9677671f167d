"""Backends: ``memory`` (the embedded default) and ``redis`` (distributed)."""

from __future__ import annotations

from broker.backends.base import Backend
from broker.config import Settings
from broker.metrics import NO_METRICS, Metrics

__all__ = ["Backend", "create_backend"]


def create_backend(settings: Settings, metrics: Metrics = NO_METRICS) -> Backend:
    """The backend the settings name: Redis when ``redis_url`` is set, memory otherwise."""
    if settings.redis_url:
        from broker.backends.redis import RedisBackend  # imported lazily: the memory path needs no Redis

        return RedisBackend(settings, metrics=metrics)
    from broker.backends.memory import MemoryBackend

    return MemoryBackend(settings, metrics)
