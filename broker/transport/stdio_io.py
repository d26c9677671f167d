"""The stdio channel's bytes: one writer of stdout, and input lines read without blocking the loop.

Framing: one compact JSON message per line, UTF-8. Every write goes through one writer task
(``Output``), so frames of concurrent listens, replies and legacy notifications never
interleave; a client that stops reading slows the broker down instead of growing its memory.
A line longer than the bound is skipped and stands as ``TOO_LONG`` (answered with an error).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from typing import IO, Final

__all__ = ["LINE_LIMIT_SLACK", "MAX_IN_FLIGHT", "TOO_LONG", "Output", "Places", "StdioWriter", "blocking", "lines"]

logger = logging.getLogger(__name__)

#: Bytes waiting for stdout past which a writer waits; a client that stops reading slows the broker
#: down instead of growing its memory (a count of messages alone let 1024 answers of up to
#: ``max_read_bytes`` each wait).
OUTPUT_BYTES: Final = 1 << 20
#: Modern requests one client may have running at once (``Places``).
MAX_IN_FLIGHT: Final = 8
#: Room for the envelope on top of ``max_body_bytes``; a longer line is refused and skipped.
LINE_LIMIT_SLACK: Final = 4096
TOO_LONG: Final = b"\x00"  # stands in for a line that was too long (it never reaches the parser)


class Output:
    """The single writer of stdout: a bounded queue drained by one task (blocking writes run in a thread)."""

    def __init__(self, stream: IO[bytes]) -> None:
        self.stream = stream
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None
        self.broken = False
        #: Bytes queued and not written yet; ``room`` is set while they are at most ``OUTPUT_BYTES``.
        self.pending = 0
        self.room = asyncio.Event()
        self.room.set()

    def start(self) -> None:
        self.task = asyncio.create_task(self._drain(), name="stdio-writer")

    async def put(self, line: bytes) -> None:
        """Queue ``line``, once what is queued is within ``OUTPUT_BYTES`` (so one more line at most)."""
        await self.room.wait()
        if not self.broken:
            self.pending += len(line)
            if self.pending > OUTPUT_BYTES:
                self.room.clear()
            self.queue.put_nowait(line)

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
            self.pending -= sum(len(line) - 1 for line in chunk)
            if self.pending <= OUTPUT_BYTES:
                self.room.set()

    async def close(self) -> None:
        """Write what is queued, then stop."""
        self.queue.put_nowait(None)
        if self.task is not None:
            await self.task


class Places:
    """At most ``size`` requests of one client running at once, by id: the next line is read when one
    gives its place back (a listen, once it is open). With the bounded ``Output``, a client that does
    not read holds back its own requests, and the process holds a few answers, not one per request."""

    def __init__(self, size: int = MAX_IN_FLIGHT) -> None:
        self._free = asyncio.Semaphore(size)
        self._held: set[object] = set()

    async def take(self, id_: object) -> None:
        await self._free.acquire()
        self._held.add(id_)

    def give_back(self, id_: object) -> None:
        if id_ in self._held:
            self._held.discard(id_)
            self._free.release()


class StdioWriter:
    """The ``broker.delivery.Writer`` of the stdio channel: one line per message, no SSE-only extras."""

    def __init__(self, output: Output) -> None:
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


async def lines(stdin: IO[bytes], limit: int) -> AsyncIterator[bytes]:
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


def blocking(stream: IO[bytes]) -> bool | None:
    """Whether the stream's descriptor is blocking now (restored at exit: the pipe reader clears it)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        return os.get_blocking(stream.fileno())
    return None
