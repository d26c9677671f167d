"""MCP over a child process's stdin/stdout: newline-delimited JSON-RPC, either era.

The process is the session: when it exits, everything is gone, and the watcher starts a new
one (``SessionGone``). On 2026-07-28 a listen is a request whose answer comes at its end.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from typing import Any

from broker_client import wire
from broker_client.channel import RESUMED, RESYNCED, Channel
from broker_client.errors import Dropped, NotSupported, RpcError, SessionGone

_listen_ids = itertools.count(1)
LINE_LIMIT = 16 * 1024 * 1024


class StdioChannel(Channel):
    def __init__(self, proc: asyncio.subprocess.Process, uris: list[str], timeout: float) -> None:
        super().__init__(uris)
        self.proc = proc
        self.timeout = timeout
        self.modern = False
        self.listen_id: str | None = None
        self.pending: dict[Any, asyncio.Future[dict[str, Any]]] = {}
        self._acked: asyncio.Future[None] | None = None
        self.run_reader(self._read())

    async def send(self, message: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(wire.encode(message) + b"\n")
            await self.proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise SessionGone("the server process exited") from exc

    async def call(self, message: dict[str, Any]) -> dict[str, Any]:
        """Send a request and wait for its answer."""
        if not self.reading():  # its output has ended: nobody would ever answer
            raise SessionGone("the server process exited")
        answer: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.pending[message["id"]] = answer
        try:
            await self.send(message)
            return await asyncio.wait_for(answer, self.timeout)
        except TimeoutError as exc:
            raise Dropped(f"no answer to {message['method']} within {self.timeout}s") from exc
        finally:
            self.pending.pop(message["id"], None)

    async def negotiate(self, era: str) -> None:
        """``server/discover`` (2026-07-28), else the ``initialize`` handshake; checks ``resources.subscribe``."""
        if era in ("auto", "modern"):
            try:
                found = wire.result(await self.call(wire.request("server/discover", {}, modern=True)))
            except RpcError:
                found = {}
            if wire.modern_offered(found):
                self.modern, self.era = True, wire.MODERN
                self.extensions = wire.extensions(found.get("capabilities"))
                self._require_subscribe(found)
                return
            if era == "modern":
                raise NotSupported("the server does not offer 2026-07-28")
        found = wire.result(await self.call(wire.initialize()))
        self.era = str(found.get("protocolVersion") or wire.LEGACY)
        self._require_subscribe(found)
        await self.send(wire.notification("notifications/initialized"))

    @staticmethod
    def _require_subscribe(found: dict[str, Any]) -> None:
        if not wire.can_subscribe(found.get("capabilities")):
            raise NotSupported("the server does not offer resources.subscribe: no update would ever arrive")

    async def start(self) -> None:
        if self.modern:
            await self._listen()
            return
        for uri in self.uris:
            wire.result(await self.call(wire.request("resources/subscribe", {"uri": uri}, modern=False)))

    async def _listen(self) -> None:
        self.listen_id = f"watch-{next(_listen_ids)}"
        self._acked = asyncio.get_running_loop().create_future()
        await self.send(wire.listen(self.uris, self.listen_id))
        try:
            await asyncio.wait_for(asyncio.shield(self._acked), self.timeout)
        except TimeoutError as exc:
            raise Dropped("the listen was not acknowledged") from exc

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            message = wire.decode(line)
            if message is None:
                continue
            self.progress += 1
            if "method" in message and "id" in message:
                await self._answer_server(message)
            elif "method" in message:
                self._notified(message)
            elif self.listen_id is not None and message.get("id") == self.listen_id:
                self.listen_id = None  # the listen's answer is its end
                self.queue.put_nowait(Dropped("the server completed the listen", complete="error" not in message))
            elif (waiting := self.pending.get(message.get("id"))) is not None and not waiting.done():
                waiting.set_result(message)
        gone = SessionGone("the server process exited")
        for waiting in self.pending.values():
            if not waiting.done():
                waiting.set_exception(gone)
        if self._acked is not None and not self._acked.done():
            self._acked.set_exception(gone)
        raise gone

    async def _answer_server(self, message: dict[str, Any]) -> None:
        """A request from the server: ``ping`` is answered, anything else is not offered."""
        if message["method"] == "ping":
            await self.send({"jsonrpc": "2.0", "id": message["id"], "result": {}})
        else:
            await self.send({"jsonrpc": "2.0", "id": message["id"],
                             "error": {"code": -32601, "message": "Method not found"}})

    def _notified(self, message: dict[str, Any]) -> None:
        if self.modern and (self.listen_id is None or wire.subscription_of(message) != self.listen_id):
            return
        if message.get("method") == wire.ACKNOWLEDGED and self._acked is not None and not self._acked.done():
            honored = ((message.get("params") or {}).get("notifications") or {}).get("resourceSubscriptions")
            missing = sorted(self.watched - set(honored or ()))
            if missing:
                self._acked.set_exception(NotSupported(f"the listen was acknowledged without {missing}"))
            else:
                self._acked.set_result(None)
        elif (uri := wire.updated_uri(message)) is not None:
            self.heard(uri)

    async def recover(self) -> str:
        """A new listen after a completed one (2026-07-28); a live process lost nothing (2025)."""
        if self.proc.returncode is not None or not self.reading():
            raise SessionGone("the server process exited")
        if not self.modern:
            return RESUMED
        await self._listen()
        return RESYNCED

    async def read(self, uri: str) -> list[dict[str, Any]]:
        contents = wire.result(await self.call(wire.request("resources/read", {"uri": uri}, modern=self.modern)))
        found = contents.get("contents")
        return [c for c in found if isinstance(c, dict)] if isinstance(found, list) else []

    async def close(self) -> None:
        with contextlib.suppress(Dropped, RpcError, OSError):
            if self.modern and self.listen_id is not None:
                await self.send({"jsonrpc": "2.0", "method": "notifications/cancelled",
                                 "params": {"requestId": self.listen_id}})
            elif not self.modern and self.reading():
                for uri in self.uris:
                    await self.call(wire.request("resources/unsubscribe", {"uri": uri}, modern=False))
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            await asyncio.wait_for(self.proc.wait(), 5)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
        await self.stop_reader()


async def open_stdio(command: list[str], uris: list[str], era: str, timeout: float) -> Channel:
    """Start the server process, negotiate, subscribe; the channel once the subscription is confirmed."""
    proc = await asyncio.create_subprocess_exec(*command, stdin=asyncio.subprocess.PIPE,
                                                stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.DEVNULL, limit=LINE_LIMIT)
    channel = StdioChannel(proc, uris, timeout)
    try:
        await channel.negotiate(era)
        await channel.start()
    except BaseException:
        await channel.close()
        raise
    return channel
