"""PostgreSQL tables as resources: each row ``mcpb://<tenant>/<table>/<pk>``, each table its collection.

``MCP_BROKER_POSTGRES_URL`` names the database, ``MCP_BROKER_POSTGRES_TABLES`` maps each table
(``schema.table`` or ``table``, as written unquoted in SQL) to the tenant whose records its rows
are. The configured name is the collection name of the URIs, so it must be a record name
(``[A-Za-z0-9_.~-]{1,128}``). ``mcp-broker postgres install`` creates the outbox and the triggers
(``broker/sources/outbox.py``); the change source publishes what they capture, the provider here reads
rows (``row_to_json``) and pages of primary keys. Rows whose primary key is not a record name
cannot be addressed; their changes notify the table's subscribers (docs/sources/postgres.md).

Reads run on a pool of ``postgres_pool_size`` connections, taken in turns by tenant
(``TenantTurns``), each read within ``postgres_read_timeout`` from the moment it asks for its
turn; a row larger than ``max_read_bytes`` as JSON is measured and refused in the database.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Mapping
from typing import Any, Final

import orjson
import psycopg
from psycopg import sql
from psycopg_pool import AsyncConnectionPool

from broker.auth import Principal
from broker.config import Settings
from broker.errors import AnswerTooLarge, BackendUnavailable, NotFound
from broker.sources import Extension
from broker.sources.outbox import CONNECT_TIMEOUT, OutboxSource, TableKey, install, table_key
from broker.tenants import tenant_problem
from broker.uris import SCHEME, collection_uri, parse_record_uri, record_uri, valid_name

__all__ = ["PostgresProvider", "build", "install"]

logger = logging.getLogger(__name__)

Json = dict[str, Any]
#: How many primary keys a read of a table's collection URI shows (in key order).
COLLECTION_READ_LIMIT: Final = 1000
#: Longest primary key, as text, a read of a collection fetches (a record name is at most 128).
KEY_BYTES: Final = 128


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
    provider = PostgresProvider(settings.postgres_url, settings.postgres_tables, pool_size=settings.postgres_pool_size,
                                read_timeout=settings.postgres_read_timeout, max_bytes=settings.max_read_bytes)
    return Extension(providers=[provider], sources=[OutboxSource(settings.postgres_url, settings.postgres_tables)])


class TenantTurns:
    """``size`` places, taken in turns by tenants, so one tenant's flood of reads delays another's
    by one read at most, not by the whole queue.

    A tenant holds at most ``size - 1`` places (all of them when ``size`` is 1), so with one tenant
    flooding a place stays free for the others. A freed place goes to the tenants waiting, round
    robin: the one served moves to the back of the turn, whatever number of reads it has queued.
    """

    def __init__(self, size: int) -> None:
        self.free = size
        self.cap = max(1, size - 1)
        self.held: dict[str, int] = {}
        #: Each waiting tenant's requests, in order; the dict's order is the turn.
        self.waiting: dict[str, deque[asyncio.Future[None]]] = {}

    async def acquire(self, tenant: str) -> None:
        """Wait for a place (cancel the wait to give up); ``release`` it after."""
        turn = asyncio.get_running_loop().create_future()
        self.waiting.setdefault(tenant, deque()).append(turn)
        self._grant()
        try:
            await turn
        except BaseException:
            if turn.done() and not turn.cancelled():
                self.release(tenant)  # granted as the wait ended: give it on
            else:
                queue = self.waiting.get(tenant)
                if queue is not None and turn in queue:
                    queue.remove(turn)
                    if not queue:
                        del self.waiting[tenant]
            raise

    def release(self, tenant: str) -> None:
        self.held[tenant] -= 1
        if not self.held[tenant]:
            del self.held[tenant]
        self.free += 1
        self._grant()

    def _grant(self) -> None:
        while self.free:
            tenant = next((t for t in self.waiting if self.held.get(t, 0) < self.cap), None)
            if tenant is None:
                return
            queue = self.waiting.pop(tenant)
            turn = queue.popleft()
            if queue:
                self.waiting[tenant] = queue  # to the back of the turn
            if turn.done():  # cancelled, its waiter not resumed yet
                continue
            self.free -= 1
            self.held[tenant] = self.held.get(tenant, 0) + 1
            turn.set_result(None)


class PostgresProvider:
    """Serves the rows of the configured tables to principals of each table's tenant.

    A pool of ``pool_size`` connections (autocommit, opened as reads need them, from the first
    one on) taken in turns by tenant (``TenantTurns``): with one connection shared under a lock,
    another tenant's read of a small row went from 5 ms to 6 s while one tenant read 8 MiB rows
    in a loop. Each read's deadline (``read_timeout``) runs from when it asks for its turn, so
    waiting counts; a read past it is answered as unavailable (503). Reads are awaited on the
    event loop (psycopg's async API), none blocking it.
    """

    def __init__(self, url: str, tables: Mapping[str, str], *, pool_size: int = 4, read_timeout: float = 10.0,
                 max_bytes: int = 16_777_216) -> None:
        self.url = url
        self.tables = dict(tables)
        self.read_timeout = read_timeout
        self.max_bytes = max_bytes
        self.turns = TenantTurns(pool_size)
        self._pool = AsyncConnectionPool(url, min_size=0, max_size=pool_size, open=False, name="postgres-reads",
                                         kwargs={"autocommit": True, "connect_timeout": CONNECT_TIMEOUT})
        self._opened = False
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
            # A key too long to be a record name is left out below anyway: it is not fetched.
            keys = await self._query(tenant, table, "SELECT CASE WHEN octet_length({pk}::text) <= %s "
                                     "THEN {pk}::text END FROM {table} ORDER BY {pk} LIMIT %s",
                                     [KEY_BYTES, COLLECTION_READ_LIMIT + 1])
            body: Json = {"collection": table,
                          "records": [record_uri(tenant, table, key) for (key,) in keys[:COLLECTION_READ_LIMIT]
                                      if key is not None and valid_name(key)],
                          "truncated": len(keys) > COLLECTION_READ_LIMIT}
            return [{"uri": uri, "mimeType": "application/json", "text": orjson.dumps(body).decode()}]
        # Measured in the database: a row larger than the bound as JSON never reaches the worker (its
        # answer could only be larger: the JSON is a string inside it).
        query = ("SELECT r.k, octet_length(r.j), CASE WHEN octet_length(r.j) <= %s THEN r.j END "
                 "FROM (SELECT t.{pk}::text AS k, row_to_json(t)::text AS j FROM {table} t WHERE t.{pk} = %s) r")
        try:
            rows = await self._query(tenant, table, query, [self.max_bytes, pk])
        except psycopg.DataError:  # not a value of the key's type ('abc' for an integer key): no such row
            raise NotFound(uri) from None
        if not rows or rows[0][0] != pk:
            raise NotFound(uri)
        if rows[0][2] is None:
            raise AnswerTooLarge(uri, self.max_bytes)
        return [{"uri": uri, "mimeType": "application/json", "text": rows[0][2]}]

    async def _query(self, tenant: str, table: str, query: str, params: list[Any]) -> list[tuple[Any, ...]]:
        """Run ``query`` (``{table}``, ``{pk}`` filled in) in the tenant's turn on a pooled connection, all
        within ``read_timeout``; after a lost connection the pool checks its idle ones and the read runs
        once more."""
        try:
            async with asyncio.timeout(self.read_timeout):
                await self.turns.acquire(tenant)
                try:
                    return await self._run(table, query, params)
                finally:
                    self.turns.release(tenant)
        except TimeoutError as exc:
            raise BackendUnavailable(f"PostgreSQL: no answer within {self.read_timeout} s") from exc

    async def _run(self, table: str, query: str, params: list[Any]) -> list[tuple[Any, ...]]:
        if not self._opened:
            self._opened = True
            await self._pool.open()
        for attempt in (1, 2):
            try:
                async with self._pool.connection() as conn:
                    key = self._keys.get(table)
                    if key is None:
                        key = self._keys[table] = await table_key(conn, table)
                    statement = sql.SQL(query).format(table=key.table_sql, pk=sql.Identifier(key.column))
                    return await (await conn.execute(statement, params)).fetchall()
            except psycopg.OperationalError as exc:  # the pool's own timeout is one too
                self._keys.clear()
                if attempt == 2:
                    raise BackendUnavailable(f"PostgreSQL: {exc}") from exc
                await self._pool.check()  # a restart broke every idle connection, not only this one
            except (ValueError, psycopg.ProgrammingError) as exc:  # the table is gone, or its key changed
                self._keys.pop(table, None)
                logger.warning("postgres provider: %s", exc)
                raise BackendUnavailable(f"PostgreSQL: {exc}") from exc
        raise AssertionError("unreachable")

    async def aclose(self) -> None:
        """Close the pool's connections (the broker calls a provider's ``aclose`` as it stops)."""
        if self._opened:
            await self._pool.close()

    def templates(self, principal: Principal) -> list[Json]:
        base = f"{SCHEME}://{principal.tenant}"
        return [{"uriTemplate": f"{base}/{table}/{{id}}", "name": f"row of {table}",
                 "title": f"A row of PostgreSQL table {table}", "mimeType": "application/json"}
                for table, tenant in sorted(self.tables.items()) if tenant == principal.tenant]
