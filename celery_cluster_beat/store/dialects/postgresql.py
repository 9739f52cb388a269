"""PostgreSQL: array parameters and plans that statistics cannot turn.

Bursts of thousands of claims are where PostgreSQL needs help: one bind
parameter per value is slow to bind and to plan, and a join against the keys
is planned from statistics that are wrong right after a burst. So rows and
keys travel as one array parameter per column, unnested on the server, and
keyed statements look each key up through the primary key in a shape whose
plan cannot go wrong (and, for updates, that stays exact when another
transaction updates the row meanwhile). The stale-row sweep locks what it reads (FOR UPDATE
SKIP LOCKED), because PostgreSQL re-checks only part of a concurrent UPDATE.
"""
from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Sequence

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import URL, Connection

from ...schedules.instants import UTC
from ...schedules.occurrence import Occurrence
from ..schema import CLAIM_KEY, claims_table
from ..types import UTCDateTime, naive_utc
from .base import CHUNK, KEY_COLUMNS, ClaimValues, Dialect, Key, KeyedUpdate, chunks, is_instant, new_token
from .base import unless_in_query


def _unnest(table: sa.Table, cols: Sequence[str], rows: Sequence[Key]) -> Any:
    """unnest() of one array parameter per column: *rows* as a table.

    A few array parameters instead of one parameter per value: psycopg
    binds them and the server parses and plans them far faster.
    """
    params = []
    columns = []
    for i, col in enumerate(cols):
        col_type = table.c[col].type
        values = [r[i] for r in rows]
        item_type: sa.types.TypeEngine[Any]
        if isinstance(col_type, UTCDateTime):
            values = [None if v is None else naive_utc(v) for v in values]
            item_type = sa.DateTime()
        elif isinstance(col_type, sa.Boolean):
            item_type = sa.Boolean()
        elif isinstance(col_type, sa.Float):
            item_type = sa.Float()
        elif isinstance(col_type, sa.Integer):
            item_type = sa.BigInteger()
        elif isinstance(col_type, sa.Text):
            item_type = sa.Text()
        else:
            item_type = sa.String()
        params.append(sa.bindparam(f"k_{col}", values, type_=postgresql.ARRAY(item_type)))
        columns.append(sa.column(col, item_type))
    return sa.func.unnest(*params).table_valued(*columns).render_derived(name="k")


def _item_type(col_type: sa.types.TypeEngine[Any]) -> sa.types.TypeEngine[Any]:
    if isinstance(col_type, UTCDateTime):
        return sa.DateTime()
    for kind in (sa.Boolean, sa.Float, sa.Text):
        if isinstance(col_type, kind):
            return kind()
    if isinstance(col_type, sa.Integer):
        return sa.BigInteger()
    return sa.String()


def _json_value(value: Any) -> Any:
    return naive_utc(value).isoformat() if isinstance(value, datetime) else value


def _json_rows(cols: Sequence[str], rows: Sequence[Key]) -> str | None:
    """*rows* as one JSON array of objects, or None when a value has no exact JSON form."""
    try:
        return json.dumps([{col: _json_value(v) for col, v in zip(cols, row)} for row in rows],
                          separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError):  # NaN or infinity, or a type JSON lacks: bind arrays instead
        return None


def _recordset(table: sa.Table, cols: Sequence[str], rows: Sequence[Key]) -> Any:
    """*rows* as a table: json_to_recordset() of one JSON parameter.

    The standard library's C encoder writes a thousand rows in well under a millisecond,
    where psycopg binds an array parameter by quoting each element in Python: this takes
    about a third off the client's CPU of a claim or a 'sent' mark. Values without an
    exact JSON form (a NaN) fall back to :func:`_unnest`.
    """
    doc = _json_rows(cols, rows)
    if doc is None:
        return _unnest(table, cols, rows)
    columns = [sa.column(col, _item_type(table.c[col].type)) for col in cols]
    param = sa.cast(sa.bindparam("k_rows", doc, type_=sa.Text()), postgresql.JSON)
    return sa.func.json_to_recordset(param).table_valued(*columns).render_derived(name="k", with_types=True)


