"""Drive the running compose stack from the host, through its load balancer only.

One MCP 2025-11-25 session (initialize, notifications/initialized, resources/subscribe, the GET
SSE stream) is notified of changes published with ``POST /changes``, and must see every one of
them exactly once while its stream moves between workers:

1. live     -- a stream on worker A gets the changes published while it is open;
2. replay   -- the stream is dropped, changes are published, and a reconnect with
               ``Last-Event-ID`` that the balancer sent to another worker B replays them;
3. kill     -- while changes are being published, ``docker kill`` takes worker B (holding the
               stream) away; the publisher goes on through the balancer;
4. resume   -- a reconnect with ``Last-Event-ID`` lands on a surviving worker C and gets every
               change published before, during and after the kill;
5. rejoin   -- worker B is started again, becomes ready, and serves the session's replay itself.

Which worker holds the stream is asked of each container (``docker exec`` … ``/healthz``, its
open stream count), never guessed. Each change goes to a URI of its own, with its number in
``meta``, so a notification names exactly one change (no coalescing). Standard library and httpx.

    python drive.py --port 18080 --project mcpbtest123
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

VERSION = "2025-11-25"
UPDATED = "notifications/resources/updated"
WORKERS = ("broker1", "broker2", "broker3")
HEALTHZ = ("import json, urllib.request; "
           "print(json.load(urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=3))['streams'])")

START = time.monotonic()


def say(message: str) -> None:
    print(f"[drive {time.monotonic() - START:6.1f}s] {message}", flush=True)


class Failed(Exception):
    """A check that did not hold."""


# -- docker ---------------------------------------------------------------------------------


async def run(*command: str, timeout: float = 30.0, check: bool = True) -> str:
    process = await asyncio.create_subprocess_exec(
        *command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(process.communicate(), timeout)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise Failed(f"{' '.join(command[:4])} … took over {timeout} s") from None
    if check and process.returncode != 0:
        raise Failed(f"{' '.join(command)}: exit {process.returncode}: {err.decode().strip()}")
    return out.decode().strip()


class Stack:
    def __init__(self, project: str) -> None:
        self.project = project
        self.ids: dict[str, str] = {}

    async def resolve(self) -> None:
        for service in WORKERS:
            out = await run("docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={self.project}",
                            "--filter", f"label=com.docker.compose.service={service}")
            if len(out.split()) != 1:
                raise Failed(f"expected one container of {service} in project {self.project}, found {out.split()}")
            self.ids[service] = out

    async def streams(self, service: str) -> int | None:
        """The open GET streams of one worker, or None when it does not answer (killed)."""
        try:
            return int(await run("docker", "exec", self.ids[service], "python3", "-c", HEALTHZ, timeout=10))
        except (Failed, ValueError):
            return None

    async def holder(self, *, timeout: float = 15.0) -> str:
        """The one worker that holds the session's stream, once exactly one does."""
        deadline = time.monotonic() + timeout
        while True:
            counts = dict(zip(WORKERS, await asyncio.gather(*(self.streams(s) for s in WORKERS)), strict=True))
            holding = [s for s, n in counts.items() if n]
            if len(holding) == 1 and counts[holding[0]] == 1:
                return holding[0]
            if time.monotonic() > deadline:
                raise Failed(f"no single worker holds the stream: open streams per worker {counts}")
            await asyncio.sleep(0.3)

    async def idle(self, *, timeout: float = 15.0) -> None:
        """Wait until no live worker holds a stream (a dropped stream was noticed)."""
        deadline = time.monotonic() + timeout
        while True:
            counts = await asyncio.gather(*(self.streams(s) for s in WORKERS))
            if not any(counts):
                return
            if time.monotonic() > deadline:
                raise Failed(f"a dropped stream is still open on a worker: {dict(zip(WORKERS, counts, strict=True))}")
            await asyncio.sleep(0.3)

    async def kill(self, service: str) -> None:
        await run("docker", "kill", self.ids[service])

    async def start(self, service: str) -> None:
        await run("docker", "start", self.ids[service])

    async def wait_healthy(self, service: str, *, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        health = ("docker", "inspect", "-f", "{{.State.Health.Status}}", self.ids[service])
        while (status := await run(*health)) != "healthy":
            if time.monotonic() > deadline:
                raise Failed(f"{service} is {status} {timeout} s after its start")
            await asyncio.sleep(0.5)


# -- MCP over Streamable HTTP ---------------------------------------------------------------


@dataclass
class Event:
    id: str | None
    data: str | None

    @property
    def message(self) -> Any:
        return json.loads(self.data) if self.data else None


END = Event(None, None)


@dataclass
class Stream:
    """A GET stream read in a task of its own; events land in ``queue``, then END."""

    number: int
    queue: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    task: asyncio.Task[None] | None = None
    status: int | None = None
    ended: str | None = None

    async def close(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()
            try:
                await self.task
            except asyncio.CancelledError:
                pass


class Session:
    def __init__(self, http: httpx.AsyncClient) -> None:
        self.http = http
        self.id: str | None = None
        self.next_id = 0
        self.streams = 0

    def headers(self, **extra: str) -> dict[str, str]:
        headers = {"Accept": "application/json, text/event-stream", "Content-Type": "application/json"}
        if self.id is not None:
            headers |= {"Mcp-Session-Id": self.id, "MCP-Protocol-Version": VERSION}
        return headers | extra

    async def initialize(self) -> None:
        response = await self.http.post("/mcp", headers=self.headers(), json={
            "jsonrpc": "2.0", "id": 0, "method": "initialize",
            "params": {"protocolVersion": VERSION, "capabilities": {},
                       "clientInfo": {"name": "compose-test", "version": "1"}}})
        if response.status_code != 200:
            raise Failed(f"initialize: {response.status_code} {response.text}")
        self.id = response.headers["mcp-session-id"]
        reply = response.json()
        if reply.get("result", {}).get("protocolVersion") != VERSION:
            raise Failed(f"initialize answered {reply}")
        initialized = {"jsonrpc": "2.0", "method": "notifications/initialized"}
        response = await self.http.post("/mcp", headers=self.headers(), json=initialized)
        if response.status_code != 202:
            raise Failed(f"notifications/initialized: {response.status_code} {response.text}")

    async def subscribe(self, uri: str) -> None:
        self.next_id += 1
        body = {"jsonrpc": "2.0", "id": self.next_id, "method": "resources/subscribe", "params": {"uri": uri}}
        response = await self.http.post("/mcp", headers=self.headers(), json=body)
        if response.status_code != 200 or response.json().get("result") != {}:
            raise Failed(f"resources/subscribe {uri}: {response.status_code} {response.text}")

    def open(self, last_event_id: str | None) -> Stream:
        self.streams += 1
        stream = Stream(self.streams)
        headers = self.headers(Accept="text/event-stream")
        headers.pop("Content-Type")
        if last_event_id is not None:
            headers["Last-Event-ID"] = last_event_id
        stream.task = asyncio.create_task(self._read(stream, headers))
        return stream

    async def _read(self, stream: Stream, headers: dict[str, str]) -> None:
        try:
            async with self.http.stream("GET", "/mcp", headers=headers) as response:
                stream.status = response.status_code
                content_type = response.headers.get("content-type", "")
                if response.status_code != 200 or not content_type.startswith("text/event-stream"):
                    stream.ended = f"GET /mcp answered {response.status_code}: {(await response.aread())[:300]!r}"
                    return
                fields: dict[str, str] = {}
                async for line in response.aiter_lines():
                    if line == "":
                        if fields:
                            await stream.queue.put(Event(fields.get("id"), fields.get("data")))
                            fields = {}
                    elif not line.startswith(":"):
                        name, _, value = line.partition(":")
                        fields[name] = value[1:] if value.startswith(" ") else value
                stream.ended = "the server ended the stream"
        except httpx.HTTPError as exc:
            stream.ended = f"{type(exc).__name__}: {exc}"
        finally:
            await stream.queue.put(END)


# -- the scenario -----------------------------------------------------------------------------


class Run:
    def __init__(self, http: httpx.AsyncClient, stack: Stack) -> None:
        self.http = http
        self.stack = stack
        self.session = Session(http)
        tag = secrets.token_hex(4)
        self.uris = [f"https://compose-test.invalid/{tag}/{n}" for n in range(80)]
        self.published: list[int] = []
        self.ambiguous: set[int] = set()  # published again after an answer that may have applied it
        self.received: list[tuple[int, str, int]] = []  # (seq, event id, stream number)
        self.unexpected: list[Any] = []
        self.last_event_id: str | None = None
        self.passed: list[str] = []

    def check(self, name: str, ok: bool, detail: str) -> None:
        if not ok:
            raise Failed(f"{name}: {detail}")
        self.passed.append(name)
        say(f"ok   {name}: {detail}")

    async def publish(self, seq: int) -> None:
        """POST /changes through the balancer until acknowledged (202); a lost answer is noted."""
        body = {"uri": self.uris[seq], "kind": "updated", "meta": {"seq": seq}}
        for attempt in range(20):
            try:
                response = await self.http.post("/changes", json=body)
            except httpx.HTTPError as exc:
                say(f"publish {seq}: {type(exc).__name__} (attempt {attempt + 1}), again")
                self.ambiguous.add(seq)
            else:
                if response.status_code == 202:
                    self.published.append(seq)
                    return
                if response.status_code not in (429, 502, 503, 504):
                    raise Failed(f"POST /changes {seq}: {response.status_code} {response.text}")
                say(f"publish {seq}: {response.status_code} (attempt {attempt + 1}), again")
                if response.status_code != 429:  # 429 appends nothing; the others may have applied it
                    self.ambiguous.add(seq)
            await asyncio.sleep(0.5)
        raise Failed(f"POST /changes {seq} was never acknowledged")

    def take(self, stream: Stream, event: Event) -> None:
        if event.id is not None:
            self.last_event_id = event.id
        message = event.message
        if message is None:
            return  # priming event or bare retry:
        seq = message.get("params", {}).get("_meta", {}).get("seq") if message.get("method") == UPDATED else None
        if not isinstance(seq, int) or message["params"].get("uri") != self.uris[seq]:
            self.unexpected.append(message)  # e.g. the gap rule's resync: a cursor was lost
            say(f"unexpected message on stream {stream.number}: {message}")
            return
        self.received.append((seq, event.id or "", stream.number))

    async def drain(self, stream: Stream, wanted: set[int], *, timeout: float, until_end: bool = False) -> None:
        """Take the stream's events until every seq in ``wanted`` has arrived (or the stream ends)."""
        deadline = time.monotonic() + timeout
        while not wanted <= {seq for seq, _, _ in self.received} or until_end:
            try:
                event = await asyncio.wait_for(stream.queue.get(), max(0.05, deadline - time.monotonic()))
            except TimeoutError:
                missing = sorted(wanted - {seq for seq, _, _ in self.received})
                raise Failed(f"stream {stream.number}: after {timeout} s still missing changes {missing}"
                             + (f" (stream: {stream.ended})" if stream.ended else "")) from None
            if event is END:
                if until_end:
                    return
                missing = sorted(wanted - {seq for seq, _, _ in self.received})
                raise Failed(f"stream {stream.number} ended ({stream.ended}) while changes {missing} were due")
            self.take(stream, event)

    async def discard(self, stream: Stream) -> None:
        """Drop a stream and what it delivered, as a client that processed none of it."""
        await stream.close()

    async def reconnect_to(self, wanted: set[str], cursor: str | None) -> tuple[Stream, str]:
        """Reconnect with Last-Event-ID ``cursor`` until the balancer lands on a worker in ``wanted``.

        A try that lands elsewhere is dropped unread and made again from the same cursor, so the
        replay this checks is the one served by the wanted worker.
        """
        for attempt in range(1, 13):
            stream = self.session.open(cursor)
            where = await self.stack.holder()
            if where in wanted:
                say(f"stream {stream.number}: Last-Event-ID {cursor} -> {where} (try {attempt})")
                return stream, where
            say(f"stream {stream.number}: Last-Event-ID {cursor} -> {where}, not one of {sorted(wanted)}: "
                "drop it, again")
            await self.discard(stream)
            await self.stack.idle()
        raise Failed(f"12 reconnects through the balancer never reached {sorted(wanted)}")

    async def main(self) -> None:
        await self.stack.resolve()
        session = self.session
        await session.initialize()
        for uri in self.uris:
            await session.subscribe(uri)
        say(f"session {session.id}: initialized and subscribed to {len(self.uris)} URIs through the balancer")

        # 1. live, on worker A
        s1 = session.open(None)
        a = await self.stack.holder()
        say(f"stream {s1.number} (no Last-Event-ID) is held by {a}")
        for seq in range(0, 10):
            await self.publish(seq)
        await self.drain(s1, set(range(0, 10)), timeout=20)
        self.check("live", True, f"changes 0-9 arrived on the stream held by {a}")

        # 2. dropped; changes published meanwhile; replay from Last-Event-ID on another worker B
        await s1.close()
        await self.stack.idle()
        for seq in range(10, 20):
            await self.publish(seq)
        s2, b = await self.reconnect_to(set(WORKERS) - {a}, self.last_event_id)
        await self.drain(s2, set(range(10, 20)), timeout=20)
        self.check("replay", b != a,
                   f"changes 10-19, published with no stream open, replayed by {b} (stream was on {a})")

        for seq in range(20, 30):
            await self.publish(seq)
        await self.drain(s2, set(range(20, 30)), timeout=20)
        self.check("live-after-replay", True, f"changes 20-29 arrived live on {b}")

        # 3. docker kill B mid-flow, publishing on through the balancer
        async def publisher() -> None:
            for seq in range(30, 60):
                await self.publish(seq)
                if seq == 37:
                    say(f"docker kill {b} (it holds stream {s2.number}), changes 30-37 acknowledged")
                    await self.stack.kill(b)
                await asyncio.sleep(0.1)

        flow = asyncio.create_task(publisher())
        await self.drain(s2, set(), timeout=30, until_end=True)  # what B sent before it died
        say(f"stream {s2.number} ended: {s2.ended}; {len(self.received)} notifications so far")
        self.check("killed", await self.stack.streams(b) is None,
                   f"{b} is gone (docker kill); the stream it held ended")

        # 4. resume on a surviving worker C, while the publisher goes on
        s3, c = await self.reconnect_to(set(WORKERS) - {b}, self.last_event_id)
        await asyncio.wait_for(flow, 90)
        await self.drain(s3, set(range(30, 60)), timeout=45)
        self.check("resume-after-kill", c != b,
                   f"changes 30-59 (8 before, 22 during and after the kill) all arrived on {c}")

        # 5. B started again: it becomes ready and serves the session's replay itself
        await s3.close()
        await self.stack.idle()
        await self.stack.start(b)
        await self.stack.wait_healthy(b)
        say(f"{b} started again and ready (/readyz)")
        for seq in range(60, 70):
            await self.publish(seq)
        s4, back = await self.reconnect_to({b}, self.last_event_id)
        await self.drain(s4, set(range(60, 70)), timeout=30)
        await s4.close()
        self.check("rejoin", back == b, f"changes 60-69 replayed by the restarted {b}")

        # nothing missed, nothing twice
        counts = Counter(seq for seq, _, _ in self.received)
        missing = sorted(set(self.published) - set(counts))
        twice = sorted(seq for seq, n in counts.items() if n > 1 and seq not in self.ambiguous)
        self.check("nothing-missed", not missing and len(set(self.published)) == 70,
                   f"all {len(set(self.published))} acknowledged changes were notified"
                   + (f"; missing {missing}" if missing else ""))
        ids = [event_id for _, event_id, _ in self.received]
        self.check("exactly-once", not twice and not self.unexpected and len(set(ids)) == len(ids),
                   f"{len(self.received)} notifications, none twice (changes re-published after a lost answer: "
                   f"{sorted(self.ambiguous) or 'none'}), no resync, event ids unique"
                   + (f"; twice: {twice}" if twice else "")
                   + (f"; unexpected: {self.unexpected[:3]}" if self.unexpected else ""))


async def amain(port: int, project: str, budget: float) -> int:
    stack = Stack(project)
    timeout = httpx.Timeout(15.0, read=40.0)  # streams carry a keep-alive every 15 s
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=timeout) as http:
        scenario = Run(http, stack)
        try:
            async with asyncio.timeout(budget):
                await scenario.main()
        except TimeoutError:
            say(f"FAIL: the scenario took over {budget} s")
        except Failed as exc:
            say(f"FAIL {exc}")
        failed = 0 if len(scenario.passed) == 8 else 1
        print(f"compose-test: {len(scenario.passed)} passed, {failed} failed", flush=True)
        return failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True, help="the load balancer's port on 127.0.0.1")
    parser.add_argument("--project", required=True, help="the compose project name (container labels)")
    parser.add_argument("--budget", type=float, default=300.0, help="seconds the whole scenario may take")
    args = parser.parse_args()
    sys.exit(asyncio.run(amain(args.port, args.project, args.budget)))


if __name__ == "__main__":
    main()
