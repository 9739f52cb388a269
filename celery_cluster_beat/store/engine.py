"""The claim store's connection to its server: the URL, the engine, and one transaction at a time.

Everything here is about *how* the store talks to the database, not what it
says: parsing and checking the URL without touching the network (beat builds
stores lazily), the engine with its pool and the dialect's session settings
(lock and statement timeouts), opening and closing it, and :meth:`StoreEngine._run`,
the one way any query runs: a short transaction, retried when the server picked
it as a deadlock victim, timed for the metrics observer, its database errors
turned into :class:`~.errors.StoreUnavailable`.

:class:`StoreEngine` is the base of :class:`~.claims.ClaimStore`; the query
mixins (claiming, takeover, reads, pruning, ledger, ...) build on ``_run`` and
``_now``. Creating and migrating the tables on open is :mod:`.prepare`'s.
"""
from __future__ import annotations

import logging
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
from .dialects import SUPPORTED_BACKENDS, dialect_for
from .errors import StoreUnavailable
from .errors import database_errors as _database_errors

#: Named as before the store was split into modules: operators' logging configuration names it.
logger = logging.getLogger("celery_cluster_beat.store.claims")


#: How often a transaction the server aborted as a deadlock victim is retried.
_DEADLOCK_ATTEMPTS = 4

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

    def __enter__(self: S) -> S:
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

    @_database_errors
    def db_now(self) -> datetime:
        """The database's clock (aware UTC)."""
        return self._run(self._now, write=False)
