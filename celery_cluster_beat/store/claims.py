"""The SQL tick-claim store: the one place that makes "at most once" true.

Every replica computes the same occurrences (schedule name, nominal UTC
instant). Before sending one, a replica inserts its row into
``cluster_beat_claims`` whose primary key is exactly that pair, with an
insert-if-absent that is atomic in each dialect; it sends only the rows *it*
inserted. Two replicas can therefore both decide an occurrence is due, but
only one of them can win the row.

A leader lease (Redis, elsewhere) hands out a fencing token ("term") with
INCR. Each claiming transaction first raises ``cluster_beat_leader.term`` to
its own term with ``UPDATE ... WHERE term < :term OR (term = :term AND node =
:me)``: a deposed leader whose lease expired while it was paused finds a higher
term recorded (or its own term held by another node) and is refused
(:class:`StaleTermError`) in the same transaction that would have inserted its
claims, so it cannot claim anything after a newer leader has claimed.

Who may send a claimed row: its claimant, which confirms the row is still its
own just before publishing (:meth:`ClaimStore.confirm`); another node only once
the claimant is known to be gone by the database's clock: its heartbeat in
``cluster_beat_nodes`` is older than the grace, the claim is older than the
claimant's current start, or the claimant handed it over
(:meth:`ClaimStore.release`). Every time compared across nodes is the
database's (:meth:`ClaimStore.db_now`), never a node's own clock.

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
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Any, Callable, Iterable, Iterator, Sequence, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine, make_url

from .. import faults
from ..base import MAX_NAME_LENGTH, MAX_NODE_ID_LENGTH, clip
from ..errors import ConfigError
from ..schedules.instants import EPOCH, require_aware
from ..schedules.occurrence import Occurrence
from .dialects import SUPPORTED_BACKENDS, dialect_for
from .dialects.base import KEY_COLUMNS, ClaimValues, KeyedUpdate, Merge, chunks, claim_key, new_token
from .errors import SchemaVersionError, StaleTermError, StoreUnavailable
from .errors import database_errors as _database_errors
from .controls import ControlQueries
from .ledger import LedgerQueries
from .opsqueries import OpsQueries
from .stored import StoredScheduleQueries
from .schema import (
    CLAIM_KEY,
    MIGRATIONS,
    SCHEMA_VERSION,
    STATUSES,
    TASK_ID_LENGTH,
    ClaimRow,
    ClaimStatus,
    NodeState,
    ScheduleState,
    claims_table,
    leader_table,
    meta_table,
    metadata,
    nodes_table,
    schedule_version_table,
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


#: How often a transaction the server aborted as a deadlock victim is retried.
_DEADLOCK_ATTEMPTS = 4

#: The node a released claim is given: no node has this id (node ids are never empty),
#: so the row reads as its claimant's being gone and the next sweep takes it at once.
RELEASED = ""

#: Seconds one prune statement may run (where the server can bound it).
PRUNE_STATEMENT_TIMEOUT = 5.0

T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])


def _unique(occurrences: Iterable[Occurrence]) -> list[Occurrence]:
    """Input order, first of each (schedule, instant) kept."""
    seen: set[tuple[str, datetime]] = set()
    out = []
    for occ in occurrences:
        k = claim_key(occ)
        if k not in seen:
            seen.add(k)
            out.append(occ)
    return out


#: Above this many names, :meth:`ClaimStore.last_occurrences` reads the whole table once and
#: filters, instead of looking the names up 500 at a time.
_READ_ALL_ABOVE = 2000


class ClaimStore(LedgerQueries, StoredScheduleQueries, ControlQueries, OpsQueries):
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
        if backend not in SUPPORTED_BACKENDS:
            raise ConfigError(
                f"cluster_beat database URL uses {backend!r}; supported: {', '.join(SUPPORTED_BACKENDS)}"
            )
        if not node_id or not isinstance(node_id, str) or len(node_id) > MAX_NODE_ID_LENGTH:
            raise ConfigError(
                f"node_id must be a non-empty string of at most {MAX_NODE_ID_LENGTH} characters, got {node_id!r}"
            )
        if lock_timeout <= 0:
            raise ConfigError(f"lock_timeout must be positive, got {lock_timeout!r}")
        self.node_id = node_id
        self.url_masked: str = self._url.render_as_string(hide_password=True)
        self._engine_options = dict(engine_options or {})
        self._lock_timeout = float(lock_timeout)
        self._engine: Engine | None = None
        # Re-entrant: beat's SIGTERM handler calls close() in the very thread that may be inside open().
        self._open_lock = threading.RLock()
        self._dialect = dialect_for(backend)
        self._cluster_id: str | None = None
        #: Called after each transaction with its duration (seconds, retries included) and whether it
        #: succeeded (False: the database failed it); the metrics hook in here. Must not raise.
        self.observer: Callable[[float, bool], None] | None = None

    @property
    def cluster_id(self) -> str:
        """The random id this database was given when its tables were created (known once open).

        Nodes sharing a lease must share a store: the lease compares this id.
        """
        if self._cluster_id is None:
            raise RuntimeError(f"{self!r} is not open; call open() first")
        return self._cluster_id

    def __repr__(self) -> str:
        return f"<ClaimStore {self.url_masked} node={self.node_id!r}>"

    # ------------------------------------------------------------------ life cycle

    @_database_errors
    def open(self) -> None:
        """Connect, create missing tables and refuse a newer schema; a no-op when open.

        Replicas starting together all run this at once, so table creation
        tolerates losing the race to another replica.
        """
        with self._open_lock:
            if self._engine is not None:
                return
            try:
                engine = sa.create_engine(self._url, **self._build_engine_options())
            except (ImportError, sa.exc.NoSuchModuleError) as exc:  # no driver: not an outage to retry
                raise ConfigError(self._driver_problem(exc)) from None
            self._dialect.install_events(engine, self._lock_timeout)
            try:
                self._prepare_schema(engine)
                self._dialect.learn(engine.dialect)
            except BaseException:
                engine.dispose()
                raise
            self._engine = engine
            logger.debug("claim store open: %s (node %s)", self.url_masked, self.node_id)

    #: Per backend: the driver we test with, in its URL form, and the extra that installs it.
    _DRIVERS = {"postgresql": ("psycopg", "postgres"), "mysql": ("pymysql", "mysql"), "mariadb": ("pymysql", "mysql")}

    def _driver_problem(self, exc: BaseException) -> str:
        """What to do when SQLAlchemy cannot load the URL's database driver."""
        backend = self._url.get_backend_name()
        if isinstance(exc, ImportError):
            what = f"its driver module {exc.name or str(exc)!r} is not installed"
        else:
            what = f"SQLAlchemy has no driver {self._url.get_driver_name()!r} for {backend}"
        problem = f"setting cluster_beat_db_url: {self.url_masked}: {what}"
        if backend not in self._DRIVERS:
            return problem
        driver, extra = self._DRIVERS[backend]
        suggested = self._url.set(drivername=f"{backend}+{driver}").render_as_string(hide_password=True)
        return (f"{problem}; use the URL form {backend}+{driver}:// ({suggested}) and install the driver "
                f"with pip install 'celery-cluster-beat[{extra}]'")

    @_database_errors
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
        options: dict[str, Any] = {"pool_pre_ping": True, **self._dialect.engine_options(self._url)}
        connect_args: dict[str, Any] = dict(options.pop("connect_args", {}))
        user = dict(self._engine_options)
        connect_args.update(user.pop("connect_args", {}) or {})
        if connect_args:
            options["connect_args"] = connect_args
        options.update(user)
        return options

    def _prepare_schema(self, engine: Engine) -> None:
        attempts = 4
        for attempt in range(1, attempts + 1):
            # Failing to connect is not a race: let it propagate at once.
            with self._connection(engine, write=True) as conn:
                try:
                    with conn.begin():
                        found = self._check_version(conn)
                        if found is not None and found < SCHEMA_VERSION:
                            self._migrate(conn, found)
                        metadata.create_all(conn, checkfirst=True)
                        self._dialect.insert_if_absent(
                            conn,
                            meta_table,
                            [{"key": "schema_version", "value": str(SCHEMA_VERSION)},
                             {"key": "cluster_id", "value": new_token()}],
                            ["key"],
                        )
                        self._insert_leader_row(conn)
                        self._dialect.insert_if_absent(conn, schedule_version_table, [{"id": 1, "version": 0}], ["id"])
                        # A concurrent opener may have stamped first: check again.
                        self._check_version(conn)
                        self._cluster_id = conn.execute(
                            sa.select(meta_table.c.value).where(meta_table.c.key == "cluster_id")
                        ).scalar_one()
                    return
                except sa.exc.DBAPIError as exc:
                    # Another replica created a table between our "exists?"
                    # check and our CREATE; the next round sees it and skips it.
                    if attempt == attempts or exc.connection_invalidated:
                        raise
                    logger.debug("schema creation raced another node (%s); retrying", exc.orig)
            time.sleep(0.1 * attempt + random.random() * 0.1)

    def _migrate(self, conn: Connection, found: int) -> None:
        """Bring a store written by an older release up to :data:`SCHEMA_VERSION`, step by step."""
        for version in range(found, SCHEMA_VERSION):
            logger.info("claim store %s: migrating the schema from version %d to %d",
                        self.url_masked, version, version + 1)
            for step in MIGRATIONS.get(version, ()):
                step(conn)
        conn.execute(
            sa.update(meta_table).where(meta_table.c.key == "schema_version").values(value=str(SCHEMA_VERSION))
        )

    def _check_version(self, conn: Connection) -> int | None:
        """The schema version the database records (None for a new database); refuses a newer one."""
        if not sa.inspect(conn).has_table(meta_table.name):
            return None
        raw = conn.execute(
            sa.select(meta_table.c.value).where(meta_table.c.key == "schema_version")
        ).scalar_one_or_none()
        if raw is None:
            return None
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
        return version

    # ------------------------------------------------------------------ plumbing

    def _require_engine(self) -> Engine:
        engine = self._engine
        if engine is None:
            raise RuntimeError(f"{self!r} is not open; call open() first")
        return engine

    @contextmanager
    def _connection(self, engine: Engine, *, write: bool) -> Iterator[Connection]:
        with engine.connect() as conn:
            options = self._dialect.write_options() if write else {}
            if options:
                conn.execution_options(**options)
            yield conn

    def _run(self, work: Callable[[Connection], T], *, write: bool = True) -> T:
        """Run *work* in one transaction, retrying if the server picked it as a deadlock victim.

        Retrying is safe because the whole transaction was rolled back.
        """
        engine = self._require_engine()
        started, ok = time.monotonic(), True
        try:
            for attempt in range(1, _DEADLOCK_ATTEMPTS + 1):
                try:
                    with self._connection(engine, write=write) as conn, conn.begin():
                        return work(conn)
                except sa.exc.DBAPIError as exc:
                    if attempt == _DEADLOCK_ATTEMPTS or not self._dialect.is_deadlock(exc):
                        ok = False
                        raise StoreUnavailable.wrap(exc, self.url_masked) from exc
                    logger.info("claim store: deadlock (attempt %d), retrying: %s", attempt, exc.orig)
                    time.sleep(random.uniform(0.005, 0.05) * attempt)
            raise AssertionError("unreachable")  # pragma: no cover
        finally:
            observer = self.observer
            if observer is not None:
                try:
                    observer(time.monotonic() - started, ok)
                except Exception:  # metrics must never fail a transaction
                    logger.debug("claim store: observer failed", exc_info=True)

    def _now(self, conn: Connection) -> datetime:
        return self._dialect.db_now(conn)

    def _insert_leader_row(self, conn: Connection) -> None:
        """Create the leader row (term 0) unless it exists."""
        self._dialect.insert_if_absent(
            conn, leader_table, [{"id": 1, "term": 0, "node": None, "updated_at": self._now(conn)}], ["id"]
        )

    def _fence(self, conn: Connection, term: int | None) -> None:
        """Raise the recorded term to *term*, or refuse: it holds the leader row
        lock until commit, so fenced writers are serialized on it.

        An equal term is ours only if we recorded it: two nodes holding "the
        same" term (two leases over one store) are refused, not both admitted.
        """
        if term is None:
            return
        term = int(term)
        lt = leader_table
        for _ in range(2):
            result = conn.execute(
                sa.update(lt)
                .where(lt.c.id == 1, sa.or_(lt.c.term < term, sa.and_(lt.c.term == term, lt.c.node == self.node_id)))
                .values(term=term, node=self.node_id, updated_at=self._now(conn))
            )
            if result.rowcount:
                return
            seen = conn.execute(sa.select(lt.c.term).where(lt.c.id == 1)).scalar()
            if seen is not None:
                raise StaleTermError(int(seen), term)
            # Row deleted by hand: recreate it, then fence again.
            self._insert_leader_row(conn)
        raise RuntimeError("cluster_beat_leader row 1 cannot be written")  # pragma: no cover

    def _upsert_schedules(
        self,
        conn: Connection,
        rows: list[dict[str, Any]],
        *,
        now: datetime,
        add: Sequence[str] = (),
        greatest: Sequence[str] = (),
        assign: Sequence[str] = (),
        forward: tuple[str, Sequence[str]] | None = None,
    ) -> None:
        """Insert or merge per-schedule state: counters in *add* are summed,
        datetimes in *greatest* keep the later value, *assign* overwrites,
        *forward* assigns only what is not older (see :class:`Merge`)."""
        if not rows:
            return
        rows = sorted(rows, key=lambda r: r["name"])  # global lock order
        for row in rows:
            row["updated_at"] = now
        merge = Merge(add=add, greatest=greatest, assign=(*assign, "updated_at"), forward=forward)
        self._dialect.upsert(conn, schedules_table, rows, "name", merge)

    def _validate(self, occurrences: Sequence[Occurrence]) -> list[Occurrence]:
        # Refuse what the columns cannot hold exactly: a truncated name would
        # claim another schedule's key.
        unique = _unique(occurrences)
        for occ in unique:
            if not occ.schedule or len(occ.schedule) > MAX_NAME_LENGTH:
                raise ValueError(f"schedule name must have 1 to {MAX_NAME_LENGTH} characters: {occ.schedule!r}")
            if len(occ.task_id) > TASK_ID_LENGTH:
                raise ValueError(
                    f"task id longer than {TASK_ID_LENGTH} characters for {occ.schedule!r}: {occ.task_id!r}"
                )
            self._dialect.check_name(occ.schedule)
        return unique

    # ------------------------------------------------------------------ claiming

    @_database_errors
    def claim(self, occurrences: Sequence[Occurrence], *, term: int | None = None, token: str | None = None,
              resume: bool = False, reason: str | None = None) -> list[Occurrence]:
        """Claim occurrences for sending; only the returned ones may be sent by this node.

        One transaction: fence with *term*, insert-if-absent every
        occurrence, update per-schedule state. The result is exactly the
        occurrences this call inserted (input order); the rest were already
        claimed by some node and are counted as ``claim_lost``.

        *token* marks the rows written. With *resume*, a claim retried after an
        error (a commit whose reply was lost) passes the failed attempt's token:
        rows that attempt wrote count as won, not as claimed by another node.

        *reason* stays on the rows (``manual`` for an operator's run-now).

        Raises StaleTermError (and writes nothing) when a higher term than
        *term* is recorded.
        """
        won = self._insert(occurrences, status=ClaimStatus.CLAIMED, reason=reason, term=term,
                           token=token or new_token(), resume=resume)
        faults.hit("claim-committed", error=StoreUnavailable)  # committed; the reply may yet be lost
        return won

    @_database_errors
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
        if status not in (ClaimStatus.SKIPPED, ClaimStatus.MISSED):
            raise ValueError(
                f"record() status must be {ClaimStatus.SKIPPED.value!r} or {ClaimStatus.MISSED.value!r}, "
                f"not {status!r}"
            )
        if not reason:
            raise ValueError("record() needs a reason (e.g. 'overlap', 'catchup')")
        return self._insert(occurrences, status=ClaimStatus(status), reason=clip(str(reason)), term=term,
                            token=new_token())

    def _insert(
        self, occurrences: Sequence[Occurrence], *, status: ClaimStatus, reason: str | None, term: int | None,
        token: str, resume: bool = False,
    ) -> list[Occurrence]:
        unique = self._validate(occurrences)
        if not unique:
            return []
        ordered = sorted(unique, key=claim_key)  # same lock order in every replica
        claiming = status is ClaimStatus.CLAIMED

        def work(conn: Connection) -> set[tuple[str, datetime]]:
            self._fence(conn, term)
            faults.hit("claim-in-transaction")
            now = self._now(conn)
            shared = ClaimValues(claimed_at=now, node=self.node_id, term=term, status=status.value, reason=reason,
                                 token=token)
            won = self._dialect.insert_claims(conn, ordered, shared)
            if resume:
                rest = [occ for occ in ordered if claim_key(occ) not in won]
                if rest:
                    won |= self._dialect.keys_written(conn, token, rest)
            per: dict[str, dict[str, Any]] = {}
            counter = "claim_lost" if claiming else status.value
            for occ in ordered:
                state = per.setdefault(
                    occ.schedule, {"name": occ.schedule, "last_occurrence": occ.at, "claim_lost": 0, counter: 0}
                )
                if occ.at > state["last_occurrence"]:
                    state["last_occurrence"] = occ.at
                if claim_key(occ) in won:
                    if not claiming:
                        state[counter] += 1
                else:
                    state["claim_lost"] += 1
            add = ("claim_lost",) if claiming else ("claim_lost", counter)
            self._upsert_schedules(conn, list(per.values()), now=now, add=add, greatest=("last_occurrence",))
            return won

        won = self._run(work)
        return [occ for occ in unique if claim_key(occ) in won]

    @_database_errors
    def mark_sent(self, occurrences: Sequence[Occurrence]) -> int:
        """Record that these claimed occurrences were published.

        Only rows this node still owns in status ``claimed`` change: if a
        sweeper took a row over meanwhile, that node will (re)send it and
        owns its bookkeeping. Returns how many rows changed.
        """
        unique = _unique(occurrences)
        if not unique:
            return 0
        ordered = sorted(unique, key=claim_key)
        c = claims_table

        def work(conn: Connection) -> int:
            now = self._now(conn)
            changed: list[Any] = []
            for chunk in chunks(ordered, self._dialect.batch):
                update = KeyedUpdate(
                    cols=CLAIM_KEY,
                    keys=[claim_key(o) for o in chunk],
                    where={"node": self.node_id, "status": ClaimStatus.CLAIMED.value},
                    values={"status": ClaimStatus.SENT.value, "sent_at": now},
                    increment=("attempts",),
                    returning=(*KEY_COLUMNS, c.c.task_id),
                    expected=[(o.schedule, o.at, o.task_id) for o in chunk],
                )
                changed.extend(self._dialect.update_by_keys(conn, update))
            per: dict[str, dict[str, Any]] = {}
            for schedule, at, task_id in changed:
                state = per.setdefault(
                    schedule,
                    {"name": schedule, "sent": 0, "last_task_id": task_id, "last_sent_at": now,
                     "last_sent_occurrence": at},
                )
                state["sent"] += 1
                if at > state["last_sent_occurrence"]:
                    state["last_sent_occurrence"] = at
                    state["last_task_id"] = task_id
            # The last run only moves forward: a late (re)send of an older occurrence
            # must not make the overlap guard watch that older run.
            self._upsert_schedules(conn, list(per.values()), now=now, add=("sent",),
                                   forward=("last_sent_occurrence", ("last_task_id", "last_sent_at")))
            return len(changed)

        return self._run(work)

    @_database_errors
    def mark_failed(self, occurrence: Occurrence, error: str, *, final: bool = False) -> bool:
        """Record a failed publish attempt.

        The row stays ``claimed`` so it is retried (by this node, or by a
        sweeper if this node dies) unless *final*, which gives up on it
        (``failed``). Returns False when this node no longer owns the
        claimed row (nothing recorded then).
        """
        error = clip(str(error))
        c = claims_table

        def work(conn: Connection) -> bool:
            now = self._now(conn)
            values: dict[str, Any] = {"reason": error, "attempts": c.c.attempts + 1}
            if final:
                values["status"] = ClaimStatus.FAILED.value
            else:  # still ours and being retried: keep the row from looking abandoned to sweepers
                values["claimed_at"] = now
            result = conn.execute(
                sa.update(c)
                .where(
                    c.c.schedule == occurrence.schedule,
                    c.c.scheduled_at == occurrence.at,
                    c.c.node == self.node_id,
                    c.c.status == ClaimStatus.CLAIMED.value,
                )
                .values(**values)
            )
            if result.rowcount != 1:
                return False
            state = {"name": occurrence.schedule, "last_error": error, "last_error_at": now, "failed": int(final)}
            self._upsert_schedules(conn, [state], now=now, add=("failed",), assign=("last_error", "last_error_at"))
            return True

        return self._run(work)

    @_database_errors
    def take_over_stale(self, grace: float, *, term: int | None = None, limit: int = 500) -> list[Occurrence]:
        """Adopt rows left ``claimed`` by a node that is gone, so they get sent.

        Gone, by the database's clock: the claimant's heartbeat is older than
        *grace* seconds, or the claim predates the claimant's current start (it
        restarted), or it handed the row over (:meth:`release`), or it never
        heartbeated at all. A row is taken only once it is itself older than
        *grace*, and not before its instant (a leader claims a moment ahead). This node's own rows older than *grace* are adopted too: they
        are ones it lost track of (the caller skips those it is retrying).

        The UPDATE repeats each row's old node and claimed_at in its WHERE, so
        when two sweepers race, the second finds the row changed and skips
        it: each stale row is adopted exactly once. The returned occurrences
        keep their task id, so the resend is recognisable as the same task.
        Fenced like :meth:`claim`.
        """
        if limit <= 0:
            return []
        c, n = claims_table, nodes_table

        def work(conn: Connection) -> list[Occurrence]:
            self._fence(conn, term)
            now = self._now(conn)
            cutoff = now - timedelta(seconds=grace)
            gone = sa.or_(n.c.node.is_(None), n.c.heartbeat_at < cutoff, c.c.claimed_at < n.c.started_at,
                          c.c.node == self.node_id)
            query = (
                sa.select(*KEY_COLUMNS, c.c.node, c.c.claimed_at, c.c.task_id)
                .select_from(c.outerjoin(n, n.c.node == c.c.node))
                # Claimed ahead of its instant and handed over: not published before the instant.
                .where(c.c.status == ClaimStatus.CLAIMED.value, c.c.claimed_at < cutoff, gone,
                       c.c.scheduled_at <= now)
                .order_by(c.c.claimed_at, *KEY_COLUMNS)
                .limit(limit)
            )
            stale = conn.execute(self._dialect.lock_stale(query)).all()
            if not stale:
                return []
            stale = sorted(stale)
            taken: list[Any] = []
            for rows in chunks(stale, self._dialect.batch):
                update = KeyedUpdate(
                    cols=(*CLAIM_KEY, "node", "claimed_at"),
                    keys=[(r[0], r[1], r[2], r[3]) for r in rows],
                    where={"status": ClaimStatus.CLAIMED.value},
                    values={"node": self.node_id, "claimed_at": now, "term": term},
                    returning=(*KEY_COLUMNS, c.c.task_id),
                    expected=[(r[0], r[1], r[4]) for r in rows],
                )
                taken.extend(self._dialect.update_by_keys(conn, update))
            per: dict[str, dict[str, Any]] = {}
            for schedule, _at, _task_id in taken:
                per.setdefault(schedule, {"name": schedule, "resent": 0})["resent"] += 1
            self._upsert_schedules(conn, list(per.values()), now=now, add=("resent",))
            return [Occurrence(s, at, task_id=task_id) for s, at, task_id in sorted(taken)]

        return self._run(work)

    @_database_errors
    def confirm(self, occurrences: Sequence[Occurrence], *, term: int | None = None) -> list[Occurrence]:
        """The occurrences still claimed by this node, with their claims refreshed; the one
        statement a sender runs just before publishing them.

        Rows another node took over meanwhile are not returned (and must not
        be published here). Fenced like :meth:`claim`; refreshes this node's
        heartbeat too, so a long burst keeps it alive.
        """
        unique = sorted(_unique(occurrences), key=claim_key)
        if not unique:
            return []

        def work(conn: Connection) -> list[Any]:
            self._fence(conn, term)
            now = self._now(conn)
            mine: list[Any] = []
            for chunk in chunks(unique, self._dialect.batch):
                update = KeyedUpdate(
                    cols=CLAIM_KEY,
                    keys=[claim_key(o) for o in chunk],
                    where={"node": self.node_id, "status": ClaimStatus.CLAIMED.value},
                    values={"claimed_at": now},
                    returning=KEY_COLUMNS,
                    expected=[claim_key(o) for o in chunk],
                )
                mine.extend(self._dialect.update_by_keys(conn, update))
            conn.execute(sa.update(nodes_table).where(nodes_table.c.node == self.node_id).values(heartbeat_at=now))
            return mine

        kept = {(r[0], r[1]) for r in self._run(work)}
        return [occ for occ in occurrences if claim_key(occ) in kept]

    @_database_errors
    def release(self) -> int:
        """Hand every row this node holds in ``claimed`` to the next sender; returns how many.

        For a node that stops scheduling (lease lost, shut down): its unsent
        claims are taken over by the next sweep instead of after the grace.
        Call it only once every message this node published is marked sent.
        """
        c = claims_table

        def work(conn: Connection) -> int:
            result = conn.execute(
                sa.update(c)
                .where(c.c.node == self.node_id, c.c.status == ClaimStatus.CLAIMED.value)
                .values(node=RELEASED, claimed_at=EPOCH, reason=clip(f"released by {self.node_id}"),
                        op_token=new_token())
            )
            return max(result.rowcount, 0)

        return self._run(work)

    @_database_errors
    def heartbeat(self, *, scheduling: bool, clock_offset: float | None = None, register: bool = False) -> datetime:
        """Record that this node is alive (by the database's clock) and return that time.

        *register* starts a new incarnation: claims this node id made before
        now count as a stopped node's and may be taken over.
        """

        def work(conn: Connection) -> datetime:
            now = self._now(conn)
            row = {"node": self.node_id, "started_at": now, "heartbeat_at": now, "scheduling": bool(scheduling),
                   "clock_offset": clock_offset}
            assign = ("heartbeat_at", "scheduling", "clock_offset") + (("started_at",) if register else ())
            self._dialect.upsert(conn, nodes_table, [row], "node", Merge(assign=assign))
            return now

        return self._run(work)

    def check_names(self, names: Iterable[str]) -> None:
        """Refuse (ConfigError) schedule names this database would compare equal to others."""
        problems = []
        for name in names:
            try:
                self._dialect.check_name(name)
            except ValueError as exc:
                problems.append(f"beat_schedule entry {name!r}: name: {exc}")
        if problems:
            raise ConfigError(problems)

    @_database_errors
    def db_now(self) -> datetime:
        """The database's clock (aware UTC)."""
        return self._run(self._now, write=False)

    # ------------------------------------------------------------------ reading

    @_database_errors
    def current_term(self) -> int:
        """The highest leader term any node has claimed with (0 before any)."""
        value = self._run(
            lambda conn: conn.execute(sa.select(leader_table.c.term).where(leader_table.c.id == 1)).scalar(),
            write=False,
        )
        return int(value or 0)

    @_database_errors
    def last_occurrences(self, names: Iterable[str] | None = None) -> dict[str, datetime]:
        """Per schedule (only *names*, if given), where catch-up resumes: its latest recorded
        instant, or for a schedule nothing was ever recorded of, the time a scheduling node
        first saw it (:meth:`register`)."""
        t = schedules_table
        stmt = sa.select(t.c.name, sa.func.coalesce(t.c.last_occurrence, t.c.registered_at)).where(
            sa.or_(t.c.last_occurrence.is_not(None), t.c.registered_at.is_not(None)))
        if names is None:
            return {name: at for name, at in self._run(lambda conn: conn.execute(stmt).all(), write=False)}
        wanted = sorted(set(names))
        if len(wanted) > _READ_ALL_ABOVE:  # every entry at start-up: one read may beat a lookup per 500

            def read_all(conn: Connection) -> dict[str, datetime] | None:
                total = conn.execute(sa.select(sa.func.count()).select_from(t)).scalar_one()
                if total > 2 * len(wanted):  # mostly other schedules' rows (stored ones): look up
                    return None
                keep = set(wanted)
                return {name: at for name, at in conn.execute(stmt) if name in keep}

            found = self._run(read_all, write=False)
            if found is not None:
                return found

        def read(conn: Connection) -> dict[str, datetime]:
            out: dict[str, datetime] = {}
            for part in chunks(wanted, 500):
                out.update((name, at) for name, at in conn.execute(stmt.where(t.c.name.in_(list(part)))))
            return out

        return self._run(read, write=False)

    @_database_errors
    def register(self, names: Sequence[str]) -> datetime:
        """Record that a scheduling node knows these schedules from now on (database clock);
        names already known keep their record. Returns that time.

        A schedule's first occurrence that falls due while no node schedules (a
        failover) is then caught up from here instead of being skipped unseen.
        """

        def work(conn: Connection) -> datetime:
            now = self._now(conn)
            self._dialect.insert_names(conn, schedules_table, sorted(set(names)), now)
            return now

        return self._run(work)

    @_database_errors
    def schedule_states(self, names: Iterable[str] | None = None) -> list[ScheduleState]:
        """Per-schedule state and counters, by name, for operators and the overlap guard (only *names*, if given)."""
        t = schedules_table
        if names is None:
            rows = self._run(lambda conn: conn.execute(sa.select(t).order_by(t.c.name)).all(), write=False)
        else:
            wanted = sorted(set(names))

            def read(conn: Connection) -> list[Any]:
                out: list[Any] = []
                for chunk in chunks(wanted, self._dialect.batch):
                    out.extend(conn.execute(sa.select(t).where(t.c.name.in_(chunk)).order_by(t.c.name)).all())
                return out

            rows = self._run(read, write=False) if wanted else []
        return [ScheduleState(**row._asdict()) for row in rows]

    @_database_errors
    def nodes(self) -> list[NodeState]:
        """Every node that has heartbeated to this store, most recent first."""
        n = nodes_table
        rows = self._run(
            lambda conn: conn.execute(
                sa.select(n.c.node, n.c.started_at, n.c.heartbeat_at, n.c.scheduling, n.c.clock_offset)
                .order_by(n.c.heartbeat_at.desc(), n.c.node)
            ).all(),
            write=False,
        )
        return [NodeState(*row) for row in rows]

    @_database_errors
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
            stmt = stmt.where(c.c.scheduled_at >= require_aware(since, "since"))
        stmt = stmt.order_by(c.c.scheduled_at, c.c.schedule)
        if limit is not None:
            stmt = stmt.limit(limit)
        rows = self._run(lambda conn: conn.execute(stmt).all(), write=False)
        return [ClaimRow(*row) for row in rows]

    # ------------------------------------------------------------------ housekeeping

    @_database_errors
    def prune(self, older_than: datetime, *, batch: int = 1000, max_batches: int | None = None) -> int:
        """Delete finished claim rows scheduled before *older_than*; returns how many.

        Each batch is its own short transaction so pruning a large backlog
        never holds locks long. Rows still ``claimed`` are kept: they await a
        (re)send. Per-schedule state lives in ``cluster_beat_schedules`` and is
        untouched.
        """
        return self._prune(older_than, batch=batch, max_batches=max_batches)[0]

    @_database_errors
    def prune_pass(self, older_than: datetime, *, time_budget: float, batch: int = 1000) -> tuple[int, bool]:
        """Prune like :meth:`prune` for at most *time_budget* seconds; (rows deleted, done).

        The scheduler calls this a pass at a time, so pruning keeps up with any
        rate of new rows without ever holding up the loop for long.
        """
        return self._prune(older_than, batch=batch, deadline=time.monotonic() + time_budget)

    def _prune(self, older_than: datetime, *, batch: int, max_batches: int | None = None,
               deadline: float | None = None) -> tuple[int, bool]:
        cutoff = require_aware(older_than, "older_than")
        if batch <= 0:
            raise ValueError(f"batch must be positive, got {batch!r}")
        c = claims_table
        timeout = self._dialect.statement_timeout_sql(PRUNE_STATEMENT_TIMEOUT)

        def one_batch(conn: Connection) -> tuple[int, int]:
            if timeout is None:
                return delete_batch(conn)
            set_timeout, reset = timeout
            conn.exec_driver_sql(set_timeout)
            try:
                return delete_batch(conn)
            finally:
                if reset:
                    conn.exec_driver_sql(reset)

        def delete_batch(conn: Connection) -> tuple[int, int]:
            # Select the keys first, then delete by key: MySQL refuses a
            # DELETE whose subquery reads the same table, and DELETE ... LIMIT
            # is not portable.
            keys = conn.execute(
                sa.select(*KEY_COLUMNS)
                .where(c.c.scheduled_at < cutoff, c.c.status != ClaimStatus.CLAIMED.value)
                .order_by(c.c.scheduled_at, c.c.schedule)
                .limit(batch)
            ).all()
            if not keys:
                return 0, 0
            removed = 0
            for chunk in chunks([tuple(k) for k in keys], self._dialect.batch):
                removed += self._dialect.delete_finished(conn, chunk)
            return len(keys), removed

        deleted = 0
        batches = 0
        while True:
            selected, removed = self._run(one_batch)
            batches += 1
            deleted += removed
            if selected < batch:
                return deleted, True
            if (max_batches is not None and batches >= max_batches) or (
                    deadline is not None and time.monotonic() >= deadline):
                return deleted, False


_CLAIM_ROW_FIELDS = ClaimRow.__dataclass_fields__.values()
