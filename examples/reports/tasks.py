"""The Celery app and the task every report schedule sends: ``run_report(report_id)``.

Start a worker and a beat (any number of each, on any hosts) from the ``examples`` folder::

    celery -A reports.tasks worker -l info
    celery -A reports.tasks beat -S celery_cluster_beat.Scheduler -l info

A run is decided at run time, never at scheduling time:

1. The report is read again: gone or disabled → logged, skipped, nothing recorded.
2. An export row is inserted for the occurrence (status ``running``).
3. The owner's permission to export the table is read again: revoked → the run fails.
4. The CSV snapshot is written (masked columns masked) under a name of its own occurrence,
   through a temporary file, and the export row gets its rows, bytes and path. A masked
   column is masked in the query itself, so its value never reaches this process (nor a
   failure message); the snapshot is 0600 in a 0700 folder.
5. The owner is notified (``report.ready``, or ``report.failed`` with the reason). A failed
   notification is logged and nothing more: it never fails or re-runs the run.

A failure reason never holds a row's values: a row that cannot be read or written is named by
its number, with the error's class only.

A failed run is recorded (export row ``failed`` with the reason, the ledger's ``failed``),
raises, and is never retried: Celery acknowledges the message before running it, the task
has no automatic retry, and the ledger refuses a second delivery of the same occurrence.
The next run is the next occurrence, on schedule.
"""
from __future__ import annotations

import csv
import os
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Dict, Optional, Tuple

import sqlalchemy as sa
from celery.utils.log import get_task_logger
from sqlalchemy.orm import Session

from celery_cluster_beat.worker import LedgerTask

from .models import Export, Notification, Permission, Report, utcnow
from .settings import Settings, make_celery, private_dir

settings = Settings.from_env()
app = make_celery(settings)
log = get_task_logger(__name__)

#: What a masked value becomes in the snapshot.
MASK = "***"
#: Mode of a snapshot: the owner's alone (its folder is 0700).
FILE_MODE = 0o600


class ReportFailed(Exception):
    """The run could not produce the snapshot; the message is the reason the owner is told."""


_engines: Dict[int, sa.Engine] = {}


def reports_engine() -> sa.Engine:
    """One engine per worker process (a forked pool child must not share its parent's connections)."""
    pid = os.getpid()
    if pid not in _engines:
        _engines[pid] = sa.create_engine(settings.reports_db_url, pool_pre_ping=True)
    return _engines[pid]


def occurrence(task: LedgerTask) -> Tuple[Optional[str], datetime]:
    """(schedule name, nominal instant as naive UTC) of this delivery; a run by hand is "now"."""
    occ = task.occurrence  # the cluster_beat_* headers beat put on the message; None when run by hand
    if occ is None:
        return None, utcnow()
    return occ.schedule, occ.scheduled_at.astimezone(timezone.utc).replace(tzinfo=None)


