"""Limits on the wire: what a client sends before the app sees a request is bounded in bytes and time,
and a worker refuses connections beyond its cap quickly instead of running out of descriptors.

Raw sockets against real ``mcp-broker serve`` processes. Every wait has a deadline that a stalled
server would miss; none asserts how fast a healthy one is.
"""

from __future__ import annotations

import contextlib
import os
import resource
import select
import socket
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.support import BIN, BrokerProcess, free_port, wait_until

pytestmark = pytest.mark.timeout(90)

# Far beyond every deadline under test, short enough that a held connection fails the test.
ANSWER_WITHIN = 15.0


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=ANSWER_WITHIN)
    return sock


def read_until_closed(sock: socket.socket, timeout: float = ANSWER_WITHIN) -> bytes:
    """Everything the server sends until it closes the connection; fails if it keeps it open."""
    data = b""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"connection still open after {timeout} s; received {data[:200]!r}")
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data
        except TimeoutError as exc:
            raise AssertionError(f"connection still open after {timeout} s; received {data[:200]!r}") from exc
        if not chunk:
            return data
        data += chunk


def trickle_until_closed(sock: socket.socket, pieces: Iterator[bytes], every: float = 0.2) -> bytes:
    """Send one piece every ``every`` seconds, as a slow client would, until the server closes."""
    data = b""
    deadline = time.monotonic() + ANSWER_WITHIN
    for piece in pieces:
        if time.monotonic() > deadline:
            raise AssertionError(f"connection still open after {ANSWER_WITHIN} s; received {data[:200]!r}")
        try:
            sock.sendall(piece)
        except (BrokenPipeError, ConnectionResetError):
            return data
        readable, _, _ = select.select([sock], [], [], every)
        if readable:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                return data
            if not chunk:
                return data
            data += chunk
            with contextlib.suppress(AssertionError):
                return data + read_until_closed(sock, timeout=2)
    raise AssertionError("ran out of pieces")


def forever(piece: bytes) -> Iterator[bytes]:
    while True:
        yield piece


def read_response(sock: socket.socket) -> bytes:
    """One response with a Content-Length, read to its end; the connection stays open."""
    sock.settimeout(ANSWER_WITHIN)
    data = b""
    while b"\r\n\r\n" not in data or len(data) < data.index(b"\r\n\r\n") + 4 + content_length(data):
        chunk = sock.recv(65536)
        assert chunk, f"closed in the middle of a response: {data[:200]!r}"
        data += chunk
    return data


def content_length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n")[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def get(port: int, path: str = "/healthz", extra: bytes = b"") -> bytes:
    with connect(port) as sock:
        sock.sendall(b"GET " + path.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                     + extra + b"\r\n")
        return read_until_closed(sock)


@pytest.fixture(scope="module")
def broker() -> Iterator[BrokerProcess]:
    """Default size limits; head and body deadlines of a second, so a test sees them pass."""
    with BrokerProcess(env={"MCP_BROKER_HEADER_TIMEOUT": "1", "MCP_BROKER_BODY_TIMEOUT": "1"}) as proc:
        yield proc


# -- header bytes ----------------------------------------------------------------------------------
def test_an_unfinished_100_kb_header_is_answered_431_and_closed(broker: BrokerProcess) -> None:
    with connect(broker.port) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 100_000)
        answer = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]


def test_a_complete_100_kb_head_is_answered_431_too(broker: BrokerProcess) -> None:
    answer = get(broker.port, extra=b"".join(b"X-H%d: %s\r\n" % (i, b"b" * 1000) for i in range(100)))
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert b"x-content-type-options: nosniff" in answer.lower()


def test_a_head_of_some_kilobytes_is_served(broker: BrokerProcess) -> None:
    """Real clients' tokens and cookies fit: 16 KB of headers is served as usual."""
    answer = get(broker.port, extra=b"Cookie: " + b"c" * 16_000 + b"\r\n")
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]


