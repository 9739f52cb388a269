"""What the claim store raises, so callers need not know SQLAlchemy."""
from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar, cast

import sqlalchemy as sa

from ..errors import ConfigError

F = TypeVar("F", bound=Callable[..., Any])


def database_errors(method: F) -> F:
    """Turn any SQLAlchemy error escaping the store method *method* into :class:`StoreUnavailable`.

    Callers back off on that one type without importing SQLAlchemy. Our own
    errors (StaleTermError, SchemaVersionError, ConfigError, ValueError) are
    not SQLAlchemy's and pass unchanged.
    """

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except sa.exc.SQLAlchemyError as exc:
            raise StoreUnavailable.wrap(exc, self.url_masked) from exc

    return cast(F, wrapper)


class StoreUnavailable(RuntimeError):
    """The claim database could not do what was asked (unreachable, timed out, refused).

    The one error type the store raises for database trouble: the beat loop
    backs off on it without importing SQLAlchemy. The message is the error's
    class and first line with the URL's password masked, never the SQL or its
    parameters; the original exception is the ``__cause__``.
    """

    @classmethod
    def wrap(cls, exc: BaseException, where: str) -> "StoreUnavailable":
        orig = getattr(exc, "orig", None) or exc
        first = (str(orig).strip().splitlines() or [""])[0]
        return cls(f"claim store {where}: {type(orig).__name__}: {first}")

    @classmethod
    def timed_out(cls, where: str, seconds: float, exc: BaseException | None = None) -> "StoreUnavailable":
        """The call overran ``cluster_beat_db_timeout`` (*seconds*): the server stopped answering,
        or answers too slowly; *exc* is what the driver said, if it said something else than
        that its connection was cut."""
        said = ""
        if exc is not None:
            orig = getattr(exc, "orig", None) or exc
            said = f" ({type(orig).__name__}: {(str(orig).strip().splitlines() or [''])[0]})"
        return cls(f"claim store {where}: no answer within {seconds:g}s (cluster_beat_db_timeout){said}")


class StaleTermError(RuntimeError):
    """A higher leader term is recorded in the database than the one we hold.

    The caller is no longer (or was never) the leader: a newer leader has
    already claimed with its term, so anything we claimed now could duplicate
    its sends. Nothing was written by the refused call.
    """

    def __init__(self, seen_term: int, term: int) -> None:
        self.seen_term = seen_term
        self.term = term
        super().__init__(
            f"leader term {term} is stale: term {seen_term} is already recorded in the "
            "claim database, so another node has become leader since; not claiming"
        )

    def __reduce__(self) -> tuple[Any, ...]:  # survive pickling (multiprocessing, logging handlers)
        return (type(self), (self.seen_term, self.term))


class SchemaVersionError(ConfigError):
    """The database was written by a newer celery-cluster-beat than this one.

    Opening it anyway could corrupt data the newer version relies on, so we
    refuse at start-up and say which versions are involved.
    """


class StoreNotInitialised(ConfigError):
    """A store opened without preparing the schema (operators' reads and writes) found no cluster-beat
    tables: no beat prepared this database yet.

    Not an outage to retry: the database is there and answers. A :class:`ConfigError`, so whatever
    reports configuration problems reports it alike (one line, no traceback); the command line
    exits with a code of its own on it (see :mod:`celery_cluster_beat.ops.cli`)."""

    def __init__(self, where: str, what: str = "no cluster-beat tables in") -> None:
        self.where, self.what = where, what
        super().__init__(f"not initialised yet: {what} {where}; start a beat first")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.where, self.what))


class OlderSchema(ConfigError):
    """A store opened without preparing the schema found one written by an older release: only beat
    migrates it (operators' commands must not change the schema under running replicas)."""

    def __init__(self, where: str, found: int, current: int) -> None:
        self.where, self.found, self.current = where, found, current
        super().__init__(
            f"the claim database {where} has schema version {found}, older than version {current} "
            "of this celery-cluster-beat; only beat migrates it: start a beat of this release (it migrates "
            "the schema on start-up), then try again")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.where, self.found, self.current))


class ReadOnlyStore(ConfigError):
    """A write was asked of a store opened read-only (``ClaimStore(..., read_only=True)``, or
    :func:`celery_cluster_beat.ops.report.open_store` without ``write=True``).

    Raised before anything reaches the database. A :class:`ConfigError` rather than a bare
    ``RuntimeError``: the caller opened the store the wrong way, and the message says how to open
    it for writing."""

    def __init__(self, store: str) -> None:
        self.store = store
        super().__init__(
            f"{store} was opened read-only and does not write: open it with "
            "celery_cluster_beat.ops.report.open_store(app, write=True) (or ClaimStore(..., read_only=False))")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.store,))
