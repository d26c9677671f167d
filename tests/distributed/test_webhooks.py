"""Webhooks and polls across three workers on one Redis behind the round-robin proxy.

A receiver started by the test (a small HTTP server on loopback, allow-listed) verifies every
signature with ``standardwebhooks``; it fails for a while, then recovers, and receives every
event in order; the worker delivering them is killed with ``kill -9`` mid-stream and another
finishes (duplicates allowed, deduplicated by ``eventId``; none missing). A callback to a
private address is refused, and a poll cursor from before Redis restarted empty is answered
``truncated: true``.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import secrets
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from redis import Redis
from standardwebhooks import Webhook

from tests.distributed.conftest import Deployment
from tests.distributed.test_faults import publish_seq
from tests.integration import modern
from tests.support import BIN

KEYS = {"key-a": "default/alice"}
EVENT = "mcp.resource.updated"
ENV = {
    "MCP_BROKER_API_KEYS": json.dumps(KEYS),
    "MCP_BROKER_WEBHOOK_ALLOW": '["127.0.0.1"]',
    "MCP_BROKER_WEBHOOK_LEASE_MS": "1500",
    "MCP_BROKER_WEBHOOK_RETRY_INITIAL": "0.05",
    "MCP_BROKER_WEBHOOK_RETRY_MAX": "0.3",
    "MCP_BROKER_WEBHOOK_MAX_ATTEMPTS": "100",
    "MCP_BROKER_INBOX_MAXLEN": "5000",
}


class Receiver:
    """Verifies each POST's signature, answers 503 while ``failing``, and keeps what it accepted, in order."""

    def __init__(self, secret: str) -> None:
        self.webhook = Webhook(secret)
        self.failing = 0  # requests still to refuse
        self.accepted: list[dict[str, Any]] = []
        self.refused = 0
        self.bad_signatures = 0
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                try:
                    payload = receiver.webhook.verify(body, dict(self.headers))
                except Exception:
                    with receiver.lock:
                        receiver.bad_signatures += 1
                    self.send_response(400)
                    self.end_headers()
                    return
                with receiver.lock:
                    fail = receiver.failing > 0
                    if fail:
                        receiver.failing -= 1
                        receiver.refused += 1
                    else:
                        receiver.accepted.append({"headers": dict(self.headers), "body": payload})
                self.send_response(503 if fail else 200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def seqs(self) -> list[int]:
        """Each event's sequence once (the first delivery of its ``eventId``), in arrival order."""
        seen: set[str] = set()
        out = []
        with self.lock:
            for item in self.accepted:
                body = item["body"]
                if "eventId" in body and body["eventId"] not in seen:
                    seen.add(body["eventId"])
                    assert item["headers"]["webhook-id"] == body["eventId"]
                    out.append(body["data"]["_meta"]["seq"])
        return out

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def webhook_deployment() -> Iterator[Deployment]:
    with Deployment(env=ENV) as deploy:
        yield deploy


def holder_pid(deploy: Deployment, subscription: str) -> int | None:
    with Redis.from_url(deploy.redis_url) as raw:
        owner = raw.get(f"mcpb:lease:webhook:{subscription}")
    return None if owner is None else int(owner.decode().split("-")[1])


async def until(check: Any, timeout: float = 30) -> None:
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.05)


async def subscribe(http: httpx.AsyncClient, uris: list[str], url: str, secret: str) -> httpx.Response:
    return await modern.call(http, "events/subscribe", {
        "name": EVENT, "arguments": {"uris": uris}, "ttlMs": 120_000,
        "delivery": {"mode": "webhook", "url": url, "secret": secret}}, auth="key-a")