# -- head deadline ---------------------------------------------------------------------------------
def test_a_slowloris_head_is_closed_after_the_header_timeout(broker: BrokerProcess) -> None:
    with connect(broker.port) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        answer = trickle_until_closed(sock, forever(b"X"))
    assert answer == b"" or answer.startswith(b"HTTP/1.1 408 "), answer[:200]


def test_a_connection_that_sends_nothing_is_closed_after_the_header_timeout(broker: BrokerProcess) -> None:
    with connect(broker.port) as sock:
        assert read_until_closed(sock) == b""


def test_a_kept_alive_connection_serves_its_next_request_after_a_pause(broker: BrokerProcess) -> None:
    """The head deadline runs from a request's first byte, not from the connection's start."""
    with connect(broker.port) as sock:
        for _ in range(2):
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert read_response(sock).startswith(b"HTTP/1.1 200 ")
            # Longer than the head deadline, shorter than uvicorn's keep-alive timeout (5 s).
            readable, _, _ = select.select([sock], [], [], 2.0)
            assert not readable, "the server closed a kept-alive connection before its keep-alive timeout"


def test_blank_lines_after_a_request_do_not_keep_a_connection_open(broker: BrokerProcess) -> None:
    """Bytes the parser skips between requests still start the head deadline (they used to
    cancel the keep-alive timer and start nothing, so a CRLF every 2 s held the connection)."""
    with connect(broker.port) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert read_response(sock).startswith(b"HTTP/1.1 200 ")
        trickle_until_closed(sock, forever(b"\r\n"), every=0.5)


def test_a_head_that_follows_a_body_in_the_same_read_is_measured_too(broker: BrokerProcess) -> None:
    body = b'{"uri": "x:a"}'
    big_get = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 60_000 + b"\r\n\r\n"
    with connect(broker.port) as sock:
        sock.sendall(POSTS["/changes"] + b"Content-Length: %d\r\n\r\n" % len(body))
        readable, _, _ = select.select([sock], [], [], 0.3)  # the head is read alone; the body is awaited
        assert not readable
        sock.sendall(body + big_get)  # one read: the body's end, then a whole oversized head
        answers = read_until_closed(sock)
    # The oversized head is refused and the connection closed (the POST before it, pipelined
    # with it, may lose its answer: it shares the connection of a client that broke the rules).
    assert b"HTTP/1.1 431 " in answers and b"HTTP/1.1 200 " not in answers, answers[:400]


# -- body deadline ---------------------------------------------------------------------------------
POSTS = {
    "/changes": b"POST /changes HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n",
    "/mcp": (b"POST /mcp HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
             b"Accept: application/json, text/event-stream\r\n"),
    "/collections/c/r": b"PUT /collections/c/r HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n",
}


@pytest.mark.parametrize("path", list(POSTS))
def test_an_endless_chunked_body_is_answered_408_after_the_body_timeout(broker: BrokerProcess, path: str) -> None:
    with connect(broker.port) as sock:
        sock.sendall(POSTS[path] + b"Transfer-Encoding: chunked\r\n\r\n")
        answer = trickle_until_closed(sock, forever(b"1\r\n \r\n"))
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]


@pytest.mark.parametrize("path", list(POSTS))
def test_a_body_shorter_than_its_content_length_is_answered_408(broker: BrokerProcess, path: str) -> None:
    with connect(broker.port) as sock:
        sock.sendall(POSTS[path] + b"Content-Length: 100\r\n\r\n{\"uri\": ")
        answer = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]


def test_a_body_that_arrives_in_time_is_served(broker: BrokerProcess) -> None:
    body = b'{"uri": "https://example.com/slow"}'
    with connect(broker.port) as sock:
        sock.sendall(POSTS["/changes"] + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body))
        for i in range(0, len(body), 12):
            sock.sendall(body[i:i + 12])
            time.sleep(0.1)  # a slow client, well within the deadline
        answer = read_until_closed(sock)
    assert answer.startswith(b"HTTP/1.1 202 "), answer[:200]


