"""Clients for the Redis URLs the broker accepts, and the one place redis-py errors are translated.

* ``redis://`` and ``rediss://`` (TLS): one server.
* ``redis+sentinel://host:port[,host:port...]/<service>[/<db>]``: the master Sentinel names,
  found again after a failover (``redis.asyncio.sentinel``, asked again every half second:
  see ``sentinel.SentinelMasterPool``).
* ``redis+cluster://host:port[,host:port...]``: Redis Cluster (``redis.asyncio.cluster``);
  ``rediss+cluster://`` with TLS.

Every client has connect and socket timeouts, TCP keep-alive and a small retry with backoff,
so a dead server surfaces as :class:`BackendUnavailable` within seconds rather than a hang.

**A command given up on is never sent later.** When redis-py gives up on a command (a socket
timeout, an error, a cancellation) it drops the connection before it raises. A graceful close
would still deliver the command: asyncio flushes its write buffer first, and the kernel keeps
retransmitting its send queue, so over a route that drops packets for a while the command ran
seconds after the caller was answered 503, over the caller's newer acknowledged writes. Every
TCP connection to Redis (:class:`_DiscardUnsent`, on every client built here) therefore sets
``SO_LINGER`` to ``(on, 0)`` and is dropped by aborting its transport and waiting until the
socket is closed: the close sends RST and the kernel frees the send queue at once, so by the
time the error is raised the command either reached Redis's host already or never will. A
retry goes out on a new connection, which the same rule covers. Not recalled: segments already
on the wire (a network that holds packets back for seconds rather than dropping them delivers
them late), and bytes Redis's host has received but Redis has not read yet (Redis frozen, or
busy in a long script, past the socket timeout): Redis runs those when it reads again. Fencing
every write script with a deadline checked against Redis's ``TIME`` would cover those too, but
it trusts every worker's clock to agree with Redis's and touches every write; a reset
connection trusts only the local kernel and costs nothing per command.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

from redis import exceptions as rexc
from redis.asyncio import Redis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.connection import Connection
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import ExponentialBackoff

from broker.backends.redis.multiplex import Multiplexed, Server
from broker.backends.redis.pool import QuickPool
from broker.backends.redis.sentinel import SentinelMasterPool
from broker.config import Settings
from broker.errors import BackendUnavailable

_hiredis_pack: Callable[[tuple[Any, ...]], bytes] | None
try:
    from hiredis import pack_command as _hiredis_pack
except ImportError:  # redis-py packs in Python without it
    _hiredis_pack = None

__all__ = ["Client", "ClientFactory", "Clients", "open_clients", "unavailable"]

#: A client of one server (plain, TLS, Sentinel's master) or of a Cluster.
Client = Redis | RedisCluster

#: Builds one client; the backend calls it twice (commands, pub/sub). Tests pass a fake server's here.
ClientFactory = Callable[[], Redis]

# Errors that mean "the store cannot be reached", as opposed to a bug in a command.
_UNREACHABLE = (
    rexc.ConnectionError,
    rexc.TimeoutError,
    rexc.BusyLoadingError,
    rexc.ReadOnlyError,
    rexc.ClusterDownError,
    rexc.TryAgainError,
    rexc.MasterDownError,
    rexc.SlotNotCoveredError,
    rexc.OutOfMemoryError,  # maxmemory reached under noeviction: no write can succeed for now
    OSError,
)


@contextlib.contextmanager
def unavailable(what: str) -> Iterator[None]:
    """Translate redis-py's connection failures into ``BackendUnavailable`` (``raise ... from``)."""
    try:
        yield
    except _UNREACHABLE as exc:
        raise BackendUnavailable(f"redis unavailable during {what}: {exc}") from exc


@dataclass(slots=True)
class Clients:
    commands: Client
    pubsub: Client
    cluster: bool


def _common(settings: Settings) -> dict[str, Any]:
    return {
        "socket_timeout": settings.redis_socket_timeout,
        "socket_connect_timeout": settings.redis_connect_timeout,
        "socket_keepalive": True,
        "health_check_interval": settings.redis_health_check_interval,
        "retry": Retry(ExponentialBackoff(cap=0.5, base=0.05), settings.redis_retries),
    }


def _hosts(netloc: str, default_port: int) -> list[tuple[str, int]]:
    hosts = []
    for part in netloc.rpartition("@")[2].split(","):
        host, _, port = part.rpartition(":") if part.count(":") == 1 or part.startswith("[") else (part, "", "")
        hosts.append((host.strip("[]") or "localhost", int(port) if port else default_port))
    return hosts


