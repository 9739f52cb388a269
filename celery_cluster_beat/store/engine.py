"""The claim store's connection to its server: the URL, the engine, and one transaction at a time.

Everything here is about *how* the store talks to the database, not what it
says: parsing and checking the URL without touching the network (beat builds
stores lazily), the engine with its pool and the dialect's session settings
(lock and statement timeouts), opening and closing it, and :meth:`StoreEngine._run`,
the one way any query runs: a short transaction, retried when the server picked
it as a deadlock victim, timed for the metrics observer, its database errors
turned into :class:`~.errors.StoreUnavailable`.

Every connection use is bounded by ``db_timeout`` (``cluster_beat_db_timeout``):
the dialect's connect and session settings bound what the server and the
kernel can bound, and :mod:`.deadline`'s watchdog cuts a connection whose
server stopped answering (the pool's checkout and connect events tell it which
connection a call is on; the pre-ping is done here, inside the bound).

:class:`StoreEngine` is the base of :class:`~.claims.ClaimStore`; the query
mixins (claiming, takeover, reads, pruning, ledger, ...) build on ``_run`` and
``_now``. Creating and migrating the tables on open is :mod:`.prepare`'s.

A store opened with ``read_only=True`` (operators' reads: the CLI and the status page) writes
nothing at all, so a SELECT-only role is enough: it checks the schema instead of preparing it,
refuses any call that would write (:class:`~.errors.ReadOnlyStore`), and every session it opens is
read-only on the server as well (``SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY``, ``SET
SESSION TRANSACTION READ ONLY``, ``PRAGMA query_only``), so a write that slipped past is refused by
the database too. Operators' writes (``pause``, ``run-now``, ...) open with ``prepare=False``: they
write rows, but like reads they only check the schema, so a mistyped URL or an empty database is
refused (:class:`~.errors.StoreNotInitialised`) instead of given tables and a cluster id of its own,
and an older schema is left for beat to migrate (:class:`~.errors.OlderSchema`).

A SQLite claim file is created here, before SQLAlchemy opens it, with mode 0600 whatever the
umask (SQLite gives its ``-wal`` and ``-shm`` files the database file's mode): it holds
schedules' arguments and the operators' names.
"""
from __future__ import annotations

import logging
import math
import os
import random
import threading
import time
from contextlib import contextmanager
from datetime import datetime
from typing import TYPE_CHECKING, Any, Callable, Iterator, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine, make_url

from ..base import MAX_NODE_ID_LENGTH
from ..errors import ConfigError
from .deadline import DEFAULT_DB_TIMEOUT, WATCHDOG, Call
from .dialects import SUPPORTED_BACKENDS, dialect_for
from .dialects.sqlite import SQLiteDialect, claim_file, create_private
from .errors import ReadOnlyStore, StoreNotInitialised, StoreUnavailable
from .errors import database_errors as _database_errors

#: Named as before the store was split into modules: operators' logging configuration names it.
logger = logging.getLogger("celery_cluster_beat.store.claims")


#: How often a transaction the server aborted as a deadlock victim is retried.
_DEADLOCK_ATTEMPTS = 4
#: The server's own statement limit, as a share of ``db_timeout``: a slow statement is
#: cancelled by the server (the connection stays usable) before the client cuts it.
_SERVER_SHARE = 0.8
#: Marks a connection the pool has not handed out yet (nothing to ping).
_FRESH = "ccb_fresh"
#: The :class:`Call` a checked-out connection is watched for (its pool record's ``info``).
_CALL = "ccb_call"
#: Per backend: the session statement that makes every later transaction of a read-only store
#: read-only on the server (a write that slipped past :meth:`StoreEngine._connection` fails there too).
_READ_ONLY_SESSION = {
    "postgresql": "SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY",
    "mysql": "SET SESSION TRANSACTION READ ONLY",
    "mariadb": "SET SESSION TRANSACTION READ ONLY",
    "sqlite": "PRAGMA query_only = ON",
}

T = TypeVar("T")
S = TypeVar("S", bound="StoreEngine")


