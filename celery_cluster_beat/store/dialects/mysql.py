"""MySQL and MariaDB: exact answers without RETURNING, byte-exact names.

The MySQL family cannot say which rows an INSERT or UPDATE wrote, so every
write stamps its rows with a random ``op_token`` and, only when the
affected-rows count leaves it open, selects them back by token in the same
transaction. Keyed statements are hand-built (a UNION ALL derived table joined
on the primary key) because the servers plan a long IN list quadratically,
and they must spell the driver's placeholder and the name collation out
themselves. This module also owns the session settings (READ COMMITTED,
lock wait timeout) and the check for PAD SPACE collations, which would make
"a" and "a " one schedule.
"""
from __future__ import annotations

import math
from datetime import datetime
from typing import Any, Sequence

import sqlalchemy as sa
from sqlalchemy.dialects import mysql
from sqlalchemy.engine import URL, Connection

from ...schedules.instants import UTC
from ...schedules.occurrence import Occurrence
from ..schema import CLAIM_KEY, ClaimStatus, claims_table
from ..types import UTCDateTime, name_collation, naive_utc
from .base import CHUNK, ClaimValues, Dialect, Key, KeyedUpdate, Merge, chunks, claim_key, is_instant, new_token
from .base import unless_in_query


def _db_value(value: Any) -> Any:
    """*value* as the driver gets it in hand-built SQL: datetimes naive UTC."""
    return naive_utc(value) if isinstance(value, datetime) else value