def _credentials(netloc: str) -> dict[str, Any]:
    userinfo, at, _ = netloc.rpartition("@")
    if not at:
        return {}
    user, colon, password = userinfo.partition(":")
    creds: dict[str, Any] = {"password": unquote(password) if colon else unquote(user)}
    if colon and user:
        creds["username"] = unquote(user)
    return creds


#: ``struct linger`` with ``l_onoff=1, l_linger=0``: close() resets the connection and drops its send queue.
_RESET_ON_CLOSE = struct.pack("ii", 1, 0)


class _DiscardUnsent(Connection):
    """A TCP connection to Redis whose unsent bytes die with it (see the module docstring)."""

    async def _connect(self) -> None:
        await super()._connect()  # type: ignore[no-untyped-call]
        if self._writer is not None and (sock := self._writer.get_extra_info("socket")) is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET_ON_CLOSE)

    async def disconnect(self, nowait: bool = False, error: Exception | None = None, failure_count: int | None = None,
                         health_check_failed: bool = False) -> None:
        if self._writer is not None:
            self._writer.transport.abort()  # asyncio's unsent buffer is dropped, not flushed
        # Wait for the socket to close even when redis-py would not (nowait): the caller's
        # error, and so its 503, must come after the kernel has dropped the send queue.
        await super().disconnect(nowait=False, error=error, failure_count=failure_count,
                                 health_check_failed=health_check_failed)

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        """redis-py's, without ``asyncio.wait_for`` around the write.

        On Python 3.11 ``wait_for`` runs the write in a task of its own, and when the caller is
        cancelled just as that task finishes it returns normally and the cancellation is lost
        (fixed in 3.12): a stream's request task cancelled mid-command then never ended. It was
        also a task, a future and a timer per command sent. The write is handed to the
        transport at once; only a transport that could not take it all (its buffer above the
        high-water mark) is waited for, under ``socket_timeout`` as before.
        """
        if not self.is_connected:
            await self.connect_check_health(check_health=False)
        if check_health:
            await self.check_health()  # type: ignore[no-untyped-call]
        writer = self._writer
        try:
            if isinstance(command, str):
                command = command.encode()
            if isinstance(command, bytes):
                command = [command]
            assert writer is not None
            writer.writelines(command)
            if writer.transport.get_write_buffer_size() == 0 or not self.socket_timeout:
                await writer.drain()  # nothing is buffered: returns at once (raises if the connection is lost)
            else:
                async with asyncio.timeout(self.socket_timeout):
                    await writer.drain()
        except TimeoutError:
            await self.disconnect(nowait=True)
            raise rexc.TimeoutError("Timeout writing to socket") from None
        except OSError as exc:
            await self.disconnect(nowait=True)
            raise rexc.ConnectionError(f"Error while writing to socket: {exc}.") from exc
        except BaseException:
            await self.disconnect(nowait=True)
            raise

    def pack_command(self, *args: Any) -> list[bytes]:
        """The command in RESP, packed by hiredis's C packer as redis-py's synchronous client does.

        redis-py's asyncio connection packs in Python, a function call and several type checks
        per argument and a bytes join per argument: fan-out's pipelines carry a few hundred
        arguments per batch (an inbox append is six per session). In ``bench.instructions``
        on Redis that was about 25 encoder calls and 180 ``isinstance`` checks of the 1,070
        Python calls per delivered frame (bench/NOTES.md). Anything hiredis refuses (a bool,
        an unknown type) is redis-py's to pack, or to refuse with its own error; a non-UTF-8
        client encoding too.
        """
        if _hiredis_pack is None or self.encoder.encoding != "utf-8" or self.encoder.encoding_errors != "strict":
            return super().pack_command(*args)
        first = args[0]
        # As redis-py: a command name with spaces ("CONFIG GET") is several arguments.
        if isinstance(first, (str, bytes)) and len(parts := first.split()) > 1:
            args = (*parts, *args[1:])  # a one-word name, the usual, is packed as it is
        try:
            return [_hiredis_pack(args)]
        except TypeError:
            return super().pack_command(*args)

    def _close(self) -> None:  # redis-py's synchronous close, outside a task (garbage collection)
        if self._writer is not None:
            self._writer.transport.abort()
        super()._close()  # type: ignore[no-untyped-call]