class StoreEngine:
    """The URL, the engine and the transaction runner under :class:`~.claims.ClaimStore`."""

    if TYPE_CHECKING:  # pragma: no cover

        def _prepare_schema(self, engine: Engine) -> None: ...

        def _check_schema(self, engine: Engine) -> None: ...

    def __init__(
        self,
        url: str,
        *,
        node_id: str,
        engine_options: dict[str, Any] | None = None,
        lock_timeout: float = 10.0,
        db_timeout: float | None = None,
        read_only: bool = False,
        prepare: bool | None = None,
    ) -> None:
        """Parse and validate only: beat builds stores lazily and a store that
        is never opened must not touch the network or the file system.

        *db_timeout* bounds every database call, connecting included (seconds;
        None: :data:`~.deadline.DEFAULT_DB_TIMEOUT`, the setting's default).
        *read_only*: open for reads only (see the module docstring): nothing is created,
        migrated or written, and an uninitialised database is refused on open
        (:class:`~.errors.StoreNotInitialised`). *prepare*: create and migrate the schema on open,
        as beat does (default: unless *read_only*); False checks it as a read-only open does."""
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
        db_timeout = DEFAULT_DB_TIMEOUT if db_timeout is None else db_timeout
        if (isinstance(db_timeout, bool) or not isinstance(db_timeout, (int, float))
                or not math.isfinite(db_timeout) or not 0.5 <= db_timeout <= 86400):
            raise ConfigError(f"setting cluster_beat_db_timeout: expected seconds between 0.5 and 86400, "
                              f"got {db_timeout!r}")
        self.node_id = node_id
        #: Opened for reads only: no preparation, no writes (see the module docstring).
        self.read_only = bool(read_only)
        #: Open creates and migrates the schema (beat); otherwise it only checks it (operators).
        self.prepare = not self.read_only if prepare is None else bool(prepare)
        if self.read_only and self.prepare:
            raise ValueError("a read-only store cannot prepare the schema")
        self.url_masked: str = self._url.render_as_string(hide_password=True)
        self._engine_options = dict(engine_options or {})
        self._lock_timeout = float(lock_timeout)
        #: Seconds any one database call may take (see the module docstring).
        self.db_timeout = float(db_timeout)
        self._ping = True  # the pool's pre-ping, done by _checkout inside the call's bound
        self._local = threading.local()  # .call: the Call running in this thread
        self._engine: Engine | None = None
        # Re-entrant: beat's SIGTERM handler calls close() in the very thread that may be inside open().
        self._open_lock = threading.RLock()
        self._dialect = dialect_for(backend)
        if isinstance(self._dialect, SQLiteDialect):
            self._dialect.read_only = not self.prepare  # leaves the file's journal mode as it is
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
        tolerates losing the race to another replica. Without :attr:`prepare` (operators),
        check the schema instead (:class:`~.errors.StoreNotInitialised` on an empty database).
        """
        with self._open_lock:
            if self._engine is not None:
                return
            self._claim_file()
            try:
                engine = sa.create_engine(self._url, **self._build_engine_options())
            except (ImportError, sa.exc.NoSuchModuleError) as exc:  # no driver: not an outage to retry
                raise ConfigError(self._driver_problem(exc)) from None
            # First, so the dialect's own set-up (and SQLAlchemy's first-connect queries) runs watched.
            sa.event.listen(engine, "connect", self._connected, insert=True)
            dialect = engine.dialect

            def checkout(dbapi_conn: Any, record: Any, proxy: Any) -> None:
                self._checkout(dialect, dbapi_conn, record)

            sa.event.listen(engine, "checkout", checkout)
            sa.event.listen(engine, "checkin", self._checkin)
            self._dialect.install_events(engine, self._lock_timeout, self.db_timeout * _SERVER_SHARE)
            if self.read_only:
                self._install_read_only(engine)
            try:
                if self.prepare:
                    self._prepare_schema(engine)
                else:
                    self._check_schema(engine)
                self._dialect.learn(engine.dialect)
            except BaseException:
                engine.dispose()
                raise
            self._engine = engine
            logger.debug("claim store open: %s (node %s)", self.url_masked, self.node_id)

    def _claim_file(self) -> None:
        """SQLite: create the claim file 0600 before SQLite does (it would make it 0644 less the
        umask); without :attr:`prepare`, refuse a missing file rather than let SQLite create it."""
        if not isinstance(self._dialect, SQLiteDialect):
            return
        path = claim_file(self._url)
        if path is None:  # in memory, or a file: URI (its own mode= and modeof= say how)
            return
        if not self.prepare:
            if not os.path.exists(path):
                raise StoreNotInitialised(path, "no claim database file at")
            return
        create_private(path)

    def _install_read_only(self, engine: Engine) -> None:
        """Every new connection of a read-only store: its transactions read-only on the server."""
        statement = _READ_ONLY_SESSION[self._url.get_backend_name()]

        @sa.event.listens_for(engine, "connect")
        def _read_only_session(dbapi_conn: Any, record: Any) -> None:
            cur = dbapi_conn.cursor()
            try:
                cur.execute(statement)
            finally:
                cur.close()
            dbapi_conn.commit()

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

    def __enter__(self: S) -> S:
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _build_engine_options(self) -> dict[str, Any]:
        options: dict[str, Any] = dict(self._dialect.engine_options(self._url, self.db_timeout))
        connect_args: dict[str, Any] = dict(options.pop("connect_args", {}))
        user = dict(self._engine_options)
        # The pre-ping is ours (_checkout): SQLAlchemy's would run before a call knows its connection.
        self._ping = bool(user.pop("pool_pre_ping", True))
        options["pool_pre_ping"] = False
        connect_args.update(user.pop("connect_args", {}) or {})
        if connect_args:
            options["connect_args"] = connect_args
        options.update(user)
        return options

    # ------------------------------------------------------------------ plumbing

    def _require_engine(self) -> Engine:
        engine = self._engine
        if engine is None:
            raise RuntimeError(f"{self!r} is not open; call open() first")
        return engine

    @contextmanager
    def _connection(self, engine: Engine, *, write: bool) -> Iterator[Connection]:
        """A pooled connection for one call, the call bounded by :attr:`db_timeout` from checkout to
        check-in; a call the bound cut off raises :class:`StoreUnavailable` saying so.

        The watch ends at check-in (:meth:`_checkin`, before the pool can hand the connection to
        another thread), not in the ``finally`` below, which runs after the connection is back."""
        if write and self.read_only:
            raise ReadOnlyStore(repr(self))
        call = Call(self.db_timeout, self.url_masked)
        local = self._local
        outer, local.call = getattr(local, "call", None), call
        WATCHDOG.arm(call)
        try:
            with engine.connect() as conn:
                options = self._dialect.write_options() if write else {}
                if options:
                    conn.execution_options(**options)
                yield conn
        except sa.exc.DBAPIError as exc:
            if call.cut:  # the watchdog logged it
                raise StoreUnavailable.timed_out(self.url_masked, self.db_timeout) from exc
            if call.overdue():  # the driver's own limit (connecting, or a socket it does not show)
                logger.warning("claim store %s: no answer within %gs (cluster_beat_db_timeout): %s",
                               self.url_masked, self.db_timeout, type(exc.orig).__name__)
                raise StoreUnavailable.timed_out(self.url_masked, self.db_timeout, exc) from exc
            raise
        finally:
            local.call = outer
            call.finish()

    # Pool events (registered on the engine by open()); they run in the thread of the call.

    def _connected(self, dbapi_conn: Any, record: Any) -> None:
        """A new connection: the call that opened it watches it (its session set-up too)."""
        record.info[_FRESH] = True
        call = getattr(self._local, "call", None)
        if call is not None:
            record.info[_CALL] = call
            call.watch(dbapi_conn)

    def _checkout(self, dialect: sa.engine.Dialect, dbapi_conn: Any, record: Any) -> None:
        """The pool hands out *dbapi_conn*: the call watches it, and it is pinged unless new.

        A ping that fails on a lost connection asks the pool for a new one, as SQLAlchemy's
        pre-ping does; once the call's bound has passed it fails the call instead.
        """
        call = getattr(self._local, "call", None)
        if call is not None:
            record.info[_CALL] = call
            call.watch(dbapi_conn)
        if record.info.pop(_FRESH, False) or not self._ping:
            return
        try:
            dialect.do_ping(dbapi_conn)
        except dialect.loaded_dbapi.Error as exc:
            if (call is None or not call.cut) and dialect.is_disconnect(exc, dbapi_conn, None):
                raise sa.exc.InvalidatePoolError(f"pre-ping: {type(exc).__name__}") from exc
            raise

    def _checkin(self, dbapi_conn: Any, record: Any) -> None:
        """The connection goes back to the pool (its reset, itself bounded, is done): its call lets
        go of it first, so a deadline passing from now on cannot cut it under its next user."""
        call = record.info.pop(_CALL, None)
        if call is not None:
            call.release()

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
                except StoreUnavailable:  # the call overran db_timeout (see _connection)
                    ok = False
                    raise
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

    @_database_errors
    def db_now(self) -> datetime:
        """The database's clock (aware UTC)."""
        return self._run(self._now, write=False)
