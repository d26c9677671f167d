"""Webhooks and polls across three workers on one Redis behind the round-robin proxy.

A receiver started by the test (a small HTTP server on loopback, allow-listed) verifies every
signature with ``standardwebhooks``; it fails for a while, then recovers, and receives every
event in order; the worker delivering them is killed with ``kill -9`` mid-stream and another
finishes (duplicates allowed, deduplicated by ``eventId``; none missing). A callback to a
private address is refused, and a poll cursor from before Redis restarted empty is answered
``truncated: true``. A gap notice its worker died before sending is sent by the next one, and a
subscription made with a stored API key lasts no longer than the key: its lease is capped at
the key's expiry, and revoking the key ends it.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import secrets
import subprocess
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import pytest
from redis import Redis
from standardwebhooks import Webhook

from tests.distributed.conftest import Deployment
from tests.distributed.test_faults import publish_seq
from tests.integration import modern
from tests.keys_support import create_key, revoke_key
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
    """Verifies each POST's signature, answers 503 while ``failing`` (or to gap notices while
    ``refuse_gaps``), and keeps what it accepted, in order. A body shorter than its
    ``content-length`` (its sender killed between the headers and the body) is counted apart."""

    def __init__(self, secret: str) -> None:
        self.webhook = Webhook(secret)
        self.failing = 0  # requests still to refuse
        self.refuse_gaps = False
        self.gaps_refused = 0
        self.accepted: list[dict[str, Any]] = []
        self.refused = 0
        self.bad_signatures = 0
        self.truncated = 0  # requests cut short by the kill of their sender
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("content-length", "0"))
                body = self.rfile.read(length)
                if len(body) < length:  # its sender was killed mid-request: nothing to verify, no answer
                    with receiver.lock:
                        receiver.truncated += 1
                    return
                try:
                    payload = receiver.webhook.verify(body, dict(self.headers))
                except Exception:
                    with receiver.lock:
                        receiver.bad_signatures += 1
                    self.send_response(400)
                    self.end_headers()
                    return
                with receiver.lock:
                    if receiver.refuse_gaps and payload.get("type") == "gap":
                        receiver.gaps_refused += 1
                        fail = True
                    elif fail := receiver.failing > 0:
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
                if "seq" in body.get("data", {}).get("_meta", {}) and body["eventId"] not in seen:
                    seen.add(body["eventId"])
                    assert item["headers"]["webhook-id"] == body["eventId"]
                    out.append(body["data"]["_meta"]["seq"])
        return out

    def bodies(self, check: Any) -> list[dict[str, Any]]:
        with self.lock:
            return [item["body"] for item in self.accepted if check(item["body"])]

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


async def subscribe(http: httpx.AsyncClient, uris: list[str], url: str, secret: str, auth: str = "key-a",
                    ttl_ms: int | None = 120_000) -> httpx.Response:
    return await modern.call(http, "events/subscribe", {
        "name": EVENT, "arguments": {"uris": uris}, "ttlMs": ttl_ms,
        "delivery": {"mode": "webhook", "url": url, "secret": secret}}, auth=auth)


def new_secret() -> str:
    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()


def stored(deploy: Deployment, subscription: str, field: str) -> Any:
    with Redis.from_url(deploy.redis_url) as raw:
        value = raw.hget(f"mcpb:{{wh}}:sub:{subscription}", field)
    return None if value is None else json.loads(value)


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
            assert receiver.truncated <= 1, "only the POST in flight at the kill may be cut short"
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


@pytest.mark.timeout(120)
async def test_a_gap_notice_owed_by_a_worker_that_died_is_sent_by_the_next(webhook_deployment: Deployment) -> None:
    deploy = webhook_deployment
    secret = new_secret()
    receiver = Receiver(secret)
    uris = ["mcpb://default/gapped/a", "mcpb://default/gapped/b"]
    try:
        async with httpx.AsyncClient(base_url=deploy.url, timeout=30,
                                     headers={"Authorization": "Bearer key-a"}) as http:
            sub_id = (await subscribe(http, uris, receiver.url, secret)).json()["result"]["id"]
            await publish_seq(http, [(uris[0], 1)])
            await until(lambda: receiver.seqs() == [1])
            receiver.refuse_gaps = True
            session = stored(deploy, sub_id, "session")
            with Redis.from_url(deploy.redis_url) as raw:  # the hidden session is gone, as if it had expired
                raw.delete(*raw.keys(f"mcpb:{{s:{session}}}*"))
            await until(lambda: receiver.gaps_refused >= 2)  # the holder owes the gap, and is failing to send it
            pid = holder_pid(deploy, sub_id)
            deploy.kill9(next(i for i, w in enumerate(deploy.workers) if w.proc.pid == pid))
            receiver.refuse_gaps = False
            resync = {"dev.mcp-broker/resync": True}
            await until(lambda: len(receiver.bodies(lambda b: b.get("data", {}).get("_meta") == resync)) >= 2)
            gaps = receiver.bodies(lambda b: b.get("type") == "gap")
            assert len(gaps) == 1 and gaps[0]["cursor"].startswith(stored(deploy, sub_id, "session"))
            # The debt is cleared once the last event was acknowledged: just after the receiver saw it.
            await until(lambda: stored(deploy, sub_id, "gap") is False)
            assert holder_pid(deploy, sub_id) != pid
            await publish_seq(http, [(uris[1], 2)])
            await until(lambda: receiver.seqs() == [1, 2])  # and delivery goes on in the new session
    finally:
        receiver.close()


KEYED_ENV = {**ENV, "MCP_BROKER_AUTH": "keys", "MCP_BROKER_CREDENTIAL_CHECK_SECONDS": "0.5"}


@pytest.mark.timeout(120)
async def test_a_subscription_lasts_no_longer_than_the_stored_key_it_was_made_with() -> None:
    with Deployment(workers=1, env=KEYED_ENV) as deploy:
        cli = {"MCP_BROKER_REDIS_URL": deploy.redis_url, "MCP_BROKER_AUTH": "keys"}
        hour = create_key(cli, "default", "alice", "--expires-in", "1h")
        lasting = create_key(cli, "default", "alice")
        secret = new_secret()
        receiver = Receiver(secret)
        uris = ["mcpb://default/keyed/a"]
        try:
            async with httpx.AsyncClient(base_url=deploy.url, timeout=30,
                                         headers={"Authorization": f"Bearer {lasting.key}"}) as http:
                capped = await subscribe(http, uris, receiver.url + "?short", secret, auth=hour.key, ttl_ms=None)
                refresh_before = datetime.fromisoformat(capped.json()["result"]["refreshBefore"]).timestamp()
                assert refresh_before <= time.time() + 3600, "never past the key's expiry (not the 24 h asked for)"
                sub_id = (await subscribe(http, uris, receiver.url, secret, auth=lasting.key)).json()["result"]["id"]
                assert stored(deploy, sub_id, "credential") == lasting.id
                await publish_seq(http, [(uris[0], 1)])
                await until(lambda: 1 in receiver.seqs())
                revoke_key(cli, lasting.id)
                await until(lambda: stored(deploy, sub_id, "session") is None, timeout=15)
            async with httpx.AsyncClient(base_url=deploy.url, timeout=30,
                                         headers={"Authorization": f"Bearer {hour.key}"}) as http:
                count = len(receiver.accepted)
                await publish_seq(http, [(uris[0], 2)])
                await asyncio.sleep(1.5)
                assert all(item["headers"]["X-MCP-Subscription-Id"] != sub_id
                           for item in receiver.accepted[count:]), "nothing after the revocation"
        finally:
            receiver.close()