# -- a frozen worker --------------------------------------------------------------------------------
def receive_queue(local_port: int, remote_port: int) -> int:
    """Bytes received and not read yet at the loopback socket between these ports; at a listening
    socket (``remote_port`` 0), connections not accepted yet (``/proc/net/tcp``)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1].endswith(f":{local_port:04X}") and fields[2].endswith(f":{remote_port:04X}"):
            return int(fields[4].split(":")[1], 16)
    return 0


@pytest.mark.parametrize("idle", ["kept-alive", "new"])
def test_a_request_that_arrived_while_the_worker_was_frozen_past_its_idle_timeout_is_answered(idle: str) -> None:
    """A worker paused (a suspended VM, SIGSTOP) beyond the time it gives an idle connection (the
    keep-alive timeout after a request, the head deadline on a new connection) finds the request
    a balancer sent meanwhile: it is answered, not reset unread (a 502 for a POST, which nginx
    does not retry)."""
    body = b'{"uri": "https://example.com/frozen"}'
    env = {"MCP_BROKER_HTTP_KEEPALIVE_TIMEOUT": "1", "MCP_BROKER_HEADER_TIMEOUT": "1"}
    with BrokerProcess(env=env) as worker, connect(worker.port) as sock:
        if idle == "kept-alive":
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert read_response(sock).startswith(b"HTTP/1.1 200 ")
        wait_until(lambda: receive_queue(worker.port, 0) == 0, what="the worker to accept the connection")
        # Frozen idle, as a paused machine finds a worker: waiting for events, so its timer for
        # the connection is armed. The wait ends with EINTR when the worker resumes, and uvloop
        # then runs its due timers before it polls again.
        wait_until(lambda: "epoll" in Path(f"/proc/{worker.proc.pid}/wchan").read_text(), what="the worker to idle")
        idle_since = time.monotonic()
        frozen = psutil.Process(worker.proc.pid)
        frozen.suspend()
        try:
            wait_until(lambda: frozen.status() == psutil.STATUS_STOPPED, what="the worker to stop")
            request = POSTS["/changes"] + b"Content-Length: %d\r\n\r\n" % len(body) + body
            sock.sendall(request)
            client_port = sock.getsockname()[1]
            wait_until(lambda: receive_queue(worker.port, client_port) == len(request), what="the request to arrive")
            # Frozen until the timer (1 s) is due: it and the request wait for the worker together.
            time.sleep(max(0.0, idle_since + 1.5 - time.monotonic()))
        finally:
            frozen.resume()
        answer = read_response(sock)
    assert answer.startswith(b"HTTP/1.1 202 "), answer[:200]


# -- connections -------------------------------------------------------------------------------------
def refused(port: int) -> bool:
    """A new connection is answered 503 and closed without sending anything."""
    with connect(port) as sock:
        answer = read_until_closed(sock, timeout=5)
    return answer.startswith(b"HTTP/1.1 503 ")


def await_body(sock: socket.socket, extra: bytes = b"") -> None:
    """Send a POST's head and wait until the app reads it and asks for the body (100 Continue)."""
    sock.sendall(POSTS["/changes"] + extra + b"Expect: 100-continue\r\nContent-Length: 100\r\n\r\n")
    sock.settimeout(ANSWER_WITHIN)
    assert sock.recv(65536).startswith(b"HTTP/1.1 100 ")


def test_connections_beyond_the_cap_are_refused_while_one_within_it_is_served() -> None:
    env = {"MCP_BROKER_MAX_CONNECTIONS": "3", "MCP_BROKER_BODY_TIMEOUT": "60"}
    with BrokerProcess(env=env) as broker, contextlib.ExitStack() as stack:
        busy = [stack.enter_context(connect(broker.port)) for _ in range(3)]
        for sock in busy:
            await_body(sock)
        assert refused(broker.port)
        busy.pop().close()
        wait_until(lambda: get(broker.port).startswith(b"HTTP/1.1 200 "), what="a client within the cap served")


