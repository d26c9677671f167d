"""A refusal reads the same wherever it happens: every path that makes a session, HTTP and stdio alike.

In-process (memory backend, the app over ``httpx.ASGITransport``, a ``StdioServer`` writing to a
list), so each answer is compared byte for byte rather than against a copy of the expected text.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, cast

import httpx
import orjson
import pytest

from broker.auth import Principal
from broker.config import Settings
from broker.errors import (
    BackendUnavailable,
    LimitExceeded,
    LogFull,
    OverQuota,
    PublishRateLimited,
    QuotaExceeded,
    Reason,
)
from broker.protocol import jsonrpc as rpc
from broker.protocol.refusals import SPELLING, rpc_error
from broker.runtime import Broker
from broker.runtime.app import create_app
from broker.transport.edge import REST_STATUS, refused
from broker.transport.rpc import STATUS, status_of
from broker.transport.stdio import StdioServer
from broker.transport.stdio_io import Output
from broker.uris import record_uri

VERSION = "2026-07-28"
URI = record_uri("default", "items", "1")
INITIALIZE = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
              "params": {"protocolVersion": "2025-11-25", "capabilities": {},
                         "clientInfo": {"name": "t", "version": "1"}}}
LEGACY_HEADERS = {"accept": "application/json, text/event-stream", "content-type": "application/json"}


def modern(method: str, params: dict[str, Any], id_: Any = 7, *, resumable: bool = False) -> dict[str, Any]:
    caps: dict[str, Any] = {"extensions": {"dev.mcp-broker/resumable-listen": {}}} if resumable else {}
    meta = {"io.modelcontextprotocol/protocolVersion": VERSION, "io.modelcontextprotocol/clientCapabilities": caps,
            "io.modelcontextprotocol/clientInfo": {"name": "t", "version": "1"}}
    return {"jsonrpc": "2.0", "id": id_, "method": method, "params": {"_meta": meta, **params}}


def modern_headers(method: str) -> dict[str, str]:
    return {**LEGACY_HEADERS, "mcp-protocol-version": VERSION, "mcp-method": method}


LISTEN = modern("subscriptions/listen", {"notifications": {"resourceSubscriptions": [URI]}}, resumable=True)
POLL = modern("events/poll", {"name": "mcp.resource.updated", "arguments": {"uris": [URI]}, "cursor": None})


class Lines:
    """What a ``StdioServer`` writes, one message a line."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    async def put(self, line: bytes) -> None:
        self.sent.append(orjson.loads(line))


@pytest.fixture
async def broker() -> AsyncIterator[Broker]:
    running = Broker(Settings(_env_file=None, max_sessions=1))  # type: ignore[call-arg]
    await running.start()
    yield running
    await running.stop()


@pytest.fixture
async def http(broker: Broker) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=create_app(broker=broker))
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        yield client


async def stdio(broker: Broker, *messages: dict[str, Any]) -> list[dict[str, Any]]:
    """The replies a stdio client gets to ``messages`` (modern requests answered before the next is sent)."""
    lines = Lines()
    server = StdioServer(broker.dispatcher, cast(Output, lines), Principal("default", "anonymous"),
                         max_line=1 << 20, retry_ms=1000)
    for message in messages:
        await server.handle_line(orjson.dumps(message))
        for task in list(server.tasks.values()):
            await task
    await server.close()
    return lines.sent


async def test_sessions_full_is_one_error_on_every_path_that_makes_a_session(
        broker: Broker, http: httpx.AsyncClient) -> None:
    first = await http.post("/mcp", json=INITIALIZE, headers=LEGACY_HEADERS)
    assert first.status_code == 200, first.text  # the one place MCP_BROKER_MAX_SESSIONS=1 allows
    answers = [
        await http.post("/mcp", json=INITIALIZE, headers=LEGACY_HEADERS),
        await http.post("/mcp", json=LISTEN, headers=modern_headers("subscriptions/listen")),
        await http.post("/mcp", json=POLL, headers=modern_headers("events/poll")),
    ]
    errors = []
    for answer in answers:
        assert answer.status_code == 503, answer.text
        assert answer.headers["retry-after"] == "5"
        errors.append(answer.json()["error"])
    assert errors[0] == {"code": rpc.SERVICE_UNAVAILABLE, "message": "Too many sessions; retry later",
                         "data": {"limit": "sessions"}}
    assert errors == [errors[0]] * 3, "initialize, a resumable listen and events/poll refuse alike"
    on_stdio = await stdio(broker, INITIALIZE, LISTEN, POLL)
    assert [reply["error"] for reply in on_stdio] == [errors[0]] * 3, "and stdio says the same"


