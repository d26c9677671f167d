"""MCP over stdio: one client on stdin/stdout, both protocol eras; lines and task bookkeeping only.

What each message means is ``broker.dispatch``'s. This module reads lines (``stdio_io``), picks
each message's era (``protocol.envelope.stdio_era``: docs/PROTOCOL.md, "Two eras on one
endpoint"), runs what the dispatcher returns, and writes the answers. Nothing but MCP messages
reaches stdout: logs go to stderr, and ``sys.stdout`` is pointed at stderr so a stray ``print``
cannot corrupt the channel.

Legacy: ``initialize`` creates a session in the configured backend for the default tenant's
anonymous principal (stdio takes no credentials from the wire). Its notifications flow
through the same inbox as on HTTP into a ``SessionStream`` whose writer is stdout; the stream
starts on ``notifications/initialized`` (or the first ``resources/subscribe``), and since it
reads the inbox from the start nothing published before it is lost. A stream that ends for a
reason this process can resume from (an outage) is started again from its cursor, since a
stdio client cannot reconnect. The session ends with the process.

Modern: each request runs as its own task, so a slow read does not hold up the next line, and
``notifications/cancelled`` cancels it; for a listen, the cancel ends the stream and nothing
more is written for it. Every listen frame carries its ``subscriptionId``; on shutdown (EOF,
SIGTERM or SIGINT) every open listen gets its ``complete`` result before the process exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from typing import IO, Any, Protocol

import orjson

from broker.auth import Principal
from broker.config import Settings
from broker.delivery import EndReason, Listen
from broker.dispatch import Dispatcher
from broker.errors import BackendUnavailable, Refusal
from broker.feeds.listen import ResumableListen
from broker.feeds.service import SessionRecord
from broker.feeds.session import SessionStream
from broker.methods import Call
from broker.protocol import jsonrpc as rpc
from broker.protocol.envelope import stdio_era
from broker.protocol.jsonrpc import Message
from broker.transport.rpc import as_rpc
from broker.transport.stdio_io import LINE_LIMIT_SLACK, TOO_LONG, Output, Places, StdioWriter, blocking, lines

__all__ = ["StdioServer", "StdioWriter", "serve_stdio"]

logger = logging.getLogger(__name__)


class Runtime(Protocol):
    """What stdio needs of the process it serves (``broker.runtime.Broker``)."""

    settings: Settings
    dispatcher: Dispatcher

    async def start(self) -> None: ...

    async def end_streams(self) -> None: ...

    async def stop(self) -> None: ...


class StdioServer:
    """Serves one client: dispatches each input line and tracks the work it started."""

    def __init__(self, dispatcher: Dispatcher, output: Output, principal: Principal, *, max_line: int,
                 retry_ms: int) -> None:
        self.dispatcher = dispatcher
        self.output = output
        self.writer = StdioWriter(output)
        self.principal = principal
        self.max_line = max_line
        self.retry_ms = retry_ms
        self.session: SessionRecord | None = None
        self.stream: SessionStream | None = None
        self.stream_task: asyncio.Task[EndReason] | None = None
        #: In-flight modern requests (listens included) by JSON-RPC id.
        self.tasks: dict[rpc.Id, asyncio.Task[None]] = {}
        self.listens: dict[rpc.Id, Listen | ResumableListen] = {}
        self.places = Places()

    async def reply(self, data: bytes) -> None:
        await self.output.put(data)

    async def progress(self, note: dict[str, Any]) -> None:
        """An upstream's notification about a request forwarded to it (``notifications/progress``)."""
        await self.reply(orjson.dumps(note))

    # -- input ------------------------------------------------------------------------------
    async def handle_line(self, line: bytes) -> None:
        if not line.strip():
            return
        if line is TOO_LONG:
            error = rpc.RpcError(rpc.INVALID_REQUEST, f"Invalid Request: line longer than {self.max_line} bytes")
            await self.reply(rpc.encode_error(None, error))
            return
        try:
            obj = rpc.parse_body(line)
        except rpc.RpcError as exc:
            await self.reply(rpc.encode_error(None, exc))
            return
        if isinstance(obj, list):
            await self.handle_batch(obj)
            return
        try:
            msg = rpc.parse_message(obj)
        except rpc.RpcError as exc:
            await self.reply(rpc.encode_error(rpc.request_id_of(obj), exc))
            return
        if msg.kind == "response":
            return  # the broker sends no requests, so there is nothing to match a response to
        if msg.method == "notifications/cancelled":
            self.cancel(msg.params.get("requestId"))
        elif stdio_era(obj, msg.method, self.session is not None) == "modern":
            await self.start_modern(msg)
        elif (reply := await self.legacy(msg)) is not None:
            await self.reply(reply)

    async def handle_batch(self, items: list[Any]) -> None:
        """2025-03-26 batches: legacy messages only, answered with one array (an outage in each member's reply)."""
        try:
            body = await self.dispatcher.batch(Call(self.principal, False, self.session), items, self.legacy)
        except rpc.RpcError as exc:
            await self.reply(rpc.encode_error(None, exc))
        else:
            if body is not None:
                await self.reply(body)

    def cancel(self, request_id: Any) -> None:
        """Cancel a modern request, a listen above all; unknown or finished ids are ignored (spec)."""
        if not isinstance(request_id, str | int):
            return
        listen = self.listens.get(request_id)
        if listen is not None:
            listen.end(EndReason.CANCELLED)  # its task returns on its own and writes nothing more
            return
        task = self.tasks.get(request_id)
        if task is not None:
            task.cancel()

    # -- legacy -----------------------------------------------------------------------------
    async def legacy(self, msg: Message) -> bytes | None:
        """The reply to a legacy message, with an outage answered in-band rather than ending the process."""
        call = Call(self.principal, False, self.session, progress=self.progress)
        try:
            if not msg.is_request:
                await self.dispatcher.notify(call, msg)
                if msg.method == "notifications/initialized":
                    self.start_stream()
                return None
            if msg.method == "initialize":
                return await self.initialize(msg)
            assert msg.id is not None  # a request has one
            result = await self.dispatcher.call(call, msg)
        except (rpc.RpcError, Refusal) as exc:  # an outage, a quota, a bound: the error HTTP sends
            if not msg.is_request:
                logger.warning("%s dropped: %s", msg.method, exc)
                return None
            return rpc.encode_error(msg.id, as_rpc(exc))
        if msg.method == "resources/subscribe":
            self.start_stream()  # the session now watches something: its frames flow from the inbox
        return self.dispatcher.answer(msg, result)

    async def initialize(self, msg: Message) -> bytes:
        if self.session is not None:
            return rpc.encode_error(msg.id, rpc.RpcError(rpc.INVALID_REQUEST, "Already initialized"))
        try:
            reply, self.session = await self.dispatcher.initialize(self.principal, msg)
        except (rpc.RpcError, Refusal) as exc:
            return rpc.encode_error(msg.id, as_rpc(exc))
        return reply

    def start_stream(self) -> None:
        """Start the session's stream, or start it again after it ended for a reason this process can
        resume from (an outage ends it with ``retry:``, which means nothing on stdio)."""
        if self.session is None or self.dispatcher.closing:
            return
        if self.stream_task is not None and not self.stream_task.done():
            return
        cursor = None if self.stream is None else self.stream.cursor
        self.stream = self.dispatcher.legacy_stream(self.session, cursor)
        self.stream_task = asyncio.create_task(self.stream.run(self.writer), name="stdio-legacy-stream")
        self.stream_task.add_done_callback(self._stream_ended)

    def _stream_ended(self, task: asyncio.Task[EndReason]) -> None:
        reason = None if task.cancelled() or task.exception() is not None else task.result()
        if reason is not None and reason.resumable:
            asyncio.get_running_loop().call_later(self.retry_ms / 1000, self.start_stream)

    # -- modern -----------------------------------------------------------------------------
    async def start_modern(self, msg: Message) -> None:
        if not msg.is_request:
            return  # 2026-07-28 defines no other client notifications; accepted and dropped
        assert msg.id is not None
        id_ = msg.id
        if id_ in self.tasks:
            # 2026-07-28: an id must not match another unanswered request of the same sender.
            error = rpc.RpcError(rpc.INVALID_REQUEST, "Invalid Request: id is in use by an unanswered request")
            await self.reply(rpc.encode_error(id_, error))
            return
        await self.places.take(id_)
        task = asyncio.create_task(self.modern(msg), name=f"stdio-request-{id_}")
        self.tasks[id_] = task
        task.add_done_callback(lambda _t: self._ended(id_))

    def _ended(self, id_: rpc.Id) -> None:
        self.tasks.pop(id_, None)
        self.places.give_back(id_)

    async def modern(self, msg: Message) -> None:
        assert msg.id is not None
        try:
            answer = await self.dispatcher.modern(self.principal, msg, progress=self.progress)
        except (rpc.RpcError, Refusal) as exc:
            answer = rpc.encode_error(msg.id, as_rpc(exc))
        if isinstance(answer, Listen | ResumableListen):
            self.places.give_back(msg.id)  # open for as long as the client wants: it holds no place
            await self.listen(msg.id, answer)
        else:
            await self.reply(answer)

    async def listen(self, request_id: rpc.Id, listen: Listen | ResumableListen) -> None:
        self.listens[request_id] = listen
        try:
            await listen.run(self.writer)
        finally:
            self.dispatcher.close_listen(listen)
            self.listens.pop(request_id, None)

    # -- shutdown -----------------------------------------------------------------------------
    async def close(self) -> None:
        """End everything this client started (its streams have ended: listens got their ``complete``)."""
        for task in list(self.tasks.values()):
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        if self.stream_task is not None:
            await asyncio.gather(self.stream_task, return_exceptions=True)
        if self.session is not None:
            try:
                await self.dispatcher.end_session(self.session)
            except BackendUnavailable:
                logger.warning("could not end the stdio session: backend unavailable; it will expire")


