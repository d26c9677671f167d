"""MCP over stdio: one client on stdin/stdout, both protocol eras.

Framing: one compact JSON message per line, UTF-8; nothing but MCP messages on stdout (logs go
to stderr, and ``sys.stdout`` is pointed at stderr so a stray ``print`` cannot corrupt the
channel). Every write goes through one writer task, so frames of concurrent listens, replies
and legacy notifications never interleave.

Era per message (docs/PROTOCOL.md, "Two eras on one endpoint"): a request carrying the modern
``_meta`` envelope is handled statelessly; ``initialize`` starts the legacy semantics, scoped
to this process; later requests without the envelope belong to that legacy session. ``ping`` is answered before
``initialize`` (legacy allows it); any other request without either is treated as modern and
gets the precise envelope error.

Legacy: ``initialize`` creates a session in the configured backend for the default tenant's
anonymous principal (stdio takes no credentials from the wire). Its notifications flow
through the same inbox as on HTTP into a ``LegacyStream`` whose writer is stdout; the stream
starts on ``notifications/initialized`` (or the first ``resources/subscribe``), and since it
reads the inbox from the start nothing published before it is lost. The session ends with
the process.

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
from typing import IO, Any, Final

from broker.auth import Principal
from broker.config import Settings
from broker.core import Broker
from broker.delivery import LegacyStream, Listen
from broker.errors import BackendUnavailable, LimitExceeded
from broker.methods import Call
from broker.protocol import jsonrpc as rpc
from broker.protocol.envelope import check_meta, has_modern_meta
from broker.protocol.jsonrpc import Message
from broker.protocol.versions import BATCH_VERSIONS
from broker.transport.batches import answer_batch, check_batch, encode_batch

__all__ = ["StdioServer", "StdioWriter", "serve_stdio"]

logger = logging.getLogger(__name__)

#: Messages waiting for stdout; a client that stops reading slows the broker down instead of growing memory.
OUTPUT_QUEUE: Final = 1024
#: Room for the envelope on top of ``max_body_bytes``; a longer line is refused and skipped.
LINE_LIMIT_SLACK: Final = 4096
TOO_LONG: Final = b"\x00"  # stands in for a line that was too long (it never reaches the parser)


class _Output:
    """The single writer of stdout: a bounded queue drained by one task (blocking writes run in a thread)."""

    def __init__(self, stream: IO[bytes]) -> None:
        self.stream = stream
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue(OUTPUT_QUEUE)
        self.task: asyncio.Task[None] | None = None
        self.broken = False

    def start(self) -> None:
        self.task = asyncio.create_task(self._drain(), name="stdio-writer")

    async def put(self, line: bytes) -> None:
        if not self.broken:
            await self.queue.put(line)

    def _write(self, chunk: bytes) -> None:
        self.stream.write(chunk)
        self.stream.flush()

    async def _drain(self) -> None:
        while (line := await self.queue.get()) is not None:
            chunk = [line + b"\n"]
            while not self.queue.empty():  # batch what is already waiting into one write
                more = self.queue.get_nowait()
                if more is None:
                    self.queue.put_nowait(None)
                    break
                chunk.append(more + b"\n")
            try:
                await asyncio.to_thread(self._write, b"".join(chunk))
            except (OSError, ValueError):  # the client closed stdout: keep draining, write nothing
                self.broken = True
                logger.info("stdout closed by the client")

    async def close(self) -> None:
        """Write what is queued, then stop."""
        await self.queue.put(None)
        if self.task is not None:
            await self.task


class StdioWriter:
    """The ``broker.delivery.Writer`` of the stdio channel: one line per message, no SSE-only extras."""

    def __init__(self, output: _Output) -> None:
        self.output = output

    async def send(self, message: bytes, event_id: str | None = None) -> None:
        await self.output.put(message)

    async def send_many(self, items: list[tuple[bytes, str | None]]) -> None:
        await self.output.put(b"\n".join(message for message, _ in items))

    async def comment(self) -> None:
        """No keep-alives: stdio has no intermediaries to time out."""

    async def retry(self) -> None:
        """No reconnect hint: a stdio client restarts the process instead."""

    async def prime(self, event_id: str) -> None:
        """No cursors on stdio."""


class StdioServer:
    """Serves one client: dispatches each input line and tracks the work it started."""

    def __init__(self, broker: Broker, output: _Output) -> None:
        self.broker = broker
        self.methods = broker.methods
        self.output = output
        self.writer = StdioWriter(output)
        self.principal = Principal(broker.settings.default_tenant, "anonymous")
        self.session: Any = None
        self.stream: LegacyStream | None = None
        self.stream_task: asyncio.Task[str] | None = None
        #: In-flight modern requests (listens included) by JSON-RPC id.
        self.tasks: dict[rpc.Id, asyncio.Task[None]] = {}
        self.listens: dict[rpc.Id, Listen] = {}

    async def reply(self, data: bytes) -> None:
        await self.output.put(data)

    # -- input ------------------------------------------------------------------------------
    async def handle_line(self, line: bytes) -> None:
        if not line.strip():
            return
        if line is TOO_LONG:
            limit = self.broker.settings.max_body_bytes + LINE_LIMIT_SLACK
            error = rpc.RpcError(rpc.INVALID_REQUEST, f"Invalid Request: line longer than {limit} bytes")
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
        elif has_modern_meta(obj) or (self.session is None and msg.method not in ("initialize", "ping")):
            await self.start_modern(msg)
        else:
            reply = await self.legacy_or_unavailable(msg)
            if reply is not None:
                await self.reply(reply)

    async def handle_batch(self, items: list[Any]) -> None:
        """2025-03-26 batches: legacy messages only, answered with one array."""
        settings = self.broker.settings
        try:
            if self.session is None or self.session.protocol_version not in BATCH_VERSIONS:
                raise rpc.RpcError(rpc.INVALID_REQUEST, "Invalid Request: batches are only part of 2025-03-26")
            check_batch(items, settings.max_batch_items)
        except rpc.RpcError as exc:
            await self.reply(rpc.encode_error(None, exc))
            return
        replies = await answer_batch(items, self.legacy_or_unavailable, settings.max_response_bytes)
        if replies:
            await self.reply(encode_batch(replies))

    def cancel(self, request_id: Any) -> None:
        """Cancel a modern request, a listen above all; unknown or finished ids are ignored (spec)."""
        if not isinstance(request_id, str | int):
            return
        listen = self.listens.get(request_id)
        if listen is not None:
            listen.end("cancelled")  # its task returns on its own and writes nothing more
            return
        task = self.tasks.get(request_id)
        if task is not None:
            task.cancel()

    # -- legacy -----------------------------------------------------------------------------
    async def legacy_or_unavailable(self, msg: Message) -> bytes | None:
        """``legacy``, with an outage answered in-band rather than ending the process."""
        try:
            return await self.legacy(msg)
        except BackendUnavailable:
            if not msg.is_request:
                logger.warning("backend unavailable: %s dropped", msg.method)
                return None
            return rpc.encode_error(msg.id, rpc.RpcError(rpc.SERVICE_UNAVAILABLE, "Backend unavailable; retry"))

    async def legacy(self, msg: Message) -> bytes | None:
        if msg.method == "initialize" and msg.is_request:
            return await self.initialize(msg)
        if not msg.is_request:
            if msg.method == "notifications/initialized" and self.session is not None:
                await self.broker.backend.update_session(self.session.id, initialized=True)
                self.start_stream()
            return None
        assert msg.id is not None and msg.method is not None  # a request has both
        try:
            result = await self.methods.call(Call(self.principal, False, self.session), msg.method, msg.params)
        except rpc.RpcError as exc:
            return rpc.encode_error(msg.id, exc)
        if msg.method == "resources/subscribe":
            self.start_stream()
        return rpc.encode_result(msg.id, result)

    async def initialize(self, msg: Message) -> bytes:
        if self.session is not None:
            return rpc.encode_error(msg.id, rpc.RpcError(rpc.INVALID_REQUEST, "Already initialized"))
        try:
            version, client_info, caps = self.methods.initialize(msg.params)
            self.session = await self.broker.sessions.create(self.principal, version, client_info, caps)
        except rpc.RpcError as exc:
            return rpc.encode_error(msg.id, exc)
        except LimitExceeded:
            return rpc.encode_error(msg.id, rpc.RpcError(rpc.INTERNAL_ERROR, "Too many sessions; retry later"))
        return rpc.encode_result(msg.id, self.methods.initialize_result(version))

    def start_stream(self) -> None:
        """Start the session's stream, or start it again after it ended (an outage ends it with ``retry:``,
        which means nothing on stdio, so the broker resumes from the stream's cursor itself)."""
        if self.session is None or self.broker.hub.closing:
            return
        if self.stream_task is not None and not self.stream_task.done():
            return
        cursor = None if self.stream is None else self.stream.cursor
        self.stream = LegacyStream(self.broker.hub, self.session, self.writer, cursor)
        self.stream_task = asyncio.create_task(self.stream.run(), name="stdio-legacy-stream")
        self.stream_task.add_done_callback(self._stream_ended)

    def _stream_ended(self, task: asyncio.Task[str]) -> None:
        reason = None if task.cancelled() or task.exception() is not None else task.result()
        if reason in ("unavailable", "lost"):
            loop = asyncio.get_running_loop()
            loop.call_later(self.broker.settings.retry_ms / 1000, self.start_stream)

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
        task = asyncio.create_task(self.modern(msg), name=f"stdio-request-{id_}")
        self.tasks[id_] = task
        task.add_done_callback(lambda _t: self.tasks.pop(id_, None))

    async def modern(self, msg: Message) -> None:
        assert msg.id is not None and msg.method is not None
        call = Call(self.principal, True)
        try:
            check_meta(msg)
            if msg.method == "subscriptions/listen":
                await self.listen(call, msg)
                return
            reply = rpc.encode_result(msg.id, await self.methods.call(call, msg.method, msg.params))
        except rpc.RpcError as exc:
            reply = rpc.encode_error(msg.id, exc)
        except BackendUnavailable:
            reply = rpc.encode_error(msg.id, rpc.RpcError(rpc.SERVICE_UNAVAILABLE, "Backend unavailable; retry"))
        await self.reply(reply)

    async def listen(self, call: Call, msg: Message) -> None:
        assert msg.id is not None
        hub = self.broker.hub
        if hub.closing:
            raise rpc.RpcError(rpc.INTERNAL_ERROR, "Shutting down")
        uris, list_changed, ack = self.methods.listen_filter(call, msg.params)
        self.methods.check_listen_capacity()
        listen = Listen(hub, msg.id, call.principal.tenant, uris, list_changed, self.writer)
        hub.add_listen(listen)
        self.listens[msg.id] = listen
        try:
            await listen.run(ack)
        finally:
            hub.remove_listen(listen)
            self.listens.pop(msg.id, None)

    # -- shutdown -----------------------------------------------------------------------------
    async def close(self) -> None:
        """End everything this client started; listens get their ``complete`` result first."""
        hub = self.broker.hub
        await hub.shutdown()  # ends listens (complete) and the legacy stream, and waits for them
        for task in list(self.tasks.values()):
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        if self.stream_task is not None:
            await asyncio.gather(self.stream_task, return_exceptions=True)
        if self.session is not None:
            try:
                await self.broker.sessions.end(self.session.id)
            except BackendUnavailable:
                logger.warning("could not end the stdio session: backend unavailable; it will expire")


