"""The distributed backend on Redis (single node, Sentinel, Cluster); ``backend`` maps its modules."""

from __future__ import annotations

from broker.backends.redis.backend import RedisBackend

__all__ = ["RedisBackend"]