async def serve_stdio(broker: Runtime, stdin: IO[bytes] | None = None, stdout: IO[bytes] | None = None) -> None:
    """Serve one client until stdin reaches EOF or the process gets SIGTERM/SIGINT; starts and stops ``broker``.

    Raises:
        BackendUnavailable: the configured backend cannot be reached at start.
    """
    settings = broker.settings
    stdin = stdin or sys.stdin.buffer
    stdout = stdout or sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but MCP messages may reach the real stdout
    await broker.start()
    output = Output(stdout)
    output.start()
    max_line = settings.max_body_bytes + LINE_LIMIT_SLACK
    server = StdioServer(broker.dispatcher, output, Principal(settings.default_tenant, "anonymous"),
                         max_line=max_line, retry_ms=settings.retry_ms)
    reading = asyncio.current_task()
    signalled = False

    def on_signal() -> None:
        nonlocal signalled
        if reading is not None and not signalled:
            signalled = True
            reading.cancel()

    loop = asyncio.get_running_loop()
    stop_signals = [signal.SIGTERM, signal.SIGINT]
    for sig in stop_signals:
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, on_signal)
    was_blocking = blocking(stdin)
    try:
        async for line in lines(stdin, max_line):
            await server.handle_line(line)
        logger.info("stdin closed; shutting down")
    except asyncio.CancelledError:
        if not signalled or reading is None:
            raise  # cancelled from outside: still shut down (finally), then propagate
        reading.uncancel()
        logger.info("signal received; shutting down")
    finally:
        for sig in stop_signals:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(sig)
        try:
            await broker.end_streams()  # ends listens (complete) and the legacy stream, and waits for them
            await server.close()
            await output.close()
        finally:
            await broker.stop()
            if was_blocking is not None:
                with contextlib.suppress(OSError, ValueError):
                    os.set_blocking(stdin.fileno(), was_blocking)
