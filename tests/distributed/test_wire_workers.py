"""``serve --workers N`` keeps the limits on the wire: the spawned workers get them with their config."""

from __future__ import annotations

import contextlib
import select
import socket

import pytest

from tests.distributed.conftest import WORKER_ENV
from tests.integration.test_wire_limits import (
    ATTACKER,
    POSTS,
    SLOW_HEAD,
    VISITOR,
    connect_from,
    read_until_closed,
    status_from,
)
from tests.support import BrokerProcess, RedisProcess, wait_until


@pytest.mark.timeout(60)
def test_every_worker_answers_an_oversized_head_431_and_a_stalled_body_408() -> None:
    with RedisProcess() as redis:
        env = {**WORKER_ENV, "MCP_BROKER_REDIS_URL": redis.url, "MCP_BROKER_BODY_TIMEOUT": "1"}
        with BrokerProcess(env=env, args=["--workers", "2"]) as broker:
            # Several connections each, so both workers are asked (the kernel spreads accepts).
            for _ in range(4):
                with socket.create_connection(("127.0.0.1", broker.port), timeout=15) as sock:
                    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * 100_000)
                    assert read_until_closed(sock).startswith(b"HTTP/1.1 431 ")
                with socket.create_connection(("127.0.0.1", broker.port), timeout=15) as sock:
                    sock.sendall(POSTS["/changes"] + b"Content-Length: 100\r\n\r\n[")
                    assert read_until_closed(sock).startswith(b"HTTP/1.1 408 ")


@pytest.mark.timeout(60)
def test_every_worker_bounds_the_connections_of_one_peer() -> None:
    """Each spawned worker has its own count per peer: one peer keeps at most the bound on each."""
    with RedisProcess() as redis:
        env = {**WORKER_ENV, "MCP_BROKER_REDIS_URL": redis.url, "MCP_BROKER_MAX_CONNECTIONS_PER_PEER": "1",
               "MCP_BROKER_HEADER_TIMEOUT": "60"}
        with BrokerProcess(env=env, args=["--workers", "2"]) as broker, contextlib.ExitStack() as stack:
            socks = [stack.enter_context(connect_from(ATTACKER, broker.port)) for _ in range(10)]
            for sock in socks:
                with contextlib.suppress(OSError):
                    sock.sendall(SLOW_HEAD)

            def answered() -> list[socket.socket]:
                return select.select(socks, [], [], 0)[0]

            wait_until(lambda: len(answered()) >= 8, what="all but one connection a worker refused")
            assert all(read_until_closed(sock).startswith(b"HTTP/1.1 503 ") for sock in answered())
            assert status_from(VISITOR, broker.port) == 200
