"""Creating, editing and deleting reports, each kept in step with its stored schedule.

A report's row lives in the application's database; its schedule ``report:<id>`` lives
in the scheduler's (``cluster_beat_db_url``), possibly another database. No transaction
spans both, so every operation orders its two writes such that a failure half-way
leaves at worst a **schedule without a report**, which is harmless: its run re-reads the
report, finds it gone, logs and skips. The other half-state, a report without its
schedule, would silently never run, so it is never left behind knowingly:

* create: insert the row (not committed) → add the schedule → commit the row. If the
  schedule is refused (bad cron, database down) the row is rolled back: nothing exists.
  If the final commit fails, the schedule is removed again; should that fail too, an
  orphan schedule remains (runs skip it, :meth:`ReportService.reconcile` removes it).
* update: change the row (not committed) → update the schedule → commit. A refused
  schedule rolls the row back; a failed commit puts the schedule's old timing back.
* delete: delete the row and commit → remove the schedule. If the removal fails the
  schedule is an orphan (logged; runs skip it; reconcile removes it).

A run re-reads everything it needs at run time (the report, the owner's permission),
so the schedule carries only the report's id and its timing. ``grant`` and ``revoke``
therefore touch no schedule at all: the next run sees the change.

With SQLite, the two databases must be two files: the row's open write transaction
would otherwise lock out the schedule's write.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, Iterable, List, Optional

import sqlalchemy as sa
from sqlalchemy.orm import Session

from celery_cluster_beat import cron as cron_schedule
from celery_cluster_beat import every
from celery_cluster_beat.dynamic import StoredSchedules

from .models import Permission, Report, schedule_name, utcnow

log = logging.getLogger(__name__)

TASK = "reports.run_report"
PREFIX = "report:"
#: Report fields the schedule depends on; changing any other one leaves the schedule alone.
SCHEDULE_FIELDS = ("cron", "timezone", "every_seconds", "enabled", "title", "source_table")
EDITABLE = ("title", "source_table", "cron", "timezone", "every_seconds", "masked_columns", "enabled")


def schedule_of(report: Report) -> Any:
    """The report's schedule: its cron text in its zone, or every N seconds."""
    if report.every_seconds is not None:
        return every(report.every_seconds)
    return cron_schedule(report.cron, tz=report.timezone or "UTC")


def schedule_fields(report: Report) -> Dict[str, Any]:
    """What the stored schedule ``report:<id>`` holds for *report*."""
    return {
        "schedule": schedule_of(report),
        "enabled": report.enabled,
        "description": f"{report.title or 'report'}: {report.source_table} for {report.owner}",
    }