@pytest.mark.timeout(120)
async def test_webhooks_are_signed_retried_in_order_and_survive_the_kill_of_their_worker(
        webhook_deployment: Deployment) -> None:
    deploy = webhook_deployment
    secret = "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()
    receiver = Receiver(secret)
    # One URI per change: fan-out merges repeated updates of one URI (level triggers), so each
    # change is an event of its own only on a URI of its own.
    uris = [f"mcpb://default/hooked/r{n}" for n in range(80)]
    try:
        async with httpx.AsyncClient(base_url=deploy.url, timeout=30,
                                     headers={"Authorization": "Bearer key-a"}) as http:
            answer = await subscribe(http, uris, receiver.url, secret)
            assert answer.status_code == 200, answer.text
            result = answer.json()["result"]
            sub_id = result["id"]
            assert result["truncated"] is False and result["refreshBefore"].endswith("Z")
            for url in ("https://192.168.0.10/hook", "https://169.254.169.254/latest", "https://[::1]/hook",
                        "https://10.0.0.1:8443/", "http://example.com/hook"):
                refused = await subscribe(http, uris, url, secret)
                assert refused.status_code == 400 and refused.json()["error"]["code"] == -32602, refused.text
            again = (await subscribe(http, uris, receiver.url, secret)).json()["result"]
            assert again["id"] == sub_id and again["deliveryStatus"]["active"] is True  # a refresh, same key

            receiver.failing = 15  # the receiver fails for a while: every event waits, then comes in order
            await publish_seq(http, [(uris[n], n) for n in range(40)])
            await until(lambda: receiver.refused >= 15 and len(receiver.seqs()) >= 10)
            pid = holder_pid(deploy, sub_id)
            index = next(i for i, w in enumerate(deploy.workers) if w.proc.pid == pid)
            deploy.kill9(index)  # mid-stream: the rest is another worker's to deliver
            killed_at = len(receiver.seqs())
            await publish_seq(http, [(uris[n], n) for n in range(40, 80)])
            await until(lambda: len(receiver.seqs()) >= 80)
            assert receiver.seqs() == list(range(80)), "every event, in order, none missing"
            assert killed_at < 80
            new_pid = holder_pid(deploy, sub_id)
            assert new_pid is not None and new_pid != pid
            assert receiver.bad_signatures == 0
            headers = receiver.accepted[-1]["headers"]
            assert headers["X-MCP-Subscription-Id"] == sub_id and headers["webhook-signature"].startswith("v1,")
            body = receiver.accepted[-1]["body"]
            assert body["name"] == EVENT and body["cursor"] == body["eventId"]

            listed = subprocess.run([str(BIN), "webhooks", "list", "--json"], capture_output=True, text=True,
                                    env={**os.environ, "MCP_BROKER_REDIS_URL": deploy.redis_url}, timeout=30)
            rows = [json.loads(line) for line in listed.stdout.splitlines()]
            assert [(r["id"], r["url"], r["error"]) for r in rows] == [(sub_id, receiver.url, None)], listed.stderr
            assert secret not in listed.stdout

            gone = await modern.call(http, "events/unsubscribe", {
                "name": EVENT, "arguments": {"uris": uris}, "delivery": {"url": receiver.url}}, auth="key-a")
            assert gone.status_code == 200, gone.text
            count = len(receiver.accepted)
            await publish_seq(http, [(uris[0], 999)])
            with Redis.from_url(deploy.redis_url) as raw:
                assert raw.exists(f"mcpb:{{wh}}:sub:{sub_id}") == 0
            assert all(item["body"]["data"]["_meta"]["seq"] != 999 for item in receiver.accepted[count:])
        print(f"\n[webhooks] 80 events in order through 15 refusals and a kill -9 after {killed_at}; "
              f"{len(receiver.accepted) - 80} redelivered, deduplicated by eventId")
    finally:
        receiver.close()


@pytest.mark.timeout(90)
async def test_a_poll_cursor_from_before_redis_lost_its_data_is_truncated(own_deployment: Deployment) -> None:
    deploy = own_deployment
    assert deploy.redis is not None
    uris = ["mcpb://default/polled/a", "mcpb://default/polled/b"]
    params: dict[str, Any] = {"name": EVENT, "arguments": {"uris": uris}, "cursor": None}
    async with httpx.AsyncClient(base_url=deploy.url, timeout=30) as http:
        first = (await modern.call(http, "events/poll", params)).json()["result"]
        await publish_seq(http, [(uris[0], 1)])
        deploy.redis.stop()
        deploy.redis.start()  # same port, no data
        async with asyncio.timeout(30):
            while (response := await modern.call(http, "events/poll", {**params, "cursor": first["cursor"]})
                   ).status_code != 200:
                assert response.status_code in (502, 503), response.text
        result = response.json()["result"]
        assert result["truncated"] is True, "never silence"
        assert sorted(e["data"]["uri"] for e in result["events"]) == uris
        assert result["cursor"] != first["cursor"]
        await publish_seq(http, [(uris[1], 2)])
        async with asyncio.timeout(20):  # fanned out after the publish was acknowledged
            while not (after := (await modern.call(http, "events/poll", {**params, "cursor": result["cursor"]})
                                 ).json()["result"])["events"]:
                await asyncio.sleep(0.05)
        assert after["truncated"] is False and [e["data"]["uri"] for e in after["events"]] == [uris[1]]