def test_at_the_cap_the_oldest_connection_yet_to_send_a_whole_head_makes_room() -> None:
    env = {"MCP_BROKER_MAX_CONNECTIONS": "3", "MCP_BROKER_HEADER_TIMEOUT": "60"}
    with BrokerProcess(env=env) as broker, contextlib.ExitStack() as stack:
        silent, slow, newest = (stack.enter_context(connect(broker.port)) for _ in range(3))
        slow.sendall(SLOW_HEAD)
        assert get(broker.port).startswith(b"HTTP/1.1 200 ")
        assert read_until_closed(silent) == b""  # the oldest, closed as if its head deadline had passed
        stack.enter_context(connect(broker.port))  # the cap is reached again
        assert get(broker.port).startswith(b"HTTP/1.1 200 ")
        assert read_until_closed(slow).startswith(b"HTTP/1.1 503 ")
        newest.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert read_response(newest).startswith(b"HTTP/1.1 200 ")


@contextlib.contextmanager
def descriptor_limit(soft: int) -> Iterator[None]:
    """Processes started inside inherit this soft RLIMIT_NOFILE."""
    before = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, before[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, before)


def test_at_its_descriptor_limit_a_worker_refuses_new_clients_quickly_and_serves_again_later() -> None:
    """With 256 descriptors and no cap set, 300 idle connections exhaust a server that accepts them all."""
    with descriptor_limit(256):
        broker = BrokerProcess(env={"MCP_BROKER_HEADER_TIMEOUT": "60", "MCP_BROKER_HTTP_KEEPALIVE_TIMEOUT": "60"})
    with broker, contextlib.ExitStack() as stack:
        held = [stack.enter_context(connect(broker.port)) for _ in range(300)]
        for sock in held:  # each sends a request, so none is closed to make room for a newer one
            with contextlib.suppress(OSError):  # one refused already
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert refused(broker.port)
        for sock in held:
            sock.close()
        wait_until(lambda: get(broker.port).startswith(b"HTTP/1.1 200 "), what="a client served again")


@pytest.mark.parametrize("setting", ["MCP_BROKER_HEADER_TIMEOUT=0", "MCP_BROKER_MAX_HEADER_BYTES=many",
                                     "MCP_BROKER_MAX_CONNECTIONS=-1", "MCP_BROKER_MAX_CONNECTIONS_PER_PEER=-1",
                                     'MCP_BROKER_TRUSTED_PROXIES=["lb.internal"]',
                                     # a zero batch hung the worker, a zero page paged forever, and
                                     # these two crashed with a traceback
                                     "MCP_BROKER_FANOUT_BATCH=0", "MCP_BROKER_PAGE_SIZE=0",
                                     "MCP_BROKER_REDIS_URL=foo://x", "MCP_BROKER_GC_THRESHOLDS=[1,2,3,4]",
                                     "MCP_BROKER_API_KEYS=notjson", "MCP_BROKER_PORT=abc",
                                     # ignored silently: a misspelled Redis URL meant a worker alone
                                     # on its own memory; an origin without a scheme, 403 for all
                                     "MCP_BROKER_REDISURL=redis://127.0.0.1:1",
                                     'MCP_BROKER_ALLOWED_ORIGINS=["app.example.com"]',
                                     "MCP_BROKER_MAX_READ_BYTES=100", "MCP_BROKER_POSTGRES_POOL_SIZE=0",
                                     "MCP_BROKER_POSTGRES_READ_TIMEOUT=0"])
def test_a_bad_setting_stops_serve_with_one_line_naming_it(setting: str) -> None:
    name, _, value = setting.partition("=")
    done = subprocess.run([str(BIN), "serve", "--port", str(free_port())], env={**os.environ, name: value},
                          capture_output=True, timeout=30)
    assert done.returncode == 2
    lines = done.stderr.decode().strip().splitlines()
    assert len(lines) == 1 and name in lines[0], lines


# -- connections shared between peers ------------------------------------------------------------------
# Every 127.0.0.0/8 address is loopback: a client socket bound to 127.0.0.2 is another peer than
# one bound to 127.0.0.3. 127.0.0.1, where the other tests connect from, is a trusted proxy by default.
ATTACKER, VISITOR, WITNESS = "127.0.0.2", "127.0.0.3", "127.0.0.4"
#: A head that never ends (the header timeout is set far beyond the test).
SLOW_HEAD = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "


