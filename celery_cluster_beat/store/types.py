"""The claim store's column types: how a datetime and a name are stored on each server.

Kept apart from both the tables (:mod:`.schema`) and the per-server SQL
(:mod:`.dialects`) because both need them: the tables are declared with these
types, and the dialects recognise them when they bind values by hand. Here
they import neither, so the tables and the dialects import this module and
nothing imports in a circle (``tests/test_layout.py`` checks that no cycle
comes back).

Two choices differ by server, both made when SQLAlchemy first resolves a type
for a dialect (at ``CREATE TABLE`` and when a statement is compiled):

* datetimes are naive UTC everywhere; MySQL/MariaDB need ``DATETIME(6)`` to keep
  microseconds;
* names compare byte for byte everywhere; MySQL/MariaDB's default collations do
  not, so name columns take a binary one (:func:`name_collation`).
"""
from __future__ import annotations

from datetime import datetime
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy.dialects import mysql

from ..schedules.instants import UTC, require_aware

#: SQLAlchemy's names for the MySQL family's dialects.
_MYSQL_FAMILY = ("mysql", "mariadb")


def naive_utc(value: datetime, what: str = "a datetime stored in the claim database") -> datetime:
    # A naive value is ambiguous (local? UTC?); guessing wrong would move
    # claims by hours, so require_aware refuses rather than guesses. Values
    # already in UTC (occurrences, utcnow()) skip it: every bound datetime
    # passes here, thousands per claimed burst.
    if value.tzinfo is not UTC:
        value = require_aware(value, what)
    return value.replace(tzinfo=None)


def name_collation(dialect: Any) -> str:
    """The collation of name columns on a MySQL-family server.

    The default collations are case-insensitive: "Report" and "report" would
    collide on the primary key and one schedule would silently lose every
    claim. Binary collations compare byte for byte; we prefer a NO PAD one,
    in which "a" and "a " differ too.
    """
    if getattr(dialect, "is_mariadb", False):
        return "utf8mb4_nopad_bin"
    version = getattr(dialect, "server_version_info", None) or ()
    if tuple(version[:3]) >= (8, 0, 17):
        return "utf8mb4_0900_bin"
    return "utf8mb4_bin"  # PAD SPACE: MySQLDialect.check_name rejects names ending in a space


class UTCDateTime(sa.types.TypeDecorator[datetime]):
    """Naive UTC in the database, aware UTC in Python.

    Naive storage is the one representation that behaves the same in
    SQLite (text), PostgreSQL (``timestamp``) and MySQL (``DATETIME(6)``, which
    has no time zone at all); converting at the boundary means no value ever
    depends on a server or session time zone.
    """

    impl = sa.DateTime
    cache_ok = True

    def load_dialect_impl(self, dialect: sa.engine.Dialect) -> sa.types.TypeEngine[Any]:
        if dialect.name in _MYSQL_FAMILY:
            # Plain DATETIME drops microseconds; occurrences may carry them.
            return dialect.type_descriptor(mysql.DATETIME(fsp=6))
        return dialect.type_descriptor(sa.DateTime())

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        return naive_utc(value)

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC)


class NameType(sa.types.TypeDecorator[str]):
    """VARCHAR compared byte for byte in every dialect (see :func:`name_collation`)."""

    impl = sa.String
    cache_ok = True

    def load_dialect_impl(self, dialect: sa.engine.Dialect) -> sa.types.TypeEngine[Any]:
        length = cast(sa.String, self.impl_instance).length
        if dialect.name in _MYSQL_FAMILY:
            return dialect.type_descriptor(
                mysql.VARCHAR(length, charset="utf8mb4", collation=name_collation(dialect)))
        return dialect.type_descriptor(sa.String(length))
