"""Every way the claim store's SQL differs between servers, behind one interface.

The claim store promises the same things on SQLite, PostgreSQL and
MySQL/MariaDB (exact insert-if-absent, exact "which rows did this statement
change", bounded lock waits), but keeping those promises fast and exact under
concurrency takes different SQL on each server. This folder owns that SQL and
the reasons for it: :class:`~.base.Dialect` is the interface with the portable
SQLAlchemy Core shapes, and each server's module overrides what its server
plans badly or lacks. :class:`~..claims.ClaimStore` talks only to the interface,
so it holds no per-server branches and a server's quirks are read in one place.
How each server stores a datetime or a name (the column types) is :mod:`..types`'s,
which the tables are declared with; this folder imports the tables, never the reverse.
"""
from __future__ import annotations

from .base import CHUNK, Dialect
from .mysql import MySQLDialect
from .postgresql import PostgreSQLDialect
from .sqlite import SQLiteDialect

__all__ = ["CHUNK", "Dialect", "SUPPORTED_BACKENDS", "dialect_for"]

_DIALECTS: dict[str, type[Dialect]] = {
    "sqlite": SQLiteDialect,
    "postgresql": PostgreSQLDialect,
    "mysql": MySQLDialect,
    "mariadb": MySQLDialect,
}

#: The SQLAlchemy backend names the claim store runs on.
SUPPORTED_BACKENDS = tuple(_DIALECTS)


def dialect_for(backend_name: str) -> Dialect:
    """A new :class:`Dialect` for SQLAlchemy backend *backend_name* (one per store: it learns its server)."""
    try:
        cls = _DIALECTS[backend_name]
    except KeyError:
        raise ValueError(
            f"no claim store dialect for {backend_name!r}; supported: {', '.join(SUPPORTED_BACKENDS)}"
        ) from None
    return cls()