def connect_from(peer: str, port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=ANSWER_WITHIN, source_address=(peer, 0))


def status_from(peer: str, port: int, extra: bytes = b"") -> int:
    """The status of one GET /healthz from ``peer`` on a new connection."""
    with connect_from(peer, port) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n" + extra + b"\r\n")
        answer = read_until_closed(sock)
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else 0


def open_slow_heads(stack: contextlib.ExitStack, port: int, peer: str, count: int) -> list[socket.socket]:
    """``count`` connections from ``peer`` that each sent part of a head: those the worker kept.

    A refused one is answered at once, as it is accepted; the witness's answer on a later
    connection shows the worker has accepted every one before it, so nothing is left to wait for.
    """
    socks = []
    for _ in range(count):
        sock = stack.enter_context(connect_from(peer, port))
        with contextlib.suppress(OSError):
            sock.sendall(SLOW_HEAD)
        socks.append(sock)
    status_from(WITNESS, port)
    answered, _, _ = select.select(socks, [], [], 0)
    return [sock for sock in socks if sock not in answered]


def test_one_peer_holding_slow_heads_leaves_connections_for_another() -> None:
    """One client reopening slow heads held every connection of the worker: others got 503."""
    env = {"MCP_BROKER_MAX_CONNECTIONS": "20", "MCP_BROKER_HEADER_TIMEOUT": "60"}
    with BrokerProcess(env=env) as broker, contextlib.ExitStack() as stack:
        held = open_slow_heads(stack, broker.port, ATTACKER, 40)
        statuses = [status_from(VISITOR, broker.port) for _ in range(10)]
    print(f"\none peer's slow heads: {len(held)} of 40 kept; another peer's 10 requests: "
          f"{statuses.count(200)} answered 200, {statuses.count(503)} 503")
    assert statuses == [200] * 10
    assert len(held) == 5  # a quarter of the worker's connections


def flood_slow_heads(port: int, peer: str, stop: threading.Event, counts: Counter[str]) -> None:
    """Keep 60 connections from ``peer`` sending slow heads, reopening each one the worker refuses or closes."""
    held: list[socket.socket] = []
    try:
        while not stop.is_set():
            while len(held) < 60:
                sock = connect_from(peer, port)
                held.append(sock)
                counts["opened"] += 1
                with contextlib.suppress(OSError):
                    sock.sendall(SLOW_HEAD)
            answered, _, _ = select.select(held, [], [], 0.05)
            for sock in answered:
                counts["refused"] += 1
                held.remove(sock)
                sock.close()
    finally:
        counts["held at the end"] = len(held)
        for sock in held:
            sock.close()


def test_under_a_flood_of_slow_heads_from_one_peer_another_peer_is_served() -> None:
    """Load: one peer reopens slow heads as fast as it can while another sends 100 requests."""
    env = {"MCP_BROKER_MAX_CONNECTIONS": "20", "MCP_BROKER_HEADER_TIMEOUT": "60"}
    flood: Counter[str] = Counter()
    stop = threading.Event()
    with BrokerProcess(env=env) as broker:
        attacker = threading.Thread(target=flood_slow_heads, args=(broker.port, ATTACKER, stop, flood))
        attacker.start()
        try:
            wait_until(lambda: flood["refused"] > 0, what="the flood to reach its bound")
            started = time.monotonic()
            statuses = Counter(status_from(VISITOR, broker.port) for _ in range(100))
            took = time.monotonic() - started
        finally:
            stop.set()
            attacker.join()
    print(f"\nflood from one peer: {flood['opened']} connections opened, {flood['refused']} refused, "
          f"{flood['held at the end']} held at the end; another peer's 100 requests in {took:.2f} s: "
          f"{statuses[200]} answered 200, {statuses[503]} 503")
    assert statuses == {200: 100}