_DISCARDING: dict[Any, Any] = {}


def _discarding(connection_class: Any) -> Any:
    """``connection_class`` (TCP, TLS, Sentinel-managed) with :class:`_DiscardUnsent` first."""
    if not issubclass(connection_class, Connection) or issubclass(connection_class, _DiscardUnsent):
        return connection_class  # a Unix socket: no network in between to hold bytes back
    if connection_class not in _DISCARDING:
        name = f"DiscardUnsent{connection_class.__name__}"
        _DISCARDING[connection_class] = type(name, (_DiscardUnsent, connection_class), {})
    return _DISCARDING[connection_class]


def _make(settings: Settings, *, pubsub: bool) -> tuple[Client, bool]:
    url = settings.redis_url
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    common = _common(settings)
    if pubsub:
        # The pub/sub reader reconnects itself (and re-subscribes); it must see every failure.
        common["retry"] = Retry(ExponentialBackoff(), 0)
    if scheme in ("redis", "rediss", "unix"):
        # A blocking pool: a burst of more concurrent calls than connections (a reconnect storm)
        # waits for a free connection, where the default pool refused at once (a 503 per call).
        pool = QuickPool.from_url(url, max_connections=settings.redis_max_connections,
                                   timeout=settings.redis_socket_timeout, **common)
        plain_tcp = pool.connection_class is Connection  # not TLS, not a Unix socket
        pool.connection_class = _discarding(pool.connection_class)
        if plain_tcp and not pubsub:
            packer = pool.connection_class(**pool.connection_kwargs)  # never connected: it packs commands
            server = Server(pool.connection_kwargs, int(packer.protocol or 2))
            pool.multiplexed = Multiplexed(server, packer.pack_command)
        return Redis(connection_pool=pool), False
    creds = _credentials(parts.netloc)
    if scheme in ("redis+sentinel", "rediss+sentinel"):
        path = [p for p in parts.path.split("/") if p]
        if not path:
            raise ValueError("a redis+sentinel:// URL names the service: redis+sentinel://host:26379/mymaster")
        db = int(path[1]) if len(path) > 1 else 0
        sentinel_kwargs = {"socket_timeout": settings.redis_socket_timeout,
                           "socket_connect_timeout": settings.redis_connect_timeout}
        sentinel = Sentinel(  # type: ignore[no-untyped-call,unused-ignore]  # typed from redis-py 8.2
            _hosts(parts.netloc, 26379), sentinel_kwargs=sentinel_kwargs, **common)
        client = sentinel.master_for(path[0], redis_class=Redis, connection_pool_class=SentinelMasterPool, db=db,
                                     ssl=scheme.startswith("rediss"), **creds)
        pool = client.connection_pool
        pool.connection_class = _discarding(pool.connection_class)
        return client, False
    if scheme in ("redis+cluster", "rediss+cluster"):
        nodes = [ClusterNode(host, port) for host, port in _hosts(parts.netloc, 6379)]
        common.pop("health_check_interval")
        client = RedisCluster(startup_nodes=nodes, ssl=scheme.startswith("rediss"),
                              max_connections=settings.redis_max_connections, **creds, **common)
        # RedisCluster takes no connection class; every node it creates uses these kwargs (one
        # dict, shared with its NodesManager), and the startup nodes are already built.
        kwargs = client.get_connection_kwargs()
        kwargs["connection_class"] = discarding = _discarding(kwargs["connection_class"])
        for node in client.nodes_manager.startup_nodes.values():
            node.connection_class = discarding
        return client, True
    raise ValueError(f"unsupported redis URL scheme {scheme!r}")


def open_clients(settings: Settings, factory: ClientFactory | None = None) -> Clients:
    """The command client and the pub/sub client for ``settings.redis_url`` (or from ``factory``)."""
    if factory is not None:
        return Clients(factory(), factory(), False)
    commands, cluster = _make(settings, pubsub=False)
    pubsub, _ = _make(settings, pubsub=True)
    if (isinstance(commands, Redis) and isinstance(pubsub, Redis)  # a RedisCluster has no pool
            and isinstance(commands.connection_pool, SentinelMasterPool)
            and isinstance(pubsub.connection_pool, SentinelMasterPool)):
        commands.connection_pool.followers.append(pubsub.connection_pool)
    return Clients(commands, pubsub, cluster)
