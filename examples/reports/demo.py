"""The whole story in one command (from the ``examples`` folder)::

    python -m reports.demo

1. creates the application's tables with sample customers, lets alice
   and bob export them, and creates two reports: alice's every 10 seconds (email masked)
   and bob's on the cron ``* * * * *`` in Europe/Paris (name and email masked);
2. starts ``celery beat -S celery_cluster_beat.Scheduler`` and ``celery worker`` (logs in
   ``reports/data/``);
3. prints each export and notification as it appears; after two snapshots of the first
   report it revokes alice's permission (the next run fails, alice gets ``report.failed``),
   then grants it again and deletes that report (it stops);
4. ends once the cron report has written its first snapshot (within the minute).

Everything is embedded unless the environment says otherwise (see settings.py).
``--keep-running`` leaves beat and worker running until Ctrl-C.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List

import sqlalchemy as sa

from celery_cluster_beat.dynamic import StoredSchedules

from .models import Export, Notification, create_schema
from .service import ReportService
from .settings import Settings, make_celery

EXAMPLES = Path(__file__).resolve().parent.parent


def start(settings: Settings, *args: str, log: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(EXAMPLES), os.environ.get("PYTHONPATH")])),
               PYTHONUNBUFFERED="1", REPORTS_DATA_DIR=str(settings.data_dir))
    out = open(settings.data_dir / log, "ab")
    return subprocess.Popen([sys.executable, "-m", "celery", "-A", "reports.tasks", *args], cwd=EXAMPLES, env=env,
                            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def stop(procs: List[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=180, help="give up after this long (default 180)")
    parser.add_argument("--keep-running", action="store_true", help="leave beat and worker running until Ctrl-C")
    args = parser.parse_args(argv)

    settings = Settings.from_env()
    app = make_celery(settings)
    engine = sa.create_engine(settings.reports_db_url)
    create_schema(engine)
    service = ReportService(engine, StoredSchedules(app))
    print(f"data in {settings.data_dir}; snapshots in {settings.output_dir}")
    cleaned = service.reconcile()  # a previous run may have left reports behind: make schedules match them
    if any(cleaned.values()):
        print(f"reconciled schedules with existing reports: {cleaned}")

    service.grant("alice", "customers")
    service.grant("bob", "customers")
    fast = service.create_report("alice", "customers", every_seconds=10, masked_columns=["email"],
                                 title="customers every 10 s")
    minutely = service.create_report("bob", "customers", cron="* * * * *", timezone="Europe/Paris",
                                     masked_columns=["name", "email"], title="customers every minute")
    print(f"created report {fast} for alice (every 10 s) and report {minutely} for bob "
          "(cron '* * * * *' Europe/Paris)")

    procs = [
        start(settings, "beat", "-S", "celery_cluster_beat.Scheduler", "-l", "info", "--pidfile=",
              "-s", str(settings.data_dir / "celerybeat-schedule"), log="beat.log"),
        start(settings, "worker", "-l", "info", "-c", "2", "--pidfile=", "-n", f"reports-demo-{os.getpid()}@%h",
              log="worker.log"),
    ]
    print(f"started beat (pid {procs[0].pid}) and worker (pid {procs[1].pid}); their logs: "
          f"{settings.data_dir / 'beat.log'}, {settings.data_dir / 'worker.log'}")
    print("the same by hand, from the examples folder:\n"
          "    celery -A reports.tasks beat -S celery_cluster_beat.Scheduler -l info\n"
          "    celery -A reports.tasks worker -l info\n")

    seen_exports: Dict[int, str] = {}
    seen_notes: set = set()
    state = "running"
    deadline = time.monotonic() + args.seconds
    shown_csv = False
    try:
        while time.monotonic() < deadline:
            with engine.connect() as conn:
                exports = conn.execute(sa.select(Export).order_by(Export.id)).all()
                notes = conn.execute(sa.select(Notification).order_by(Notification.id)).all()
            for e in exports:
                if e.status != "running" and seen_exports.get(e.id) != e.status:
                    seen_exports[e.id] = e.status
                    detail = f"{e.rows} rows, {e.bytes} bytes -> {e.path}" if e.status == "succeeded" else e.reason
                    print(f"  export #{e.id}: report {e.report_id}, occurrence {e.scheduled_at:%H:%M:%S} UTC: "
                          f"{e.status}: {detail}")
                    if e.status == "succeeded" and not shown_csv:
                        shown_csv = True
                        print("    " + Path(e.path).read_text().replace("\n", "\n    ").rstrip())
            for n in notes:
                if n.id not in seen_notes:
                    seen_notes.add(n.id)
                    print(f"  notification to {n.owner}: {n.kind}: {n.message}")
            ok = [e for e in exports if e.report_id == fast and e.status == "succeeded"]
            failed = [e for e in exports if e.report_id == fast and e.status == "failed"]
            if state == "running" and len(ok) >= 2:
                service.revoke("alice", "customers")
                state = "revoked"
                print("revoked alice's permission to export customers: her next run fails (bob's are unaffected)")
            elif state == "revoked" and failed:
                service.grant("alice", "customers")
                service.delete_report(fast)
                state = "deleted"
                print(f"granted it again, and deleted report {fast}: its schedule is gone, it runs no more")
            elif state == "deleted" and any(e.report_id == minutely and e.status == "succeeded" for e in exports):
                state = "done"
                print(f"report {minutely} ran on its cron; the story is complete")
                break
            time.sleep(0.5)
        if state != "done":
            print(f"gave up after {args.seconds:.0f} s in state {state!r}; see the logs in {settings.data_dir}")
            return 1
        if args.keep_running:
            print("beat and worker keep running (report %d every minute); Ctrl-C stops them" % minutely)
            while all(p.poll() is None for p in procs):
                time.sleep(1)
        return 0
    except KeyboardInterrupt:
        return 130
    finally:
        stop(procs)
        service.delete_report(minutely)
        service.schedules.close()
        engine.dispose()


if __name__ == "__main__":
    sys.exit(main())
