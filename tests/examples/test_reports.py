"""The scheduled report-job example (``examples/reports``), end to end.

Real processes only: ``celery beat -S celery_cluster_beat.Scheduler`` and ``celery
worker`` started from the example's own module (``reports.tasks``), a real Redis as
broker and lease, SQLite or PostgreSQL for the app's tables and the claims. The test
process plays the application: it creates, edits and deletes reports through
``reports.service`` (which keeps the stored schedules in step) and reads what the
runs left behind: export rows, notifications, CSV files, the worker ledger's claim rows
and the worker's log.

Reports run every 2-3 s here (``every_seconds``); one cron report proves the cron path
on a seconds field (every 5 s, no wait for a minute boundary), the README demo's cron
report on a real minute. Every wait is on a condition with a bound that holds on a
loaded 2-core machine.
"""
from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
import time
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Dict, List

import pytest
import redis
import sqlalchemy as sa

import procs
from procs import wait_for, wait_for_log

EXAMPLES = procs.REPO / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))

from reports.models import Export, Notification, Report, create_schema  # noqa: E402
from reports.service import ReportService  # noqa: E402
from reports.settings import Settings, make_celery  # noqa: E402

from celery_cluster_beat import every  # noqa: E402
from celery_cluster_beat.dynamic import StoredSchedules  # noqa: E402
from celery_cluster_beat.store.schema import claims_table  # noqa: E402

START = 90  # seconds beat or a worker may take to start on a loaded host
RUN = 30  # seconds an occurrence may take from its instant to its export on a loaded host
LATE = 12  # seconds a run may start after its nominal instant on a loaded host

def naive_utc_now() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)


class Rig:
    """The example application of one test: its settings (from the environment, as the
    processes read them), its service, its beat and worker, and readers of what runs left."""

    def __init__(self, tmp: Path, redis_url: str, monkeypatch: pytest.MonkeyPatch, db_url: str | None = None):
        tag = uuid.uuid4().hex[:8]
        self.tmp = tmp
        env = {
            "REPORTS_DATA_DIR": str(tmp / "data"),
            "REPORTS_DB_URL": db_url or f"sqlite:///{tmp}/reports.sqlite3",
            "CLUSTER_BEAT_DB_URL": db_url or f"sqlite:///{tmp}/claims.sqlite3",
            "BROKER_URL": redis_url,
            "REDIS_URL": redis_url,
            "REPORTS_QUEUE": f"reports_{tag}",  # this test's own queue and lease on the shared Redis
            "CLUSTER_BEAT_NAME": f"reports_{tag}",
        }
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        monkeypatch.delenv("REPORTS_OUTPUT_DIR", raising=False)
        self.settings = Settings.from_env()
        self.celery = make_celery(self.settings)
        self.engine = sa.create_engine(self.settings.reports_db_url)
        create_schema(self.engine)
        self.claims_engine = sa.create_engine(self.settings.cluster_db_url)
        self.schedules = StoredSchedules(self.celery)
        self.service = ReportService(self.engine, self.schedules)
        self.app = procs.App(EXAMPLES, "reports.tasks", self.settings.queue, redis_url, redis_url)
        self.beat: procs.Proc | None = None
        self.worker: procs.Proc | None = None

    # -- processes -------------------------------------------------------------------
    def start_beat(self) -> None:
        self.beat = procs.start_beat(self.app, self.tmp, "beat")
        wait_for_log(self.beat, "is now the leader", START)

    def start_worker(self) -> None:
        self.worker = procs.start_worker(self.app, self.tmp, "worker", concurrency=4)
        wait_for_log(self.worker, " ready.", START)

    def start_beat_and_worker(self) -> None:
        """Both at once (their start-ups overlap), then wait until beat leads and the worker is ready."""
        self.beat = procs.start_beat(self.app, self.tmp, "beat")
        self.worker = procs.start_worker(self.app, self.tmp, "worker", concurrency=4)
        wait_for_log(self.beat, "is now the leader", START)
        wait_for_log(self.worker, " ready.", START)

    def close(self) -> None:
        for proc in (self.worker, self.beat):
            if proc is not None:
                proc.stop()
        self.schedules.close()
        self.engine.dispose()
        self.claims_engine.dispose()

    # -- what the runs left ------------------------------------------------------------
    def exports(self, report_id: int, status: str | None = None) -> List[sa.Row]:
        query = sa.select(Export).where(Export.report_id == report_id).order_by(Export.scheduled_at)
        if status is not None:
            query = query.where(Export.status == status)
        with self.engine.connect() as conn:
            return conn.execute(query).all()

    def notifications(self, report_id: int, kind: str | None = None) -> List[sa.Row]:
        query = sa.select(Notification).where(Notification.report_id == report_id).order_by(Notification.id)
        if kind is not None:
            query = query.where(Notification.kind == kind)
        with self.engine.connect() as conn:
            return conn.execute(query).all()

    def claims(self, report_id: int) -> List[sa.Row]:
        query = (sa.select(claims_table).where(claims_table.c.schedule == f"report:{report_id}")
                 .order_by(claims_table.c.scheduled_at))
        with self.claims_engine.connect() as conn:
            return conn.execute(query).all()

    def wait_exports(self, report_id: int, n: int, timeout: float, status: str = "succeeded",
                     after: datetime | None = None) -> List[sa.Row]:
        def enough() -> bool:
            rows = [e for e in self.exports(report_id, status) if after is None or e.scheduled_at > after]
            return len(rows) >= n

        wait_for(enough, timeout, interval=0.2, what=f"{n} {status} export(s) of report {report_id}")
        return self.exports(report_id, status)

    def deliveries(self, task_id: str) -> int:
        """How often the worker received the message of *task_id*."""
        assert self.worker is not None
        return self.worker.log().count(f"Task reports.run_report[{task_id}] received")


