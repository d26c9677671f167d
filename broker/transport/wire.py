"""Bounds on the wire: uvicorn's httptools protocol with a header size limit, read deadlines and a connection cap.

The broker's processes face clients directly (``serve``, ``serve --workers N``, the image), and
uvicorn's HTTP/1.1 protocol bounds none of what a client sends before the app sees a request:
a header line may grow without end (httptools keeps concatenating it), a head or a body may
arrive a byte at a time or never finish, a connection that sends nothing is kept forever, and
connections are accepted until ``accept()`` fails for want of descriptors. This subclass keeps
uvicorn's parsing and request cycle and adds, per connection:

* **header bytes**: a request head larger than ``max_header_bytes`` is answered 431 and the
  connection closed. Bytes are counted per read while a head is incomplete (no work per header);
  a head that completes inside one large read is measured exactly, and only then.
* **head deadline**: from the connection's start, or from the first byte of a later request on
  a kept-alive connection, the complete head must arrive within ``header_timeout``; else 408
  (or, if nothing at all was sent, a plain close). Between requests uvicorn's keep-alive
  timeout applies as before.
* **body deadline**: once the head is in, the body must be complete within ``body_timeout``
  (an endless chunked body or a Content-Length never reached); else 408 and close, and the
  app reading it sees the client leave.
* **connection cap**: a worker holding ``max_connections`` answers a new connection 503 at once
  and closes it, before reading anything, so it never runs out of descriptors for the ones it
  serves, for Redis or for ``accept()``; but first it makes room by closing the oldest connection
  that has not sent a whole request head yet, if there is one.
* **connections per peer**: one client address (an IPv6 /64) holds at most
  ``max_connections_per_peer`` connections that have not authenticated; more are refused like
  connections beyond the cap. Connections from ``trusted_proxies`` are not counted.
  ``broker.transport.peers`` keeps this count and picks the connection that makes room.

* **unread answers**: while a connection's write buffer is above uvicorn's high-water mark
  (64 KiB; its client is not reading) nothing more is read from it, and a request it sent
  meanwhile (pipelined) starts only once the client has read that buffer down. uvicorn counts a
  response complete once it is handed to the transport, so a client that sent many requests and
  read none had each answer run and buffered in turn. A connection so holds at most one answer
  (bounded by ``max_read_bytes`` or ``max_response_bytes``) plus the high-water mark.

Neither an idle connection's keep-alive timeout (uvicorn's) nor the deadline of a connection
that has sent nothing closes it while a request waits unread in the kernel (see
``_unread_bytes``): a worker frozen past the timeout (a paused VM) runs the due timer before it
reads what arrived meanwhile, and closing then would reset a request a balancer had sent.

A connection's first head deadline is armed when it opens; after that, timers are armed only
when a read leaves a head or body incomplete: a request that arrives in one read (nearly all of
them) starts and cancels none, and an open stream holds none. Bytes that arrive after a finished
exchange, blank lines included, start the next head's deadline.
"""

from __future__ import annotations

import asyncio
import fcntl
import functools
import logging
import resource
import struct
import termios
import time
from dataclasses import dataclass
from typing import Any

import httptools
import orjson
from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
from uvicorn.protocols.utils import get_remote_addr
from uvicorn.server import ServerState

from broker.config import Settings
from broker.transport.edge import PRINCIPAL
from broker.transport.peers import Peers

__all__ = ["WireLimits", "WireProtocol", "connection_cap", "protocol_factory"]

logger = logging.getLogger(__name__)

# What a connection is waiting for. IDLE: a request was read in full; the app has it and the
# keep-alive timeout (uvicorn's) covers the wait for the next one.
_IDLE, _HEAD, _BODY = 0, 1, 2
_READ_PAUSED, _COMPLETION_WAITS = 1, 2

#: Descriptors kept free beside the connections when the cap is derived from the limit: Redis
#: pools, pub/sub, the listening socket, the event loop's own, log files.
_RESERVED_DESCRIPTORS = 128
_REFUSAL_LOG_INTERVAL = 60.0


