"""The PostgreSQL outbox: what ``mcp-broker postgres install`` creates, and the change source that reads it.

A trigger on each configured table writes every committed row change (table, primary key,
operation) to ``mcp_broker.outbox`` in the writer's own transaction, and ``pg_notify``s
``mcp_broker_outbox``. ``OutboxSource`` (exclusive: one worker of the deployment at a time) reads
the outbox in id order, publishes each change as ``mcpb://<tenant>/<table>/<pk>``, then, in one
transaction, deletes the rows it published and moves its cursor (``mcp_broker.cursor``) to the
highest id. The outbox therefore holds exactly what is not delivered yet, including a row whose
transaction committed after rows with higher ids had been delivered (ids are taken before
commit): the source reads what is in the outbox, not what is above the cursor, so no change is
skipped. A crash between the publish and that commit publishes the batch again (at least once).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any, Final

import psycopg
from psycopg import sql

from broker.changes import ChangeKind, InvalidChange
from broker.errors import BackendUnavailable, PublishRefused, raise_if_cancelled
from broker.publisher import Publisher
from broker.uris import collection_uri, record_uri, valid_name

__all__ = ["CHANNEL", "OutboxSource", "TableKey", "install", "table_key"]

logger = logging.getLogger(__name__)

SCHEMA: Final = "mcp_broker"
CHANNEL: Final = "mcp_broker_outbox"
TRIGGER: Final = "mcp_broker_outbox"
#: Outbox rows published in one transaction.
BATCH: Final = 500
#: Seconds between two reads of the outbox when no notification arrives.
POLL: Final = 1.0
#: The longest pause before reconnecting to a database that went away, in seconds.
MAX_BACKOFF: Final = 10.0
CONNECT_TIMEOUT: Final = 5

_KINDS: Final = {"INSERT": ChangeKind.CREATED, "UPDATE": ChangeKind.UPDATED, "DELETE": ChangeKind.DELETED}

_FUNCTION: Final = f"""
CREATE OR REPLACE FUNCTION {SCHEMA}.capture() RETURNS trigger LANGUAGE plpgsql AS $fn$
DECLARE
  old_key text;
  new_key text;
BEGIN
  IF TG_OP <> 'INSERT' THEN old_key := to_jsonb(OLD) ->> TG_ARGV[1]; END IF;
  IF TG_OP <> 'DELETE' THEN new_key := to_jsonb(NEW) ->> TG_ARGV[1]; END IF;
  IF TG_OP = 'UPDATE' AND old_key IS DISTINCT FROM new_key THEN
    -- a new primary key: the old row is gone and a new one exists
    INSERT INTO {SCHEMA}.outbox (tbl, pk, op) VALUES (TG_ARGV[0], old_key, 'DELETE'), (TG_ARGV[0], new_key, 'INSERT');
  ELSE
    INSERT INTO {SCHEMA}.outbox (tbl, pk, op) VALUES (TG_ARGV[0], coalesce(new_key, old_key), TG_OP);
  END IF;
  PERFORM pg_notify('{CHANNEL}', TG_ARGV[0]);
  RETURN NULL;
