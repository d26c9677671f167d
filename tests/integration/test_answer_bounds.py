"""Every answer is bounded: a read whose encoded answer passes ``MCP_BROKER_MAX_READ_BYTES`` is refused
precisely, and a client that does not read its answers holds about one of them on its worker.

Real ``mcp-broker serve`` and ``stdio`` processes, a real directory, raw sockets for the client
that never reads. The one timed check (the worker's RSS over a few seconds) has a wide margin.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import psutil
import pytest

from broker.sources.files import file_uri
from tests.integration import modern
from tests.integration.mcp_http import McpSession
from tests.integration.test_stdio import stdio_process
from tests.support import BrokerProcess, wait_until

KEYS = json.dumps({"ka": "acme/alice"})
LIMIT = 1_048_576
MIB = 1 << 20


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("answers")
    (base / "control.txt").write_bytes(b"\x01" * 300_000)  # 300 kB on disk, 1.8 MB as JSON (\u0001)
    (base / "plain.txt").write_bytes(b"a" * 900_000)  # within the bound as it is
    (base / "large.bin").write_bytes(b"\xff" * (2 * MIB))  # above it on disk already
    return base


@pytest.fixture(scope="module")
def broker(root: Path) -> Iterator[BrokerProcess]:
    env = {"MCP_BROKER_API_KEYS": KEYS, "MCP_BROKER_MAX_READ_BYTES": str(LIMIT),
           "MCP_BROKER_FILE_ROOTS": json.dumps({"acme": str(root)})}
    with BrokerProcess(env=env) as proc:
        yield proc


def refused(error: dict[str, Any], uri: str) -> bool:
    return (error["code"] == -32602 and error["data"] == {"uri": uri, "maxBytes": LIMIT}
            and "MCP_BROKER_MAX_READ_BYTES" in error["message"])


async def test_a_read_whose_encoded_answer_passes_the_bound_is_refused_in_both_eras(
        root: Path, broker: BrokerProcess) -> None:
    async with httpx.AsyncClient(base_url=broker.url, timeout=30) as http:
        for name in ("control.txt", "large.bin"):
            uri = file_uri(str(root / name))
            response = await modern.call(http, "resources/read", {"uri": uri}, name=uri, auth="ka")
            print(f"{name}: HTTP {response.status_code}, {len(response.content)} bytes answered")
            assert response.status_code == 200  # a handler's error, in-band (docs/PROTOCOL.md)
            assert refused(response.json()["error"], uri), response.text[:300]
            assert len(response.content) < 2000
            session = await McpSession(http, auth="ka").initialize()
            legacy = await session.call("resources/read", {"uri": uri})
            assert refused(legacy["error"], uri), str(legacy)[:300]
        plain = file_uri(str(root / "plain.txt"))
        served = (await modern.call(http, "resources/read", {"uri": plain}, name=plain, auth="ka")).json()
        assert served["result"]["contents"][0]["text"] == "a" * 900_000


async def test_a_stdio_read_is_bounded_too(root: Path) -> None:
    uri = file_uri(str(root / "control.txt"))
    async with stdio_process(MCP_BROKER_DEMO="false", MCP_BROKER_MAX_READ_BYTES=str(LIMIT),
                             MCP_BROKER_FILE_ROOTS=json.dumps({"default": str(root)})) as stdio:
        await stdio.send(modern.request("resources/read", {"uri": uri}, id_=7))
        assert stdio.proc.stdout is not None
        line = await stdio.proc.stdout.readline()
        print(f"stdio: {len(line)} bytes answered")
        assert refused(orjson.loads(line)["error"], uri), line[:300]


# -- a client that does not read ------------------------------------------------------------------
CONNECTIONS = 8
PIPELINED = 16


def answers(broker: BrokerProcess) -> int:
    text = httpx.get(broker.url + "/metrics", timeout=5).text
    found = re.search(r'mcp_broker_http_answers_total\{[^}]*route="mcp"[^}]*status="200"[^}]*\} (\S+)', text)
    return int(float(found.group(1))) if found else 0


def pipelined_reads(port: int, uri: str, count: int) -> bytes:
    body = orjson.dumps(modern.request("resources/read", {"uri": uri}))
    head = "".join(f"{name}: {value}\r\n" for name, value in modern.headers("resources/read", uri, auth="ka").items())
    one = f"POST /mcp HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-length: {len(body)}\r\n{head}\r\n".encode() + body
    return one * count


@pytest.mark.parametrize(("content", "size"), [(b"\x01", 2 * MIB), (b"b", 6 * MIB)], ids=["escaped", "plain"])
def test_a_client_that_never_reads_holds_at_most_one_bounded_answer_per_connection(
        tmp_path: Path, content: bytes, size: int) -> None:
    """Escaped: 2 MiB on disk is a 12 MiB answer, refused. Plain: a 6 MiB answer (more than the 4 MiB
    a loopback socket's send buffer grows to), served, and the connection's next request waits
    until its client has read it."""
    (tmp_path / "file.txt").write_bytes(content * size)
    uri = file_uri(str(tmp_path / "file.txt"))
    env = {"MCP_BROKER_API_KEYS": KEYS, "MCP_BROKER_FILE_ROOTS": json.dumps({"acme": str(tmp_path)}),
           "MCP_BROKER_MAX_READ_BYTES": str(8 * MIB)}
    with BrokerProcess(env=env) as broker:
        worker = psutil.Process(broker.proc.pid)
        request = pipelined_reads(broker.port, uri, PIPELINED)
        before, counted = worker.memory_info().rss, answers(broker)
        sockets = []
        try:
            for _ in range(CONNECTIONS):
                sock = socket.socket()
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # and never read
                sock.connect(("127.0.0.1", broker.port))
                sock.sendall(request)
                sockets.append(sock)
            wait_until(lambda: answers(broker) - counted >= CONNECTIONS, what="a first answer on every connection")
            peak, began = worker.memory_info().rss, time.monotonic()
            while time.monotonic() - began < 3.0:  # the unbounded worker grew by hundreds of MB in this time
                peak = max(peak, worker.memory_info().rss)
                time.sleep(0.1)
            started = answers(broker) - counted
            print(f"{len(request) // PIPELINED}-byte requests: RSS {before / MIB:.0f} MiB -> peak {peak / MIB:.0f} MiB "
                  f"(+{(peak - before) / MIB:.0f} MiB) with {CONNECTIONS} x {PIPELINED} requests unread; "
                  f"{started} answers started")
            if content == b"b":
                assert started == CONNECTIONS  # one each: the next waits for its client to read
            assert peak - before < 2 * CONNECTIONS * size  # escaped: a moment's copies of the file, no answer
            # Another client is served meanwhile.
            discover = modern.request("server/discover")
            served = httpx.post(broker.mcp_url, json=discover, headers=modern.headers("server/discover", auth="ka"),
                                timeout=10)
            assert "result" in served.json()
        finally:
            for sock in sockets:
                sock.close()


async def test_a_stdio_client_that_does_not_read_holds_back_its_own_requests(tmp_path: Path) -> None:
    """Its answers wait in a bounded output, and no more than a few of its requests run meanwhile."""
    size, count = 2 * MIB, 48
    (tmp_path / "file.txt").write_bytes(b"s" * size)
    uri = file_uri(str(tmp_path / "file.txt"))
    async with stdio_process(MCP_BROKER_DEMO="false", MCP_BROKER_FILE_ROOTS=json.dumps({"default": str(tmp_path)})) \
            as stdio:
        worker = psutil.Process(stdio.proc.pid)
        await stdio.send(modern.request("server/discover", id_="warm"))
        assert (await stdio.next()) is not None  # started
        before = worker.memory_info().rss
        assert stdio.proc.stdin is not None
        lines = b"".join(orjson.dumps(modern.request("resources/read", {"uri": uri}, id_=i)) + b"\n"
                         for i in range(count))
        stdio.proc.stdin.write(lines)  # fits the pipe: the broker may read them all at once
        await stdio.proc.stdin.drain()
        wait_until(lambda: worker.memory_info().rss - before > size, what="the first answers")
        peak, began = worker.memory_info().rss, time.monotonic()
        while time.monotonic() - began < 3.0:  # with no bound every request ran and waited: +100 MiB
            peak = max(peak, worker.memory_info().rss)
            await asyncio.sleep(0.1)
        print(f"stdio, {count} reads of {size // MIB} MiB unread: RSS {before / MIB:.0f} MiB -> "
              f"peak {peak / MIB:.0f} MiB (+{(peak - before) / MIB:.0f} MiB)")
        assert peak - before < 16 * size
        assert stdio.proc.stdout is not None
        chunks: list[bytes] = []
        newlines = 0
        async with asyncio.timeout(30):  # read at last: every answer is there, in full
            while newlines < count:
                chunks.append(await stdio.proc.stdout.read(1 << 20))
                assert chunks[-1], "stdout closed"
                newlines += chunks[-1].count(b"\n")
        assert [len(line) > size for line in b"".join(chunks).splitlines()] == [True] * count
