"""SQLite: a claim file shared by the beat processes of one host.

SQLite has one writer at a time and no server to wait on locks, so what this
module owns is transaction control: WAL and a busy timeout on every
connection, and BEGIN IMMEDIATE for the transactions that will write, so that
writers queue instead of failing. It also sizes the keyed statements for old
builds' 999 bind parameters. The statements themselves are the portable ones
of :class:`.base.Dialect` (ON CONFLICT, RETURNING where the build has it, a
row-value IN, which SQLite answers with a temporary index).
"""
from __future__ import annotations

from datetime import datetime
from typing import Any, Sequence

import sqlalchemy as sa
from sqlalchemy.dialects import sqlite
from sqlalchemy.engine import URL, Connection, Engine

from .base import CHUNK, Dialect, unless_in_query

#: Execution option marking a connection whose transaction will write.
_WRITE = "ccb_write"


class SQLiteDialect(Dialect):
    def insert_names(self, conn: Connection, table: sa.Table, names: Sequence[str], now: datetime) -> None:
        # The sqlite3 module's executemany, in C, with the one instant converted once: 20,000
        # names in a few milliseconds instead of a quarter of a second of bind processing.
        # The column's own SQLite conversion: the very text SQLAlchemy stores for this instant.
        column_type = table.c.registered_at.type.dialect_impl(conn.dialect)
        convert = column_type.bind_processor(conn.dialect)
        at = convert(now) if convert else now
        conn.exec_driver_sql(f"INSERT INTO {table.name} (name, registered_at, updated_at) VALUES (?, ?, ?) "
                             "ON CONFLICT (name) DO NOTHING", [(name, at, at) for name in names])

    def engine_options(self, url: URL, timeout: float) -> dict[str, Any]:
        # A file: no server to time out on, only the other processes' locks. The sqlite3
        # module's busy timeout covers connecting (and the WAL switch below) until the
        # PRAGMA sets the session's; both stay within the call's bound.
        return {"connect_args": unless_in_query(url, timeout=timeout)}

    def install_events(self, engine: Engine, lock_timeout: float, statement_timeout: float) -> None:
        self.statement_timeout = statement_timeout
        # No statement limit in SQLite; the lock waits stay inside the call's bound.
        busy = min(lock_timeout, statement_timeout)

        @sa.event.listens_for(engine, "connect")
        def _sqlite_connect(dbapi_conn: Any, record: Any) -> None:
            # Take transaction control from the sqlite3 module (it would
            # BEGIN lazily and DEFERRED); our "begin" hook decides below.
            dbapi_conn.isolation_level = None
            cur = dbapi_conn.cursor()
            try:
                # busy_timeout first: switching to WAL needs a lock that
                # another process opening the file may hold.
                cur.execute(f"PRAGMA busy_timeout = {max(1, int(busy * 1000))}")
                # Several local beat processes share the file: WAL lets
                # readers run beside the single writer.
                cur.execute("PRAGMA journal_mode = WAL")
            finally:
                cur.close()

        @sa.event.listens_for(engine, "begin")
        def _sqlite_begin(conn: Connection) -> None:
            # Writers take the write lock up front (IMMEDIATE): two
            # DEFERRED transactions that both read then write cannot be
            # serialized and one fails with SQLITE_BUSY at once, whereas
            # IMMEDIATE ones wait for each other under busy_timeout.
            if conn.get_execution_options().get(_WRITE):
                conn.exec_driver_sql("BEGIN IMMEDIATE")
            else:
                conn.exec_driver_sql("BEGIN")

    def learn(self, dialect: sa.engine.Dialect) -> None:
        super().learn(dialect)
        # Up to 4 key columns a row (take_over_stale), some room to spare.
        limit = int(getattr(dialect, "insertmanyvalues_max_parameters", 32766))
        self.batch = max(1, min(CHUNK, (limit - 16) // 4))

    def write_options(self) -> dict[str, Any]:
        return {_WRITE: True}

    def insert(self, table: sa.Table) -> Any:
        return sqlite.insert(table)