@app.task(bind=True, base=LedgerTask, name="reports.run_report", throws=(ReportFailed,))
def run_report(self: Any, report_id: int) -> Dict[str, Any]:
    schedule, scheduled_at = occurrence(self)
    engine = reports_engine()
    with Session(engine, expire_on_commit=False) as session:
        report = session.get(Report, report_id)
        if report is None or not report.enabled:
            why = "gone" if report is None else "disabled"
            log.info("report %s: skipped, the report is %s (occurrence %s)", report_id, why, scheduled_at)
            return {"status": "skipped", "reason": why}
        owner, table, masked = report.owner, report.source_table, list(report.masked_columns)
        title = report.title or f"report {report_id}"
        export = Export(report_id=report_id, scheduled_at=scheduled_at, schedule=schedule, task_id=self.request.id,
                        status="running")
        session.add(export)
        try:
            session.commit()
        except sa.exc.IntegrityError:  # only if the ledger were bypassed: this occurrence already has its export
            log.warning("report %s: occurrence %s already exported, not run again", report_id, scheduled_at)
            return {"status": "duplicate"}
        export_id = export.id
        try:
            if session.get(Permission, (owner, table)) is None:
                raise ReportFailed(f"permission revoked: {owner} may no longer export {table}")
            path = settings.output_dir / f"report-{report_id}" / snapshot_name(scheduled_at)
            rows, size = write_snapshot(engine, table, masked, path)
            outcome = {"status": "succeeded", "rows": rows, "bytes": size, "path": str(path)}
        except Exception as exc:
            session.rollback()
            reason = str(exc) if isinstance(exc, ReportFailed) else f"{type(exc).__name__}: {first_line(exc)}"
            outcome = {"status": "failed", "reason": reason}
        session.execute(sa.update(Export).where(Export.id == export_id).values(finished_at=utcnow(), **outcome))
        session.commit()

    if outcome["status"] == "succeeded":
        notify(engine, owner, "report.ready", report_id, export_id,
               f"{title}: {outcome['rows']} rows, {outcome['bytes']} bytes at {outcome['path']}")
        log.info("report %s: snapshot of %s written, %s rows", report_id, scheduled_at, outcome["rows"])
        return {"export_id": export_id, **outcome}
    notify(engine, owner, "report.failed", report_id, export_id, f"{title}: {outcome['reason']}")
    log.warning("report %s: run of %s failed: %s", report_id, scheduled_at, outcome["reason"])
    raise ReportFailed(outcome["reason"])


def snapshot_name(at: datetime) -> str:
    """The snapshot's file name: its occurrence, e.g. 20261201T090000Z.csv."""
    return f"{at:%Y%m%dT%H%M%S}{'.%06d' % at.microsecond if at.microsecond else ''}Z.csv"


def write_snapshot(engine: sa.Engine, table_name: str, masked: Any, path: Path) -> Tuple[int, int]:
    """Write *table_name* as CSV to *path* with the *masked* columns masked; (rows, bytes).

    Fails (before writing anything) when a column to mask no longer exists: better no
    snapshot than an unmasked one. A masked column is masked by the query (``***``, or empty
    for NULL): its value is never fetched, so never converted, and no conversion error can
    carry it into a message. A row that fails is named by its number, never by its values.
    The file appears whole or not at all (rename), 0600 in a 0700 folder.
    """
    table = sa.Table(table_name, sa.MetaData(), autoload_with=engine)
    missing = [c for c in masked if c not in table.c]
    if missing:
        raise ReportFailed(f"table {table_name} has no column {', '.join(missing)} to mask any more")
    columns = [sa.case((c.is_(None), sa.null()), else_=sa.literal(MASK)).label(c.name) if c.name in masked else c
               for c in table.c]
    private_dir(path.parent)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    rows = 0
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
        os.fchmod(fd, FILE_MODE)  # whatever the umask
        with open(fd, "w", newline="", encoding="utf-8") as out, engine.connect() as conn:
            writer = csv.writer(out)
            writer.writerow(table.c.keys())
            order = list(table.primary_key.columns) or list(table.c)
            try:
                for row in conn.execute(sa.select(*columns).order_by(*order)):
                    writer.writerow(row)
                    rows += 1
            except Exception as exc:  # a value the driver or the CSV writer could not take: its text may quote it
                raise ReportFailed(f"row {rows + 1} of table {table_name} could not be exported "
                                   f"({type(exc).__name__}; its values are not shown)") from None
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return rows, path.stat().st_size


def notify(engine: sa.Engine, owner: str, kind: str, report_id: int, export_id: Optional[int], message: str) -> None:
    """Tell the owner; a failure here is logged and swallowed (the run's outcome is already recorded)."""
    try:
        with Session(engine) as session, session.begin():
            session.add(Notification(owner=owner, kind=kind, report_id=report_id, export_id=export_id,
                                     message=message))
    except Exception as exc:
        log.error("report %s: could not notify %s of %s: %s: %s", report_id, owner, kind, type(exc).__name__,
                  first_line(exc))


def first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0]