class MySQLDialect(Dialect):
    #: The driver's positional placeholder, for hand-built statements.
    placeholder = "%s"
    #: The name columns' collation, for comparing keys like the columns do.
    collation = ""
    #: The collation ignores trailing spaces (see :meth:`check_name`).
    pad_space = False

    def engine_options(self, url: URL, timeout: float) -> dict[str, Any]:
        base = super().engine_options(url, timeout)
        # PyMySQL waits for a reply for ever by default: a server that accepts and never
        # answers would hold beat (even its SIGTERM) inside a connect or a statement. The
        # watchdog (..deadline) cuts a call at the bound; these per-read limits (the server's
        # greeting included) are the bound where it cannot see the socket: while connecting,
        # or with a driver that does not show it. Whole seconds: mysqlclient takes integers only.
        io = max(1, math.ceil(timeout))
        return {
            **base,
            # Fewer gap locks than REPEATABLE READ, so concurrent
            # insert-if-absent of overlapping keys queues instead of deadlocking.
            "isolation_level": "READ COMMITTED",
            "pool_recycle": 3600,  # below the usual wait_timeout
            "connect_args": {**base.get("connect_args", {}),
                             **unless_in_query(url, read_timeout=io, write_timeout=io)},
        }

    def session_sql(self, lock_timeout: float, statement_timeout: float) -> list[str]:
        # Whole seconds, at least one: the server's granularity. (The MySQL family has no
        # idle-in-transaction limit; a frozen session's locks go with its connection.)
        # MariaDB also bounds every statement (max_statement_time, inside the client's bound),
        # in a comment only MariaDB executes; MySQL's max_execution_time bounds SELECTs only
        # and has no such comment, so there the client's bound is the only one.
        return [f"SET SESSION innodb_lock_wait_timeout = {max(1, int(round(lock_timeout)))}"
                f" /*M!100108 , max_statement_time = {statement_timeout:.3f} */"]

    def db_now(self, conn: Connection) -> datetime:
        return conn.exec_driver_sql("SELECT UTC_TIMESTAMP(6)").scalar_one().replace(tzinfo=UTC)

    def statement_timeout_sql(self, seconds: float) -> tuple[str, str | None] | None:
        # MariaDB's per-session limit (seconds), reset after use: the connection goes back to
        # the pool. MySQL's max_execution_time covers SELECTs only.
        if not self.mariadb:
            return None
        # Back to the session's own bound (session_sql) afterwards, not to none.
        return (f"SET SESSION max_statement_time = {seconds:g}",
                f"SET SESSION max_statement_time = {self.statement_timeout:.3f}")

    #: The server is MariaDB (it has max_statement_time).
    mariadb = False

    def learn(self, dialect: sa.engine.Dialect) -> None:
        self.mariadb = bool(getattr(dialect, "is_mariadb", False))
        # No UPDATE ... RETURNING in the MySQL family (nor INSERT ...
        # RETURNING in MySQL): affected-row counts and op_token tell which
        # rows a statement wrote instead.
        self.returning = False
        # Hand-built statements (see join) use the driver's own
        # placeholder: "?" for MariaDB Connector/Python.
        self.placeholder = "?" if dialect.paramstyle == "qmark" else "%s"
        self.collation = name_collation(dialect)
        self.pad_space = self.collation == "utf8mb4_bin"

    def insert(self, table: sa.Table) -> Any:
        return mysql.insert(table)

    def insert_if_absent(
        self, conn: Connection, table: sa.Table, rows: list[dict[str, Any]], key: Sequence[str]
    ) -> None:
        # A no-op ON DUPLICATE KEY UPDATE rather than INSERT IGNORE:
        # IGNORE also turns real errors (truncation, bad values) into
        # warnings, which would hide bugs as "already claimed".
        conn.execute(mysql.insert(table).on_duplicate_key_update({key[0]: table.c[key[0]]}), rows)

    def insert_claims(self, conn: Connection, ordered: Sequence[Occurrence], shared: ClaimValues) -> set[Key]:
        c = claims_table
        token = shared.token
        won: set[Key] = set()
        # The values shared by every row travel once, as session
        # variables, so each row binds only its own three: the driver
        # escapes a third as many values.
        ph = self.placeholder
        conn.exec_driver_sql(
            f"SET @ccb_claimed_at = {ph}, @ccb_node = {ph}, @ccb_term = {ph}, "
            f"@ccb_status = {ph}, @ccb_reason = {ph}, @ccb_token = {ph}",
            (naive_utc(shared.claimed_at), shared.node, shared.term, shared.status, shared.reason, token),
        )
        row = f"({ph}, {ph}, @ccb_claimed_at, @ccb_node, @ccb_term, {ph}, @ccb_status, @ccb_reason, 0, @ccb_token)"
        head = (
            f"INSERT IGNORE INTO {c.name} (schedule, scheduled_at, claimed_at, node, term, task_id, "
            "status, reason, attempts, op_token) VALUES "
        )
        for chunk in chunks(ordered, CHUNK):
            params = [v for o in chunk for v in (o.schedule, naive_utc(o.at), o.task_id)]
            # INSERT IGNORE, because its affected-rows count is exactly
            # the number of rows inserted (ON DUPLICATE KEY UPDATE counts
            # a duplicate too): when a chunk was all new or all taken we
            # know which rows we won without selecting them. IGNORE also
            # downgrades data errors to warnings; ClaimStore._validate()
            # rules those out before we get here.
            result = conn.exec_driver_sql(head + ", ".join([row] * len(chunk)), tuple(params))
            if result.rowcount == len(chunk):
                won.update(claim_key(occ) for occ in chunk)
            elif result.rowcount:
                # Another node won some of the chunk meanwhile: ask which rows are ours.
                won.update(self.keys_written(conn, token, chunk))
        return won

    def upsert(self, conn: Connection, table: sa.Table, rows: list[dict[str, Any]], key: str, merge: Merge) -> None:
        stmt = mysql.insert(table)
        # A list, not a dict: MySQL evaluates the assignments in this order (see Merge.forward).
        conn.execute(stmt.on_duplicate_key_update(list(merge.changes(table, stmt.inserted).items())), rows)

    # Keyed statements: a UNION ALL derived table joined on the primary key
    # (eq_ref); UPDATE/DELETE re-read the latest row version when locking.
    # (Why not an IN list: see the comment above Dialect.key_match.)

    def join(self, cols: Sequence[str], keys: Sequence[Key]) -> tuple[str, list[Any]]:
        """``cluster_beat_claims AS c JOIN (<keys>) AS k ON ...`` and its parameters."""
        ph = self.placeholder
        exprs = [
            # Compare names byte for byte like the column does; pin the
            # charset too so a non-utf8mb4 connection cannot break COLLATE.
            f"CONVERT({ph} USING utf8mb4) COLLATE {self.collation}" if not is_instant(col)
            else f"CAST({ph} AS DATETIME(6))"
            for col in cols
        ]
        first = "SELECT " + ", ".join(f"{e} AS {col}" for e, col in zip(exprs, cols))
        rest = "SELECT " + ", ".join(exprs)
        derived = " UNION ALL ".join([first] + [rest] * (len(keys) - 1))
        on = " AND ".join(f"c.{col} = k.{col}" for col in cols)
        params = [_db_value(v) for key in keys for v in key]
        return f"{claims_table.name} AS c JOIN ({derived}) AS k ON {on}", params

    def token_rows(
        self, conn: Connection, token: str, keys: Sequence[Key], columns: Sequence[sa.Column[Any]]
    ) -> list[Key]:
        join, params = self.join(CLAIM_KEY, keys)
        params.append(token)
        result = conn.exec_driver_sql(
            f"SELECT {', '.join('c.' + col.name for col in columns)} FROM {join} WHERE c.op_token = {self.placeholder}",
            tuple(params),
        )
        aware = [isinstance(col.type, UTCDateTime) for col in columns]
        return [
            tuple(v.replace(tzinfo=UTC) if a and v is not None else v for v, a in zip(row, aware))
            for row in result
        ]

    def update_by_keys(self, conn: Connection, update: KeyedUpdate) -> list[Any]:
        token = new_token()
        join, params = self.join(update.cols, update.keys)
        ph = self.placeholder
        sets = [f"c.{col} = {ph}" for col in update.values] + [f"c.{col} = c.{col} + 1" for col in update.increment]
        sets.append(f"c.op_token = {ph}")
        conds = [f"c.{col} = {ph}" for col in update.where]
        params += [_db_value(v) for v in update.values.values()]
        params.append(token)
        params += list(update.where.values())
        sql = f"UPDATE {join} SET {', '.join(sets)}"
        if conds:
            sql += " WHERE " + " AND ".join(conds)
        result = conn.exec_driver_sql(sql, tuple(params))
        # Affected rows count matched rows here (SQLAlchemy connects with
        # CLIENT_FOUND_ROWS): all keys matched, or none did, is exact.
        if result.rowcount == len(update.keys):
            return list(update.expected)
        if result.rowcount == 0:
            return []
        return self.changed_rows(conn, token, update.keys, update.returning)

    def delete_finished(self, conn: Connection, keys: Sequence[Key]) -> int:
        join, params = self.join(CLAIM_KEY, keys)
        result = conn.exec_driver_sql(
            f"DELETE c FROM {join} WHERE c.status <> '{ClaimStatus.CLAIMED.value}'", tuple(params)
        )
        return max(result.rowcount, 0)

    def check_name(self, name: str) -> None:
        if self.pad_space and name.endswith(" "):
            raise ValueError(
                f"schedule name {name!r} ends with a space, which this MySQL server's "
                "collation ignores (it would share claims with the name without it)"
            )
