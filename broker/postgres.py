"""PostgreSQL tables as resources: each row ``mcpb://<tenant>/<table>/<pk>``, each table its collection.

``MCP_BROKER_POSTGRES_URL`` names the database, ``MCP_BROKER_POSTGRES_TABLES`` maps each table
(``schema.table`` or ``table``, as written unquoted in SQL) to the tenant whose records its rows
are. The configured name is the collection name of the URIs, so it must be a record name
(``[A-Za-z0-9_.~-]{1,128}``). ``mcp-broker postgres install`` creates the outbox and the triggers
(``broker/outbox.py``); the change source publishes what they capture, the provider here reads
rows (``row_to_json``) and pages of primary keys. Rows whose primary key is not a record name
cannot be addressed; their changes notify the table's subscribers (docs/sources/postgres.md).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any, Final

import orjson
import psycopg
from psycopg import sql

from broker.auth import Principal
from broker.config import Settings
from broker.errors import BackendUnavailable, NotFound
from broker.outbox import CONNECT_TIMEOUT, OutboxSource, TableKey, install, table_key
from broker.sources import Extension
from broker.tenants import tenant_problem
from broker.uris import SCHEME, collection_uri, parse_record_uri, record_uri, valid_name

__all__ = ["PostgresProvider", "build", "install"]

logger = logging.getLogger(__name__)

Json = dict[str, Any]
#: How many primary keys a read of a table's collection URI shows (in key order).
COLLECTION_READ_LIMIT: Final = 1000
#: Seconds one read may take, connecting included, before it is answered as unavailable.
READ_TIMEOUT: Final = 10.0


def check_tables(tables: Mapping[str, str]) -> None:
    """Raises ValueError when a configured table or tenant cannot appear in a record URI."""
    if not tables:
        raise ValueError("MCP_BROKER_POSTGRES_TABLES: no tables; write a JSON map of table to tenant, "
                         'e.g. \'{"public.items": "acme"}\'')
    for table, tenant in tables.items():
        if not valid_name(table):
            raise ValueError(f"MCP_BROKER_POSTGRES_TABLES: {table!r} cannot be a collection name "
                             "(letters, digits, _ . ~ - only, 1-128 long)")
        if (problem := tenant_problem(tenant)) is not None:
            raise ValueError(f"MCP_BROKER_POSTGRES_TABLES: table {table!r}: {problem}")


def build(settings: Settings) -> Extension:
    """The provider and the change source of ``settings.postgres_tables`` in ``settings.postgres_url``."""
    check_tables(settings.postgres_tables)
    return Extension(providers=[PostgresProvider(settings.postgres_url, settings.postgres_tables)],
                     sources=[OutboxSource(settings.postgres_url, settings.postgres_tables)])


class PostgresProvider:
    """Serves the rows of the configured tables to principals of each table's tenant.

    One connection (autocommit), opened at the first read and again after it broke; reads take
    turns on it under a lock, each awaited on the event loop (psycopg's async API), none blocking it.
    """

    def __init__(self, url: str, tables: Mapping[str, str]) -> None:
        self.url = url
        self.tables = dict(tables)
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._lock = asyncio.Lock()
        self._keys: dict[str, TableKey] = {}

    def _ref(self, uri: str) -> tuple[str, str, str | None] | None:
        ref = parse_record_uri(uri)
        if ref is None or self.tables.get(ref.collection) != ref.tenant:
            return None
        return ref.tenant, ref.collection, ref.record_id

    def owns(self, uri: str) -> bool:
        return uri.startswith(SCHEME + "://") and self._ref(uri) is not None

    def can_watch(self, principal: Principal, uri: str) -> bool:
        ref = self._ref(uri)
        return ref is not None and ref[0] == principal.tenant

    async def list_page(self, principal: Principal, state: str | None, limit: int) -> tuple[list[Json], str | None]:
        """The principal's tables, as collections (the configuration bounds them); rows are not listed."""
        names = sorted(table for table, tenant in self.tables.items() if tenant == principal.tenant)
        # The state comes back from a client (inside the listing's cursor): ASCII digits only.
        start = int(state) if state and state.isascii() and state.isdigit() else 0
        page = [self._collection_item(principal.tenant, name) for name in names[start:start + limit]]
        following = start + len(page)
        return page, (str(following) if following < len(names) else None)

    @staticmethod
    def _collection_item(tenant: str, name: str) -> Json:
        return {"uri": collection_uri(tenant, name), "name": name, "title": f"Table {name}",
                "description": f"The rows of PostgreSQL table {name}; notified when any of them changes.",
                "mimeType": "application/json"}

    async def read(self, principal: Principal, uri: str) -> list[Json]:
        """The row (or the table's keys) ``uri`` names.

        A row has one URI, its key as PostgreSQL prints it (``pk::text``), the one its changes are
        published under. Another spelling the key's type accepts (``01`` for 1, a UUID in upper
        case) is not found rather than read: answered, it would lead a client to subscribe to a
        URI that is never notified, and answering under the canonical URI would not stop that
        (a subscription is to the URI the client sends).
        """
        ref = self._ref(uri)
        if ref is None or ref[0] != principal.tenant:
            raise NotFound(uri)
        tenant, table, pk = ref
        if pk is None:
            keys = await self._query(table, "SELECT {pk}::text FROM {table} ORDER BY {pk} LIMIT %s",
                                     [COLLECTION_READ_LIMIT + 1])
            body: Json = {"collection": table,
                          "records": [record_uri(tenant, table, key) for (key,) in keys[:COLLECTION_READ_LIMIT]
                                      if key is not None and valid_name(key)],
                          "truncated": len(keys) > COLLECTION_READ_LIMIT}
            return [{"uri": uri, "mimeType": "application/json", "text": orjson.dumps(body).decode()}]
        try:
            rows = await self._query(table, "SELECT t.{pk}::text, row_to_json(t)::text FROM {table} t "
                                            "WHERE t.{pk} = %s", [pk])
        except psycopg.DataError:  # not a value of the key's type ('abc' for an integer key): no such row
            raise NotFound(uri) from None
        if not rows or rows[0][0] != pk:
            raise NotFound(uri)
        return [{"uri": uri, "mimeType": "application/json", "text": rows[0][1]}]

    async def _query(self, table: str, query: str, params: list[Any]) -> list[tuple[Any, ...]]:
        """Run ``query`` (``{table}``, ``{pk}`` filled in) on the shared connection; one retry on a fresh one."""
        for attempt in (1, 2):
            # The lock first, then the deadline: a read waiting its turn does not time out the one
            # in flight, and only the holder of the lock ever discards the connection it used.
            async with self._lock:
                try:
                    async with asyncio.timeout(READ_TIMEOUT):
                        conn = await self._connection()
                        key = self._keys.get(table)
                        if key is None:
                            key = self._keys[table] = await table_key(conn, table)
                        statement = sql.SQL(query).format(table=key.table_sql, pk=sql.Identifier(key.column))
                        return await (await conn.execute(statement, params)).fetchall()
                except (psycopg.OperationalError, TimeoutError) as exc:
                    await self._discard()
                    if attempt == 2:
                        raise BackendUnavailable(f"PostgreSQL: {exc}") from exc
                except (ValueError, psycopg.ProgrammingError) as exc:  # the table is gone, or its key changed
                    self._keys.pop(table, None)
                    logger.warning("postgres provider: %s", exc)
                    raise BackendUnavailable(f"PostgreSQL: {exc}") from exc
        raise AssertionError("unreachable")

    async def _connection(self) -> psycopg.AsyncConnection[Any]:
        if self._conn is None or self._conn.closed or self._conn.broken:
            self._conn = await psycopg.AsyncConnection.connect(self.url, autocommit=True,
                                                               connect_timeout=CONNECT_TIMEOUT)
        return self._conn

    async def _discard(self) -> None:
        conn, self._conn = self._conn, None
        self._keys.clear()
        if conn is not None:
            try:
                await conn.close()
            except psycopg.Error:
                pass

    def templates(self, principal: Principal) -> list[Json]:
        base = f"{SCHEME}://{principal.tenant}"
        return [{"uriTemplate": f"{base}/{table}/{{id}}", "name": f"row of {table}",
                 "title": f"A row of PostgreSQL table {table}", "mimeType": "application/json"}
                for table, tenant in sorted(self.tables.items()) if tenant == principal.tenant]
