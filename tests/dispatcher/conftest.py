"""The dispatcher tier: the MCP conversation in this process, on the memory backend, no socket, no subprocess.

A ``Broker`` is built as ``mcp-broker serve`` builds it. Its clients talk to its ``Dispatcher``
through the stdio transport's ``StdioServer`` (one JSON-RPC message in, the lines it writes out),
the same channel a stdio client has, held in memory: each ``Client`` is one such channel, so several
stand for several clients of one worker. The legacy GET stream, which only HTTP has, is run by
``Client.stream`` as the HTTP transport runs it: ``Dispatcher.legacy_stream`` from the
``Last-Event-ID`` the client names, on a writer that records every frame and its event id.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
import pytest

from broker.auth import Principal
from broker.config import Settings
from broker.delivery import EndReason
from broker.feeds.model import parse_event_id
from broker.feeds.session import SessionStream
from broker.methods import Call
from broker.protocol import jsonrpc as rpc
from broker.runtime import Broker
from broker.transport.stdio import StdioServer
from broker.transport.stdio_io import Output

#: How long a test waits for a frame it expects; reached only when the broker is wrong.
TIMEOUT = 5.0
LEGACY = "2025-11-25"
MODERN = "2026-07-28"
SUBSCRIPTION_ID = "io.modelcontextprotocol/subscriptionId"
RESUMABLE = "dev.mcp-broker/resumable-listen"
EVENT_ID = "dev.mcp-broker/eventId"
LAST_EVENT_ID = "dev.mcp-broker/lastEventId"
UPDATED = "notifications/resources/updated"
ACK = "notifications/subscriptions/acknowledged"

Message = dict[str, Any]


class Lines(Output):
    """The output of one client's channel, kept in memory: every message written, in order."""

    def __init__(self) -> None:
        super().__init__(stream=None)  # type: ignore[arg-type]
        self.messages: asyncio.Queue[Message] = asyncio.Queue()

    def start(self) -> None:
        return None

    async def put(self, line: bytes) -> None:
        for part in line.split(b"\n"):  # send_many joins a burst with newlines, as stdout gets it
            self.messages.put_nowait(orjson.loads(part))

    async def close(self) -> None:
        return None


class Frames:
    """A ``Writer`` of a legacy GET stream that keeps each frame with its event id (the SSE ``id:``)."""

    def __init__(self) -> None:
        self.frames: asyncio.Queue[tuple[Message, str | None]] = asyncio.Queue()

    async def send(self, message: bytes, event_id: str | None = None) -> None:
        self.frames.put_nowait((orjson.loads(message), event_id))

    async def send_many(self, items: list[tuple[bytes, str | None]]) -> None:
        for message, event_id in items:
            await self.send(message, event_id)

    async def comment(self) -> None:
        return None

    async def retry(self) -> None:
        return None

    async def prime(self, event_id: str) -> None:
        return None


class Stream:
    """A client's open legacy GET stream."""

    def __init__(self, stream: SessionStream) -> None:
        self.stream = stream
        self.writer = Frames()
        self.task = asyncio.create_task(stream.run(self.writer))
        self.last_event_id: str | None = None

    async def next(self) -> Message:
        """The next notification the client receives on it."""
        message, event_id = await asyncio.wait_for(self.writer.frames.get(), TIMEOUT)
        self.last_event_id = event_id or self.last_event_id
        return message

    async def close(self) -> None:
        """The client goes away (the connection closes)."""
        self.stream.disconnect()
        await asyncio.wait_for(self.task, TIMEOUT)


