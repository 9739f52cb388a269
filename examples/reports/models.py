"""The application's own tables (SQLAlchemy 2 ORM), in the application's own database.

* ``reports``: what to export for whom and when. The schedule is a cron text and a
  zone (``cron``, ``timezone``), or, for demos and tests, ``every_seconds``.
* ``permissions``: owner may export table. Read by every run, never copied anywhere.
* ``exports``: one row per run that got past "is the report still there and enabled":
  its occurrence, status (``running`` → ``succeeded`` / ``failed`` with a reason), and
  for a snapshot its rows, bytes and path. Kept after the report is deleted.
* ``notifications``: what the owner is told (``report.ready``, ``report.failed``).
* ``customers``: a sample source table, with an email column worth masking.

Times are naive UTC (the same on SQLite, PostgreSQL and MySQL).
"""
from __future__ import annotations

from datetime import datetime, timezone
from typing import List, Optional

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


def utcnow() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)


class Base(DeclarativeBase):
    pass


class Report(Base):
    __tablename__ = "reports"

    id: Mapped[int] = mapped_column(primary_key=True)
    title: Mapped[str] = mapped_column(sa.String(200), default="")
    owner: Mapped[str] = mapped_column(sa.String(100), index=True)
    source_table: Mapped[str] = mapped_column(sa.String(100))
    cron: Mapped[Optional[str]] = mapped_column(sa.String(100))  # "0 9 * * mon-fri"
    timezone: Mapped[str] = mapped_column(sa.String(64), default="UTC")  # IANA name
    every_seconds: Mapped[Optional[int]] = mapped_column()  # instead of cron, for demos and tests
    masked_columns: Mapped[List[str]] = mapped_column(sa.JSON, default=list)
    enabled: Mapped[bool] = mapped_column(default=True)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(default=utcnow, onupdate=utcnow)

    __table_args__ = (
        sa.CheckConstraint("(cron IS NULL) <> (every_seconds IS NULL)", name="ck_reports_one_schedule"),
        # Never reuse a deleted report's id: it names the schedule, the exports and the snapshot folder.
        {"sqlite_autoincrement": True},
    )

    @property
    def schedule_name(self) -> str:
        """The stored schedule that runs this report."""
        return schedule_name(self.id)


def schedule_name(report_id: int) -> str:
    return f"report:{report_id}"


class Permission(Base):
    __tablename__ = "permissions"

    owner: Mapped[str] = mapped_column(sa.String(100), primary_key=True)
    table_name: Mapped[str] = mapped_column(sa.String(100), primary_key=True)
    granted_at: Mapped[datetime] = mapped_column(default=utcnow)


class Export(Base):
    __tablename__ = "exports"

    id: Mapped[int] = mapped_column(primary_key=True)
    report_id: Mapped[int] = mapped_column(index=True)  # no foreign key: history outlives the report
    scheduled_at: Mapped[datetime]  # the occurrence (its nominal instant), or the start of a run by hand
    schedule: Mapped[Optional[str]] = mapped_column(sa.String(200))  # "report:<id>", None when run by hand
    task_id: Mapped[Optional[str]] = mapped_column(sa.String(36))
    status: Mapped[str] = mapped_column(sa.String(16))  # running, succeeded, failed
    reason: Mapped[Optional[str]] = mapped_column(sa.Text)
    rows: Mapped[Optional[int]]
    bytes: Mapped[Optional[int]]
    path: Mapped[Optional[str]] = mapped_column(sa.String(500))
    started_at: Mapped[datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[Optional[datetime]]

    # Belt and braces beside the worker ledger: one export per occurrence of a report.
    __table_args__ = (sa.UniqueConstraint("report_id", "scheduled_at", name="uq_exports_occurrence"),)


class Notification(Base):
    __tablename__ = "notifications"

    id: Mapped[int] = mapped_column(primary_key=True)
    owner: Mapped[str] = mapped_column(sa.String(100), index=True)
    kind: Mapped[str] = mapped_column(sa.String(32))  # report.ready, report.failed
    report_id: Mapped[int]
    export_id: Mapped[Optional[int]]
    message: Mapped[str] = mapped_column(sa.Text)
    created_at: Mapped[datetime] = mapped_column(default=utcnow)


class Customer(Base):
    """Sample data to export."""

    __tablename__ = "customers"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(sa.String(100))
    email: Mapped[str] = mapped_column(sa.String(200))
    country: Mapped[str] = mapped_column(sa.String(2))


SAMPLE_CUSTOMERS = [
    ("Ada Lovelace", "ada@example.org", "GB"),
    ("Grace Hopper", "grace@example.org", "US"),
    ("Émilie du Châtelet", "emilie@example.fr", "FR"),
    ("Alan Turing", "alan@example.org", "GB"),
    ("Katherine Johnson", "katherine@example.org", "US"),
    ("Hedy Lamarr", "hedy@example.at", "AT"),
]


def create_schema(engine: sa.Engine) -> None:
    """Create the tables (if missing) and the sample customers (if there are none)."""
    Base.metadata.create_all(engine)
    with engine.begin() as conn:
        if conn.scalar(sa.select(sa.func.count()).select_from(Customer)) == 0:
            conn.execute(sa.insert(Customer), [{"name": n, "email": e, "country": c} for n, e, c in SAMPLE_CUSTOMERS])
