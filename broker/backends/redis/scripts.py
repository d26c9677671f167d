"""The Lua scripts beside this module, registered once per client and run by EVALSHA.

Each script declares every key it touches in ``KEYS`` (its header comment lists them), so it
is legal in Redis Cluster when those keys share a hash tag; ``tests/contract`` checks the
sources for key arguments that do not come from ``KEYS``.
"""

from __future__ import annotations

from importlib import resources

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.commands.core import AsyncScript

__all__ = ["NAMES", "Scripts", "source"]

NAMES = (
    "get_or_set",
    "session_create",
    "session_touch",
    "session_update",
    "session_delete",
    "subscription_add",
    "subscription_remove",
    "session_restore",
    "subscriptions_get",
    "inbox_append",
    "inbox_read",
    "stream_claim",
    "record_write",
    "record_delete",
    "partition_lease",
    "fanout_read",
    "fanout_consumers",
    "changelog_append",
    "changelog_ack",
    "quota_acquire",
    "quota_refresh",
    "quota_take",
    "session_admit",
    "compare_and_set",
    "record_import",
)


#: The scripts that number a session's frames or hand out its head, with ``lineage.lua`` before them.
FENCED = frozenset({"inbox_append", "inbox_read", "session_create", "session_restore"})


def _read(name: str) -> str:
    return resources.files(__package__).joinpath(f"{name}.lua").read_text(encoding="utf-8")


def source(name: str) -> str:
    return _read("lineage") + _read(name) if name in FENCED else _read(name)


class Scripts:
    """One ``AsyncScript`` per file; ``AsyncScript`` reloads a script the server forgot (NOSCRIPT)."""

    def __init__(self, client: Redis | RedisCluster) -> None:
        loaded = {name: client.register_script(source(name)) for name in NAMES}
        self.get_or_set: AsyncScript = loaded["get_or_set"]
        self.session_create: AsyncScript = loaded["session_create"]
        self.session_touch: AsyncScript = loaded["session_touch"]
        self.session_update: AsyncScript = loaded["session_update"]
        self.session_delete: AsyncScript = loaded["session_delete"]
        self.subscription_add: AsyncScript = loaded["subscription_add"]
        self.subscription_remove: AsyncScript = loaded["subscription_remove"]
        self.session_restore: AsyncScript = loaded["session_restore"]
        self.subscriptions_get: AsyncScript = loaded["subscriptions_get"]
        self.inbox_append: AsyncScript = loaded["inbox_append"]
        self.inbox_read: AsyncScript = loaded["inbox_read"]
        self.stream_claim: AsyncScript = loaded["stream_claim"]
        self.record_write: AsyncScript = loaded["record_write"]
        self.record_delete: AsyncScript = loaded["record_delete"]
        self.partition_lease: AsyncScript = loaded["partition_lease"]
        self.fanout_read: AsyncScript = loaded["fanout_read"]
        self.fanout_consumers: AsyncScript = loaded["fanout_consumers"]
        self.changelog_append: AsyncScript = loaded["changelog_append"]
        self.changelog_ack: AsyncScript = loaded["changelog_ack"]
        self.quota_acquire: AsyncScript = loaded["quota_acquire"]
        self.quota_refresh: AsyncScript = loaded["quota_refresh"]
        self.quota_take: AsyncScript = loaded["quota_take"]
        self.session_admit: AsyncScript = loaded["session_admit"]
        self.compare_and_set: AsyncScript = loaded["compare_and_set"]
        self.record_import: AsyncScript = loaded["record_import"]