async def test_an_outage_reads_the_same_on_http_and_stdio(
        broker: Broker, http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch) -> None:
    async def down(*args: Any, **kwargs: Any) -> Any:
        raise BackendUnavailable("redis unavailable during sessions.create: Connection refused")

    monkeypatch.setattr(broker.dispatcher.feeds, "create", down)
    monkeypatch.setattr(broker.dispatcher.methods, "call", down)
    list_request = modern("resources/list", {})
    over_http = [await http.post("/mcp", json=INITIALIZE, headers=LEGACY_HEADERS),
                 await http.post("/mcp", json=list_request, headers=modern_headers("resources/list"))]
    for answer in over_http:
        assert answer.status_code == 503, answer.text
        assert answer.headers["retry-after"] == "1"
    errors = [answer.json()["error"] for answer in over_http]
    assert errors[0]["code"] == rpc.SERVICE_UNAVAILABLE
    assert "redis" not in errors[0]["message"], "the backend's own words stay in the log"
    assert errors == [errors[0]] * 2
    on_stdio = await stdio(broker, INITIALIZE, list_request)
    assert [reply["error"] for reply in on_stdio] == errors


def test_every_reason_has_a_json_rpc_spelling_and_a_rest_status() -> None:
    assert set(SPELLING) == set(Reason) == set(REST_STATUS)
    for reason in Reason:
        assert SPELLING[reason].code in STATUS or SPELLING[reason].code in (rpc.INTERNAL_ERROR, rpc.INVALID_PARAMS)


@pytest.mark.parametrize(("refusal", "code", "status"), [
    (OverQuota("streams", "acme", 2), rpc.QUOTA_EXCEEDED, 429),
    (LimitExceeded("", reason=Reason.SESSIONS, retry_after=5, data={"limit": "sessions"}),
     rpc.SERVICE_UNAVAILABLE, 503),
    (LimitExceeded("", reason=Reason.LISTENS, data={"limit": 4}), rpc.INTERNAL_ERROR, 200),
    (LimitExceeded("", reason=Reason.SUBSCRIPTIONS, data={"limit": 3}), rpc.INVALID_PARAMS, 200),
    (LimitExceeded("", reason=Reason.WEBHOOKS, retry_after=60, data={"limit": "subscriptions", "max": 1}),
     rpc.EVENTS_EXHAUSTED, 429),
    (BackendUnavailable("gone"), rpc.SERVICE_UNAVAILABLE, 503),
], ids=lambda value: getattr(value, "reason", value))
def test_a_refusal_as_a_whole_reply_gets_the_status_of_its_code(refusal: Any, code: int, status: int) -> None:
    error = rpc_error(refusal)
    assert (error.code, status_of(error), error.retry_after) == (code, status, refusal.retry_after)


@pytest.mark.parametrize(("refusal", "status", "retry_after"), [
    (QuotaExceeded("acme", 10, 10, 1), 429, "1"),
    (QuotaExceeded("acme", 10, 0, 11), 413, "1"),  # more than the tenant may ever have waiting
    (PublishRateLimited("acme", 5, 2), 429, "2"),
    (LogFull(0, 100), 503, "1"),
    (LimitExceeded("tenant 'acme' has 3 records", reason=Reason.RECORDS), 507, None),
    (BackendUnavailable("redis unavailable during records.write"), 503, "1"),
], ids=lambda value: getattr(value, "reason", value))
def test_the_record_routes_and_post_changes_answer_a_refusal_by_one_rule(
        refusal: Any, status: int, retry_after: str | None) -> None:
    answer = refused(refusal)
    assert (answer.status_code, answer.headers.get("retry-after")) == (status, retry_after)
    detail = orjson.loads(answer.body)["detail"]
    assert detail == ("backend unavailable" if isinstance(refusal, BackendUnavailable) else str(refusal))