@pytest.fixture
def rig(tmp_path, redis_url, monkeypatch):
    made: List[Rig] = []

    def make(db_url: str | None = None) -> Rig:
        r = Rig(tmp_path, redis_url, monkeypatch, db_url)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


def read_csv(path: str) -> List[Dict[str, str]]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def assert_on_grid(at: datetime, seconds: int) -> None:
    since_epoch = at.replace(tzinfo=timezone.utc).timestamp()
    assert since_epoch % seconds == 0, f"{at} is not on the {seconds}-second grid"


# ----------------------------------------------------------------------------- the four behaviours


@pytest.mark.slow
@pytest.mark.timeout(360)
def test_reports_created_at_run_time_fire_at_their_times(rig):
    r = rig()
    r.start_beat_and_worker()
    r.service.grant("alice", "customers")
    created = naive_utc_now()
    fast = r.service.create_report("alice", "customers", every_seconds=3, masked_columns=["email"], title="fast")
    # The cron report on a seconds field (every 5 s): the cron path without waiting for a minute
    # boundary (the README demo's report runs on a real minute).
    minutely = r.service.create_report("alice", "customers", cron="* * * * * */5", timezone="Europe/Paris",
                                       masked_columns=["name", "email"], title="minutely")
    assert r.schedules.get(f"report:{fast}").schedule == "every 3s"
    assert (r.schedules.get(f"report:{minutely}").schedule, r.schedules.get(f"report:{minutely}").zone) == (
        "* * * * * */5", "Europe/Paris")

    done = r.wait_exports(fast, 3, RUN + 9)
    for e in done:
        assert_on_grid(e.scheduled_at, 3)
        assert e.scheduled_at > created - timedelta(seconds=1), "no catch-up to before the report existed"
        assert timedelta(0) <= e.started_at - e.scheduled_at < timedelta(seconds=LATE), e
        assert e.schedule == f"report:{fast}" and e.rows == 6 and e.reason is None
        assert Path(e.path).stat().st_size == e.bytes
        assert Path(e.path).name == f"{e.scheduled_at:%Y%m%dT%H%M%S}Z.csv"
        rows = read_csv(e.path)
        assert len(rows) == 6
        assert {row["email"] for row in rows} == {"***"}
        assert "Ada Lovelace" in {row["name"] for row in rows}
    assert len({e.scheduled_at for e in done}) == len(done), "one export per occurrence"

    (cron_run,) = r.wait_exports(minutely, 1, 5 + RUN)[:1]
    assert cron_run.scheduled_at.second % 5 == 0 and cron_run.scheduled_at.microsecond == 0
    assert cron_run.scheduled_at > created
    assert cron_run.started_at - cron_run.scheduled_at < timedelta(seconds=LATE)
    rows = read_csv(cron_run.path)
    assert {row["name"] for row in rows} == {"***"} and {row["email"] for row in rows} == {"***"}
    assert {row["country"] for row in rows} == {"GB", "US", "FR", "AT"}

    # Each snapshot told its owner, once.
    def told() -> List[int]:
        return [n.export_id for n in r.notifications(fast, "report.ready") if n.owner == "alice"]

    wait_for(lambda: all(e.id in told() for e in done), RUN, what="report.ready notifications")
    assert all(told().count(e.id) == 1 for e in done)
    # The ledger recorded each run (it writes the outcome once the task has returned).
    def states() -> dict:
        return {c.scheduled_at.replace(tzinfo=None): c.run_state for c in r.claims(fast)}

    wait_for(lambda: all(states().get(e.scheduled_at) == "succeeded" for e in done), RUN,
             what="the ledger's succeeded rows")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_revoked_permission_fails_the_next_run_with_a_notification_and_is_never_rerun(rig):
    r = rig()
    r.start_beat_and_worker()
    r.service.grant("alice", "customers")
    report = r.service.create_report("alice", "customers", every_seconds=3, masked_columns=["email"])
    r.wait_exports(report, 1, RUN)

    revoked_at = naive_utc_now()
    r.service.revoke("alice", "customers")
    failed = r.wait_exports(report, 3, RUN + 12, status="failed")
    first = failed[0]
    assert first.scheduled_at > revoked_at - timedelta(seconds=3)
    assert first.reason == "permission revoked: alice may no longer export customers"
    assert first.path is None and first.rows is None
    assert not (r.settings.output_dir / f"report-{report}" / f"{first.scheduled_at:%Y%m%dT%H%M%S}Z.csv").exists()
    wait_for(lambda: first.id in [n.export_id for n in r.notifications(report, "report.failed")], RUN,
             what="the report.failed notification")
    told = r.notifications(report, "report.failed")
    assert told and told[0].owner == "alice" and "permission revoked" in told[0].message
    assert told[0].export_id == first.id

    # Recorded, never re-run in a loop: one export and one delivery per failed occurrence, the
    # failures one occurrence apart (the next one comes on schedule), the ledger says failed.
    failed = r.exports(report, "failed")
    assert len({e.scheduled_at for e in failed}) == len(failed)
    for e in failed:
        assert_on_grid(e.scheduled_at, 3)
        assert r.deliveries(e.task_id) == 1, e.task_id
    def ledger() -> dict:
        return {c.scheduled_at.replace(tzinfo=None): c for c in r.claims(report)}

    wait_for(lambda: all(getattr(ledger().get(e.scheduled_at), "run_state", None) == "failed" for e in failed),
             RUN, what="the ledger's failed rows")  # written once the task has raised
    claims = ledger()
    for e in failed:
        assert claims[e.scheduled_at].run_state == "failed"
        assert "permission revoked" in claims[e.scheduled_at].run_error
        assert claims[e.scheduled_at].task_id == e.task_id

    # The permission is read at run time: granting it back makes the next occurrence succeed.
    granted_at = naive_utc_now()
    r.service.grant("alice", "customers")
    (back,) = r.wait_exports(report, 1, RUN, after=granted_at)[-1:]
    assert back.status == "succeeded" and back.rows == 6
    wait_for(lambda: back.id in [n.export_id for n in r.notifications(report, "report.ready")], RUN,
             what="the report.ready notification")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_deleted_report_stops_and_a_disabled_one_pauses(rig, pg_url):
    # The app's tables and the claims in one PostgreSQL database, as a cluster would run it.
    r = rig(db_url=pg_url)
    r.start_beat_and_worker()
    r.service.grant("alice", "customers")
    # Two reports, one to disable and one to delete: their quiet windows run side by side.
    paused = r.service.create_report("alice", "customers", every_seconds=2, masked_columns=["email"])
    report = r.service.create_report("alice", "customers", every_seconds=2, masked_columns=["email"])
    r.wait_exports(paused, 2, RUN)
    r.wait_exports(report, 2, RUN)

    # Disabled: the schedule stops sending. Deleted: the schedule is removed, nothing is
    # claimed or exported afterwards.
    r.service.update_report(paused, enabled=False)
    disabled_at = naive_utc_now()
    assert r.schedules.get(f"report:{paused}").enabled is False
    before = len(r.exports(report))
    assert r.service.delete_report(report) is True
    deleted_at = naive_utc_now()
    assert r.schedules.get(f"report:{report}") is None
    time.sleep(10)  # five occurrences' worth
    assert [e for e in r.exports(paused) if e.started_at > disabled_at + timedelta(seconds=3)] == []
    late = [e for e in r.exports(report) if e.started_at > deleted_at + timedelta(seconds=3)]
    assert late == [], late
    assert len(r.exports(report)) <= before + 1  # at most a run already under way
    claimed_after = [c for c in r.claims(report)
                     if c.scheduled_at.replace(tzinfo=None) > deleted_at + timedelta(seconds=3)]
    assert claimed_after == [], claimed_after
    assert r.beat.alive() and r.worker.alive()

    # Enabled again, the disabled one resumes from then on.
    r.service.update_report(paused, enabled=True)
    r.wait_exports(paused, 1, RUN, after=naive_utc_now())

    # A schedule left behind by a removal that failed (the report row is gone) is harmless:
    # its runs find no report and are skipped; reconcile() removes it.
    r.schedules.add(f"report:{report}", "reports.run_report", every(2), args=[report])
    wait_for_log(r.worker, f"report {report}: skipped, the report is gone", RUN)
    assert len(r.exports(report)) <= before + 1
    assert r.service.reconcile() == {"added": [], "removed": [f"report:{report}"], "updated": []}
    assert r.schedules.get(f"report:{report}") is None


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_duplicate_delivery_gives_one_snapshot(rig, redis_url):
    r = rig()
    r.start_beat()  # no worker yet: the messages wait on the broker
    r.service.grant("alice", "customers")
    report = r.service.create_report("alice", "customers", every_seconds=3, masked_columns=["email"])

    client = redis.Redis.from_url(redis_url)
    try:
        def first_message():
            for raw in reversed(client.lrange(r.settings.queue, 0, -1)):  # oldest last in the list
                msg = json.loads(raw)
                if msg["headers"].get("cluster_beat_schedule") == f"report:{report}":
                    return msg
            return None

        wait_for(lambda: first_message() is not None, RUN, what="beat's first message")
        original = first_message()
        # The same occurrence delivered a second time (as after a resend in beat's one
        # unclosable window): the same message, task id and headers, its own delivery tag.
        copy = json.loads(json.dumps(original))
        copy["properties"]["delivery_tag"] = str(uuid.uuid4())
        client.rpush(r.settings.queue, json.dumps(copy))  # taken next, right beside the original
    finally:
        client.close()
    task_id = original["headers"]["id"]
    at = datetime.fromisoformat(original["headers"]["cluster_beat_scheduled_at"].replace("Z", "+00:00"))
    at = at.astimezone(timezone.utc).replace(tzinfo=None)

    r.start_worker()
    wait_for(lambda: r.deliveries(task_id) == 2, RUN, what="both deliveries at the worker")
    wait_for(lambda: any(c.scheduled_at.replace(tzinfo=None) == at and c.duplicates == 1 for c in r.claims(report)),
             RUN, what="the ledger counting the duplicate")
    r.wait_exports(report, 1, RUN)
    wait_for(lambda: all(e.status != "running" for e in r.exports(report)), RUN, what="runs to finish")

    mine = [e for e in r.exports(report) if e.scheduled_at == at]
    assert len(mine) == 1 and mine[0].status == "succeeded" and mine[0].task_id == task_id
    folder = r.settings.output_dir / f"report-{report}"
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith(f"{at:%Y%m%dT%H%M%S}")) == [
        f"{at:%Y%m%dT%H%M%S}Z.csv"]
    assert [p.name for p in folder.iterdir() if p.name.startswith(".")] == []  # no temporary file left
    # The notification commits just after the export's outcome: wait for it, then count.
    wait_for(lambda: mine[0].id in [n.export_id for n in r.notifications(report, "report.ready")], RUN,
             what="the report.ready notification")
    assert [n.export_id for n in r.notifications(report, "report.ready")].count(mine[0].id) == 1
    log = r.worker.log()
    assert f"duplicate delivery of report:{report}" in log
    assert "already exported" not in log  # the ledger refused it, not the export table's constraint
    # Every other occurrence ran once too.
    runs = r.exports(report)
    assert len({e.scheduled_at for e in runs}) == len(runs)


