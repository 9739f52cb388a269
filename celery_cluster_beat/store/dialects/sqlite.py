"""SQLite: a claim file shared by the beat processes of one host.

SQLite has one writer at a time and no server to wait on locks, so what this
module owns is transaction control: WAL and a busy timeout on every
connection, and BEGIN IMMEDIATE for the transactions that will write, so that
writers queue instead of failing. It also sizes the keyed statements for old
builds' 999 bind parameters. The statements themselves are the portable ones
of :class:`.base.Dialect` (ON CONFLICT, RETURNING where the build has it, a
row-value IN, which SQLite answers with a temporary index).

And the claim file itself: :func:`create_private` makes it 0600 before SQLite opens it
(SQLite would create it 0644 less the umask, and it holds schedules' arguments and operators'
names); SQLite then gives the ``-wal`` and ``-shm`` files the database file's own mode, exactly
(it chmods them, whatever the umask), so they are 0600 too. A file that exists keeps its mode.
"""
from __future__ import annotations

import os
from datetime import datetime
from typing import Any, Optional, Sequence

import sqlalchemy as sa
from sqlalchemy.dialects import sqlite
from sqlalchemy.engine import URL, Connection, Engine

from .base import CHUNK, Dialect, unless_in_query

#: Execution option marking a connection whose transaction will write.
_WRITE = "ccb_write"
#: Mode of a claim file this package creates: the owner's alone.
FILE_MODE = 0o600


def claim_file(url: URL) -> Optional[str]:
    """The absolute path of *url*'s database file; None in memory and for a ``file:`` URI
    (``?uri=true``: its own ``mode=`` / ``modeof=`` parameters say how SQLite opens it)."""
    database = url.database
    if not database or database == ":memory:" or "uri" in url.query or database.startswith("file:"):
        return None
    return os.path.abspath(database)


def create_private(path: str) -> None:
    """Create *path* empty with mode 0600 (umask or not) unless it exists. Whatever goes wrong is
    left to SQLite, which says so when it opens the file (a missing folder, no permission)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), FILE_MODE)
    except OSError:  # it exists (another replica won the race), or SQLite will say what is wrong
        return
    try:
        os.fchmod(fd, FILE_MODE)  # the umask may have taken bits off; an empty file is a valid database
    finally:
        os.close(fd)


class SQLiteDialect(Dialect):
    #: The store is read-only (set by the engine): the file's journal mode is left as it is, since
    #: switching it writes the file.
    read_only = False

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
                if not self.read_only:
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