class Client:
    """One client of the broker, on a channel of its own."""

    def __init__(self, broker: Broker, principal: Principal) -> None:
        self.broker = broker
        self.lines = Lines()
        self.server = StdioServer(broker.dispatcher, self.lines, principal, max_line=1 << 20, retry_ms=100)
        self.next_id = 0

    async def send(self, message: Message) -> None:
        await self.server.handle_line(orjson.dumps(message))

    async def next(self) -> Message:
        """The next message the client receives."""
        return await asyncio.wait_for(self.lines.messages.get(), TIMEOUT)

    async def until(self, matches: Callable[[Message], bool]) -> Message:
        """The first message received from now that ``matches``; the others are passed over."""
        while not matches(message := await self.next()):
            pass
        return message

    async def request(self, method: str, params: Message | None = None) -> Message:
        """A 2025 request and the response to it (a ``result`` or an ``error``)."""
        self.next_id += 1
        id_ = self.next_id
        await self.send({"jsonrpc": "2.0", "id": id_, "method": method, "params": params or {}})
        return await self.until(lambda m: m.get("id") == id_ and "method" not in m)

    async def initialize(self, version: str = LEGACY) -> Message:
        return await self.request("initialize", {"protocolVersion": version, "capabilities": {},
                                                 "clientInfo": {"name": "tests", "version": "1"}})

    async def initialized(self) -> None:
        """``notifications/initialized``: the session's notifications start to flow on the channel."""
        await self.send({"jsonrpc": "2.0", "method": "notifications/initialized"})

    async def listen(self, id_: Any, *uris: str, resumable: bool = False, last_event_id: str | None = None) -> None:
        """Open a 2026-07-28 ``subscriptions/listen`` (its ack, or its error, arrives on the channel)."""
        meta: Message = {"io.modelcontextprotocol/protocolVersion": MODERN,
                         "io.modelcontextprotocol/clientInfo": {"name": "tests", "version": "1"},
                         "io.modelcontextprotocol/clientCapabilities":
                             {"extensions": {RESUMABLE: {}}} if resumable else {}}
        if last_event_id is not None:
            meta[LAST_EVENT_ID] = last_event_id
        await self.send({"jsonrpc": "2.0", "id": id_, "method": "subscriptions/listen",
                         "params": {"_meta": meta, "notifications": {"resourceSubscriptions": list(uris)}}})

    async def cancel(self, id_: Any) -> None:
        await self.send({"jsonrpc": "2.0", "method": "notifications/cancelled", "params": {"requestId": id_}})

    async def post(self, method: str, params: Message | None = None) -> Message:
        """A 2025 request as HTTP sends it (a POST of the session): answered, and no stream started."""
        self.next_id += 1
        message = rpc.parse_message({"jsonrpc": "2.0", "id": self.next_id, "method": method, "params": params or {}})
        call = Call(self.server.principal, False, self.server.session)
        reply = await self.broker.dispatcher.legacy(call, message)
        assert reply is not None
        answer: Message = orjson.loads(reply)
        return answer

    def stream(self, last_event_id: str | None = None) -> Stream:
        """The session's legacy GET stream, from ``Last-Event-ID`` when given (the HTTP transport's reading of it)."""
        session = self.server.session
        assert session is not None, "initialize first"
        cursor = None
        if last_event_id is not None:
            parsed = parse_event_id(last_event_id)
            assert parsed is not None and parsed[0] == session.epoch, last_event_id
            cursor = parsed[1]
        return Stream(self.broker.dispatcher.legacy_stream(session, cursor))

    async def close(self) -> None:
        """The client goes away: its streams end and its session with it."""
        if self.server.stream is not None:
            self.server.stream.disconnect()
        for listen in list(self.server.listens.values()):
            listen.end(EndReason.DISCONNECT)
        await self.server.close()


def sub_id(message: Message) -> Any:
    """The ``subscriptionId`` a listen frame carries (None on another message)."""
    return (message.get("params") or message.get("result") or {}).get("_meta", {}).get(SUBSCRIPTION_ID)


def is_ack(id_: Any) -> Callable[[Message], bool]:
    return lambda m: m.get("method") == ACK and sub_id(m) == id_


def is_update(id_: Any, uri: str | None = None) -> Callable[[Message], bool]:
    return lambda m: (m.get("method") == UPDATED and sub_id(m) == id_
                      and (uri is None or m["params"]["uri"] == uri))


def is_answer(id_: Any) -> Callable[[Message], bool]:
    return lambda m: m.get("id") == id_ and "method" not in m


@pytest.fixture
async def make_broker() -> AsyncIterator[Callable[..., Awaitable[Broker]]]:
    """A started broker on the memory backend, of settings given as keywords; stopped after the test."""
    started: list[Broker] = []

    async def make(**overrides: Any) -> Broker:
        settings = Settings(_env_file=None, metrics=False, **overrides)  # type: ignore[call-arg]
        broker = Broker(settings)
        await broker.start()
        started.append(broker)
        return broker

    yield make
    for broker in started:
        await broker.stop()


@pytest.fixture
async def broker(make_broker: Callable[..., Awaitable[Broker]]) -> Broker:
    return await make_broker()


@pytest.fixture
async def connect() -> AsyncIterator[Callable[..., Client]]:
    """A new client of a broker (of ``tenant``'s principal ``alice`` unless one is given); closed after the test."""
    clients: list[Client] = []

    def make(broker: Broker, tenant: str = "default", principal: str = "alice") -> Client:
        client = Client(broker, Principal(tenant, principal))
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.close()


@pytest.fixture(autouse=True)
def no_sockets(monkeypatch: pytest.MonkeyPatch) -> None:
    """This tier opens no network socket: connecting or listening fails the test."""
    def refuse(self: socket.socket, *args: object) -> None:
        raise AssertionError(f"the dispatcher tier opened a {self.family.name} socket")

    for name in ("bind", "connect", "connect_ex"):
        monkeypatch.setattr(socket.socket, name, refuse)