# ----------------------------------------------------------------------------- more of the contract


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_failed_notification_neither_fails_nor_reruns_the_run(rig):
    r = rig()
    r.start_beat_and_worker()
    r.service.grant("alice", "customers")
    report = r.service.create_report("alice", "customers", every_seconds=3, masked_columns=["email"])
    r.wait_exports(report, 1, RUN)
    with r.engine.begin() as conn:  # a real failure of the notification's insert
        conn.execute(sa.text("DROP TABLE notifications"))
    broken_at = naive_utc_now()
    runs = r.wait_exports(report, 2, RUN + 6, after=broken_at + timedelta(seconds=1))
    wait_for_log(r.worker, "could not notify alice of report.ready", RUN)
    after = [e for e in runs if e.scheduled_at > broken_at + timedelta(seconds=1)]
    assert all(e.status == "succeeded" and Path(e.path).exists() for e in after)
    assert r.exports(report, "failed") == []

    def claims() -> dict:
        return {c.scheduled_at.replace(tzinfo=None): c for c in r.claims(report)}

    wait_for(lambda: all(getattr(claims().get(e.scheduled_at), "run_state", None) == "succeeded" for e in after),
             RUN, what="the ledger's succeeded rows")
    claims = claims()
    for e in after:
        assert claims[e.scheduled_at].run_state == "succeeded"
        assert r.deliveries(e.task_id) == 1


