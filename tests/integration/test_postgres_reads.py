"""PostgreSQL reads: bounded answers, tenants isolated from each other's reads, a deadline that covers the wait.

A private PostgreSQL (``tests/postgres_support.py``), real ``mcp-broker serve`` processes, and a
flood from a process of its own, so that its client work does not slow the measured reads. The
fairness check's bound (1 s) is wide; the numbers are printed.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import psycopg
import pytest

from tests.integration import modern
from tests.postgres_support import PostgresProcess, postgres_binary
from tests.support import BIN, ROOT, BrokerProcess

pytestmark = pytest.mark.skipif(postgres_binary("initdb") is None, reason="PostgreSQL is not installed")

KEYS = json.dumps({"ka": "a/alice", "kb": "b/bob"})
TABLES = json.dumps({"big": "a", "small": "b"})
MIB = 1 << 20
LIMIT = MIB


@pytest.fixture(scope="module")
def pg() -> Iterator[PostgresProcess]:
    with PostgresProcess() as server:
        with psycopg.connect(server.url, autocommit=True) as conn:
            conn.execute("CREATE TABLE big (id integer PRIMARY KEY, body text)")
            conn.execute("CREATE TABLE small (id integer PRIMARY KEY, name text)")
            conn.execute("INSERT INTO big VALUES (1, repeat('x', 10 * 1024 * 1024)), (2, repeat('y', 8 * 1024 * 1024)),"
                         " (3, repeat('\"', 600 * 1024)), (4, repeat('z', 500 * 1024))")
            conn.execute("INSERT INTO small VALUES (1, 'lamp')")
        env = {**os.environ, "MCP_BROKER_POSTGRES_URL": server.url, "MCP_BROKER_POSTGRES_TABLES": TABLES}
        done = subprocess.run([str(BIN), "postgres", "install"], env=env, capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        yield server


def broker_env(pg: PostgresProcess, **extra: str) -> dict[str, str]:
    return {"MCP_BROKER_API_KEYS": KEYS, "MCP_BROKER_POSTGRES_URL": pg.url, "MCP_BROKER_POSTGRES_TABLES": TABLES,
            **extra}


async def read(http: httpx.AsyncClient, uri: str, auth: str) -> httpx.Response:
    return await modern.call(http, "resources/read", {"uri": uri}, name=uri, auth=auth)


async def test_a_row_whose_answer_passes_the_bound_is_refused_precisely(pg: PostgresProcess) -> None:
    with BrokerProcess(env=broker_env(pg, MCP_BROKER_MAX_READ_BYTES=str(LIMIT))) as broker:
        async with httpx.AsyncClient(base_url=broker.url, timeout=60) as http:
            for pk in (1, 3):  # 10 MiB of text; 600 kB of quotes, 1.2 MB as row_to_json and 2.4 MB answered
                uri = f"mcpb://a/big/{pk}"
                response = await read(http, uri, "ka")
                print(f"row {pk}: HTTP {response.status_code}, {len(response.content)} bytes answered")
                assert response.status_code == 200
                error = response.json()["error"]
                assert error["code"] == -32602 and error["data"] == {"uri": uri, "maxBytes": LIMIT}, error
                assert "MCP_BROKER_MAX_READ_BYTES" in error["message"]
            served = (await read(http, "mcpb://a/big/4", "ka")).json()
            assert json.loads(served["result"]["contents"][0]["text"])["body"] == "z" * 500 * 1024


async def flood(url: str, tasks: int) -> None:
    """Tenant a reads an 8 MiB row in ``tasks`` loops until killed; says ``flooding`` once every loop read once."""
    first = asyncio.Event()
    done = 0

    async def loop(http: httpx.AsyncClient) -> None:
        nonlocal done
        while True:
            response = await read(http, "mcpb://a/big/2", "ka")
            assert "result" in response.json(), response.text[:200]
            done += 1
            if done == tasks:
                first.set()

    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=tasks)) as http:
        running = [asyncio.create_task(loop(http)) for _ in range(tasks)]
        await first.wait()
        print("flooding", flush=True)
        await asyncio.gather(*running)


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


@pytest.mark.timeout(180)
async def test_another_tenants_reads_stay_fast_while_one_tenant_reads_big_rows_in_a_loop(
        pg: PostgresProcess) -> None:
    with BrokerProcess(env=broker_env(pg)) as broker:
        async with httpx.AsyncClient(base_url=broker.url, timeout=60) as http:

            async def timed_reads(count: int) -> list[float]:
                took = []
                for _ in range(count):
                    began = time.perf_counter()
                    response = await read(http, "mcpb://b/small/1", "kb")
                    took.append(time.perf_counter() - began)
                    assert json.loads(response.json()["result"]["contents"][0]["text"])["name"] == "lamp"
                return took

            quiet = await timed_reads(20)
            code = ("import asyncio, tests.integration.test_postgres_reads as t; "
                    f"asyncio.run(t.flood({broker.url!r}, 24))")
            flooder = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                                       env={**os.environ, "PYTHONPATH": str(ROOT)})
            try:
                assert flooder.stdout is not None
                assert await asyncio.to_thread(flooder.stdout.readline) == "flooding\n"
                loud = await timed_reads(20)
            finally:
                flooder.kill()
                flooder.wait(10)
                assert flooder.stdout is not None
                flooder.stdout.close()
        ms = {name: (percentile(values, 0.5) * 1000, percentile(values, 0.99) * 1000, max(values) * 1000)
              for name, values in (("quiet", quiet), ("flood", loud))}
        print("tenant b's read p50/p99/max, ms: " + "; ".join(
            f"{name} {p50:.1f}/{p99:.1f}/{top:.1f}" for name, (p50, p99, top) in ms.items()))
        assert percentile(loud, 0.99) < 1.0


async def test_the_deadline_of_a_read_covers_its_wait_for_a_connection(pg: PostgresProcess) -> None:
    env = broker_env(pg, MCP_BROKER_POSTGRES_READ_TIMEOUT="1", MCP_BROKER_POSTGRES_POOL_SIZE="1")
    with BrokerProcess(env=env) as broker, psycopg.connect(pg.url) as lock:
        lock.execute("LOCK TABLE small IN ACCESS EXCLUSIVE MODE")  # every read of it waits, in PostgreSQL
        async with httpx.AsyncClient(base_url=broker.url, timeout=60) as http:

            async def timed() -> tuple[float, Any]:
                began = time.perf_counter()
                response = await read(http, "mcpb://b/small/1", "kb")
                return time.perf_counter() - began, (response.status_code, response.json()["error"]["code"])

            answers = await asyncio.gather(*(timed() for _ in range(4)))
        lock.rollback()
        print("4 reads of a locked table, one connection:", ", ".join(f"{took:.2f} s {what}" for took, what in answers))
        assert all(what == (503, -31000) for _, what in answers)
        assert all(took < 5.0 for took, _ in answers)  # each within about its own 1 s, the wait included
        async with httpx.AsyncClient(base_url=broker.url, timeout=60) as http:
            assert "result" in (await read(http, "mcpb://b/small/1", "kb")).json()
