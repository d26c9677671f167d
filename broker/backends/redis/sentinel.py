"""The master Sentinel names, followed as soon as it names another (``redis+sentinel://``).

``connection.py`` builds the clients; this module keeps their connections on the master.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from redis import exceptions as rexc
from redis.asyncio.sentinel import SentinelConnectionPool, SentinelManagedConnection

__all__ = ["SENTINEL_RECHECK", "SentinelMasterPool"]


#: How often a Sentinel client asks which server is the master, besides on every reconnect.
SENTINEL_RECHECK = 0.5


class _FollowsMaster(SentinelManagedConnection):
    """A connection to Sentinel's master that reconnects to the master its pool knows now.

    redis-py's Sentinel connection looks the master up in ``connect`` only; a connection
    dropped in use (a failed command, or the pool dropping it after a failover) reconnects in
    ``send_packed_command`` through ``connect_check_health``, to the host and port it had. After
    a failover that was the old master, still writable for about ten seconds until Sentinel
    demotes it: commands retried there were acknowledged and then lost (measured: writes to the
    old master for 11 s after the promotion, against 1.5 s for a pool's new connections).
    """

    connection_pool: Any

    async def _connect(self) -> None:
        address = self.connection_pool.master_address
        if self.connection_pool.is_master and address is not None:
            self.host, self.port = address
        await super()._connect()  # type: ignore[no-untyped-call]


class SentinelMasterPool(SentinelConnectionPool):
    """The master's connections, dropped as soon as Sentinel names another master.

    redis-py asks Sentinel only when it opens a connection, and then drops only its idle
    connections. After a failover the old master stays a writable master until Sentinel turns
    it into a replica (about ten seconds later), so connections in use at the failover would
    keep writing there, all of it lost when it resynchronises.

    Every ``SENTINEL_RECHECK`` seconds, a checkout starts a check in the background (a slow
    Sentinel never holds up a command). When the master differs from the one the last check
    found, the check closes every connection, in use or not (commands are retried on the new
    master), and those of ``followers`` too: the pub/sub client's, so its reader resubscribes
    on the new master. Closing the pool closes the connections to the Sentinels as well
    (redis-py leaves them open).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[no-untyped-call]
        # connection.py puts _DiscardUnsent in front of this too.
        self.connection_class = type(f"Following{self.connection_class.__name__}",
                                     (_FollowsMaster, self.connection_class), {})
        self.followers: list[SentinelMasterPool] = []
        self._next_check = time.monotonic() + SENTINEL_RECHECK
        #: The master the last check found (or the first connection used); redis-py's own
        #: ``master_address`` moves whenever any connection is opened, so it cannot tell.
        self._checked: Any = None
        self._check: asyncio.Task[None] | None = None

    async def _master(self) -> Any:
        """The master as Sentinel names it to clients (``SENTINEL GET-MASTER-ADDR-BY-NAME``).

        During a failover that names the promoted replica as soon as it is promoted, where
        ``SENTINEL MASTERS`` (redis-py's ``discover_master``) names the old master until the
        failover ends, up to ``failover-timeout`` later: writes made there meanwhile are lost
        when it becomes a replica. A master that is down and not being replaced is left to
        ``discover_master``, which refuses it.
        """
        for sentinel in self.sentinel_manager.sentinels:
            try:
                state = await sentinel.sentinel_master(self.service_name)
                found = await sentinel.sentinel_get_master_addr_by_name(self.service_name)
            except (rexc.ConnectionError, rexc.TimeoutError, rexc.ResponseError):
                continue
            if not found:
                continue
            host, port = found
            address = (host.decode() if isinstance(host, bytes) else host), int(port)
            if address != (state.get("ip"), state.get("port")):
                return address  # the replica being promoted
            if not (state.get("is_sdown") or state.get("is_odown")):
                return address
        return await self.sentinel_manager.discover_master(self.service_name)

    async def get_master_address(self) -> Any:
        address = await self._master()
        if self.is_master and self.master_address != address:
            # As redis-py does: idle connections reconnect to the new master when next used.
            self.master_address = address
            await self.disconnect(inuse_connections=False)
        if self._checked is None:
            self._checked = address
        return address

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        now = time.monotonic()
        if now >= self._next_check and self._checked is not None and (self._check is None or self._check.done()):
            self._next_check = now + SENTINEL_RECHECK
            self._check = asyncio.create_task(self._recheck())
        return await super().get_connection(*args, **kwargs)  # type: ignore[no-untyped-call]

    async def _recheck(self) -> None:
        try:
            address = await self._master()
        except (rexc.ConnectionError, rexc.TimeoutError):
            return  # an unreachable Sentinel is no reason to drop anything: keep the master we know
        if address == self._checked:
            return
        self._checked = address
        for pool in (self, *self.followers):
            pool.master_address = address  # where their dropped connections reconnect (_FollowsMaster)
            try:
                await pool.disconnect()
            except (rexc.RedisError, OSError):
                pass  # a connection that fails to close is gone all the same

    async def aclose(self) -> None:
        if self._check is not None:
            self._check.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._check
        await super().aclose()
        for sentinel in self.sentinel_manager.sentinels:
            await sentinel.aclose()
