"""``mcp-broker stdio`` under hostile lines: every line out is one well-formed message, no traceback on stderr.

After each fuzzed line a ``ping`` with its own id follows; its answer marks that the line was
dealt with (modern requests run as tasks, so their answers may come later, and are checked
as they come).
"""

from __future__ import annotations

import os
import queue
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz.conftest import FUZZ, LOG_MARKERS
from tests.fuzz.strategies import ANY, LEGACY_METHODS, MODERN_METHODS, encode, message
from tests.fuzz.test_fuzz_mcp import check_message
from tests.support import BIN

TIMEOUT = 15.0


class Stdio:
    def __init__(self, log: Path) -> None:
        self.log = log
        with log.open("ab") as stderr:
            self.proc = subprocess.Popen([str(BIN), "--log-level", "warning", "stdio"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=stderr,
                                         env={**os.environ, "MCP_BROKER_DEMO": "false"})
        self.lines: queue.Queue[bytes] = queue.Queue()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.sentinel = 0

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(b"")

    def write(self, line: bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + b"\n")
        self.proc.stdin.flush()

    def settle(self) -> None:
        """Send a ping and check every line up to its answer."""
        self.sentinel += 1
        mark = f"sentinel-{self.sentinel}"
        self.write(orjson.dumps({"jsonrpc": "2.0", "id": mark, "method": "ping"}))
        while True:
            line = self.lines.get(timeout=TIMEOUT)
            assert line, "stdout closed: " + self.log.read_text("utf-8", "replace")[-3000:]
            msg = orjson.loads(line)
            if isinstance(msg, list):
                for item in msg:
                    check_message(item)
                continue
            if "method" in msg and "id" not in msg:
                assert isinstance(msg["method"], str)  # a notification: a listen's ack or frame
                continue
            check_message(msg)
            if msg.get("id") == mark:
                return


@pytest.fixture(scope="module")
def stdio(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stdio]:
    log = tmp_path_factory.mktemp("fuzz-stdio") / "stdio.log"
    server = Stdio(log)
    try:
        yield server
    finally:
        assert server.proc.stdin is not None
        server.proc.stdin.close()
        code = server.proc.wait(TIMEOUT)
        assert server.proc.stdout is not None
        server.proc.stdout.close()
        text = log.read_text("utf-8", "replace")
        assert code == 0, text[-3000:]
        assert not any(marker in text for marker in LOG_MARKERS), text[-3000:]


LINES = st.one_of(
    message(LEGACY_METHODS, False).map(encode),
    message(MODERN_METHODS, True).map(encode),
    st.lists(message(LEGACY_METHODS, False), min_size=1, max_size=8).map(encode),
    ANY.map(encode),
    st.binary(max_size=100).map(lambda b: b.replace(b"\n", b" ")),
)
INITIALIZE = {"jsonrpc": "2.0", "id": "init", "method": "initialize",
              "params": {"protocolVersion": "2025-03-26", "capabilities": {},
                         "clientInfo": {"name": "f", "version": "1"}}}


@FUZZ
@given(line=LINES)
def test_stdio_lines(stdio: Stdio, line: bytes) -> None:
    if stdio.sentinel == 0:
        stdio.write(encode(INITIALIZE))  # a 2025-03-26 session, so batches are taken too
    stdio.write(line)
    stdio.settle()
    with stdio.log.open("rb") as file:
        text = file.read().decode("utf-8", "replace")
    assert not any(marker in text for marker in LOG_MARKERS), text[-3000:]

