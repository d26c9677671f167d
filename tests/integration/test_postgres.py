"""PostgreSQL rows as resources: committed INSERT/UPDATE/DELETE reach subscribers through the outbox.

A private PostgreSQL (``tests/postgres_support.py``) and real ``mcp-broker serve`` processes. Each
test starts its own broker: with the memory backend every broker would run its own copy of the
exclusive source, and only one may drain the outbox at a time for the test to know who delivers.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import psycopg
import pytest
from mcp import types
from mcp.client.client import Client

from tests.integration.mcp_http import McpSession, SSEStream
from tests.postgres_support import PostgresProcess, postgres_binary
from tests.sdk_inbox import Inbox
from tests.support import BIN, BrokerProcess, wait_until

pytestmark = [
    pytest.mark.skipif(postgres_binary("initdb") is None, reason="PostgreSQL is not installed"),
    pytest.mark.filterwarnings("ignore::mcp.shared.exceptions.MCPDeprecationWarning"),
]

ROW = "mcpb://default/items/{}"
TABLE = "mcpb://default/items"
UPDATED = "notifications/resources/updated"


@pytest.fixture(scope="module")
def pg() -> Iterator[PostgresProcess]:
    with PostgresProcess() as server:
        with psycopg.connect(server.url, autocommit=True) as conn:
            conn.execute("CREATE TABLE items (id integer PRIMARY KEY, name text, price integer)")
        yield server


def env(pg: PostgresProcess, tables: str = '{"items": "default"}') -> dict[str, str]:
    return {"MCP_BROKER_POSTGRES_URL": pg.url, "MCP_BROKER_POSTGRES_TABLES": tables}


def install(pg: PostgresProcess, tables: str = '{"items": "default"}') -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN), "postgres", "install"], env={**os.environ, **env(pg, tables)},
                          capture_output=True, text=True, timeout=30)


@pytest.fixture(scope="module")
def installed(pg: PostgresProcess) -> PostgresProcess:
    done = install(pg)
    assert done.returncode == 0, done.stderr
    return pg


def sql(pg: PostgresProcess, statement: str, params: list[Any] | None = None) -> list[tuple[Any, ...]]:
    with psycopg.connect(pg.url, autocommit=True) as conn:
        cur = conn.execute(statement, params)
        return cur.fetchall() if cur.description else []


@asynccontextmanager
async def subscribed(broker: BrokerProcess, *uris: str) -> AsyncIterator[tuple[McpSession, SSEStream]]:
    async with httpx.AsyncClient(base_url=broker.url, timeout=10) as http:
        session = await McpSession(http).initialize()
        await session.subscribe(*uris)
        async with session.stream() as stream:
            yield session, stream


async def notified(stream: SSEStream, *uris: str) -> None:
    """Wait until every one of ``uris`` was notified as updated (10 s at most per message)."""
    missing = set(uris)
    while missing:
        event = await stream.next_message()
        if event.method == UPDATED:
            missing.discard(event.uri or "")


async def read_row(session: McpSession, pk: int) -> Any:
    result = await session.result("resources/read", {"uri": ROW.format(pk)})
    return json.loads(result["contents"][0]["text"])


def test_install_prints_each_object_and_can_run_again(installed: PostgresProcess) -> None:
    again = install(installed)
    assert again.returncode == 0, again.stderr
    lines = again.stdout.splitlines()
    assert lines[:4] == ["schema mcp_broker", "table mcp_broker.outbox", "table mcp_broker.cursor",
                         "function mcp_broker.capture()"]
    assert lines[4].startswith("trigger mcp_broker_outbox on items (primary key id, tenant default")
    assert sql(installed, "SELECT count(*) FROM pg_trigger WHERE tgname = 'mcp_broker_outbox'") == [(1,)]
    missing = install(installed, '{"nope": "default"}')
    assert missing.returncode == 2 and missing.stdout == ""
    assert missing.stderr.count("\n") == 1 and "'nope' does not exist" in missing.stderr


async def test_committed_row_changes_reach_the_row_and_the_table_and_reads_see_them(
        installed: PostgresProcess) -> None:
    with BrokerProcess(env=env(installed)) as broker:
        async with subscribed(broker, ROW.format(1), TABLE) as (session, stream):
            sql(installed, "INSERT INTO items VALUES (1, 'lamp', 12)")
            await notified(stream, ROW.format(1), TABLE)
            assert await read_row(session, 1) == {"id": 1, "name": "lamp", "price": 12}
            sql(installed, "UPDATE items SET price = 13 WHERE id = 1")
            await notified(stream, ROW.format(1), TABLE)
            assert await read_row(session, 1) == {"id": 1, "name": "lamp", "price": 13}
            table = await session.result("resources/read", {"uri": TABLE})
            assert ROW.format(1) in json.loads(table["contents"][0]["text"])["records"]
            sql(installed, "DELETE FROM items WHERE id = 1")
            await notified(stream, ROW.format(1), TABLE)
            gone = await session.call("resources/read", {"uri": ROW.format(1)})
            assert gone["error"]["code"] == -32002
            listed = await session.result("resources/list")
            assert TABLE in {item["uri"] for item in listed["resources"]}
        # Delivered, so trimmed: the outbox is empty and the cursor passed every row.
        wait_until(lambda: sql(installed, "SELECT count(*) FROM mcp_broker.outbox") == [(0,)], what="outbox trimmed")
        ((last,),) = sql(installed, "SELECT last_id FROM mcp_broker.cursor WHERE name = 'postgres'")
        assert last >= 3


async def test_changes_committed_while_no_broker_ran_are_delivered_once_one_starts(
        installed: PostgresProcess) -> None:
    sql(installed, "INSERT INTO items VALUES (7, 'chair', 40)")
    sql(installed, "UPDATE items SET price = 41 WHERE id = 7")
    assert sql(installed, "SELECT op FROM mcp_broker.outbox ORDER BY id") == [("INSERT",), ("UPDATE",)]
    # Holding the cursor row's lock keeps the starting source from draining until we subscribed.
    async with await psycopg.AsyncConnection.connect(installed.url) as hold:
        await hold.execute("INSERT INTO mcp_broker.cursor (name) VALUES ('postgres') ON CONFLICT DO NOTHING")
        await hold.commit()
        await hold.execute("SELECT 1 FROM mcp_broker.cursor WHERE name = 'postgres' FOR UPDATE")
        with BrokerProcess(env=env(installed)) as broker:
            async with subscribed(broker, ROW.format(7), TABLE) as (session, stream):
                await hold.commit()
                await notified(stream, ROW.format(7), TABLE)
                assert await read_row(session, 7) == {"id": 7, "name": "chair", "price": 41}
            wait_until(lambda: sql(installed, "SELECT count(*) FROM mcp_broker.outbox") == [(0,)],
                       what="outbox trimmed")


async def test_the_official_client_subscribes_to_a_row_sees_the_update_and_reads_it(
        installed: PostgresProcess) -> None:
    sql(installed, "INSERT INTO items VALUES (9, 'desk', 100) ON CONFLICT (id) DO NOTHING")
    with BrokerProcess(env=env(installed)) as broker:
        inbox = Inbox()
        async with Client(broker.mcp_url, mode="legacy", message_handler=inbox.handler) as client:
            await client.subscribe_resource(ROW.format(9))
            sql(installed, "UPDATE items SET price = 90 WHERE id = 9")
            await inbox.wait_for(types.ResourceUpdatedNotification, ROW.format(9))
            read = await client.read_resource(ROW.format(9), cache_mode="bypass")
            assert json.loads(read.contents[0].text) == {"id": 9, "name": "desk", "price": 90}  # type: ignore[union-attr]


async def test_the_source_and_reads_survive_a_database_restart(installed: PostgresProcess) -> None:
    sql(installed, "INSERT INTO items VALUES (11, 'shelf', 5) ON CONFLICT (id) DO NOTHING")
    with BrokerProcess(env=env(installed)) as broker:
        async with subscribed(broker, ROW.format(11)) as (session, stream):
            assert (await read_row(session, 11))["price"] == 5
            installed.stop()
            installed.start()
            sql(installed, "UPDATE items SET price = 6 WHERE id = 11")
            await notified(stream, ROW.format(11))
            assert (await read_row(session, 11))["price"] == 6


async def test_a_row_has_one_uri_and_another_spelling_of_its_key_is_not_found(installed: PostgresProcess) -> None:
    """``01`` is the integer 1 to PostgreSQL, but its changes are published under ``.../1`` only."""
    sql(installed, "INSERT INTO items VALUES (21, 'desk', 90)")
    with BrokerProcess(env=env(installed)) as broker:
        async with httpx.AsyncClient(base_url=broker.url, timeout=10) as http:
            session = await McpSession(http).initialize()
            assert (await read_row(session, 21))["name"] == "desk"
            for spelling in ("021", "0021"):
                refused = await session.call("resources/read", {"uri": ROW.format(spelling)})
                assert refused["error"]["code"] == -32002, refused
