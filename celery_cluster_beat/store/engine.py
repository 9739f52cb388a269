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
"""
from __future__ import annotations

import logging
import math
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
from .errors import StoreUnavailable
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

T = TypeVar("T")
S = TypeVar("S", bound="StoreEngine")


class StoreEngine:
    """The URL, the engine and the transaction runner under :class:`~.claims.ClaimStore`."""

    if TYPE_CHECKING:  # pragma: no cover

        def _prepare_schema(self, engine: Engine) -> None: ...

    def __init__(
        self,
        url: str,
        *,
        node_id: str,
        engine_options: dict[str, Any] | None = None,
        lock_timeout: float = 10.0,
        db_timeout: float | None = None,
    ) -> None:
        """Parse and validate only: beat builds stores lazily and a store that
        is never opened must not touch the network or the file system.

        *db_timeout* bounds every database call, connecting included (seconds;
        None: :data:`~.deadline.DEFAULT_DB_TIMEOUT`, the setting's default)."""
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
            # First, so the dialect's own set-up (and SQLAlchemy's first-connect queries) runs watched.
            sa.event.listen(engine, "connect", self._connected, insert=True)
            dialect = engine.dialect

            def checkout(dbapi_conn: Any, record: Any, proxy: Any) -> None:
                self._checkout(dialect, dbapi_conn, record)

            sa.event.listen(engine, "checkout", checkout)
            sa.event.listen(engine, "checkin", self._checkin)
            self._dialect.install_events(engine, self._lock_timeout, self.db_timeout * _SERVER_SHARE)
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
