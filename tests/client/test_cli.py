"""``mcp-broker watch`` as a person and a script use it: under a pseudo-terminal, and with ``--json``;
``publish --url`` and ``status`` against a server that answers what a broker would not."""

from __future__ import annotations

import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from tests.client.targets import Target
from tests.support import BIN, ROOT, BrokerProcess

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\r")


class Terminal:
    """A command under a pseudo-terminal, its output read as it comes."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        master, slave = pty.openpty()
        self.fd = master
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True,
                                     start_new_session=True)
        os.close(slave)
        self.output = ""

    def wait_for(self, text: str, timeout: float = 10.0) -> float:
        """Read until ``text`` is on the screen; the moment it arrived (monotonic)."""
        deadline = time.monotonic() + timeout
        while text not in self.output:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self.proc.poll() is not None:
                raise AssertionError(f"{text!r} not shown; the terminal shows:\n{self.output}")
            if select.select([self.fd], [], [], remaining)[0]:
                try:
                    self.output += ANSI.sub("", os.read(self.fd, 65536).decode(errors="replace"))
                except OSError:  # the command exited and its side of the terminal is closed
                    continue
        return time.monotonic()

    def close(self) -> int:
        self.proc.send_signal(signal.SIGINT)  # Ctrl-C: how a watch ends
        code = self.proc.wait(10)
        os.close(self.fd)
        return code


@pytest.fixture
def env() -> Iterator[dict[str, str]]:
    # A setting the server would refuse: a client command must not care.
    yield {**os.environ, "COLUMNS": "120", "MCP_BROKER_NOT_A_SETTING": "1", "PYTHONPATH": str(ROOT)}


async def test_watch_on_a_terminal_shows_each_change_as_a_diff(broker: BrokerProcess, env: dict[str, str]) -> None:
    target = Target("broker", broker.mcp_url, broker.url, broker=True)
    await target.write("tty", 0)
    terminal = Terminal([str(BIN), "watch", broker.mcp_url, target.uri("tty")], env)
    try:
        terminal.wait_for('"v": 0')  # the initial content, indented
        terminal.wait_for("connected")
        latencies = []
        for value in (4242, 777):
            published = time.monotonic()
            await target.write("tty", value)
            latencies.append(terminal.wait_for(f'+  "v": {value}') - published)
        assert '-  "v": 4242' in terminal.output  # a unified diff against the content before
    finally:
        assert terminal.close() == 0
    assert max(latencies) < 10.0
    print(f"\nmcp-broker watch on a pty: change shown {', '.join(f'{s * 1000:.0f} ms' for s in latencies)} "
          "after its publish returned")


async def test_watch_json_writes_one_object_per_event(broker: BrokerProcess, env: dict[str, str]) -> None:
    target = Target("broker", broker.mcp_url, broker.url, broker=True)
    await target.write("json", 1)
    proc = subprocess.Popen([str(BIN), "watch", "--json", "--era", "legacy", "--header", "X-Trace: t1",
                             broker.mcp_url, target.uri("json")], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        lines = [json.loads(proc.stdout.readline()) for _ in range(2)]
        assert lines[0] == {"event": "status", "status": "connected", "era": "2025-11-25", "detail": ""}
        assert lines[1] == {"event": "update", "uri": target.uri("json"), "content": '{"v":1}', "error": None,
                            "initial": True}
        await target.write("json", 2)
        assert json.loads(proc.stdout.readline())["content"] == '{"v":2}'
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == 0
        if proc.stdout is not None:
            proc.stdout.close()


async def test_watch_sends_the_token_and_says_why_it_cannot_watch(env: dict[str, str]) -> None:
    with BrokerProcess(env={"MCP_BROKER_API_KEYS": '{"s3cret": "default/alice"}'}) as proc:
        target = Target("broker", proc.mcp_url, proc.url, broker=True)
        async with httpx.AsyncClient(base_url=proc.url, headers={"Authorization": "Bearer s3cret"}) as http:
            assert (await http.put(f"/collections/watch{target.tag}/key", json={"v": 5})).status_code == 201
        argv = [str(BIN), "watch", "--json", proc.mcp_url, target.uri("key")]
        refused = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=20)
        assert refused.returncode == 2 and "401" in refused.stderr
        watching = subprocess.Popen([*argv, "--token", "s3cret"], env=env, stdout=subprocess.PIPE, text=True)
        try:
            assert watching.stdout is not None
            lines = [json.loads(watching.stdout.readline()) for _ in range(2)]
            assert lines[1]["content"] == '{"v":5}'
        finally:
            watching.send_signal(signal.SIGINT)
            assert watching.wait(10) == 0
            if watching.stdout is not None:
                watching.stdout.close()


def test_the_client_imports_nothing_of_the_server() -> None:
    """A fresh interpreter imports the client and its command: no broker, no server libraries."""
    code = ("import sys, broker_client, broker_client.watch_cli; import broker_client.http, broker_client.stdio; "
            "print(' '.join(sorted(sys.modules)))")
    loaded = set(subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                                check=True).stdout.split())
    server = {"broker", "redis", "fastapi", "starlette", "uvicorn", "psycopg", "prometheus_client", "pydantic",
              "orjson", "msgpack", "watchfiles", "mcp"}
    assert not {name.split(".")[0] for name in loaded} & server


INITIALIZE = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
              "params": {"protocolVersion": "2025-11-25", "capabilities": {},
                         "clientInfo": {"name": "t", "version": "1"}}}


async def test_watch_says_what_the_server_refused_and_waits_as_long_as_it_asks(env: dict[str, str]) -> None:
    with BrokerProcess(env={"MCP_BROKER_QUOTAS": '{"default": {"sessions": 1}}'}) as proc:
        headers = {"accept": "application/json, text/event-stream"}
        assert httpx.post(proc.mcp_url, json=INITIALIZE, headers=headers).status_code == 200  # the one session
        full = httpx.post(proc.mcp_url, json=INITIALIZE, headers=headers)
        assert full.status_code == 429
        message, wait = full.json()["error"]["message"], float(full.headers["retry-after"])
        argv = [str(BIN), "watch", "--json", "--era", "legacy", proc.mcp_url, "mcpb://default/c/1"]
        watching = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True)
        try:
            assert watching.stdout is not None
            status = json.loads(watching.stdout.readline())
        finally:
            watching.send_signal(signal.SIGINT)
            assert watching.wait(10) == 0
            if watching.stdout is not None:
                watching.stdout.close()
    # The server's words, and its Retry-After rather than an immediate retry.
    assert status["status"] == "retrying"
    assert status["detail"] == f"HTTP 429: {message}; next try in {wait:.2f}s"


async def test_watch_into_a_reader_that_leaves_ends_quietly(broker: BrokerProcess, env: dict[str, str]) -> None:
    target = Target("broker", broker.mcp_url, broker.url, broker=True)
    await target.write("pipe", 1)
    watching = subprocess.Popen([str(BIN), "watch", "--json", broker.mcp_url, target.uri("pipe")], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert watching.stdout is not None and watching.stderr is not None
    assert json.loads(watching.stdout.readline())["status"] == "connected"
    watching.stdout.close()  # `watch --json | head -1`: the reader has what it wanted
    await target.write("pipe", 2)  # and the watch has more to say
    try:
        code = watching.wait(15)
    finally:
        watching.kill()
    assert watching.stderr.read() == "" and code == 141
    watching.stderr.close()


@pytest.mark.parametrize(("value", "seconds"), [("7", 7.0), ("²", None), ("soon", None)])
def test_a_retry_after_of_other_digits_than_ascii_ones_is_unreadable_not_a_crash(value: str,
                                                                                  seconds: float | None) -> None:
    from broker_client.http import retry_after

    assert retry_after(httpx.Headers([(b"retry-after", value.encode("latin-1"))])) == seconds


class Stub:
    """A tiny HTTP server on loopback answering every request with ``answer`` (status, headers, body),
    and keeping the path and ``Authorization`` of each request it got."""

    def __init__(self) -> None:
        self.answer: tuple[int, dict[str, str], bytes] = (200, {}, b"{}")
        self.seen: list[tuple[str, str | None]] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                stub.seen.append((self.path, self.headers.get("authorization")))
                self.rfile.read(int(self.headers.get("content-length") or 0))
                status, headers, body = stub.answer
                self.send_response(status)
                for name, value in {"content-length": str(len(body)), **headers}.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, format: str, *args: object) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def stub() -> Iterator[Stub]:
    server = Stub()
    yield server
    server.server.shutdown()
    server.server.server_close()


HTML = (200, {"content-type": "text/html"}, b"<html>a proxy's page</html>")
LIST_ERROR = (500, {"content-type": "application/json"}, b'["not", "an", "object"]')


def run_command(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str]]:
    from broker.cli import main

    code = main(list(argv))
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize(("answer", "code"), [
    (HTML, 2), (LIST_ERROR, 2), ((200, {}, b"{}"), 2), ((202, {}, b'{"ids": []}'), 2)])
def test_publish_url_says_in_one_line_what_answered_instead_of_a_broker(
        stub: Stub, capsys: pytest.CaptureFixture[str], answer: tuple[int, dict[str, str], bytes], code: int) -> None:
    stub.answer = answer
    returned, lines = run_command(capsys, "publish", "--url", stub.url, "--key", "k", "x:y")
    assert returned == code and len(lines) == 1 and lines[0].startswith("mcp-broker publish: ")


@pytest.mark.parametrize(("answer", "code"), [
    (HTML, 2), (LIST_ERROR, 75), ((200, {}, b"{}"), 2), ((200, {}, b'{"figures": {}}'), 2)])
def test_status_says_in_one_line_what_answered_instead_of_the_console(
        stub: Stub, capsys: pytest.CaptureFixture[str], answer: tuple[int, dict[str, str], bytes], code: int) -> None:
    stub.answer = answer
    returned, lines = run_command(capsys, "status", "--url", stub.url, "--key", "k")
    assert returned == code and len(lines) == 1 and lines[0].startswith("mcp-broker status: ")


@pytest.mark.parametrize("command", [["publish", "x:y"], ["status"]])
def test_publish_and_status_never_follow_a_redirect_with_the_key(
        stub: Stub, capsys: pytest.CaptureFixture[str], command: list[str]) -> None:
    elsewhere = stub.url.replace("127.0.0.1", "localhost") + "/elsewhere"
    stub.answer = (307, {"location": elsewhere}, b"")
    returned, lines = run_command(capsys, *command, "--url", stub.url, "--key", "s3cr3t")
    assert returned == 2 and len(lines) == 1 and elsewhere in lines[0] and "not followed" in lines[0]
    assert [path for path, _ in stub.seen] == ["/changes" if command[0] == "publish" else "/console/state.json"]
    assert stub.seen[0][1] == "Bearer s3cr3t"
