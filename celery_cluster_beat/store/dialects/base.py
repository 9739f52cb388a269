"""The seam between :class:`~..claims.ClaimStore` and the SQL each server needs.

The store's guarantees (exactly the rows a call inserted or changed, a bounded
lock wait, one global lock order) are the same on every server, but the SQL
that keeps them fast and exact is not: PostgreSQL, MySQL/MariaDB and SQLite
each plan or lock some shape differently. :class:`Dialect` names every point
where they differ, so the store reads as the protocol it implements and each
server's SQL, and the reasons for it, sit in one module of its own.

What is implemented here is the portable SQLAlchemy Core shape (ON CONFLICT,
RETURNING, a row-value IN): a dialect inherits it where its server does well
with it, and overrides it where it cannot or where a plan can go wrong.
"""
from __future__ import annotations

import math
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Iterable, Iterator, NamedTuple, Sequence, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import URL, Connection, Engine

from ...schedules.instants import utcnow
from ...schedules.occurrence import Occurrence
from ..schema import CLAIM_KEY, ClaimStatus, claims_table
from ..types import UTCDateTime

#: Rows per INSERT/UPDATE/DELETE statement: few round trips, a bounded lock
#: set per statement, and well under the servers' bind-parameter limits
#: (PostgreSQL binds arrays, MySQL three values a row). SQLite builds before
#: 3.32 allow only 999 parameters; the store uses smaller batches there.
CHUNK = 1000

#: A claim row's key values, the columns of a keyed statement in order
#: (primary key first: see :data:`..schema.CLAIM_KEY`).
Key = tuple[Any, ...]

#: The primary key columns of the claim table, as a statement selects them.
KEY_COLUMNS = tuple(claims_table.c[col] for col in CLAIM_KEY)

T = TypeVar("T")


def unless_in_query(url: URL, **defaults: Any) -> dict[str, Any]:
    """The connect arguments of *defaults* that the URL's query does not set itself."""
    return {key: value for key, value in defaults.items() if key not in url.query}