class ReportService:
    """The application's operations on reports and permissions."""

    def __init__(self, engine: sa.Engine, schedules: StoredSchedules) -> None:
        self.engine = engine
        self.schedules = schedules

    # ------------------------------------------------------------------ permissions

    def grant(self, owner: str, table: str) -> None:
        """Let *owner* export *table* (from the next run on)."""
        with Session(self.engine) as session, session.begin():
            if session.get(Permission, (owner, table)) is None:
                session.add(Permission(owner=owner, table_name=table))

    def revoke(self, owner: str, table: str) -> None:
        """Stop *owner* exporting *table*: the next run of any of their reports on it fails."""
        with Session(self.engine) as session, session.begin():
            session.execute(sa.delete(Permission).where(Permission.owner == owner, Permission.table_name == table))

    def may_export(self, session: Session, owner: str, table: str) -> bool:
        return session.get(Permission, (owner, table)) is not None

    # ------------------------------------------------------------------ reports

    def create_report(self, owner: str, source_table: str, *, cron: Optional[str] = None, timezone: str = "UTC",
                      every_seconds: Optional[int] = None, masked_columns: Iterable[str] = (), title: str = "",
                      enabled: bool = True) -> int:
        """Store a report and its schedule; returns the report's id.

        Refuses before anything is stored: ValueError (a ScheduleError for a bad cron or zone,
        unknown table or column), PermissionError (the owner may not export the table), or
        what the scheduler's database raised.
        """
        report = Report(owner=owner, source_table=source_table, cron=cron, timezone=timezone,
                        every_seconds=every_seconds, masked_columns=list(masked_columns), title=title,
                        enabled=enabled)
        with Session(self.engine) as session:
            self._check(session, report)
            session.add(report)
            session.flush()  # the id, for the schedule's name; nothing committed yet
            report_id, name = report.id, report.schedule_name
            self.schedules.add(name, TASK, args=[report_id], owner=owner, **schedule_fields(report))
            try:
                session.commit()
            except Exception:
                self._undo(f"create of {name}", lambda: self.schedules.remove(name))
                raise
            log.info("report %d created, schedule %s", report_id, name)
            return report_id

    def update_report(self, report_id: int, **changes: Any) -> None:
        """Change some of a report's fields (see EDITABLE); the schedule follows when its timing
        or enabled flag changed. KeyError when there is no such report."""
        unknown = set(changes) - set(EDITABLE)
        if unknown:
            raise ValueError(f"report fields that cannot be edited: {', '.join(sorted(unknown))}")
        with Session(self.engine) as session:
            report = session.get(Report, report_id)
            if report is None:
                raise KeyError(report_id)
            before = schedule_fields(report)
            for field, value in changes.items():
                setattr(report, field, list(value) if field == "masked_columns" else value)
            if changes.get("cron") is not None and "every_seconds" not in changes:
                report.every_seconds = None  # a cron replaces an interval
            if changes.get("every_seconds") is not None and "cron" not in changes:
                report.cron = None  # and an interval a cron
            self._check(session, report)
            after = schedule_fields(report)
            session.flush()
            if any(field in changes for field in SCHEDULE_FIELDS):
                self._put_schedule(report, after)
            try:
                session.commit()
            except Exception:
                self._undo(f"update of {report.schedule_name}",
                           lambda: self.schedules.update(schedule_name(report_id), **before))
                raise
            log.info("report %d updated (%s)", report_id, ", ".join(sorted(changes)))

    def delete_report(self, report_id: int) -> bool:
        """Delete the report, then its schedule. False when there was no such report."""
        with Session(self.engine) as session, session.begin():
            deleted = session.execute(sa.delete(Report).where(Report.id == report_id)).rowcount
        name = schedule_name(report_id)
        try:
            self.schedules.remove(name)
        except Exception:  # the row is gone: runs of the orphan schedule are skipped; reconcile() removes it
            log.warning("report %d deleted but its schedule %s could not be removed yet", report_id, name,
                        exc_info=True)
        if deleted:
            log.info("report %d deleted, schedule %s removed", report_id, name)
        return bool(deleted)

    def reconcile(self) -> Dict[str, List[str]]:
        """Repair what an interrupted operation left: add missing schedules, remove orphans,
        correct timing and enabled flag. Safe to run at any time (e.g. at deploy)."""
        done: Dict[str, List[str]] = {"added": [], "removed": [], "updated": []}
        with Session(self.engine) as session:
            reports = {r.schedule_name: r for r in session.scalars(sa.select(Report))}
        stored = {s.name: s for s in self.schedules.list() if s.name.startswith(PREFIX)}
        for name in sorted(set(stored) - set(reports)):
            self.schedules.remove(name)
            done["removed"].append(name)
        for name, report in sorted(reports.items()):
            want = schedule_fields(report)
            if name not in stored:
                self.schedules.add(name, TASK, args=[report.id], owner=report.owner, **want)
                done["added"].append(name)
            elif not _same(stored[name], report):
                self.schedules.update(name, **want)
                done["updated"].append(name)
        return done

    # ------------------------------------------------------------------ helpers

    def _check(self, session: Session, report: Report) -> None:
        """Refuse a report that could not run now: unknown table or column, no permission, bad schedule."""
        columns = source_columns(self.engine, report.source_table)
        missing = [c for c in report.masked_columns if c not in columns]
        if missing:
            raise ValueError(f"table {report.source_table!r} has no column {', '.join(map(repr, missing))} to mask")
        if (report.cron is None) == (report.every_seconds is None):
            raise ValueError("a report has either a cron text or every_seconds, not both or neither")
        if not self.may_export(session, report.owner, report.source_table):
            raise PermissionError(f"{report.owner!r} may not export table {report.source_table!r}")
        schedule_of(report)  # raises celery_cluster_beat.ScheduleError (a ConfigError) on a bad cron or zone
        report.updated_at = utcnow()

    def _put_schedule(self, report: Report, fields: Dict[str, Any]) -> None:
        try:
            self.schedules.update(report.schedule_name, **fields)
        except KeyError:  # lost earlier (see reconcile): put it back
            self.schedules.add(report.schedule_name, TASK, args=[report.id], owner=report.owner, **fields)

    @staticmethod
    def _undo(what: str, action: Any) -> None:
        try:
            action()
        except Exception:
            log.error("%s: the report's commit failed and the schedule could not be put back; "
                      "run ReportService.reconcile()", what, exc_info=True)


def source_columns(engine: sa.Engine, table: str) -> List[str]:
    """The column names of an exportable table (ValueError when there is no such table)."""
    try:
        return [c["name"] for c in sa.inspect(engine).get_columns(table)]
    except sa.exc.NoSuchTableError:
        raise ValueError(f"no table {table!r} to export") from None


def _same(stored: Any, report: Report) -> bool:
    """Does the stored schedule already hold the report's timing and enabled flag? (A stored
    schedule keeps its rule as text: the cron fields and zone, or "every <seconds>s".)"""
    timing = (report.cron, report.timezone or "UTC") if report.every_seconds is None else (
        f"every {report.every_seconds}s", None)
    return (stored.schedule, stored.zone, stored.enabled) == (*timing, report.enabled)
