"""A rolling restart behind the shipped nginx configuration costs clients no error.

A real nginx runs ``deploy/nginx.conf`` (its upstream and location directives as shipped; only
addresses, paths and process counts are the test's) in front of three workers that run with the
image's settings, each a single process or ``serve --workers 2``. Clients POST all the time, on
keep-alive connections, while each worker in turn gets SIGTERM, exits and starts again on its
port. nginx does not retry a POST it has sent, so a worker that closes a connection nginx is about
to reuse, or lets nginx connect and then resets the connection, turns into a 502 for a client.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import shlex
import shutil
import signal
import socket
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.distributed.conftest import WORKER_ENV
from tests.integration import modern
from tests.integration.mcp_http import McpSession
from tests.support import ROOT, BrokerProcess, RedisProcess, free_port, wait_until

#: Clients sending POSTs at once, each on its own keep-alive connection to nginx.
CLIENTS = 16
#: Legacy sessions holding their GET stream open through nginx, reconnecting when it ends.
WATCHERS = 24


def nginx_binary() -> str | None:
    found = shutil.which("nginx")
    if found is None and Path("/usr/sbin/nginx").exists():
        found = "/usr/sbin/nginx"
    return found


def image_env() -> dict[str, str]:
    """The settings the image (``Dockerfile``) gives a worker for talking to a load balancer."""
    env: dict[str, str] = {}
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("ENV "):
            for word in shlex.split(line[4:]):
                name, _, value = word.partition("=")
                if name in ("MCP_BROKER_SHUTDOWN_DRAIN", "MCP_BROKER_HTTP_KEEPALIVE_TIMEOUT"):
                    env[name] = value
    return env


def nginx_config(shipped: str, ports: list[int], listen: int, prefix: Path) -> str:
    """``deploy/nginx.conf`` with the test's upstreams, listen address and private paths."""
    params = re.search(r"^\s*server broker1:8080([^;]*);", shipped, re.M)
    assert params is not None, "deploy/nginx.conf no longer names broker1:8080"
    servers = "".join(f"    server 127.0.0.1:{port}{params.group(1)};\n" for port in ports)
    text = re.sub(r"^\s*server broker\d+:8080[^;]*;\n", "", shipped, flags=re.M)
    text = text.replace("upstream brokers {\n", "upstream brokers {\n" + servers, 1)
    text = re.sub(r"^\s*listen 8080;", f"    listen 127.0.0.1:{listen};", text, count=1, flags=re.M)
    text = re.sub(r"^worker_processes [^;]*;", "worker_processes 1;", text, flags=re.M)
    text = re.sub(r"worker_connections [^;]*;", "worker_connections 1024;", text)
    private = "".join(f"  {name}_temp_path {prefix / name};\n"
                      for name in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    text = text.replace("http {\n", f"http {{\n  access_log off;\n{private}", 1)
    return f"daemon off;\npid {prefix / 'nginx.pid'};\nerror_log {prefix / 'error.log'} warn;\n{text}"


class NginxProcess:
    def __init__(self, binary: str, upstreams: list[int], prefix: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.prefix = prefix
        conf = prefix / "nginx.conf"
        conf.write_text(nginx_config((ROOT / "deploy" / "nginx.conf").read_text(), upstreams, self.port, prefix))
        # At a low priority, as a busy balancer is: it is slower to notice that a worker closed a
        # connection it keeps, which widens the race this test is about without changing it.
        self.proc = subprocess.Popen(["nice", "-n", "15", binary, "-p", str(prefix), "-e", str(prefix / "error.log"),
                                      "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_until(lambda: httpx.get(self.url + "/healthz", timeout=1).status_code == 200, what="nginx start")
        except TimeoutError:
            self.stop()
            raise

    def errors(self) -> str:
        """What nginx logged about requests that failed (a refused connection is retried, so not those)."""
        lines = (self.prefix / "error.log").read_text().splitlines()
        return "\n".join(line for line in lines if "[error]" in line and "connect() failed" not in line)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # fast shutdown: the master ends its workers
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


#: How a deployment's instances run: one worker process each, or ``serve --workers 2``, whose
#: supervisor holds the listening socket its worker processes share.
INSTANCES = {"single-process": [], "serve-workers-2": ["--workers", "2"]}

#: Starts instance ``index`` (on ``port``, when it is started again).
Start = Callable[[int, int | None], BrokerProcess]
NginxDeployment = tuple[NginxProcess, list[BrokerProcess], Start]


@pytest.fixture(params=list(INSTANCES))
def nginx_deployment(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[NginxDeployment]:
    binary = nginx_binary()
    if binary is None:
        pytest.skip("nginx is not installed (Debian's nginx-light or nginx): the rolling restart goes through it")
    workers: list[BrokerProcess] = []
    with RedisProcess() as redis:
        env = {**WORKER_ENV, "MCP_BROKER_REDIS_URL": redis.url, **image_env()}

        def start(index: int, port: int | None = None) -> BrokerProcess:
            return BrokerProcess(env={**env, "MCP_BROKER_SERVER_NAME": f"worker-{index}"},
                                 args=INSTANCES[request.param], port=port)

        nginx: NginxProcess | None = None
        try:
            workers.extend(start(i) for i in range(3))
            nginx = NginxProcess(binary, [w.port for w in workers], tmp_path)
            yield nginx, workers, start
        finally:
            if nginx is not None:
                nginx.stop()
            for worker in workers:
                worker.kill()


class Traffic:
    """POST clients and GET-stream watchers through nginx, each answer noted as (when, status or error)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.answers: list[tuple[float, str]] = []
        self.streams: list[tuple[float, str]] = []
        self.done = asyncio.Event()

    async def client(self, number: int) -> None:
        """``POST /changes`` and a JSON-RPC ``resources/list`` in turn, on one keep-alive connection."""
        async with httpx.AsyncClient(base_url=self.url, timeout=30, limits=httpx.Limits(max_connections=1)) as http:
            mcp = await McpSession(http).initialize()
            sent = 0
            while not self.done.is_set():
                sent += 1
                try:
                    if sent % 2:
                        body = {"uri": f"https://example.com/rolling/{number}", "meta": {"n": sent}}
                        response = await http.post("/changes", json=body)
                    else:
                        response = await mcp.post({"jsonrpc": "2.0", "id": sent, "method": "resources/list"})
                    outcome = str(response.status_code)
                except httpx.HTTPError as exc:
                    outcome = type(exc).__name__
                self.answers.append((time.monotonic(), outcome))

    async def watcher(self, number: int) -> None:
        """A legacy session with its GET stream open, reconnecting with Last-Event-ID as soon as it ends."""
        async with httpx.AsyncClient(base_url=self.url, timeout=30) as http:
            mcp = await McpSession(http).initialize()
            await mcp.subscribe(f"https://example.com/rolling/{number % CLIENTS}")
            last: str | None = None
            while not self.done.is_set():
                headers = mcp.headers(Accept="text/event-stream", **({"Last-Event-ID": last} if last else {}))
                try:
                    async with http.stream("GET", "/mcp", headers=headers) as response:
                        self.streams.append((time.monotonic(), str(response.status_code)))
                        async for line in response.aiter_lines():
                            if line.startswith("id:"):
                                last = line[3:].strip()
                except httpx.HTTPError as exc:
                    self.streams.append((time.monotonic(), type(exc).__name__))

    async def answered(self, count: int) -> None:
        async with asyncio.timeout(30):
            while len(self.answers) < count:
                await asyncio.sleep(0.05)


def served_by(url: str) -> str:
    """The name of the worker nginx sends a new session to."""
    body = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {
        "protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "probe", "version": "1"}}}
    reply = httpx.post(url + "/mcp", json=body, headers={"Accept": "application/json, text/event-stream"}, timeout=5)
    assert reply.status_code == 200, f"a probe got {reply.status_code}: {reply.text}"  # it is a POST too
    return str(reply.json()["result"]["serverInfo"]["name"])


def roll(url: str, workers: list[BrokerProcess], start: Start) -> list[tuple[float, float]]:
    """SIGTERM each worker in turn, wait for its exit, start it again on its port; when each was away.

    The next worker is stopped only once nginx sends requests to the restarted one again, as a
    rolling restart must: nginx counts a refused connection against a worker (``max_fails``)
    and sends it nothing for ``fail_timeout``, so stopping the next one sooner could leave
    nginx with no worker it believes alive.
    """
    windows = []
    for index, worker in enumerate(workers):
        started = time.monotonic()
        # uvicorn raises the signal again once it has shut down, so SIGTERM is the exit status.
        assert worker.terminate(timeout=30) in (0, -signal.SIGTERM)
        worker.kill()  # closes its pipe
        workers[index] = start(index, worker.port)
        name = f"worker-{index}"
        wait_until(lambda name=name: served_by(url) == name, what=f"nginx to send requests to {name} again")
        windows.append((started, time.monotonic()))
    return windows


@pytest.mark.timeout(180)
async def test_a_rolling_restart_through_the_shipped_nginx_answers_every_post(
    nginx_deployment: NginxDeployment,
) -> None:
    nginx, workers, start = nginx_deployment
    traffic = Traffic(nginx.url)
    clients = [asyncio.create_task(traffic.client(n)) for n in range(CLIENTS)]
    watchers = [asyncio.create_task(traffic.watcher(n)) for n in range(WATCHERS)]
    try:
        await traffic.answered(200)  # every client has its session and is sending
        windows = await asyncio.to_thread(roll, nginx.url, workers, start)
        await traffic.answered(len(traffic.answers) + 200)  # and goes on after the last restart
    finally:
        traffic.done.set()
        for task in watchers:
            task.cancel()  # a watcher waits on its open stream
        ended = await asyncio.gather(*clients, *watchers, return_exceptions=True)
    for result in ended:
        if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
            raise result

    outcomes = Counter(outcome for _, outcome in traffic.answers)
    failed = {outcome: count for outcome, count in outcomes.items() if not outcome.startswith("2")}
    assert not failed, f"{failed} of {len(traffic.answers)} POSTs failed: {dict(outcomes)}\n{nginx.errors()}"
    opened = Counter(outcome for _, outcome in traffic.streams)
    assert set(opened) == {"200"}, f"GET streams: {dict(opened)}\n{nginx.errors()}"
    for started, back in windows:
        during = sum(1 for when, _ in traffic.answers if started <= when <= back)
        assert during >= 50, f"only {during} POSTs while a worker restarted: the test proved nothing"
    assert len(traffic.answers) >= 1000


def refuses_connections(worker: BrokerProcess) -> bool:
    try:
        socket.create_connection(("127.0.0.1", worker.port), timeout=1).close()
    except ConnectionRefusedError:
        return True
    return False


@pytest.mark.timeout(60)
@pytest.mark.parametrize("args", list(INSTANCES.values()), ids=list(INSTANCES))
def test_a_stopping_worker_answers_on_its_open_connections_and_refuses_new_ones(args: list[str]) -> None:
    """What the balancer relies on: no connection it holds is closed under it, a new one is refused.

    ``serve --workers 2`` too: there a connection is refused only once no process holds the
    listening socket, the supervisor included."""
    # A long idle timeout: only the stop may end the connection, however slow the machine.
    env = {"MCP_BROKER_SHUTDOWN_DRAIN": "30", "MCP_BROKER_HTTP_KEEPALIVE_TIMEOUT": "60"}
    with RedisProcess() as redis, BrokerProcess(env={**env, "MCP_BROKER_REDIS_URL": redis.url}, args=args) as worker:
        conn = http.client.HTTPConnection("127.0.0.1", worker.port, timeout=10)
        try:
            body = b'{"uri": "https://example.com/draining"}'
            conn.request("POST", "/changes", body, {"Content-Type": "application/json"})
            before = conn.getresponse()
            assert before.status == 202 and before.getheader("connection") is None
            before.read()
            worker.proc.send_signal(signal.SIGTERM)
            wait_until(lambda: refuses_connections(worker), what="the stopping worker to refuse new connections")
            conn.request("POST", "/changes", body, {"Content-Type": "application/json"})  # the same connection
            during = conn.getresponse()
            assert during.status == 202 and during.getheader("connection") == "close"
            during.read()
        finally:
            conn.close()
        # The drain ends as soon as no connection is left, long before its 30 s.
        assert worker.proc.wait(20) in (0, -signal.SIGTERM)


def test_a_listen_asked_of_a_stopping_worker_ends_as_open_listens_do() -> None:
    """Not an error the balancer cannot retry (a POST): the ack, then the ``complete`` result."""
    with BrokerProcess(env={"MCP_BROKER_SHUTDOWN_DRAIN": "30", "MCP_BROKER_HTTP_KEEPALIVE_TIMEOUT": "60"}) as worker:
        conn = http.client.HTTPConnection("127.0.0.1", worker.port, timeout=10)
        try:
            conn.request("GET", "/healthz")
            conn.getresponse().read()
            worker.proc.send_signal(signal.SIGTERM)
            wait_until(lambda: refuses_connections(worker), what="the stopping worker to refuse new connections")
            listen = modern.request("subscriptions/listen",
                                    {"notifications": {"resourceSubscriptions": ["https://example.com/x"]}}, 7)
            conn.request("POST", "/mcp", json.dumps(listen).encode(), modern.headers("subscriptions/listen"))
            answer = conn.getresponse()
            text = answer.read().decode()
        finally:
            conn.close()
        assert answer.status == 200, text
        assert "notifications/subscriptions/acknowledged" in text, text
        assert '"id":7' in text.replace(" ", "") and '"result"' in text, text
