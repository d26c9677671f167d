"""Webhooks of one tenant cannot slow another's: a tarpit callback of tenant A, tenant B timed.

The tarpit is a server that accepts connections and never answers. Tenant A points 150
subscriptions at it, so every delivery of A holds a connection until its deadline; tenant B's
deliveries to a receiver that answers at once are timed before and while that goes on. The
only timed assert of these tests is that wide margin; the numbers are printed (``-s``).
"""

from __future__ import annotations

import asyncio
import json
import selectors
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest

from broker.uris import record_uri
from tests.integration import modern
from tests.integration.mcp_http import publish
from tests.support import BrokerProcess

KEYS = {"key-a": "alpha/alice", "key-b": "beta/bob"}
EVENT = "mcp.resource.updated"
SECRET = "whsec_" + "QUFB" * 8
#: Tenant A's share of the worker's callback connections in these tests (the default is 16).
SHARE = 8


class Tarpit:
    """Accepts every connection, reads what comes and never answers; counts the connections open at once."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0), backlog=512)
        self.port = self.sock.getsockname()[1]
        self.open = 0
        self.most = 0  # the most connections open at once
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.sock, selectors.EVENT_READ)
        self.closed = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.closed:
            for key, _ in self.selector.select(0.1):
                sock: socket.socket = key.fileobj  # type: ignore[assignment]
                if sock is self.sock:
                    conn, _ = sock.accept()
                    self.selector.register(conn, selectors.EVENT_READ)
                    self.open += 1
                    self.most = max(self.most, self.open)
                elif not sock.recv(65536):  # the broker gave up on it
                    self.selector.unregister(sock)
                    sock.close()
                    self.open -= 1

    def close(self) -> None:
        self.closed = True
        self.thread.join()
        for key in list(self.selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]


class Receiver:
    """Answers every POST 200 at once and notes when each event's ``_meta.n`` arrived (monotonic)."""

    def __init__(self) -> None:
        self.arrived: dict[int, float] = {}
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers.get("content-length", "0"))))
                if "n" in body.get("data", {}).get("_meta", {}):
                    receiver.arrived.setdefault(body["data"]["_meta"]["n"], time.monotonic())
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def broker() -> Iterator[BrokerProcess]:
    env = {"MCP_BROKER_API_KEYS": json.dumps(KEYS), "MCP_BROKER_WEBHOOK_ALLOW": '["127.0.0.1"]',
           "MCP_BROKER_WEBHOOK_LEASE_MS": "900", "MCP_BROKER_WEBHOOK_TENANT_CONNECTIONS": str(SHARE),
           "MCP_BROKER_WEBHOOK_CONNECT_TIMEOUT": "2", "MCP_BROKER_WEBHOOK_READ_TIMEOUT": "10"}
    with BrokerProcess(env=env) as proc:
        yield proc


def subscribe(http: httpx.AsyncClient, auth: str, uri: str, url: str) -> Any:
    return modern.call(http, "events/subscribe", {"name": EVENT, "arguments": {"uris": [uri]}, "ttlMs": 120_000,
                                                  "delivery": {"mode": "webhook", "url": url, "secret": SECRET}},
                       auth=auth)


async def until(check: Any, timeout: float = 40) -> None:
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.01)


async def latencies(http: httpx.AsyncClient, receiver: Receiver, uri: str, numbers: range) -> list[float]:
    """Seconds from each publish's acknowledgement to its event's arrival, one event at a time."""
    out = []
    for n in numbers:
        response = await http.post("/changes", json=[{"uri": uri, "kind": "updated", "meta": {"n": n}}],
                                   headers={"Authorization": "Bearer key-b"})
        assert response.status_code == 202, response.text
        sent = time.monotonic()
        await until(lambda n=n: n in receiver.arrived)  # type: ignore[misc]
        out.append(receiver.arrived[n] - sent)
    return out


@pytest.mark.timeout(120)
async def test_a_tarpit_of_one_tenant_leaves_another_tenants_deliveries_near_their_baseline(
        broker: BrokerProcess) -> None:
    tarpit, receiver = Tarpit(), Receiver()
    b_uri, a_uri = record_uri("beta", "things", "b"), record_uri("alpha", "things", "a")
    try:
        async with httpx.AsyncClient(base_url=broker.url, timeout=30) as http:
            assert (await subscribe(http, "key-b", b_uri, receiver.url)).status_code == 200
            await latencies(http, receiver, b_uri, range(0, 3))  # delivery has started: warm
            baseline = await latencies(http, receiver, b_uri, range(3, 23))
            for n in range(150):
                answer = await subscribe(http, "key-a", a_uri, f"http://127.0.0.1:{tarpit.port}/hook/{n}")
                assert answer.status_code == 200, answer.text
            await publish(http, a_uri, auth="key-a")
            await until(lambda: tarpit.open >= SHARE)  # A's deliveries are stuck in the tarpit
            loaded = await latencies(http, receiver, b_uri, range(23, 43))
            held = tarpit.most
    finally:
        tarpit.close()
        receiver.close()
    print(f"\ntenant B delivery latency, ms: baseline median {statistics.median(baseline) * 1000:.1f} "
          f"max {max(baseline) * 1000:.1f}; with A's 150 tarpit subscriptions median "
          f"{statistics.median(loaded) * 1000:.1f} max {max(loaded) * 1000:.1f}; tarpit connections open at once: "
          f"at most {held}")
    assert held <= SHARE, "A holds no more than its share of the worker's callback connections"
    # Wide: B's deliveries stay near their baseline (before the shares, B waited seconds for a place).
    assert statistics.median(loaded) < statistics.median(baseline) + 0.5
    assert max(loaded) < max(baseline) + 1.5