TOKEN = b"Authorization: Bearer k3y\r\n"
WITH_KEYS = {"MCP_BROKER_API_KEYS": '{"k3y": "acme/alice"}', "MCP_BROKER_HEADER_TIMEOUT": "60",
             "MCP_BROKER_BODY_TIMEOUT": "60"}


def test_connections_that_authenticated_stop_counting_toward_their_peers_bound() -> None:
    """Clients behind one address (a NAT, a service with many streams) are bounded only by the cap
    once they authenticate: both a request still running and one answered and kept alive leave the count."""
    body = b'{"uri": "https://example.com/a"}'
    with BrokerProcess(env={**WITH_KEYS, "MCP_BROKER_MAX_CONNECTIONS_PER_PEER": "2"}) as broker, \
            contextlib.ExitStack() as stack:
        for sock in (stack.enter_context(connect_from(ATTACKER, broker.port)) for _ in range(2)):
            sock.sendall(POSTS["/changes"] + b"Content-Length: %d\r\n\r\n" % len(body) + body)
            assert read_response(sock).startswith(b"HTTP/1.1 401 ")  # kept alive, still counted
        assert status_from(ATTACKER, broker.port) == 503

        running = [stack.enter_context(connect_from(VISITOR, broker.port)) for _ in range(2)]
        for sock in running:
            await_body(sock, TOKEN)
        answered = stack.enter_context(connect_from(VISITOR, broker.port))
        answered.sendall(POSTS["/changes"] + TOKEN + b"Content-Length: %d\r\n\r\n" % len(body) + body)
        assert read_response(answered).startswith(b"HTTP/1.1 202 ")
        assert [status_from(VISITOR, broker.port) for _ in range(2)] == [200, 200]


def test_a_worker_full_of_slow_heads_from_many_peers_still_admits_clients_and_keeps_authenticated_ones() -> None:
    """Each new client closes the oldest slow head to get in; connections whose requests
    authenticated are never the ones closed, and once only they are left, new ones are refused."""
    env = {**WITH_KEYS, "MCP_BROKER_MAX_CONNECTIONS": "8", "MCP_BROKER_MAX_CONNECTIONS_PER_PEER": "2"}
    body = b'{"uri": "https://example.com/%s"}' % (b"a" * 69)  # the 100 bytes await_body announced
    with BrokerProcess(env=env) as broker, contextlib.ExitStack() as stack:
        authenticated = [stack.enter_context(connect_from(VISITOR, broker.port)) for _ in range(2)]
        for sock in authenticated:
            await_body(sock, TOKEN)
        slow = [stack.enter_context(connect_from(f"127.0.0.{10 + n // 2}", broker.port)) for n in range(6)]
        for sock in slow:
            sock.sendall(SLOW_HEAD)
        # The worker is full. Each new client gets in, and stays, by closing the oldest slow head.
        for n, sock in enumerate(slow):
            newcomer = stack.enter_context(connect_from(f"127.0.0.{20 + n}", broker.port))
            await_body(newcomer, TOKEN)
            authenticated.append(newcomer)
            answer = read_until_closed(sock)
            assert answer == b"" or answer.startswith(b"HTTP/1.1 503 "), answer[:200]
        assert status_from(WITNESS, broker.port) == 503  # only authenticated requests are left
        for sock in authenticated:
            sock.sendall(body)
            assert read_response(sock).startswith(b"HTTP/1.1 202 ")


def test_trusted_proxies_are_not_bounded_per_peer() -> None:
    env = {"MCP_BROKER_TRUSTED_PROXIES": f'["{ATTACKER}/32"]', "MCP_BROKER_MAX_CONNECTIONS_PER_PEER": "2",
           "MCP_BROKER_HEADER_TIMEOUT": "60"}
    with BrokerProcess(env=env) as broker, contextlib.ExitStack() as stack:
        assert len(open_slow_heads(stack, broker.port, ATTACKER, 6)) == 6
        assert len(open_slow_heads(stack, broker.port, "127.0.0.1", 6)) == 2  # no longer trusted
