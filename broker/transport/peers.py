"""Connections shared fairly: a bound per client address, and room made at the cap (``Peers``).

``broker.transport.wire`` asks a worker's ``Peers`` when a connection opens whether it may,
and tells it when a head is read, a response completes and a connection closes.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Protocol

__all__ = ["Connection", "Peers"]


class Connection(Protocol):
    """What ``Peers`` needs of a connection (``broker.transport.wire.WireProtocol``)."""

    #: The peer it counts toward, while it has not authenticated; set and cleared by ``Peers``.
    peer: str | None

    def authenticated(self) -> bool:
        """Whether the request read last on it carried a valid credential."""

    def make_room(self) -> None:
        """Close it, for a new connection at the cap."""


class Peers:
    """One worker's connections by client address: which may open, and which one makes room at the cap.

    **Per peer.** The peer is the TCP peer's address, known when the connection is accepted, so
    a connection beyond its peer's bound is refused before any byte is read: a client reopening
    slow heads holds its share, not the worker. An IPv6 peer is its /64, which one host is given
    whole. A connection whose request carried a valid credential leaves its peer's count: clients
    behind one NAT, or one service with many streams, are bounded only by the cap once they
    authenticate. Whether a request did is read from its scope (the principal ``broker.transport.edge``
    puts there) when its response completes, and, for requests still running (streams), when
    their peer reaches its bound: then only those are looked at, never the peer's slow heads or
    idle connections, so a peer refused again and again costs no more than the refusal.

    A trusted proxy's connections are not counted: behind a balancer every connection has its
    address, and one connection carries many clients' requests in turn. The client's address it
    forwards is known only once a head is read, too late to spare the connection's slot, and a
    balancer that reads whole heads before it forwards them (nginx does) never passes a slow
    head on; bounding each client's connections is its job there (nginx's ``limit_conn``).

    **At the cap** the connection closed to make room is the oldest that has not sent a whole
    head yet: it has proved nothing, and a real client sends its head as soon as it connects.
    So clients that send requests, authenticated ones among them, get in while slow heads from
    many addresses fill the worker, and a slow head is closed once the cap's worth of newer
    connections has come. A worker whose every connection has sent a request refuses the new
    one, as before. (An unauthenticated connection idle between requests is not closed for a
    newcomer: its keep-alive timeout ends it, and its peer's bound holds it.)

    The work is done when a connection opens or closes, and per request a dict removal when
    its head is in and, on a connection still counted, a set insertion and removal: nothing
    per read.
    """

    __slots__ = ("bound", "credentials", "exact", "networks", "running", "unproven", "waiting")

    def __init__(self, bound: int, trusted_proxies: tuple[str, ...], credentials: bool) -> None:
        self.bound = bound
        #: Whether a request can authenticate at all: without credentials configured, every
        #: connection counts toward its peer for as long as it is open.
        self.credentials = credentials
        networks = [ipaddress.ip_network(entry, strict=False) for entry in trusted_proxies]
        self.exact = frozenset(str(network.network_address) for network in networks if network.num_addresses == 1)
        self.networks = tuple(network for network in networks if network.num_addresses > 1)
        #: Per peer, its open connections that have not authenticated.
        self.unproven: dict[str, set[Connection]] = {}
        #: Per peer, those of them running a request that may authenticate (credentials configured).
        self.running: dict[str, set[Connection]] = {}
        #: Connections that have not sent a whole head yet, oldest first (a dict keeps its order).
        self.waiting: dict[Connection, None] = {}

    def peer_of(self, host: str) -> str | None:
        """The peer a client at ``host`` counts as; None for a trusted proxy."""
        if host.startswith("::ffff:") and "." in host:
            host = host[7:]  # IPv4 on a dual-stack socket
        if host in self.exact:
            return None
        host = host.partition("%")[0]
        if self.networks:
            address = ipaddress.ip_address(host)
            if any(address in network for network in self.networks):
                return None
        if ":" in host:
            return socket.inet_pton(socket.AF_INET6, host)[:8].hex() + "/64"
        return host

    def admits(self, peer: str) -> bool:
        """Whether ``peer`` is below its bound, once its requests that authenticated since stop counting."""
        mine = self.unproven.get(peer)
        if mine is None or len(mine) < self.bound:
            return True
        for connection in [connection for connection in self.running.get(peer, ()) if connection.authenticated()]:
            self.leave(connection)
        return len(mine) < self.bound

    def add(self, connection: Connection, peer: str | None) -> None:
        """``connection`` is accepted (``admits`` said its peer may have it); None: a trusted proxy's."""
        self.waiting[connection] = None
        if peer is not None:
            connection.peer = peer
            self.unproven.setdefault(peer, set()).add(connection)

    def head_read(self, connection: Connection) -> None:
        """A request's head is in: the connection has proved it is a client; its request may authenticate."""
        self.waiting.pop(connection, None)
        if connection.peer is not None and self.credentials:
            self.running.setdefault(connection.peer, set()).add(connection)

    def answered(self, connection: Connection) -> None:
        """A response on ``connection`` is complete: its request authenticated, or it is no longer running."""
        if connection.peer is None:
            return
        if connection.authenticated():
            self.leave(connection)
        elif (running := self.running.get(connection.peer)) is not None:
            running.discard(connection)
            if not running:
                del self.running[connection.peer]

    def remove(self, connection: Connection) -> None:
        """``connection`` closed."""
        self.waiting.pop(connection, None)
        self.leave(connection)

    def leave(self, connection: Connection) -> None:
        """``connection`` stops counting toward its peer (it authenticated, or closed)."""
        peer = connection.peer
        if peer is None:
            return
        connection.peer = None
        for by_peer in (self.unproven, self.running):
            if (mine := by_peer.get(peer)) is not None:
                mine.discard(connection)
                if not mine:
                    del by_peer[peer]

    def make_room(self) -> bool:
        """Close the oldest connection that has not sent a whole head; False if there is none."""
        if not self.waiting:
            return False
        oldest = next(iter(self.waiting))
        del self.waiting[oldest]
        oldest.make_room()
        return True
