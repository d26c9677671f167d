"""Helpers the test tiers share: free ports, a broker in a real process, a private redis-server."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent / "mcp-broker"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_until(check: Callable[[], bool], timeout: float = 15.0, what: str = "condition") -> None:
    """Poll ``check`` (a readiness probe of another process) until it is true or the timeout passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except (OSError, httpx.HTTPError):
            pass
        time.sleep(0.05)
    raise TimeoutError(f"timed out waiting for {what}")


class BrokerProcess:
    """``mcp-broker serve`` on a free loopback port, in its own process."""

    def __init__(self, env: dict[str, str] | None = None, args: list[str] | None = None, port: int | None = None,
                 log: Path | None = None, log_level: str = "warning", host: str = "127.0.0.1",
                 prefix: list[str] | None = None):
        """``log``: a file that receives the broker's stderr (its log); by default a pipe. ``host``: the
        address it listens on and is reached at; ``prefix``: a command that runs it (``ip netns exec <ns>``)."""
        self.port = port or free_port()
        self.url = f"http://{host}:{self.port}"
        full_env = {**os.environ, "MCP_BROKER_KEEPALIVE_INTERVAL": "1", **(env or {})}
        with open(log, "ab") if log is not None else _pipe() as stderr:
            self.proc = subprocess.Popen(
                [*(prefix or []), str(BIN), "--log-level", log_level, "serve", "--port", str(self.port),
                 *(["--host", host] if host != "127.0.0.1" else []), *(args or [])],
                env=full_env,
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                # A group of its own: ``kill`` takes the worker processes of ``--workers N`` with it.
                start_new_session=True,
            )
        try:
            wait_until(lambda: httpx.get(self.url + "/healthz", timeout=1).status_code == 200, what="broker start")
        except TimeoutError:
            self.kill()
            raise

    @property
    def mcp_url(self) -> str:
        return self.url + "/mcp"

    def terminate(self, timeout: float = 15.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # the supervisor and every worker it spawned
        self.proc.wait(10)
        if self.proc.stderr is not None:
            self.proc.stderr.close()  # an unclosed pipe is a ResourceWarning, an error under filterwarnings

    def __enter__(self) -> BrokerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


@contextlib.contextmanager
def _pipe() -> Iterator[int]:
    yield subprocess.PIPE


def redis_server_binary() -> str | None:
    return shutil.which("redis-server")


class RedisProcess:
    """A private ``redis-server`` on a free loopback port, nothing persisted."""

    def __init__(self, port: int | None = None, extra: list[str] | None = None, workdir: Path | None = None):
        binary = redis_server_binary()
        if binary is None:
            raise RuntimeError("redis-server is not installed")
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.extra = extra or []
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        binary = redis_server_binary()
        assert binary is not None
        self.proc = subprocess.Popen(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             *(["--dir", str(self.workdir)] if self.workdir else []), *self.extra],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_until(self._ping, what="redis-server start")

    def _ping(self) -> bool:
        with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self) -> RedisProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