@dataclass(frozen=True, slots=True)
class WireLimits:
    max_header_bytes: int
    header_timeout: float
    body_timeout: float
    max_connections: int
    max_connections_per_peer: int
    trusted_proxies: tuple[str, ...] = ()
    #: Whether credentials are configured, so that a request can authenticate at all.
    credentials: bool = False

    @classmethod
    def from_settings(cls, settings: Settings) -> WireLimits:
        cap = settings.max_connections or connection_cap(settings.redis_max_connections)
        return cls(settings.max_header_bytes, settings.header_timeout, settings.body_timeout, cap,
                   settings.max_connections_per_peer or max(1, cap // 4), tuple(settings.trusted_proxies),
                   bool(settings.auth_methods))


def connection_cap(redis_max_connections: int) -> int:
    """Connections per worker that leave descriptors to spare under this process's ``RLIMIT_NOFILE``.

    A tenth of the limit, and at least the Redis pool plus a margin, stays free; never less
    than half the limit.
    """
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    reserve = max(soft // 10, redis_max_connections + _RESERVED_DESCRIPTORS)
    return max(soft - reserve, soft // 2)


def protocol_factory(limits: WireLimits) -> Any:
    """What ``uvicorn.Config(http=...)`` takes: uvicorn calls it as it would the protocol class.

    A ``partial`` rather than a class built here: ``--workers`` pickles the config to spawned
    processes, and the partial carries the limits with it, and an empty ``Peers``, of which
    each process so gets its own.
    """
    peers = Peers(limits.max_connections_per_peer, limits.trusted_proxies, limits.credentials)
    return functools.partial(WireProtocol, limits=limits, peers=peers)


def _answer(status: int, detail: str, *extra: bytes) -> bytes:
    body = orjson.dumps({"detail": detail})
    return b"".join([STATUS_LINE[status], b"content-type: application/json\r\n",
                     b"content-length: %d\r\n" % len(body), b"x-content-type-options: nosniff\r\n",
                     b"cache-control: no-store\r\n", *extra, b"connection: close\r\n\r\n", body])


_TOO_LARGE = _answer(431, "Request header fields too large")
_TIMEOUT = _answer(408, "Request not received in time")
_BUSY = _answer(503, "Too many connections; retry later", b"retry-after: 1\r\n")


class _Answered(Exception):
    """Raised from a parser callback to stop parsing: the connection was answered and is closing."""


class _Refusals:
    """Counts connections refused for one reason; logs a warning at most once a minute."""

    def __init__(self, why: str) -> None:
        self.why = why
        self.count = 0
        self.logged_at = -_REFUSAL_LOG_INTERVAL

    def add(self, limit: int) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.logged_at >= _REFUSAL_LOG_INTERVAL:
            logger.warning("refused %d connection(s) with 503: " + self.why, self.count, limit)
            self.count, self.logged_at = 0, now


_AT_CAP = _Refusals("this worker holds %d, its limit, each with a request sent (see MCP_BROKER_MAX_CONNECTIONS)")
_PER_PEER = _Refusals("their address holds %d that have not authenticated, its limit "
                      "(see MCP_BROKER_MAX_CONNECTIONS_PER_PEER)")


class WireProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the bounds of ``WireLimits``."""

    # Slots: uvicorn's protocol already keeps 28 attributes in its __dict__, and five more there
    # made every connection's dict a larger, unshared one (1.3 KB more per idle stream).
    __slots__ = ("_exact", "_head_bytes", "_phase", "_read_in_body", "_timer", "_timer_phase", "_unread", "limits",
                 "peer", "peers")

    def __init__(self, config: Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None, *, limits: WireLimits, peers: Peers) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.limits = limits
        self.peers = peers
        #: The peer this connection counts toward, while it has not authenticated (``Peers``).
        self.peer: str | None = None
        self._phase = _HEAD  # a new connection owes a request head
        self._head_bytes = 0
        #: The read being parsed began inside a body, so the bytes of a head it goes on to were
        #: not counted; such a head is measured exactly when it completes.
        self._read_in_body = False
        self._exact = False
        self._timer: asyncio.TimerHandle | None = None
        self._timer_phase = _IDLE
        #: While the client is not reading: ``_READ_PAUSED`` when reading from it was paused here,
        #: ``_COMPLETION_WAITS`` when a response completed meanwhile (the next request waits).
        self._unread = 0

    # -- connection ------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        limits, peers = self.limits, self.peers
        address = get_remote_addr(transport)
        peer = peers.peer_of(address[0]) if address is not None else None
        if peer is not None and not peers.admits(peer):
            self._refuse(transport, _PER_PEER, limits.max_connections_per_peer)
            return
        if len(self.connections) >= limits.max_connections and not peers.make_room():
            self._refuse(transport, _AT_CAP, limits.max_connections)
            return
        super().connection_made(transport)
        peers.add(self, peer)
        self._arm(_HEAD)

    def _refuse(self, transport: asyncio.Transport, refusals: _Refusals, limit: int) -> None:
        # Refused before it is counted or read: one write and the descriptor is given back.
        self.transport = transport
        transport.write(_BUSY)
        transport.close()
        refusals.add(limit)

    def connection_lost(self, exc: Exception | None) -> None:
        self._arm(_IDLE)
        self.peers.remove(self)
        super().connection_lost(exc)

    def authenticated(self) -> bool:
        """Whether the request read last on this connection carried a valid credential."""
        return self.peers.credentials and self.scope is not None and PRINCIPAL in self.scope

    def make_room(self) -> None:
        """Closed for a new connection at the cap, before sending a whole head: 503 if it sent a part."""
        if self._head_bytes:
            self._answer_and_close(_BUSY)
        else:
            self._arm(_IDLE)
            self.transport.close()

    def timeout_keep_alive_handler(self) -> None:
        """uvicorn's keep-alive timeout, which leaves a connection open if a request waits on it."""
        if not self.transport.is_closing() and _unread_bytes(self.transport):
            return  # read next, as if it had come a moment sooner; the head deadline runs from there
        super().timeout_keep_alive_handler()

    def data_received(self, data: bytes) -> None:
        # uvicorn's data_received, plus the accounting; a callback that answered stops the parser.
        self._unset_keepalive_if_required()
        if self._phase == _IDLE and (self.cycle is None or self.cycle.response_complete):
            # Bytes after a finished exchange begin the next head, even bytes the parser skips
            # (blank lines): they cancelled uvicorn's keep-alive timer, so the head deadline runs.
            self._phase = _HEAD
        self._read_in_body = self._phase == _BODY
        if not self._read_in_body:
            self._head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if isinstance(exc.__context__, _Answered):
                return
            msg = "Invalid HTTP request received."
            self.logger.warning(msg)
            self.send_400_response(msg)
            return
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        phase = self._phase
        if phase == _HEAD and self._head_bytes > self.limits.max_header_bytes:
            self._answer_and_close(_TOO_LARGE)
        elif phase != self._timer_phase:
            self._arm(phase)

    # -- a client that does not read ----------------------------------------------------------
    def pause_writing(self) -> None:
        super().pause_writing()
        if not self.flow.read_paused:
            self.flow.pause_reading()
            self._unread |= _READ_PAUSED

    def resume_writing(self) -> None:
        super().resume_writing()
        unread, self._unread = self._unread, 0
        if unread & _COMPLETION_WAITS:
            super().on_response_complete()  # reads on, and starts a pipelined request
        elif unread & _READ_PAUSED and not self.pipeline:
            self.flow.resume_reading()

    def on_response_complete(self) -> None:
        self.peers.answered(self)  # an authenticated request's connection stops counting toward its peer
        if self.flow.write_paused and not self.transport.is_closing():
            self._unread |= _COMPLETION_WAITS  # complete once the client has read it down
            return
        super().on_response_complete()

    # -- parser callbacks --------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._phase = _HEAD
        self._exact = self._read_in_body
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        limit = self.limits.max_header_bytes
        if (self._head_bytes > limit or self._exact) and _head_size(self.url, self.headers) > limit:
            self._answer_and_close(_TOO_LARGE)
            raise _Answered
        self.peers.head_read(self)
        self._head_bytes = 0
        self._exact = False
        self._phase = _BODY
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._phase = _IDLE
        super().on_message_complete()

    # -- deadlines ---------------------------------------------------------------------------
    def _arm(self, phase: int) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_phase = phase
        if phase == _HEAD:
            self._timer = self.loop.call_later(self.limits.header_timeout, self._timed_out)
        elif phase == _BODY:
            self._timer = self.loop.call_later(self.limits.body_timeout, self._timed_out)

    def _timed_out(self) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        if self._timer_phase == _HEAD and self._head_bytes == 0:
            if _unread_bytes(self.transport):
                self._arm(_HEAD)  # it did send, while this worker was frozen: read that first
                return
            self.transport.close()  # connected and sent nothing: nothing to answer
            return
        logger.debug("closing a connection from %s: request %s not received in time", self.client,
                     "head" if self._timer_phase == _HEAD else "body")
        self._answer_and_close(_TIMEOUT)

    def _answer_and_close(self, answer: bytes) -> None:
        """Answer ``answer`` unless a response is already under way, then close.

        The request being read (or one waiting for its response) sees the client leave, so its
        app code ends and nothing else is written on this connection.
        """
        cycle = self.cycle
        if self.pipeline:
            pass  # an earlier request's response is still being written: nothing may go in between
        elif cycle is None or cycle.response_complete:
            self.transport.write(answer)
        elif not cycle.response_started:
            cycle.disconnected = True
            cycle.message_event.set()
            self.transport.write(answer)
        self._arm(_IDLE)
        self._phase = _IDLE
        self.transport.close()


def _unread_bytes(transport: asyncio.Transport) -> int:
    """Bytes that arrived on ``transport``'s socket and are not read yet (``FIONREAD``; 0 at EOF).

    A timer that closes an idle connection asks this first. A worker frozen longer than the
    timer (a paused VM; SIGSTOP, then SIGCONT) finds when it resumes both the timer due and, on
    the socket, a request a balancer sent meanwhile. Its wait for events ends interrupted
    (EINTR) with its timeout spent, and uvloop runs due timers before it polls again, so the
    timer comes first whenever the freeze found the worker idle. Closing a socket with unread
    bytes makes the kernel send a reset, and the balancer, whose request was sent, cannot
    retry it: a POST becomes a 502. Waiting bytes keep the connection, and they are read and
    answered next. Shutting down writes first would not help: the peer sent its request
    before any FIN could reach it.
    """
    sock = transport.get_extra_info("socket")
    if sock is None:
        return 0
    try:
        waiting: int = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, bytes(4)))[0]
    except OSError:
        return 0
    return waiting


def _head_size(url: bytes, headers: list[tuple[bytes, bytes]]) -> int:
    return len(url) + sum(len(name) + len(value) + 4 for name, value in headers)