def test_a_refused_schedule_leaves_no_report(tmp_path, monkeypatch):
    """create_report writes the schedule before it commits the report: when the scheduler's
    database refuses, there is no report that would silently never run."""
    monkeypatch.setenv("REPORTS_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("REPORTS_DB_URL", f"sqlite:///{tmp_path}/reports.sqlite3")
    monkeypatch.setenv("CLUSTER_BEAT_DB_URL", "postgresql+psycopg://postgres@127.0.0.1:1/nothing")  # nobody there
    monkeypatch.setenv("REDIS_URL", "")
    settings = Settings.from_env()
    engine = sa.create_engine(settings.reports_db_url)
    create_schema(engine)
    schedules = StoredSchedules(make_celery(settings))
    service = ReportService(engine, schedules)
    try:
        service.grant("alice", "customers")
        with pytest.raises(Exception) as caught:
            service.create_report("alice", "customers", cron="0 9 * * *", timezone="Europe/Paris")
        assert "claim store" in str(caught.value) or "connect" in str(caught.value).lower()
        with pytest.raises(ValueError, match="minute"):
            service.create_report("alice", "customers", cron="61 9 * * *")
        with pytest.raises(PermissionError):
            service.create_report("bob", "customers", cron="0 9 * * *")
        with pytest.raises(ValueError, match="no column 'mail'"):
            service.create_report("alice", "customers", cron="0 9 * * *", masked_columns=["mail"])
        with engine.connect() as conn:
            assert conn.scalar(sa.select(sa.func.count()).select_from(Report)) == 0
    finally:
        schedules.close()
        engine.dispose()


# ----------------------------------------------------------------------------- the README's command


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_readme_command_runs_the_demo_on_the_embedded_defaults(tmp_path):
    readme = (EXAMPLES / "reports" / "README.md").read_text()
    (command,) = re.findall(r"```sh\n(cd examples && [^\n]*reports\.demo[^\n]*)\n```", readme)
    if not (procs.REPO / ".venv" / "bin" / "python").exists():  # run under another interpreter (tox)
        command = command.replace("../.venv/bin/python", sys.executable)
    env = {k: v for k, v in os.environ.items()
           if k not in ("BROKER_URL", "REDIS_URL", "REPORTS_DB_URL", "CLUSTER_BEAT_DB_URL", "REPORTS_OUTPUT_DIR",
                        "REPORTS_QUEUE", "CLUSTER_BEAT_NAME")}
    env["REPORTS_DATA_DIR"] = str(tmp_path / "data")  # the one departure: not into the work tree
    done = subprocess.run(["bash", "-c", command], cwd=procs.REPO, env=env, capture_output=True, text=True,
                          timeout=280)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "succeeded: 6 rows" in out
    assert "report.failed" in out and "permission revoked" in out
    assert "the story is complete" in out
    assert "sqla+sqlite" in (tmp_path / "data" / "worker.log").read_text()  # no server: SQLite as broker
    snapshots = list((tmp_path / "data" / "snapshots").rglob("*.csv"))
    assert len(snapshots) >= 3