async def _lines(stdin: IO[bytes], limit: int) -> Any:
    """Yield input lines as they arrive; non-blocking on pipes, a thread for anything else."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=limit)
    try:
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), stdin)
    except (OSError, ValueError):  # a regular file, say: reads never block for long
        while line := await asyncio.to_thread(stdin.readline, limit):
            yield line
        return
    while True:
        try:
            line = await reader.readuntil(b"\n")
        except asyncio.IncompleteReadError as exc:
            if exc.partial:
                yield exc.partial
            return
        except asyncio.LimitOverrunError as exc:
            # Drop the oversized line up to its newline, keep the channel usable, answer a parse error.
            if not await _discard_line(reader, exc.consumed):
                return
            yield TOO_LONG
            continue
        yield line


async def _discard_line(reader: asyncio.StreamReader, consumed: int) -> bool:
    """Skip the rest of an oversized line; False at EOF."""
    try:
        await reader.readexactly(consumed)
        while True:
            try:
                await reader.readuntil(b"\n")
                return True
            except asyncio.LimitOverrunError as exc:
                await reader.readexactly(exc.consumed)
    except asyncio.IncompleteReadError:
        return False


async def serve_stdio(settings: Settings | None = None, stdin: IO[bytes] | None = None,
                      stdout: IO[bytes] | None = None) -> None:
    """Serve one client until stdin reaches EOF or the process gets SIGTERM/SIGINT.

    Raises:
        BackendUnavailable: the configured backend cannot be reached at start.
    """
    settings = settings or Settings()
    stdin = stdin or sys.stdin.buffer
    stdout = stdout or sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but MCP messages may reach the real stdout
    broker = Broker(settings)
    await broker.start()
    output = _Output(stdout)
    output.start()
    server = StdioServer(broker, output)
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
    was_blocking = _blocking(stdin)
    try:
        async for line in _lines(stdin, settings.max_body_bytes + LINE_LIMIT_SLACK):
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
            await server.close()
            await output.close()
        finally:
            await broker.stop()
            if was_blocking is not None:
                with contextlib.suppress(OSError, ValueError):
                    os.set_blocking(stdin.fileno(), was_blocking)


def _blocking(stream: IO[bytes]) -> bool | None:
    """Whether the stream's descriptor is blocking now (restored at exit: the pipe reader clears it)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        return os.get_blocking(stream.fileno())
    return None