END
$fn$"""


class TableKey:
    """A configured table as PostgreSQL names it (``regclass``, quoted where needed) and its primary key column."""

    __slots__ = ("column", "qualified")

    def __init__(self, qualified: str, column: str) -> None:
        self.qualified = qualified
        self.column = column

    @property
    def table_sql(self) -> sql.Composable:
        return sql.SQL(self.qualified)  # regclass output: already quoted as PostgreSQL needs


async def table_key(conn: psycopg.AsyncConnection[Any], table: str) -> TableKey:
    """Resolve ``table`` (``schema.table`` or ``table``, on the search path) and its one-column primary key.

    Raises:
        ValueError: no such table, or its primary key is missing or has more than one column.
    """
    row = await (await conn.execute("SELECT to_regclass(%s)::oid, to_regclass(%s)::text", [table, table])).fetchone()
    if row is None or row[0] is None:
        raise ValueError(f"table {table!r} does not exist")
    columns = await (await conn.execute(
        "SELECT a.attname FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey)"
        " WHERE i.indrelid = %s AND i.indisprimary", [row[0]])).fetchall()
    if len(columns) != 1:
        what = "no primary key" if not columns else f"a primary key of {len(columns)} columns"
        raise ValueError(f"table {table!r} has {what}; a row resource needs a primary key of one column")
    return TableKey(str(row[1]), str(columns[0][0]))


async def install(url: str, tables: Mapping[str, str]) -> list[str]:
    """Create (or replace) the outbox, the cursor table, the trigger function and one trigger per table,
    in one transaction; one line per object. Running it again changes nothing but the triggers' bodies.

    Raises:
        ValueError: a table that does not exist or has no one-column primary key.
        psycopg.Error: the database refused (or could not be reached).
    """
    done: list[str] = []
    async with await psycopg.AsyncConnection.connect(url, connect_timeout=CONNECT_TIMEOUT) as conn:
        async with conn.transaction():
            await conn.execute(f"CREATE SCHEMA IF NOT EXISTS {SCHEMA}")
            done.append(f"schema {SCHEMA}")
            await conn.execute(f"CREATE TABLE IF NOT EXISTS {SCHEMA}.outbox (id bigserial PRIMARY KEY,"
                               " tbl text NOT NULL, pk text, op text NOT NULL, at timestamptz NOT NULL DEFAULT now())")
            done.append(f"table {SCHEMA}.outbox")
            await conn.execute(f"CREATE TABLE IF NOT EXISTS {SCHEMA}.cursor (name text PRIMARY KEY,"
                               " last_id bigint NOT NULL DEFAULT 0)")
            done.append(f"table {SCHEMA}.cursor")
            await conn.execute(_FUNCTION)
            done.append(f"function {SCHEMA}.capture()")
            for name, tenant in tables.items():
                key = await table_key(conn, name)
                await conn.execute(sql.SQL("DROP TRIGGER IF EXISTS {} ON {}").format(
                    sql.Identifier(TRIGGER), key.table_sql))
                await conn.execute(sql.SQL(
                    "CREATE TRIGGER {} AFTER INSERT OR UPDATE OR DELETE ON {} FOR EACH ROW EXECUTE FUNCTION {}({}, {})"
                ).format(sql.Identifier(TRIGGER), key.table_sql, sql.SQL(f"{SCHEMA}.capture"),
                         sql.Literal(name), sql.Literal(key.column)))
                done.append(f"trigger {TRIGGER} on {key.qualified} (primary key {key.column}, tenant {tenant},"
                            f" collection {name})")
    return done


class OutboxSource:
    """Publishes the outbox's row changes; runs on one worker at a time, resumes from what is left in the outbox."""

    exclusive = True

    def __init__(self, url: str, tables: Mapping[str, str], *, name: str = "postgres", poll: float = POLL,
                 batch: int = BATCH) -> None:
        self.url = url
        self.tables = dict(tables)
        self.name = name
        self.poll = poll
        self.batch = batch
        self._unfit: set[str] = set()

    async def run(self, publisher: Publisher) -> None:
        backoff = 0.5
        down = False
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(self.url, autocommit=True,
                                                                 connect_timeout=CONNECT_TIMEOUT) as conn:
                    await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(CHANNEL)))
                    await conn.execute(f"INSERT INTO {SCHEMA}.cursor (name) VALUES (%s) ON CONFLICT DO NOTHING",
                                       [self.name])
                    if down:
                        logger.info("postgres source %s: connected again", self.name)
                    down, backoff = False, 0.5
                    while True:
                        await self._drain(conn, publisher)
                        # Woken by a notification, or after ``poll`` seconds whatever happened.
                        async for _ in conn.notifies(timeout=self.poll, stop_after=1):
                            pass
            except psycopg.OperationalError as exc:
                raise_if_cancelled()
                if not down:
                    logger.warning("postgres source %s: the database is unreachable (%s); retrying", self.name,
                                   str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
                down = True
            except (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedFunction) as exc:
                self._once("install", "postgres source %s: the outbox is not installed (%s); run `mcp-broker "
                           "postgres install`", self.name, str(exc).strip().splitlines()[0])
                backoff = MAX_BACKOFF
            except (PublishRefused, BackendUnavailable) as exc:
                # Not published: the batch stays in the outbox and is tried again.
                logger.warning("postgres source %s: the change log refused a change (%s); trying again", self.name, exc)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF)

    async def _drain(self, conn: psycopg.AsyncConnection[Any], publisher: Publisher) -> None:
        """Publish and delete what the outbox holds, batch by batch, until it is empty."""
        while True:
            async with conn.transaction():
                # The cursor row's lock: a second copy of the source (a lease handover) waits here.
                await conn.execute(f"SELECT last_id FROM {SCHEMA}.cursor WHERE name = %s FOR UPDATE", [self.name])
                rows = await (await conn.execute(f"SELECT id, tbl, pk, op FROM {SCHEMA}.outbox ORDER BY id LIMIT %s",
                                                 [self.batch])).fetchall()
                if not rows:
                    return
                for _, table, pk, op in rows:
                    await self._publish(publisher, table, pk, op)
                ids = [row[0] for row in rows]
                await conn.execute(f"UPDATE {SCHEMA}.cursor SET last_id = greatest(last_id, %s) WHERE name = %s",
                                   [max(ids), self.name])
                await conn.execute(f"DELETE FROM {SCHEMA}.outbox WHERE id = ANY(%s)", [ids])
            if len(rows) < self.batch:
                return

    async def _publish(self, publisher: Publisher, table: str, pk: str | None, op: str) -> None:
        tenant = self.tables.get(table)
        if tenant is None:  # a table no longer configured: nobody can watch its rows here
            self._once(f"table:{table}", "postgres source %s: outbox rows of table %r, which is not configured, "
                       "are dropped", self.name, table)
            return
        kind = _KINDS.get(op, ChangeKind.UPDATED)
        if pk is not None and valid_name(pk):
            uri = record_uri(tenant, table, pk)
        else:
            # A key that is not a record name (``[A-Za-z0-9_.~-]{1,128}``): its table's subscribers are told.
            self._once(f"key:{table}", "postgres source %s: table %r has primary keys that are not record names "
                       "(%r); their changes are published for the table's collection URI only", self.name, table, pk)
            uri, kind = collection_uri(tenant, table), ChangeKind.UPDATED
        try:
            await publisher.publish(uri, kind, tenant=tenant, source="postgres")
        except InvalidChange as exc:  # cannot be delivered as given, now or ever
            logger.error("postgres source %s: the change of %s was refused and is dropped: %s", self.name, uri, exc)

    def _once(self, key: str, message: str, *args: object) -> None:
        if key not in self._unfit:
            self._unfit.add(key)
            logger.warning(message, *args)
