"""A ``command`` upstream: one process per worker, MCP as newline-delimited JSON-RPC on its stdin and stdout.

The process is the session (the 2025 handshake, once per process): it is started when first
needed, and again after it exited, with a new session id, so a request naming the old one is
told its session is gone (``UpstreamSession``'s renewal, as for a 404 over HTTP). Answers are
matched to requests by id; ``notifications/progress`` goes to the request whose progress token it
names; every other notification goes to the open ``stream``s (the watch's, as a GET stream). The
upstream's own requests are answered: ``ping`` with an empty result, anything else with "method
not found" (the broker declares no client capability). Its stderr is logged, line by line.

A line longer than the answer bound, or one that is not JSON, ends the process: nothing after it
could be trusted to be framed right.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Final

import orjson

from broker.upstreams.errors import UpstreamSessionGone, UpstreamUnavailable

__all__ = ["StdioUpstream"]

logger = logging.getLogger(__name__)

#: Notifications held for a stream that is not read; past it the stream ends (its reader then has a gap).
STREAM_BACKLOG: Final = 10_000
#: Seconds the process has to exit after its stdin closed, then after SIGTERM.
EXIT_GRACE: Final = 2.0
_generations = itertools.count(1)

Notify = Callable[[dict[str, Any]], Awaitable[None]]


#: The variables of the broker's environment every stdio upstream is given (the SDKs' default set,
#: with the locale and the temporary directory); ``env`` in the map names more.
PASSED_ENV: Final = ("HOME", "LOGNAME", "PATH", "SHELL", "TERM", "USER", "LANG", "LC_ALL", "TMPDIR", "TZ")


class StdioUpstream:
    """The process of one ``command`` upstream, and the messages to and from it."""

    def __init__(self, name: str, command: tuple[str, ...], max_bytes: int, env: tuple[str, ...] = ()) -> None:
        """``env``: names of the broker's environment variables the process is given, beside ``PASSED_ENV``."""
        self.name = name
        self.command = command
        self.env = env
        self.max_bytes = max_bytes
        #: The session id of the running process ("" while none runs).
        self.session_id = ""
        self._proc: asyncio.subprocess.Process | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._pending: dict[Any, asyncio.Future[dict[str, Any]]] = {}
        self._progress: dict[Any, tuple[Any, Notify]] = {}
        self._streams: set[asyncio.Queue[dict[str, Any] | None]] = set()
        self._starting = asyncio.Lock()
        self._initialized: dict[str, Any] | None = None

    def environment(self) -> dict[str, str]:
        """The process's environment: never the broker's whole one, whose variables hold its secrets
        (``MCP_BROKER_*``, its Redis password), as the SDKs' own stdio clients pass a chosen few."""
        return {name: os.environ[name] for name in (*PASSED_ENV, *self.env) if name in os.environ}

    async def open(self, initialize: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """The running process's session id and its answer to the handshake, ``initialize`` then
        ``notifications/initialized``, sent when it starts (now, if it does not run, or its handshake failed)."""
        async with self._starting:
            if self._initialized is not None:  # its process runs (its reader resets it when it ends)
                return self.session_id, self._initialized
            await self._stop()
            try:
                self._proc = await asyncio.create_subprocess_exec(
                    *self.command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.PIPE, limit=self.max_bytes, env=self.environment())
            except OSError as exc:
                raise UpstreamUnavailable(self.name, f"cannot start {self.command[0]} ({exc.strerror})") from None
            self.session_id = f"stdio-{next(_generations)}"
            self._tasks = [asyncio.create_task(self._read(self._proc, self.session_id)),
                           asyncio.create_task(self._log(self._proc))]
            answer = await self.send(initialize, None, None)
            assert answer is not None
            if "error" not in answer:
                await self.send({"jsonrpc": "2.0", "method": "notifications/initialized"}, None, None)
                self._initialized = answer
            return self.session_id, answer

    async def send(self, message: dict[str, Any], session_id: str | None,
                   on_notification: Notify | None) -> dict[str, Any] | None:
        """Write one message: the answer to a request, None for a notification.

        Raises:
            UpstreamSessionGone: ``session_id`` names a process that is no longer the running one.
            UpstreamUnavailable: the process is gone or went while the answer was awaited.
        """
        proc = self._proc
        if proc is None or proc.returncode is not None or (session_id is not None and session_id != self.session_id):
            raise UpstreamSessionGone(self.name, "its process is not the one that session was opened with")
        id_ = message.get("id")
        answer: asyncio.Future[dict[str, Any]] | None = None
        if id_ is not None:
            answer = self._pending[id_] = asyncio.get_running_loop().create_future()
            meta = (message.get("params") or {}).get("_meta") or {}
            token = meta.get("progressToken") if isinstance(meta, dict) else None
            if token is not None and on_notification is not None:
                self._progress[token] = (id_, on_notification)
        try:
            await self._write(proc, message)
            return await answer if answer is not None else None
        finally:
            if answer is not None:
                self._pending.pop(id_, None)
                self._progress = {token: held for token, held in self._progress.items() if held[0] != id_}

    async def _write(self, proc: asyncio.subprocess.Process, message: dict[str, Any]) -> None:
        assert proc.stdin is not None
        try:
            proc.stdin.write(orjson.dumps(message) + b"\n")
            await proc.stdin.drain()
        except (ConnectionError, RuntimeError) as exc:  # it exited: nothing was delivered, and its session is gone
            raise UpstreamSessionGone(self.name, f"its process stopped reading ({type(exc).__name__})") from None

    @contextlib.asynccontextmanager
    async def stream(self, session_id: str) -> AsyncIterator[AsyncIterator[dict[str, Any]]]:
        """The process's notifications from now on (those no request is waiting for), until it exits.

        Raises:
            UpstreamSessionGone: ``session_id`` is not the running process's.
        """
        if self._proc is None or self._proc.returncode is not None or session_id != self.session_id:
            raise UpstreamSessionGone(self.name, "its process is not the one that session was opened with")
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue(STREAM_BACKLOG)
        self._streams.add(queue)
        try:
            yield self._drain(queue)
        finally:
            self._streams.discard(queue)

    async def _drain(self, queue: asyncio.Queue[dict[str, Any] | None]) -> AsyncIterator[dict[str, Any]]:
        while (message := await queue.get()) is not None:
            yield message
        raise UpstreamUnavailable(self.name, "its process exited, or its notifications were not read in time")

    async def _read(self, proc: asyncio.subprocess.Process, session_id: str) -> None:
        assert proc.stdout is not None
        why = "its process closed its stdout"
        try:
            async for line in proc.stdout:
                message = _decode(line)
                if message is None:
                    if line.strip():
                        why = "its process wrote a line that is not a JSON-RPC message"
                        break
                    continue
                await self._dispatch(proc, message)
        except ValueError:  # asyncio's "separator is found, but chunk is longer than limit"
            why = f"its process wrote a line longer than {self.max_bytes} bytes"
        finally:
            self._ended(proc, session_id, why)

    async def _dispatch(self, proc: asyncio.subprocess.Process, message: dict[str, Any]) -> None:
        method = message.get("method")
        if method is None:
            waiting = self._pending.get(message.get("id"))
            if waiting is not None and not waiting.done():
                waiting.set_result(message)
        elif "id" in message:  # the upstream asks something of the broker
            answer: dict[str, Any] = {"jsonrpc": "2.0", "id": message["id"]}
            if method == "ping":
                answer["result"] = {}
            else:
                answer["error"] = {"code": -32601, "message": f"the broker does not serve {method}"}
            with contextlib.suppress(UpstreamUnavailable):
                await self._write(proc, answer)
        elif method == "notifications/progress" and (held := self._progress.get(_token(message))) is not None:
            try:
                await held[1](message)
            except Exception as exc:  # the request ends with its caller's failure, as over HTTP
                waiting = self._pending.get(held[0])
                if waiting is not None and not waiting.done():
                    waiting.set_exception(exc)
        else:
            for queue in list(self._streams):
                try:
                    queue.put_nowait(message)
                except asyncio.QueueFull:
                    self._streams.discard(queue)
                    _end(queue)

    def _ended(self, proc: asyncio.subprocess.Process, session_id: str, why: str) -> None:
        """The process can no longer be spoken to: what waits for it fails, and the next request starts another."""
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        if session_id == self.session_id:  # the next request starts another
            self.session_id, self._initialized = "", None
        failure = UpstreamUnavailable(self.name, why)
        for waiting in self._pending.values():
            if not waiting.done():
                waiting.set_exception(failure)
        for queue in list(self._streams):
            _end(queue)
        self._streams.clear()

    async def _log(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stderr is not None
        with contextlib.suppress(ValueError):
            async for line in proc.stderr:
                logger.info("upstream %r says: %s", self.name, line.decode(errors="replace").rstrip()[:1000])

    async def aclose(self) -> None:
        async with self._starting:
            await self._stop()

    async def _stop(self) -> None:
        """Close its stdin, give it time to exit, then SIGTERM, then SIGKILL (the stdio transport's shutdown)."""
        proc, self._proc, self._initialized = self._proc, None, None
        if proc is not None and proc.returncode is None:
            assert proc.stdin is not None
            proc.stdin.close()
            for signal_it in (None, proc.terminate, proc.kill):
                if signal_it is not None:
                    with contextlib.suppress(ProcessLookupError):
                        signal_it()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(proc.wait(), EXIT_GRACE)
                    break
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks)
        self._tasks = []


def _decode(line: bytes) -> dict[str, Any] | None:
    try:
        message = orjson.loads(line)
    except orjson.JSONDecodeError:
        return None
    return message if isinstance(message, dict) else None


def _token(message: dict[str, Any]) -> Any:
    params = message.get("params")
    return params.get("progressToken") if isinstance(params, dict) else None


def _end(queue: asyncio.Queue[dict[str, Any] | None]) -> None:
    """Tell a stream it ended: the end goes in even when the backlog is full (the oldest is dropped for it)."""
    if queue.full():
        queue.get_nowait()
    queue.put_nowait(None)
