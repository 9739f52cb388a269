"""The SQL tick-claim store: the one place that makes "at most once" true.

Every replica computes the same occurrences (schedule name, nominal UTC
instant). Before sending one, a replica inserts its row into
``cluster_beat_claims`` whose primary key is exactly that pair, with an
insert-if-absent that is atomic in each dialect; it sends only the rows *it*
inserted. Two replicas can therefore both decide an occurrence is due, but
only one of them can win the row.

A leader lease (Redis, elsewhere) hands out a fencing token ("term") with
INCR. Each claiming transaction first raises ``cluster_beat_leader.term`` to
its own term with ``UPDATE ... WHERE term <= :term``: a deposed leader whose
lease expired while it was paused finds a higher term recorded and is refused
(:class:`StaleTermError`) in the same transaction that would have inserted its
claims, so it cannot claim anything after a newer leader has claimed.

Design rules followed throughout:

* every method is one short transaction (or a bounded series of them for
  :meth:`ClaimStore.prune`); nothing holds a transaction open across a send;
* locks are taken in one global order (leader row, claim rows sorted by key,
  schedule rows sorted by name), so concurrent replicas queue rather than
  deadlock; a deadlock the server still reports is retried a few times;
* datetimes are naive UTC in the database (portable across the three
  dialects), aware UTC in Python.
"""
from __future__ import annotations

import logging
import random
import threading
import time
import uuid
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Any, Callable, Iterable, Iterator, Sequence, TypeVar

import sqlalchemy as sa
from sqlalchemy.dialects import mysql as mysql_dialect
from sqlalchemy.dialects import postgresql as pg_dialect
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.engine import Connection, Engine, make_url

from ..errors import ConfigError
from ..schedules.occurrence import Occurrence
from .errors import SchemaVersionError, StaleTermError, StoreUnavailable
from .schema import (
    SCHEMA_VERSION,
    STATUSES,
    ClaimRow,
    ScheduleState,
    UTCDateTime,
    _mysql_name_collation,
    _naive_utc,
    claims_table,
    leader_table,
    meta_table,
    metadata,
    schedules_table,
)

__all__ = [
    "SCHEMA_VERSION",
    "ClaimRow",
    "ClaimStore",
    "ScheduleState",
    "SchemaVersionError",
    "StaleTermError",
    "STATUSES",
]

logger = logging.getLogger(__name__)


#: Rows per INSERT/UPDATE/DELETE statement: few round trips, a bounded lock
#: set per statement, and well under the servers' bind-parameter limits
#: (PostgreSQL binds arrays, MySQL three values a row). SQLite builds before
#: 3.32 allow only 999 parameters; the store uses smaller batches there.
CHUNK = 1000

#: How often a transaction the server aborted as a deadlock victim is retried.
_DEADLOCK_ATTEMPTS = 4

#: Errors are stored for operators, not archived: keep rows small.
_MAX_ERROR_CHARS = 2000

_SUPPORTED_BACKENDS = ("sqlite", "postgresql", "mysql", "mariadb")

_PK = ("schedule", "scheduled_at")

T = TypeVar("T")


def _aware(value: datetime, what: str) -> datetime:
    if value.tzinfo is None:
        raise ValueError(f"{what}: naive datetime {value!r}; pass an aware (UTC) datetime")
    return value.astimezone(timezone.utc)


def _clip(text: str) -> str:
    if len(text) > _MAX_ERROR_CHARS:
        return text[: _MAX_ERROR_CHARS - 3] + "..."
    return text


def _utcnow() -> datetime:
    return datetime.now(timezone.utc)