def chunks(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def claim_key(occ: Occurrence) -> tuple[str, Any]:
    """The claim table's primary key of *occ*."""
    return (occ.schedule, occ.at)


def is_instant(col: str) -> bool:
    """Whether claim column *col* holds a datetime (the others hold strings)."""
    return isinstance(claims_table.c[col].type, UTCDateTime)


def new_token() -> str:
    """A fresh ``op_token``: marks the rows one statement wrote (see schema)."""
    return uuid.uuid4().hex


class ClaimValues(NamedTuple):
    """The column values every row inserted by one claim() or record() call shares."""

    claimed_at: datetime
    node: str
    term: int | None
    status: str  # a ClaimStatus value: drivers may not adapt the enum itself
    reason: str | None
    #: The ``op_token`` the rows are written with: the claimant finds them by it when
    #: the reply of a committed claim was lost.
    token: str


@dataclass(frozen=True)
class Merge:
    """How an upsert merges a proposed row into the existing one: counters in
    *add* are summed, datetimes in *greatest* keep the later value, *assign* overwrites."""

    add: Sequence[str] = ()
    greatest: Sequence[str] = ()
    assign: Sequence[str] = ()
    #: (order column, columns): the columns take the proposed values only when the proposed
    #: order column is not older than the stored one; the order column keeps the later value.
    forward: tuple[str, Sequence[str]] | None = None

    def changes(self, table: sa.Table, new: Any) -> dict[str, Any]:
        """The SET clauses, *new* being the proposed row (``excluded`` / ``inserted``)."""
        changes: dict[str, Any] = {}
        if self.forward is not None:
            # First: MySQL evaluates ON DUPLICATE KEY UPDATE left to right, so the order
            # column must still hold its old value when these compare against it.
            order, cols = self.forward
            for col in cols:
                changes[col] = sa.case(
                    (table.c[order].is_(None), new[col]),
                    (new[order] >= table.c[order], new[col]),
                    else_=table.c[col],
                )
        for col in (*self.greatest, *((self.forward[0],) if self.forward else ())):
            changes[col] = sa.case(
                (table.c[col].is_(None), new[col]),
                (new[col] > table.c[col], new[col]),
                else_=table.c[col],
            )
        for col in self.add:
            changes[col] = table.c[col] + new[col]
        for col in self.assign:
            changes[col] = new[col]
        return changes


@dataclass(frozen=True)
class KeyedUpdate:
    """UPDATE the claim rows whose *cols* equal one of *keys* (and ``col = value``
    for *where*), set *values*, add 1 to *increment*; *returning* names what to
    report of each row changed.

    *cols* start with the primary key. *expected* holds the *returning* values
    of all *keys* (same order): the answer when every key matched, which a
    dialect that cannot return rows may use to save a SELECT.

    Exact under concurrency in every dialect: a row matching *cols* and *where*
    is changed even when another transaction updates other columns of it
    meanwhile (the worker's ledger writes the run columns of the very rows
    beat marks sent), and a row whose *cols* or *where* columns changed is not.
    """

    cols: Sequence[str]
    keys: Sequence[Key]
    where: dict[str, Any]
    values: dict[str, Any]
    returning: Sequence[sa.Column[Any]]
    expected: Sequence[Key]
    increment: Sequence[str] = ()

    def __post_init__(self) -> None:
        assert tuple(self.cols[: len(CLAIM_KEY)]) == CLAIM_KEY


class Dialect:
    """One server's SQL for the claim store; the defaults are portable SQLAlchemy Core.

    One instance serves one store: :meth:`learn` records what the open
    engine's server supports, and the statements then depend on it.
    """

    #: INSERT and UPDATE ... RETURNING both work, so a statement tells which
    #: rows it wrote; otherwise they are found again by ``op_token``.
    returning = False
    #: Rows or keys per statement where the store chunks; less on an old SQLite.
    batch = CHUNK
    #: The session's statement limit (seconds; set by :meth:`install_events`; 0: none).
    statement_timeout = 0.0

    # ---------------------------------------------------------------- connecting

    def engine_options(self, url: URL, timeout: float) -> dict[str, Any]:
        """``create_engine`` defaults (``connect_args`` included) for calls bounded by *timeout*
        seconds; the URL's query and the user's options override them."""
        # A server that does not answer must not hang start-up forever.
        return {"connect_args": unless_in_query(url, connect_timeout=max(2, math.ceil(timeout)))}

    def install_events(self, engine: Engine, lock_timeout: float, statement_timeout: float) -> None:
        """Set up every new connection; here: bound its lock waits to *lock_timeout* seconds and
        its statements to *statement_timeout* seconds where the server can."""
        self.statement_timeout = statement_timeout
        statements = self.session_sql(lock_timeout, statement_timeout)

        @sa.event.listens_for(engine, "connect")
        def _server_connect(dbapi_conn: Any, record: Any) -> None:
            # Bound every lock wait: a replica frozen mid-transaction
            # must not stall the others' claims indefinitely.
            cur = dbapi_conn.cursor()
            try:
                for sql in statements:
                    cur.execute(sql)
            finally:
                cur.close()
            dbapi_conn.commit()

    def session_sql(self, lock_timeout: float, statement_timeout: float) -> list[str]:
        """The statements that bound a session's lock waits to *lock_timeout* seconds, its
        statements to *statement_timeout* (and whatever else keeps a frozen session from
        holding others up)."""
        raise NotImplementedError

    def db_now(self, conn: Connection) -> datetime:
        """The database server's clock, aware UTC: every time compared across nodes comes from here.

        The default (SQLite, a file with no server) is the local clock, which
        is every SQLite user's clock: they share one host.
        """
        return utcnow()

    def statement_timeout_sql(self, seconds: float) -> tuple[str, str | None] | None:
        """The statement bounding the next statements to *seconds*, and the one undoing it (None
        when the transaction's end undoes it); None when the server cannot bound them."""
        return None

    def learn(self, dialect: sa.engine.Dialect) -> None:
        """Record what the server supports, once the engine has connected."""
        # RETURNING together with insert-if-absent tells us exactly which
        # rows we inserted.
        self.returning = bool(dialect.insert_returning) and bool(dialect.update_returning)

    def write_options(self) -> dict[str, Any]:
        """Execution options of a connection whose transaction will write."""
        return {}

    def refresh_statistics(self, conn: Connection, table: sa.Table) -> None:
        """After a bulk insert: let the planner know the table grew (a no-op where the server
        keeps its statistics current by itself)."""

    def is_deadlock(self, exc: sa.exc.DBAPIError) -> bool:
        """Whether the server aborted the transaction as a deadlock victim (so it may be retried).

        All the servers' codes are checked whatever the dialect: several
        drivers serve each server and report them differently.
        """
        orig = exc.orig
        sqlstate = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
        if sqlstate in ("40P01", "40001"):  # deadlock_detected, serialization_failure
            return True
        args: tuple[Any, ...] = getattr(orig, "args", ())
        return len(args) > 0 and args[0] == 1213  # ER_LOCK_DEADLOCK (MySQL/MariaDB)

    # ---------------------------------------------------------------- inserting

    def insert(self, table: sa.Table) -> Any:
        """This dialect's INSERT construct (the one with its upsert clauses)."""
        raise NotImplementedError

    def insert_if_absent(
        self, conn: Connection, table: sa.Table, rows: list[dict[str, Any]], key: Sequence[str]
    ) -> None:
        """Insert *rows* whose primary key *key* is not taken yet; leave the others alone."""
        conn.execute(self.insert(table).on_conflict_do_nothing(index_elements=list(key)), rows)

    def insert_names(self, conn: Connection, table: sa.Table, names: Sequence[str], now: datetime) -> None:
        """Insert-if-absent a row (name, registered_at=now, updated_at=now) per name: the
        registration of every schedule at a first start, thousands at once."""
        rows = [{"name": name, "registered_at": now, "updated_at": now} for name in names]
        for chunk in chunks(rows, self.batch):
            self.insert_if_absent(conn, table, list(chunk), ["name"])

    def insert_claims(self, conn: Connection, ordered: Sequence[Occurrence], shared: ClaimValues) -> set[Key]:
        """Insert-if-absent a claim row for each of *ordered* (sorted by key); return the keys this call inserted."""
        c = claims_table
        won: set[Key] = set()
        stmt: Any = self.insert(c).on_conflict_do_nothing(index_elements=list(CLAIM_KEY))
        if self.returning:
            stmt = stmt.returning(*KEY_COLUMNS)
        claimed_at, node, term, status, reason, token = shared
        for chunk in chunks(ordered, self.batch):
            rows = [
                {
                    "schedule": occ.schedule,
                    "scheduled_at": occ.at,
                    "claimed_at": claimed_at,
                    "node": node,
                    "term": term,
                    "task_id": occ.task_id,
                    "status": status,
                    "reason": reason,
                    "attempts": 0,
                    "op_token": token,
                }
                for occ in chunk
            ]
            # executemany: SQLAlchemy's insertmanyvalues sends multi-row INSERTs.
            result = conn.execute(stmt, rows)
            if self.returning:
                won.update((r[0], r[1]) for r in result)
            else:  # e.g. SQLite older than 3.35
                won.update(self.keys_written(conn, token, chunk))
        return won

    def keys_written(self, conn: Connection, token: str, occurrences: Iterable[Occurrence]) -> set[Key]:
        """The keys among *occurrences* whose rows the statement with *token* inserted."""
        keys = [claim_key(occ) for occ in occurrences]
        return {(r[0], r[1]) for r in self.token_rows(conn, token, keys, KEY_COLUMNS)}

    def upsert(self, conn: Connection, table: sa.Table, rows: list[dict[str, Any]], key: str, merge: Merge) -> None:
        """Insert *rows*, or *merge* each into the row with the same primary *key*."""
        stmt, params = self.upsert_source(table, rows)
        changes = merge.changes(table, stmt.excluded)
        conn.execute(stmt.on_conflict_do_update(index_elements=[key], set_=changes), params)

    def upsert_source(self, table: sa.Table, rows: list[dict[str, Any]]) -> tuple[Any, Any]:
        """The INSERT of :meth:`upsert` and its parameters (None: the statement carries them)."""
        return self.insert(table), rows

    # ---------------------------------------------------------------- keyed statements

    # Statements keyed by a list of tuples (mark_sent, take_over_stale, prune).
    #
    # A 1,000-tuple "(a, b) IN (...)" is planned badly by two of the servers:
    # PostgreSQL expands it to a long OR chain (~70 ms per 1,000 rows) and
    # MariaDB scans the whole list for every candidate row (quadratic: ~600 ms
    # per 1,000). A plain join against the keys is fast *if* planned well,
    # but on PostgreSQL the plan depends on statistics: right after a burst the
    # (status, claimed_at) index looks like it returns one row, and after
    # psycopg starts preparing the statement the generic plan guesses ten rows
    # for unnest(), and the planner then nests the loop the wrong way round
    # (seconds per chunk). So each dialect uses a shape whose plan cannot go
    # wrong:
    #
    # * PostgreSQL: reads and deletes, a LATERAL primary-key lookup per
    #   unnested key driving a TID scan (PostgreSQLDialect.key_match);
    #   updates, a join whose only conditions on the claim table are join
    #   conditions, so it is driven from the keys (update_by_keys: a TID scan
    #   would miss a row another transaction updated meanwhile).
    # * MySQL/MariaDB: a UNION ALL derived table joined on the primary key
    #   (see mysql.py: MySQLDialect.join).
    # * SQLite: a row-value IN (the default below), which SQLite answers with
    #   a temporary index.

    def key_match(self, cols: Sequence[str], keys: Sequence[Key]) -> list[Any]:
        """WHERE clauses restricting claim rows to those whose *cols* equal one of *keys*."""
        c = claims_table
        return [sa.tuple_(*(c.c[col] for col in cols)).in_(list(keys))]

    def token_rows(
        self, conn: Connection, token: str, keys: Sequence[Key], columns: Sequence[sa.Column[Any]]
    ) -> list[Key]:
        """*columns* of the rows among primary *keys* that the statement with *token* wrote."""
        c = claims_table
        stmt = sa.select(*columns).where(*self.key_match(CLAIM_KEY, keys), c.c.op_token == token)
        return [tuple(row) for row in conn.execute(stmt)]

    def changed_rows(
        self, conn: Connection, token: str, keys: Sequence[Key], columns: Sequence[sa.Column[Any]]
    ) -> list[Key]:
        """*columns* of the rows among *keys* that the UPDATE with *token* changed."""
        # Look the rows up by primary key only: the other key columns (the
        # old node and claimed_at of take_over_stale) were just overwritten.
        return self.token_rows(conn, token, [k[: len(CLAIM_KEY)] for k in keys], columns)

    def update_by_keys(self, conn: Connection, update: KeyedUpdate) -> list[Any]:
        """Run *update*; return its *returning* columns of exactly the rows it changed."""
        c = claims_table
        token = new_token()
        full = dict(update.values, op_token=token)
        for col in update.increment:
            full[col] = c.c[col] + 1
        stmt = (
            sa.update(c)
            .where(*self.key_match(update.cols, update.keys), *(c.c[col] == v for col, v in update.where.items()))
            .values(full)
        )
        if self.returning:
            return list(conn.execute(stmt.returning(*update.returning)))
        conn.execute(stmt)
        return self.changed_rows(conn, token, update.keys, update.returning)

    def delete_finished(self, conn: Connection, keys: Sequence[Key]) -> int:
        """Delete the finished (not ``claimed``) rows among primary *keys*; return how many."""
        c = claims_table
        result = conn.execute(
            sa.delete(c).where(*self.key_match(CLAIM_KEY, keys), c.c.status != ClaimStatus.CLAIMED.value)
        )
        return max(result.rowcount, 0)

    # ---------------------------------------------------------------- checks and locks

    def lock_stale(self, query: sa.Select[Any]) -> sa.Select[Any]:
        """*query* (take_over_stale's SELECT of stale claim rows, joined to their nodes) with the
        locking this server needs."""
        return query

    def check_name(self, name: str) -> None:
        """Refuse (ValueError) a schedule name this server would compare equal to another."""
