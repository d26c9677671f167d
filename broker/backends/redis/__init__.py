"""The distributed backend on Redis (single node, Sentinel, Cluster); see ``backend`` for the design."""

from __future__ import annotations

from broker.backends.redis.backend import RedisBackend

__all__ = ["RedisBackend"]