def _chunks(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def _key(occ: Occurrence) -> tuple[str, datetime]:
    return (occ.schedule, occ.at)


def _unique(occurrences: Iterable[Occurrence]) -> list[Occurrence]:
    """Input order, first of each (schedule, instant) kept."""
    seen: set[tuple[str, datetime]] = set()
    out = []
    for occ in occurrences:
        k = _key(occ)
        if k not in seen:
            seen.add(k)
            out.append(occ)
    return out


def _is_deadlock(exc: sa.exc.DBAPIError) -> bool:
    orig = exc.orig
    sqlstate = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    if sqlstate in ("40P01", "40001"):  # deadlock_detected, serialization_failure
        return True
    args: tuple[Any, ...] = getattr(orig, "args", ())
    return len(args) > 0 and args[0] == 1213  # ER_LOCK_DEADLOCK (MySQL/MariaDB)


class ClaimStore:
    """Atomic, fenced claims of occurrences in a SQL database shared by all replicas."""

    def __init__(
        self,
        url: str,
        *,
        node_id: str,
        engine_options: dict[str, Any] | None = None,
        lock_timeout: float = 10.0,
    ) -> None:
        """Parse and validate only: beat builds stores lazily and a store that
        is never opened must not touch the network or the file system."""
        try:
            self._url = make_url(url)
        except (sa.exc.ArgumentError, ValueError, TypeError) as exc:
            # Do not echo the string: it may carry a password.
            raise ConfigError(f"cluster_beat database URL is not a valid SQLAlchemy URL: {exc}") from None
        backend = self._url.get_backend_name()
        if backend not in _SUPPORTED_BACKENDS:
            raise ConfigError(
                f"cluster_beat database URL uses {backend!r}; supported: sqlite, postgresql, mysql, mariadb"
            )
        if not node_id or not isinstance(node_id, str) or len(node_id) > 255:
            raise ConfigError(f"node_id must be a non-empty string of at most 255 characters, got {node_id!r}")
        if lock_timeout <= 0:
            raise ConfigError(f"lock_timeout must be positive, got {lock_timeout!r}")
        self.node_id = node_id
        self.url_masked: str = self._url.render_as_string(hide_password=True)
        self._engine_options = dict(engine_options or {})
        self._lock_timeout = float(lock_timeout)
        self._engine: Engine | None = None
        self._open_lock = threading.Lock()
        self._mysql = backend in ("mysql", "mariadb")
        self._sqlite = backend == "sqlite"
        self._returning = False
        self._collation = ""  # name collation on MySQL, known once open
        self._ph = "%s"  # the MySQL driver's positional placeholder
        self._pad_space = False
        self._batch = CHUNK  # keys per statement; less on an old SQLite

    def __repr__(self) -> str:
        return f"<ClaimStore {self.url_masked} node={self.node_id!r}>"

    # ------------------------------------------------------------------ life cycle

    def open(self) -> None:
        """Connect, create missing tables and refuse a newer schema; a no-op when open.

        Replicas starting together all run this at once, so table creation
        tolerates losing the race to another replica.
        """
        with self._open_lock:
            if self._engine is not None:
                return
            engine = sa.create_engine(self._url, **self._build_engine_options())
            self._install_events(engine)
            try:
                self._prepare_schema(engine)
                dialect = engine.dialect
                # RETURNING together with insert-if-absent tells us exactly
                # which rows we inserted; MySQL/MariaDB use op_token instead.
                self._returning = (
                    not self._mysql
                    and bool(dialect.insert_returning)
                    and bool(dialect.update_returning)
                )
                if self._sqlite:
                    # Up to 4 key columns a row (take_over_stale), some room to spare.
                    limit = int(getattr(dialect, "insertmanyvalues_max_parameters", 32766))
                    self._batch = max(1, min(CHUNK, (limit - 16) // 4))
                if self._mysql:
                    # Hand-built MySQL statements (see _mysql_join) use the
                    # driver's own placeholder: "?" for MariaDB Connector/Python.
                    self._ph = "?" if dialect.paramstyle == "qmark" else "%s"
                    self._collation = _mysql_name_collation(dialect)
                    self._pad_space = self._collation == "utf8mb4_bin"
            except BaseException:
                engine.dispose()
                raise
            self._engine = engine
            logger.debug("claim store open: %s (node %s)", self.url_masked, self.node_id)

    def close(self) -> None:
        """Release pooled connections; safe before open() and when called twice."""
        with self._open_lock:
            engine, self._engine = self._engine, None
        if engine is not None:
            engine.dispose()

    def __enter__(self) -> "ClaimStore":
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build_engine_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {"pool_pre_ping": True}
        connect_args: dict[str, Any] = {}
        if self._mysql:
            # Fewer gap locks than REPEATABLE READ, so concurrent
            # insert-if-absent of overlapping keys queues instead of deadlocking.
            options["isolation_level"] = "READ COMMITTED"
            options["pool_recycle"] = 3600  # below the usual wait_timeout
        if not self._sqlite and "connect_timeout" not in self._url.query:
            connect_args["connect_timeout"] = 10
        user = dict(self._engine_options)
        connect_args.update(user.pop("connect_args", {}) or {})
        if connect_args:
            options["connect_args"] = connect_args
        options.update(user)
        return options

    def _install_events(self, engine: Engine) -> None:
        timeout = self._lock_timeout
        if self._sqlite:

            @sa.event.listens_for(engine, "connect")
            def _sqlite_connect(dbapi_conn: Any, record: Any) -> None:
                # Take transaction control from the sqlite3 module (it would
                # BEGIN lazily and DEFERRED); our "begin" hook decides below.
                dbapi_conn.isolation_level = None
                cur = dbapi_conn.cursor()
                try:
                    # busy_timeout first: switching to WAL needs a lock that
                    # another process opening the file may hold.
                    cur.execute(f"PRAGMA busy_timeout = {int(timeout * 1000)}")
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
                if conn.get_execution_options().get("ccb_write"):
                    conn.exec_driver_sql("BEGIN IMMEDIATE")
                else:
                    conn.exec_driver_sql("BEGIN")

        else:
            if self._mysql:
                sql = f"SET SESSION innodb_lock_wait_timeout = {max(1, int(round(timeout)))}"
            else:
                sql = f"SET lock_timeout = {int(timeout * 1000)}"

            @sa.event.listens_for(engine, "connect")
            def _server_connect(dbapi_conn: Any, record: Any) -> None:
                # Bound every lock wait: a replica frozen mid-transaction
                # must not stall the others' claims indefinitely.
                cur = dbapi_conn.cursor()
                try:
                    cur.execute(sql)
                finally:
                    cur.close()
                dbapi_conn.commit()

    def _prepare_schema(self, engine: Engine) -> None:
        attempts = 4
        for attempt in range(1, attempts + 1):
            # Failing to connect is not a race: let it propagate at once.
            with self._connection(engine, write=True) as conn:
                try:
                    with conn.begin():
                        self._check_version(conn)
                        metadata.create_all(conn, checkfirst=True)
                        self._insert_if_absent(
                            conn, meta_table, [{"key": "schema_version", "value": str(SCHEMA_VERSION)}], ["key"]
                        )
                        self._insert_if_absent(
                            conn,
                            leader_table,
                            [{"id": 1, "term": 0, "node": None, "updated_at": _utcnow()}],
                            ["id"],
                        )
                        # A concurrent opener may have stamped first: check again.
                        self._check_version(conn)
                    return
                except sa.exc.DBAPIError as exc:
                    # Another replica created a table between our "exists?"
                    # check and our CREATE; the next round sees it and skips it.
                    if attempt == attempts or exc.connection_invalidated:
                        raise
                    logger.debug("schema creation raced another node (%s); retrying", exc.orig)
            time.sleep(0.1 * attempt + random.random() * 0.1)

    def _check_version(self, conn: Connection) -> None:
        if not sa.inspect(conn).has_table(meta_table.name):
            return
        raw = conn.execute(
            sa.select(meta_table.c.value).where(meta_table.c.key == "schema_version")
        ).scalar_one_or_none()
        if raw is None:
            return
        try:
            version = int(raw)
        except ValueError:
            raise SchemaVersionError(
                f"the claim database {self.url_masked} records schema version {raw!r}, "
                "which this celery-cluster-beat cannot read"
            ) from None
        if version > SCHEMA_VERSION:
            raise SchemaVersionError(
                f"the claim database {self.url_masked} has schema version {version}, newer than "
                f"version {SCHEMA_VERSION} that this celery-cluster-beat understands: it was written "
                "by a newer release. Upgrade celery-cluster-beat on this node (or point it at "
                "another database); refusing to open it"
            )

    # ------------------------------------------------------------------ plumbing

    def _require_engine(self) -> Engine:
        engine = self._engine
        if engine is None:
            raise RuntimeError(f"{self!r} is not open; call open() first")
        return engine

    @contextmanager
    def _connection(self, engine: Engine, *, write: bool) -> Iterator[Connection]:
        with engine.connect() as conn:
            if write and self._sqlite:
                conn.execution_options(ccb_write=True)
            yield conn

    def _run(self, work: Callable[[Connection], T], *, write: bool = True) -> T:
        """Run *work* in one transaction, retrying if the server picked it as a deadlock victim.

        Retrying is safe because the whole transaction was rolled back.
        """
        engine = self._require_engine()
        for attempt in range(1, _DEADLOCK_ATTEMPTS + 1):
            try:
                with self._connection(engine, write=write) as conn, conn.begin():
                    return work(conn)
            except sa.exc.DBAPIError as exc:
                if attempt == _DEADLOCK_ATTEMPTS or not _is_deadlock(exc):
                    raise StoreUnavailable.wrap(exc, self.url_masked) from exc
                logger.info("claim store: deadlock (attempt %d), retrying: %s", attempt, exc.orig)
                time.sleep(random.uniform(0.005, 0.05) * attempt)
        raise AssertionError("unreachable")  # pragma: no cover

    def _dialect_insert(self, table: sa.Table) -> Any:
        if self._mysql:
            return mysql_dialect.insert(table)
        if self._sqlite:
            return sqlite_dialect.insert(table)
        return pg_dialect.insert(table)

    def _insert_if_absent(
        self, conn: Connection, table: sa.Table, rows: list[dict[str, Any]], pk: list[str]
    ) -> None:
        stmt = self._dialect_insert(table)
        if self._mysql:
            # A no-op ON DUPLICATE KEY UPDATE rather than INSERT IGNORE:
            # IGNORE also turns real errors (truncation, bad values) into
            # warnings, which would hide bugs as "already claimed".
            stmt = stmt.on_duplicate_key_update({pk[0]: table.c[pk[0]]})
        else:
            stmt = stmt.on_conflict_do_nothing(index_elements=pk)
        conn.execute(stmt, rows)

    def _fence(self, conn: Connection, term: int | None) -> None:
        """Raise the recorded term to *term*, or refuse: it holds the leader row
        lock until commit, so fenced writers are serialized on it."""
        if term is None:
            return
        term = int(term)
        for _ in range(2):
            result = conn.execute(
                sa.update(leader_table)
                .where(leader_table.c.id == 1, leader_table.c.term <= term)
                .values(term=term, node=self.node_id, updated_at=_utcnow())
            )
            if result.rowcount:
                return
            seen = conn.execute(sa.select(leader_table.c.term).where(leader_table.c.id == 1)).scalar()
            if seen is not None:
                raise StaleTermError(int(seen), term)
            # Row deleted by hand: recreate it, then fence again.
            self._insert_if_absent(
                conn, leader_table, [{"id": 1, "term": 0, "node": None, "updated_at": _utcnow()}], ["id"]
            )
        raise RuntimeError("cluster_beat_leader row 1 cannot be written")  # pragma: no cover

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
    # * PostgreSQL: the key arrays are unnested and each key is looked up
    #   through the primary key in a LATERAL subquery fenced with OFFSET 0
    #   (the only index its conditions can use is the primary key); the
    #   row ids found drive a TID scan. Conditions on the row's *current*
    #   state (node, status) stay in the outer WHERE, which PostgreSQL
    #   re-evaluates on the newest row version if a concurrent transaction
    #   changed it, so the result stays exact under concurrency.
    # * MySQL/MariaDB: a UNION ALL derived table joined on the primary key
    #   (eq_ref); UPDATE/DELETE re-read the latest row version when locking.
    # * SQLite: a row-value IN, which SQLite answers with a temporary index.

    _KEY_TYPES = {"schedule": "s", "scheduled_at": "t", "node": "s", "claimed_at": "t", "task_id": "s"}

    @staticmethod
    def _pg_unnest(table: sa.Table, cols: Sequence[str], rows: Sequence[tuple[Any, ...]]) -> Any:
        """unnest() of one array parameter per column: *rows* as a table (PostgreSQL).

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
                values = [None if v is None else _naive_utc(v) for v in values]
                item_type = sa.DateTime()
            elif isinstance(col_type, sa.Integer):
                item_type = sa.BigInteger()
            elif isinstance(col_type, sa.Text):
                item_type = sa.Text()
            else:
                item_type = sa.String()
            params.append(sa.bindparam(f"k_{col}", values, type_=pg_dialect.ARRAY(item_type)))
            columns.append(sa.column(col, item_type))
        return sa.func.unnest(*params).table_valued(*columns).render_derived(name="k")

    def _key_match(self, cols: Sequence[str], keys: Sequence[tuple[Any, ...]]) -> list[Any]:
        """WHERE clauses (PostgreSQL, SQLite) restricting claim rows to *keys*."""
        c = claims_table
        if self._sqlite:
            return [sa.tuple_(*(c.c[col] for col in cols)).in_(list(keys))]
        arrays = []
        binds = []
        for i, col in enumerate(cols):
            if self._KEY_TYPES[col] == "t":
                values: list[Any] = [_naive_utc(k[i]) for k in keys]
                arrays.append(f"CAST(:k_{col} AS TIMESTAMP WITHOUT TIME ZONE[])")
                item_type: sa.types.TypeEngine[Any] = sa.DateTime()
            else:
                values = [k[i] for k in keys]
                arrays.append(f"CAST(:k_{col} AS VARCHAR[])")
                item_type = sa.String()
            binds.append(sa.bindparam(f"k_{col}", values, type_=pg_dialect.ARRAY(item_type)))
        match = " AND ".join(f"c2.{col} = k.{col}" for col in cols)
        return [
            sa.text(
                f"{c.name}.ctid = ANY(ARRAY("
                f"SELECT x.tid FROM unnest({', '.join(arrays)}) AS k({', '.join(cols)}) "
                f"CROSS JOIN LATERAL (SELECT c2.ctid AS tid FROM {c.name} AS c2 WHERE {match} OFFSET 0) AS x))"
            ).bindparams(*binds)
        ]

    def _mysql_join(self, cols: Sequence[str], keys: Sequence[tuple[Any, ...]]) -> tuple[str, list[Any]]:
        """``cluster_beat_claims AS c JOIN (<keys>) AS k ON ...`` and its parameters (MySQL)."""
        ph = self._ph
        exprs = [
            # Compare names byte for byte like the column does; pin the
            # charset too so a non-utf8mb4 connection cannot break COLLATE.
            f"CONVERT({ph} USING utf8mb4) COLLATE {self._collation}" if self._KEY_TYPES[col] == "s"
            else f"CAST({ph} AS DATETIME(6))"
            for col in cols
        ]
        first = "SELECT " + ", ".join(f"{e} AS {col}" for e, col in zip(exprs, cols))
        rest = "SELECT " + ", ".join(exprs)
        derived = " UNION ALL ".join([first] + [rest] * (len(keys) - 1))
        on = " AND ".join(f"c.{col} = k.{col}" for col in cols)
        params = [
            _naive_utc(v) if isinstance(v, datetime) else v for key in keys for v in key
        ]
        return f"{claims_table.name} AS c JOIN ({derived}) AS k ON {on}", params

    def _token_rows(
        self,
        conn: Connection,
        token: str,
        cols: Sequence[str],
        keys: Sequence[tuple[Any, ...]],
        columns: Sequence[sa.Column[Any]],
    ) -> list[tuple[Any, ...]]:
        """*columns* of the rows among *keys* that the statement with *token* wrote."""
        c = claims_table
        if self._mysql:
            join, params = self._mysql_join(cols, keys)
            params.append(token)
            result = conn.exec_driver_sql(
                f"SELECT {', '.join('c.' + col.name for col in columns)} FROM {join} WHERE c.op_token = {self._ph}",
                tuple(params),
            )
            aware = [isinstance(col.type, UTCDateTime) for col in columns]
            return [
                tuple(v.replace(tzinfo=timezone.utc) if a and v is not None else v for v, a in zip(row, aware))
                for row in result
            ]
        stmt = sa.select(*columns).where(*self._key_match(cols, keys), c.c.op_token == token)
        return [tuple(row) for row in conn.execute(stmt)]

    def _update_by_keys(
        self,
        conn: Connection,
        cols: Sequence[str],
        keys: Sequence[tuple[Any, ...]],
        *,
        where: dict[str, Any],
        values: dict[str, Any],
        increment: Sequence[str] = (),
        returning: Sequence[sa.Column[Any]],
        expected: Sequence[tuple[Any, ...]],
    ) -> list[Any]:
        """UPDATE the claim rows whose *cols* equal one of *keys* (and
        ``col = value`` for *where*), set *values*, add 1 to *increment*;
        return *returning* of exactly the rows changed.

        *expected* holds the *returning* values of all *keys* (same order):
        the answer when every key matched, which saves MySQL a SELECT.
        """
        assert tuple(cols[:2]) == _PK
        c = claims_table
        token = uuid.uuid4().hex
        if self._mysql:
            join, params = self._mysql_join(cols, keys)
            ph = self._ph
            sets = [f"c.{col} = {ph}" for col in values] + [f"c.{col} = c.{col} + 1" for col in increment]
            sets.append(f"c.op_token = {ph}")
            conds = [f"c.{col} = {ph}" for col in where]
            params += [_naive_utc(v) if isinstance(v, datetime) else v for v in values.values()]
            params.append(token)
            params += list(where.values())
            sql = f"UPDATE {join} SET {', '.join(sets)}"
            if conds:
                sql += " WHERE " + " AND ".join(conds)
            result = conn.exec_driver_sql(sql, tuple(params))
            # Affected rows count matched rows here (SQLAlchemy connects with
            # CLIENT_FOUND_ROWS): all keys matched, or none did, is exact.
            if result.rowcount == len(keys):
                return list(expected)
            if result.rowcount == 0:
                return []
            return self._changed_rows(conn, token, keys, returning)
        full = dict(values, op_token=token)
        for col in increment:
            full[col] = c.c[col] + 1
        stmt = (
            sa.update(c)
            .where(*self._key_match(cols, keys), *(c.c[col] == v for col, v in where.items()))
            .values(full)
        )
        if self._returning:
            return list(conn.execute(stmt.returning(*returning)))
        conn.execute(stmt)
        return self._changed_rows(conn, token, keys, returning)

    def _changed_rows(
        self, conn: Connection, token: str, keys: Sequence[tuple[Any, ...]], columns: Sequence[sa.Column[Any]]
    ) -> list[tuple[Any, ...]]:
        # Look the rows up by primary key only: the other key columns (the
        # old node and claimed_at of take_over_stale) were just overwritten.
        return self._token_rows(conn, token, _PK, [k[:2] for k in keys], columns)

    def _delete_by_keys(self, conn: Connection, keys: Sequence[tuple[Any, ...]]) -> int:
        """Delete finished (not ``claimed``) rows among *keys*."""
        cols = ("schedule", "scheduled_at")
        if self._mysql:
            join, params = self._mysql_join(cols, keys)
            result = conn.exec_driver_sql(f"DELETE c FROM {join} WHERE c.status <> 'claimed'", tuple(params))
        else:
            c = claims_table
            result = conn.execute(sa.delete(c).where(*self._key_match(cols, keys), c.c.status != "claimed"))
        return max(result.rowcount, 0)

    def _upsert_schedules(
        self,
        conn: Connection,
        rows: list[dict[str, Any]],
        *,
        add: Sequence[str] = (),
        greatest: Sequence[str] = (),
        assign: Sequence[str] = (),
    ) -> None:
        """Insert or merge per-schedule state: counters in *add* are summed,
        datetimes in *greatest* keep the later value, *assign* overwrites."""
        if not rows:
            return
        now = _utcnow()
        rows = sorted(rows, key=lambda r: r["name"])  # global lock order
        for row in rows:
            row["updated_at"] = now
        t = schedules_table
        pg = not (self._mysql or self._sqlite)
        stmt: Any
        if pg:
            # One INSERT ... SELECT FROM unnest() instead of a row each.
            cols = list(rows[0])
            k = self._pg_unnest(t, cols, [tuple(r[col] for col in cols) for r in rows])
            stmt = pg_dialect.insert(t).from_select(cols, sa.select(*(k.c[col] for col in cols)))
        else:
            stmt = self._dialect_insert(t)
        new = stmt.inserted if self._mysql else stmt.excluded
        changes: dict[str, Any] = {}
        for col in add:
            changes[col] = t.c[col] + new[col]
        for col in greatest:
            changes[col] = sa.case(
                (t.c[col].is_(None), new[col]),
                (new[col] > t.c[col], new[col]),
                else_=t.c[col],
            )
        for col in (*assign, "updated_at"):
            changes[col] = new[col]
        if self._mysql:
            stmt = stmt.on_duplicate_key_update(changes)
        else:
            stmt = stmt.on_conflict_do_update(index_elements=["name"], set_=changes)
        if pg:
            conn.execute(stmt)
        else:
            conn.execute(stmt, rows)

    def _validate(self, occurrences: Sequence[Occurrence]) -> list[Occurrence]:
        # Refuse what the columns cannot hold exactly: a truncated name would
        # claim another schedule's key.
        unique = _unique(occurrences)
        for occ in unique:
            if not occ.schedule or len(occ.schedule) > 255:
                raise ValueError(f"schedule name must have 1 to 255 characters: {occ.schedule!r}")
            if len(occ.task_id) > 36:
                raise ValueError(f"task id longer than 36 characters for {occ.schedule!r}: {occ.task_id!r}")
            if self._pad_space and occ.schedule.endswith(" "):
                raise ValueError(
                    f"schedule name {occ.schedule!r} ends with a space, which this MySQL server's "
                    "collation ignores (it would share claims with the name without it)"
                )
        return unique

    # ------------------------------------------------------------------ claiming

    def claim(self, occurrences: Sequence[Occurrence], *, term: int | None = None) -> list[Occurrence]:
        """Claim occurrences for sending; only the returned ones may be sent by this node.

        One transaction: fence with *term*, insert-if-absent every
        occurrence, update per-schedule state. The result is exactly the
        occurrences this call inserted (input order); the rest were already
        claimed by some node and are counted as ``claim_lost``.

        Raises StaleTermError (and writes nothing) when a higher term than
        *term* is recorded.
        """
        return self._insert(occurrences, status="claimed", reason=None, term=term)

    def record(
        self,
        occurrences: Sequence[Occurrence],
        *,
        status: str,
        reason: str,
        term: int | None = None,
    ) -> list[Occurrence]:
        """Record occurrences that will deliberately not be sent (``skipped`` or ``missed``).

        They take the claim key like a send would, so no other replica sends
        what this one decided to skip; fenced and exact like :meth:`claim`.
        """
        if status not in ("skipped", "missed"):
            raise ValueError(f"record() status must be 'skipped' or 'missed', not {status!r}")
        if not reason:
            raise ValueError("record() needs a reason (e.g. 'overlap', 'catchup')")
        reason = _clip(str(reason))
        return self._insert(occurrences, status=status, reason=reason, term=term)

    def _insert_claims(
        self, conn: Connection, ordered: Sequence[Occurrence], *, status: str, reason: str | None, term: int | None
    ) -> set[tuple[str, datetime]]:
        """Insert-if-absent rows for *ordered*; return the keys this call inserted."""
        c = claims_table
        now = _utcnow()
        token = uuid.uuid4().hex
        won: set[tuple[str, datetime]] = set()
        key_cols = ("schedule", "scheduled_at")
        if self._mysql:
            # The values shared by every row travel once, as session
            # variables, so each row binds only its own three: the driver
            # escapes a third as many values.
            ph = self._ph
            conn.exec_driver_sql(
                f"SET @ccb_claimed_at = {ph}, @ccb_node = {ph}, @ccb_term = {ph}, "
                f"@ccb_status = {ph}, @ccb_reason = {ph}, @ccb_token = {ph}",
                (_naive_utc(now), self.node_id, term, status, reason, token),
            )
            row = f"({ph}, {ph}, @ccb_claimed_at, @ccb_node, @ccb_term, {ph}, @ccb_status, @ccb_reason, 0, @ccb_token)"
            head = (
                f"INSERT IGNORE INTO {c.name} (schedule, scheduled_at, claimed_at, node, term, task_id, "
                "status, reason, attempts, op_token) VALUES "
            )
            for chunk in _chunks(ordered, CHUNK):
                params = [v for o in chunk for v in (o.schedule, _naive_utc(o.at), o.task_id)]
                # INSERT IGNORE, because its affected-rows count is exactly
                # the number of rows inserted (ON DUPLICATE KEY UPDATE counts
                # a duplicate too): when a chunk was all new or all taken we
                # know which rows we won without selecting them. IGNORE also
                # downgrades data errors to warnings; _validate() rules those
                # out before we get here.
                result = conn.exec_driver_sql(head + ", ".join([row] * len(chunk)), tuple(params))
                if result.rowcount == len(chunk):
                    won.update(_key(occ) for occ in chunk)
                elif result.rowcount:
                    # Another node won some of the chunk meanwhile: ask which rows are ours.
                    keys = [_key(occ) for occ in chunk]
                    won.update(
                        (r[0], r[1])
                        for r in self._token_rows(conn, token, key_cols, keys, (c.c.schedule, c.c.scheduled_at))
                    )
        elif self._sqlite:
            stmt: Any = sqlite_dialect.insert(c).on_conflict_do_nothing(index_elements=list(key_cols))
            if self._returning:
                stmt = stmt.returning(c.c.schedule, c.c.scheduled_at)
            for chunk in _chunks(ordered, self._batch):
                rows = [
                    {
                        "schedule": occ.schedule,
                        "scheduled_at": occ.at,
                        "claimed_at": now,
                        "node": self.node_id,
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
                if self._returning:
                    won.update((r[0], r[1]) for r in result)
                else:  # SQLite older than 3.35
                    keys = [_key(occ) for occ in chunk]
                    won.update(
                        (r[0], r[1])
                        for r in self._token_rows(conn, token, key_cols, keys, (c.c.schedule, c.c.scheduled_at))
                    )
        else:
            # PostgreSQL: INSERT ... SELECT FROM unnest(arrays): three array
            # parameters per chunk instead of ten per row, which psycopg
            # binds and the server plans several times faster.
            for chunk in _chunks(ordered, CHUNK):
                k = self._pg_unnest(
                    c, ("schedule", "scheduled_at", "task_id"), [(o.schedule, o.at, o.task_id) for o in chunk]
                )
                select = sa.select(
                    k.c.schedule,
                    k.c.scheduled_at,
                    sa.literal(now, UTCDateTime()),
                    sa.literal(self.node_id, sa.String()),
                    sa.literal(term, sa.BigInteger()),
                    k.c.task_id,
                    sa.literal(status, sa.String()),
                    sa.literal(reason, sa.Text()),
                    sa.literal(0, sa.Integer()),
                    sa.literal(token, sa.String()),
                )
                stmt = (
                    pg_dialect.insert(c)
                    .from_select(
                        ["schedule", "scheduled_at", "claimed_at", "node", "term", "task_id",
                         "status", "reason", "attempts", "op_token"],
                        select,
                    )
                    .on_conflict_do_nothing(index_elements=list(key_cols))
                    .returning(c.c.schedule, c.c.scheduled_at)
                )
                won.update((r[0], r[1]) for r in conn.execute(stmt))
        return won

    def _insert(
        self, occurrences: Sequence[Occurrence], *, status: str, reason: str | None, term: int | None
    ) -> list[Occurrence]:
        unique = self._validate(occurrences)
        if not unique:
            return []
        ordered = sorted(unique, key=_key)  # same lock order in every replica

        def work(conn: Connection) -> set[tuple[str, datetime]]:
            self._fence(conn, term)
            won = self._insert_claims(conn, ordered, status=status, reason=reason, term=term)
            per: dict[str, dict[str, Any]] = {}
            counter = "claim_lost" if status == "claimed" else status
            for occ in ordered:
                state = per.setdefault(
                    occ.schedule, {"name": occ.schedule, "last_occurrence": occ.at, "claim_lost": 0, counter: 0}
                )
                if occ.at > state["last_occurrence"]:
                    state["last_occurrence"] = occ.at
                if _key(occ) in won:
                    if status != "claimed":
                        state[status] += 1
                else:
                    state["claim_lost"] += 1
            add = ("claim_lost",) if status == "claimed" else ("claim_lost", status)
            self._upsert_schedules(conn, list(per.values()), add=add, greatest=("last_occurrence",))
            return won

        won = self._run(work)
        return [occ for occ in unique if _key(occ) in won]

    def mark_sent(self, occurrences: Sequence[Occurrence]) -> int:
        """Record that these claimed occurrences were published.

        Only rows this node still owns in status ``claimed`` change: if a
        sweeper took a row over meanwhile, that node will (re)send it and
        owns its bookkeeping. Returns how many rows changed.
        """
        unique = _unique(occurrences)
        if not unique:
            return 0
        ordered = sorted(unique, key=_key)
        c = claims_table

        def work(conn: Connection) -> int:
            now = _utcnow()
            changed: list[Any] = []
            for chunk in _chunks(ordered, self._batch):
                changed.extend(
                    self._update_by_keys(
                        conn,
                        ("schedule", "scheduled_at"),
                        [_key(o) for o in chunk],
                        where={"node": self.node_id, "status": "claimed"},
                        values={"status": "sent", "sent_at": now},
                        increment=("attempts",),
                        returning=(c.c.schedule, c.c.scheduled_at, c.c.task_id),
                        expected=[(o.schedule, o.at, o.task_id) for o in chunk],
                    )
                )
            per: dict[str, dict[str, Any]] = {}
            latest: dict[str, datetime] = {}
            for schedule, at, task_id in changed:
                state = per.setdefault(
                    schedule, {"name": schedule, "sent": 0, "last_task_id": task_id, "last_sent_at": now}
                )
                state["sent"] += 1
                if schedule not in latest or at > latest[schedule]:
                    latest[schedule] = at
                    state["last_task_id"] = task_id
            self._upsert_schedules(conn, list(per.values()), add=("sent",), assign=("last_task_id", "last_sent_at"))
            return len(changed)

        return self._run(work)

    def mark_failed(self, occurrence: Occurrence, error: str, *, final: bool = False) -> bool:
        """Record a failed publish attempt.

        The row stays ``claimed`` so it is retried (by this node, or by a
        sweeper if this node dies) unless *final*, which gives up on it
        (``failed``). Returns False when this node no longer owns the
        claimed row (nothing recorded then).
        """
        error = _clip(str(error))
        c = claims_table

        def work(conn: Connection) -> bool:
            now = _utcnow()
            values: dict[str, Any] = {"reason": error, "attempts": c.c.attempts + 1}
            if final:
                values["status"] = "failed"
            else:  # still ours and being retried: keep the row from looking abandoned to sweepers
                values["claimed_at"] = now
            result = conn.execute(
                sa.update(claims_table)
                .where(
                    c.c.schedule == occurrence.schedule,
                    c.c.scheduled_at == occurrence.at,
                    c.c.node == self.node_id,
                    c.c.status == "claimed",
                )
                .values(**values)
            )
            if result.rowcount != 1:
                return False
            state = {"name": occurrence.schedule, "last_error": error, "last_error_at": now, "failed": int(final)}
            self._upsert_schedules(conn, [state], add=("failed",), assign=("last_error", "last_error_at"))
            return True

        return self._run(work)

    def take_over_stale(
        self, older_than: datetime, *, term: int | None = None, limit: int = 500
    ) -> list[Occurrence]:
        """Adopt rows left ``claimed`` since before *older_than* (their node died
        between claim and send) so they get sent.

        The UPDATE repeats each row's old node and claimed_at in its WHERE, so
        when two sweepers race, the second finds the row changed and skips
        it: each stale row is adopted exactly once. The returned occurrences
        keep their task id, so the resend is recognisable as the same task.
        Fenced like :meth:`claim`.
        """
        cutoff = _aware(older_than, "older_than")
        if limit <= 0:
            return []
        c = claims_table

        def work(conn: Connection) -> list[Occurrence]:
            self._fence(conn, term)
            query = (
                sa.select(c.c.schedule, c.c.scheduled_at, c.c.node, c.c.claimed_at, c.c.task_id)
                .where(c.c.status == "claimed", c.c.claimed_at < cutoff)
                .order_by(c.c.claimed_at, c.c.schedule, c.c.scheduled_at)
                .limit(limit)
            )
            if not (self._mysql or self._sqlite):
                # PostgreSQL re-checks only the outer WHERE of the UPDATE
                # below on a concurrently changed row, and the old
                # node/claimed_at live in its key lookup; locking the rows
                # here (skipping those another sweeper holds) makes the
                # adoption exact. MySQL's join re-reads the locked row in
                # full, and SQLite writers are serialized already.
                query = query.with_for_update(skip_locked=True)
            stale = conn.execute(query).all()
            if not stale:
                return []
            stale = sorted(stale)
            now = _utcnow()
            taken: list[Any] = []
            for rows in _chunks(stale, self._batch):
                chunk = [(r[0], r[1], r[2], r[3]) for r in rows]
                taken.extend(
                    self._update_by_keys(
                        conn,
                        ("schedule", "scheduled_at", "node", "claimed_at"),
                        chunk,
                        where={"status": "claimed"},
                        values={"node": self.node_id, "claimed_at": now, "term": term},
                        returning=(c.c.schedule, c.c.scheduled_at, c.c.task_id),
                        expected=[(r[0], r[1], r[4]) for r in rows],
                    )
                )
            per: dict[str, dict[str, Any]] = {}
            for schedule, _at, _task_id in taken:
                per.setdefault(schedule, {"name": schedule, "resent": 0})["resent"] += 1
            self._upsert_schedules(conn, list(per.values()), add=("resent",))
            return [Occurrence(s, at, task_id=task_id) for s, at, task_id in sorted(taken)]

        return self._run(work)

    # ------------------------------------------------------------------ reading

    def current_term(self) -> int:
        """The highest leader term any node has claimed with (0 before any)."""
        value = self._run(
            lambda conn: conn.execute(sa.select(leader_table.c.term).where(leader_table.c.id == 1)).scalar(),
            write=False,
        )
        return int(value or 0)

    def last_occurrences(self) -> dict[str, datetime]:
        """Latest claimed instant per schedule, where catch-up resumes after a restart."""
        t = schedules_table
        rows = self._run(
            lambda conn: conn.execute(
                sa.select(t.c.name, t.c.last_occurrence).where(t.c.last_occurrence.is_not(None))
            ).all(),
            write=False,
        )
        return {name: at for name, at in rows}

    def schedule_states(self, names: Iterable[str] | None = None) -> list[ScheduleState]:
        """Per-schedule state and counters, by name, for operators and the overlap guard (only *names*, if given)."""
        t = schedules_table
        if names is None:
            rows = self._run(lambda conn: conn.execute(sa.select(t).order_by(t.c.name)).all(), write=False)
        else:
            wanted = sorted(set(names))

            def read(conn: Connection) -> list[Any]:
                out: list[Any] = []
                for chunk in _chunks(wanted, self._batch):
                    out.extend(conn.execute(sa.select(t).where(t.c.name.in_(chunk)).order_by(t.c.name)).all())
                return out

            rows = self._run(read, write=False) if wanted else []
        return [ScheduleState(**row._asdict()) for row in rows]

    def claims(
        self,
        schedule: str | None = None,
        since: datetime | None = None,
        *,
        limit: int | None = None,
    ) -> list[ClaimRow]:
        """Claim rows by scheduled instant, optionally of one schedule / from *since* on."""
        c = claims_table
        stmt = sa.select(*(c.c[f.name] for f in _CLAIM_ROW_FIELDS))
        if schedule is not None:
            stmt = stmt.where(c.c.schedule == schedule)
        if since is not None:
            stmt = stmt.where(c.c.scheduled_at >= _aware(since, "since"))
        stmt = stmt.order_by(c.c.scheduled_at, c.c.schedule)
        if limit is not None:
            stmt = stmt.limit(limit)
        rows = self._run(lambda conn: conn.execute(stmt).all(), write=False)
        return [ClaimRow(*row) for row in rows]

    # ------------------------------------------------------------------ housekeeping

    def prune(self, older_than: datetime, *, batch: int = 1000, max_batches: int | None = None) -> int:
        """Delete finished claim rows scheduled before *older_than*; returns how many.

        Each batch is its own short transaction so pruning a large backlog
        never holds locks long. Rows still ``claimed`` are kept: they await a
        (re)send. Per-schedule state lives in ``cluster_beat_schedules`` and is
        untouched.
        """
        cutoff = _aware(older_than, "older_than")
        if batch <= 0:
            raise ValueError(f"batch must be positive, got {batch!r}")
        c = claims_table

        def one_batch(conn: Connection) -> tuple[int, int]:
            # Select the keys first, then delete by key: MySQL refuses a
            # DELETE whose subquery reads the same table, and DELETE ... LIMIT
            # is not portable.
            keys = conn.execute(
                sa.select(c.c.schedule, c.c.scheduled_at)
                .where(c.c.scheduled_at < cutoff, c.c.status != "claimed")
                .order_by(c.c.scheduled_at, c.c.schedule)
                .limit(batch)
            ).all()
            if not keys:
                return 0, 0
            removed = 0
            for chunk in _chunks([tuple(k) for k in keys], self._batch):
                removed += self._delete_by_keys(conn, chunk)
            return len(keys), removed

        deleted = 0
        batches = 0
        while max_batches is None or batches < max_batches:
            selected, removed = self._run(one_batch)
            batches += 1
            deleted += removed
            if selected < batch:
                break
        return deleted


_CLAIM_ROW_FIELDS = ClaimRow.__dataclass_fields__.values()