class PostgreSQLDialect(Dialect):
    def engine_options(self, url: URL, timeout: float) -> dict[str, Any]:
        base = super().engine_options(url, timeout)
        # The kernel's bounds, for a server whose packets are lost (a partition, a dead host):
        # unacknowledged data fails the connection after the bound, and keepalive probes find a
        # dead peer of an idle pooled connection. (A path that accepts and never answers is the
        # client watchdog's: see ..deadline.)
        return {"connect_args": {**base["connect_args"], **unless_in_query(
            url, keepalives=1, keepalives_idle=max(1, int(timeout)), keepalives_interval=max(1, int(timeout / 3)),
            keepalives_count=3, tcp_user_timeout=int(timeout * 1000))}}

    def session_sql(self, lock_timeout: float, statement_timeout: float) -> list[str]:
        ms = int(lock_timeout * 1000)
        return [
            f"SET lock_timeout = {ms}",
            # The server's own bound on a statement, inside the client's: a slow one is cancelled
            # (the connection stays usable) before the watchdog has to cut the connection.
            f"SET statement_timeout = {max(1, int(statement_timeout * 1000))}",
            # A node frozen inside a transaction (SIGSTOP, a VM pause) would hold the leader
            # row's lock: the server ends such a session, so its successor is not held up.
            f"SET idle_in_transaction_session_timeout = {max(ms * 2, 1000)}",
        ]

    def refresh_statistics(self, conn: Connection, table: sa.Table) -> None:
        # Until autovacuum's analyse runs, a table that grew from empty is planned as tiny:
        # lookups by name scan it whole, and each bulk load gets slower than the last.
        conn.exec_driver_sql(f"ANALYZE {table.name}")

    def db_now(self, conn: Connection) -> datetime:
        # clock_timestamp(), not now(): the time of this read, not of the transaction's start.
        value = conn.exec_driver_sql("SELECT timezone('UTC', clock_timestamp())").scalar_one()
        return value.replace(tzinfo=UTC)

    def statement_timeout_sql(self, seconds: float) -> tuple[str, str | None] | None:
        return f"SET LOCAL statement_timeout = {int(seconds * 1000)}", None  # ends with the transaction

    def insert(self, table: sa.Table) -> Any:
        return postgresql.insert(table)

    def insert_claims(self, conn: Connection, ordered: Sequence[Occurrence], shared: ClaimValues) -> set[Key]:
        # INSERT ... SELECT FROM unnest(arrays): three array parameters per
        # chunk instead of ten per row, which psycopg binds and the server
        # plans several times faster.
        c = claims_table
        token = shared.token
        won: set[Key] = set()
        for chunk in chunks(ordered, CHUNK):
            k = _recordset(c, (*CLAIM_KEY, "task_id"), [(o.schedule, o.at, o.task_id) for o in chunk])
            select = sa.select(
                k.c.schedule,
                k.c.scheduled_at,
                sa.literal(shared.claimed_at, UTCDateTime()),
                sa.literal(shared.node, sa.String()),
                sa.literal(shared.term, sa.BigInteger()),
                k.c.task_id,
                sa.literal(shared.status, sa.String()),
                sa.literal(shared.reason, sa.Text()),
                sa.literal(0, sa.Integer()),
                sa.literal(token, sa.String()),
            )
            stmt = (
                postgresql.insert(c)
                .from_select(
                    [*CLAIM_KEY, "claimed_at", "node", "term", "task_id", "status", "reason", "attempts", "op_token"],
                    select,
                )
                .on_conflict_do_nothing(index_elements=list(CLAIM_KEY))
                .returning(*KEY_COLUMNS)
            )
            won.update((r[0], r[1]) for r in conn.execute(stmt))
        return won

    def insert_names(self, conn: Connection, table: sa.Table, names: Sequence[str], now: datetime) -> None:
        # One INSERT ... SELECT FROM json_to_recordset() per 10,000 names, the instant bound once.
        for chunk in chunks(list(names), 10 * CHUNK):
            k = _recordset(table, ["name"], [(name,) for name in chunk])
            at = sa.literal(now, UTCDateTime())
            conn.execute(postgresql.insert(table).from_select(["name", "registered_at", "updated_at"],
                                                               sa.select(k.c.name, at, at))
                         .on_conflict_do_nothing(index_elements=["name"]))

    def upsert_source(self, table: sa.Table, rows: list[dict[str, Any]]) -> tuple[Any, Any]:
        # One INSERT ... SELECT FROM json_to_recordset() instead of a row each.
        cols = list(rows[0])
        k = _recordset(table, cols, [tuple(r[col] for col in cols) for r in rows])
        return postgresql.insert(table).from_select(cols, sa.select(*(k.c[col] for col in cols))), None

    def update_by_keys(self, conn: Connection, update: KeyedUpdate) -> list[Any]:
        # UPDATE ... FROM json_to_recordset() joined on every key column, the *where* values
        # travelling as columns of each key row: the claim table then has no condition of its
        # own, so the planner can only drive the join from the keys, one primary-key probe
        # each (a condition like status = 'claimed' alone would be estimated from statistics
        # that are wrong right after a burst, and the join turned round). And it stays exact
        # when another transaction updates a row meanwhile (the worker's ledger writes run_*
        # on purpose while beat marks the row): PostgreSQL re-checks the join, which holds on
        # the row's newest version as long as its key, node and status do. A ctid-driven
        # UPDATE (key_match) would skip that row, its newest version having another ctid.
        c = claims_table
        where = list(update.where)
        cols = [*update.cols, *where]
        k = _recordset(c, cols, [(*key, *update.where.values()) for key in update.keys])
        values: dict[str, Any] = dict(update.values, op_token=new_token())
        for col in update.increment:
            values[col] = c.c[col] + 1
        stmt = (
            sa.update(c)
            .where(*(c.c[col] == k.c[col] for col in cols))
            .values(values)
            .returning(*update.returning)
        )
        return list(conn.execute(stmt))

    def key_match(self, cols: Sequence[str], keys: Sequence[Key]) -> list[Any]:
        # For reads and deletes (UPDATEs: update_by_keys above). The keys (one JSON
        # parameter) become rows and each key is looked up through the
        # primary key in a LATERAL subquery fenced with OFFSET 0 (the only
        # index its conditions can use is the primary key); the row ids found
        # drive a TID scan. A row another transaction changes meanwhile has a
        # new ctid and is left out: harmless for a read (its snapshot) and for
        # pruning (the next pass). (Why not an IN list or a plain join: see
        # the comment above Dialect.key_match.)
        c = claims_table
        doc = _json_rows(cols, keys)
        if doc is None:  # keys are names and aware instants; anything else is a bug, never "no rows"
            raise TypeError(f"claim keys without an exact JSON form: {list(keys)[:3]!r}")
        types = ", ".join(f"{col} {'TIMESTAMP WITHOUT TIME ZONE' if is_instant(col) else 'VARCHAR'}" for col in cols)
        match = " AND ".join(f"c2.{col} = k.{col}" for col in cols)
        return [
            sa.text(
                f"{c.name}.ctid = ANY(ARRAY("
                f"SELECT x.tid FROM json_to_recordset(CAST(:k_rows AS JSON)) AS k({types}) "
                f"CROSS JOIN LATERAL (SELECT c2.ctid AS tid FROM {c.name} AS c2 WHERE {match} OFFSET 0) AS x))"
            ).bindparams(sa.bindparam("k_rows", doc, type_=sa.Text()))
        ]

    def lock_stale(self, query: sa.Select[Any]) -> sa.Select[Any]:
        # Locking the stale rows as they are read (skipping those another
        # sweeper holds) keeps sweepers from queueing on each other's rows; the
        # UPDATE's re-check of its join (update_by_keys) keeps the adoption
        # exact anyway. MySQL's join re-reads the locked row in full, and
        # SQLite writers are serialized already, so they need no lock here.
        return query.with_for_update(skip_locked=True, of=claims_table)
