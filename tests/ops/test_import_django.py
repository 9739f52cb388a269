"""``celery -A proj cluster-beat import django-celery-beat --db URL`` on real django-celery-beat tables
(issue 22, item 6).

The tables are made by django-celery-beat's own migrations and filled through its own models, in a
process of their own (:mod:`djangobeat_rows`), on SQLite and on fresh PostgreSQL and MariaDB databases; the
command then reads them with no Django configured (this process never sets it up), through
Celery's own command line, into a real claim store:

* what is carried over is stored as the stored-schedule API stores it: crontab text in its own
  zone (the first Monday as ``1#1``), intervals on the epoch grid, args, kwargs and the options
  django-celery-beat sends; a disabled task stays disabled;
* what cannot be is refused by name with the reason (solar; Friday the 13th; a name of the Celery
  config's ``beat_schedule``; an exchange outside the allow-list; broken JSON); a clocked one-off becomes
  ``at()``, start_time / expires become start_at / end_at; spent one-offs are skipped; exit status 1
  while any is refused;
* ``--dry-run`` writes nothing and says the same; a second run is all ``unchanged``; a changed
  definition is ``differs`` and left, until ``--update`` replaces it;
* a claim database no beat prepared is exit 3 with nothing written; a password is never printed.
"""
from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
import sqlalchemy as sa
from celery import Celery

from celery_cluster_beat.dynamic import StoredSchedules
from celery_cluster_beat.store import ClaimStore
from procs import write_app
from test_cli import cli, cli_process

UTC = timezone.utc
HELPER = Path(__file__).with_name("djangobeat_rows.py")
LATER = (datetime.now(UTC) + timedelta(days=30)).replace(microsecond=0)
CONFIG = "{'nightly': {'task': 't.record', 'schedule': cron('0 3 * * *')}}"

ROWS = [
    {"name": "weekday-report", "task": "reports.run", "args": "[42]", "kwargs": '{"fmt": "csv"}',
     "queue": "reports", "priority": 5, "expire_seconds": 600, "headers": '{"x-team": "a"}',
     "description": "weekday report", "crontab": {"minute": "30", "hour": "8", "day_of_week": "mon-fri",
                                                  "timezone": "Europe/Paris"}},
    {"name": "heartbeat", "task": "ops.ping", "interval": {"every": 30, "period": "seconds"}},
    {"name": "first-monday", "task": "reports.month", "crontab": {"minute": "0", "hour": "9", "day_of_month": "1-7",
                                                                  "day_of_week": "1", "timezone": "America/New_York"}},
    {"name": "paused-job", "task": "ops.tidy", "enabled": False, "interval": {"every": 2, "period": "hours"}},
    {"name": "friday-13th", "task": "t.record", "crontab": {"minute": "0", "hour": "0", "day_of_month": "13",
                                                             "day_of_week": "5"}},
    {"name": "sunrise", "task": "t.record", "solar": {"event": "sunrise", "latitude": "51.5", "longitude": "-0.1"}},
    {"name": "nightly", "task": "t.record", "interval": {"every": 1, "period": "days"}},
    {"name": "exchange-job", "task": "t.record", "exchange": "reports-x", "interval": {"every": 1, "period": "hours"}},
    {"name": "bad-args", "task": "t.record", "args": '{"not": "a list"}', "interval": {"every": 1, "period": "hours"}},
    {"name": "evil\x1b[2Jname", "task": "t.record", "interval": {"every": 1, "period": "hours"}},
    {"name": "spent-one-off", "task": "t.record", "one_off": True, "total_run_count": 1,
     "interval": {"every": 1, "period": "hours"}},
    {"name": "launch", "task": "t.record", "one_off": True, "clocked": LATER.isoformat()},
    {"name": "bounded", "task": "t.record", "start_time": LATER.isoformat(),
     "expires": (LATER + timedelta(days=7)).isoformat(), "crontab": {"minute": "0", "hour": "12"}},
]
CREATED = {"weekday-report", "heartbeat", "first-monday", "paused-job"}
REFUSED = {"friday-13th": "both day fields are restricted", "sunrise": "solar schedules are not supported",
           "nightly": "beat_schedule", "exchange-job": "exchange", "bad-args": "expected a JSON list",
           "evil\x1b[2Jname": "name: "}
BOUNDED = {"launch", "bounded"}


def make_django_db(url: str, rows) -> None:
    r = subprocess.run([sys.executable, str(HELPER), url, json.dumps(rows)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.fixture(params=["sqlite", "postgresql", "mysql"])
def django_db(request, tmp_path):
    """django-celery-beat's database: SQLite, or a fresh PostgreSQL or MariaDB database of the test's own."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/django.sqlite3"
    return request.getfixturevalue("pg_url" if request.param == "postgresql" else "mysql_url")


@pytest.fixture
def app(tmp_path):
    claims = f"sqlite:///{tmp_path}/claims.sqlite3"
    with ClaimStore(claims, node_id="prepare"):  # as a beat leaves it
        pass
    return write_app(tmp_path, broker="memory://", db_url=claims, redis_url="", schedule=CONFIG)


def stored(app):
    celery_app = Celery("reader", set_as_current=False)
    celery_app.conf.cluster_beat_db_url = app_db(app)
    celery_app.conf.cluster_beat_redis_url = ""
    with StoredSchedules(celery_app) as schedules:
        return {s.name: s for s in schedules.list()}


def app_db(app) -> str:
    return f"sqlite:///{app.directory}/claims.sqlite3"


def statuses(doc):
    return {s["name"]: s for s in doc["schedules"]}


def run_json(app, *args):
    r = cli(app, "import", *args, "--json")
    return r.returncode, json.loads(r.stdout), r


def test_import_carries_over_what_fires_the_same_and_refuses_the_rest_by_name(django_db, app):
    make_django_db(django_db, ROWS)

    rc, doc, _ = run_json(app, "django-celery-beat", "--db", django_db, "--dry-run")
    assert rc == 1 and doc["dry_run"] is True
    seen = statuses(doc)
    assert {n for n, s in seen.items() if s["status"] == "would create"} == CREATED | BOUNDED
    assert stored(app) == {}  # the dry run wrote nothing
    r = cli(app, "import", "django-celery-beat", "--db", django_db, "--dry-run")
    assert r.returncode == 1 and len(r.stdout.strip().splitlines()) == len(ROWS) + 1
    assert "\x1b" not in r.stdout and "evil\\x1b[2Jname" in r.stdout  # a name from the source, escaped

    rc, doc, _ = run_json(app, "django-celery-beat", "--db", django_db)
    assert rc == 1  # some were refused: said, and the rest imported
    seen = statuses(doc)
    for name, words in REFUSED.items():
        assert seen[name]["status"] == "refused" and words in seen[name]["reason"], seen[name]
    assert seen["sunrise"]["what"].startswith("solar sunrise")
    assert seen["spent-one-off"]["status"] == "skipped"
    for name in BOUNDED:
        assert seen[name]["status"] == "created"
    assert "epoch grid" in " ".join(seen["heartbeat"]["notes"])

    rows = stored(app)
    assert set(rows) == CREATED | BOUNDED
    report = rows["weekday-report"]
    assert (report.task, report.schedule, report.zone) == ("reports.run", "30 8 * * mon-fri", "Europe/Paris")
    assert (report.args, report.kwargs, report.description) == ([42], {"fmt": "csv"}, "weekday report")
    assert report.options == {"queue": "reports", "priority": 5, "expires": 600,
                              "headers": {"x-team": "a", "periodic_task_name": "weekday-report"}}
    assert (rows["first-monday"].schedule, rows["first-monday"].zone) == ("0 9 * * 1#1", "America/New_York")
    assert (rows["heartbeat"].schedule, rows["heartbeat"].zone) == ("every 30s", None)
    assert rows["paused-job"].enabled is False and rows["heartbeat"].enabled is True
    assert rows["launch"].schedule.startswith("at ") and rows["launch"].max_runs is None
    assert rows["bounded"].start_at == LATER and rows["bounded"].end_at == LATER + timedelta(days=7)

    # -- a second run is a no-op
    versions = {n: s.version for n, s in rows.items()}
    rc, doc, _ = run_json(app, "django-celery-beat", "--db", django_db)
    assert rc == 1 and {n for n, s in statuses(doc).items() if s["status"] == "unchanged"} == set(rows)
    assert {n: s.version for n, s in stored(app).items()} == versions


def test_a_changed_definition_is_reported_and_replaced_only_with_update(tmp_path, app):
    url = f"sqlite:///{tmp_path}/django.sqlite3"
    make_django_db(url, ROWS[:2])
    r = cli(app, "import", "django-celery-beat", "--db", url)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 3 and lines[0].startswith("created") and "weekday-report: crontab 30 8" in lines[0]
    assert "-> cron '30 8 * * mon-fri' Europe/Paris" in lines[0] and "2 created" in lines[-1]

    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE django_celery_beat_periodictask SET args = '[43]' WHERE name = 'weekday-report'"))
    engine.dispose()
    r = cli(app, "import", "django-celery-beat", "--db", url)
    assert r.returncode == 1
    assert any(line.startswith("differs") and "weekday-report" in line and "in args" in line
               for line in r.stdout.splitlines()), r.stdout
    assert stored(app)["weekday-report"].args == [42]

    rc, doc, _ = run_json(app, "django-celery-beat", "--db", url, "--update", "--dry-run")
    assert rc == 0 and statuses(doc)["weekday-report"]["status"] == "would update"
    assert stored(app)["weekday-report"].args == [42]
    rc, doc, _ = run_json(app, "django-celery-beat", "--db", url, "--update")
    assert rc == 0 and statuses(doc)["weekday-report"]["status"] == "updated"
    assert statuses(doc)["heartbeat"]["status"] == "unchanged"
    row = stored(app)["weekday-report"]
    assert (row.args, row.schedule, row.zone) == ([43], "30 8 * * mon-fri", "Europe/Paris")
    rc, doc, _ = run_json(app, "django-celery-beat", "--db", url)
    assert rc == 0 and {s["status"] for s in doc["schedules"]} == {"unchanged"}


def test_a_claim_database_no_beat_prepared_is_exit_3_and_left_empty(tmp_path, pg_url):
    url = f"sqlite:///{tmp_path}/django.sqlite3"
    make_django_db(url, ROWS[:1])
    app = write_app(tmp_path, broker="memory://", db_url=pg_url, redis_url="", schedule="{}")
    r = cli(app, "import", "django-celery-beat", "--db", url)
    assert r.returncode == 3 and "not initialised" in r.stderr
    engine = sa.create_engine(pg_url)
    try:
        assert sa.inspect(engine).get_table_names() == []
    finally:
        engine.dispose()


def test_bad_sources_are_one_line_without_the_password(tmp_path, app):
    for url, words in (("postgresql://importer:s3cret@127.0.0.1:1/nodb", "127.0.0.1"),
                       (f"sqlite:///{tmp_path}/missing.sqlite3", "no SQLite database file"),
                       (app_db(app), "no table django_celery_beat_periodictask")):
        r = cli(app, "import", "django-celery-beat", "--db", url)
        assert r.returncode == 1 and "s3cret" not in r.stdout + r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], r.stderr


def test_it_is_a_cluster_beat_command_and_fails_in_a_real_process_with_one_line(tmp_path, app):
    r = cli_process(app, "import", "--help")
    assert r.returncode == 0 and "django-celery-beat" in r.stdout and "redbeat" in r.stdout, r.stderr
    r = cli_process(app, "import", "django-celery-beat", "--help")
    assert all(option in r.stdout for option in ("--db", "--dry-run", "--update", "--json"))
    r = cli_process(app, "import", "django-celery-beat", "--db", "postgresql://importer:s3cret@127.0.0.1:1/nodb")
    assert r.returncode == 1 and "Traceback" not in r.stderr and "s3cret" not in r.stdout + r.stderr
    assert [line for line in r.stderr.splitlines() if line.startswith("error: ")] == r.stderr.strip().splitlines()


def test_what_is_read_is_bounded_in_all_and_past_it_nothing_is_written(tmp_path, app, monkeypatch):
    from celery_cluster_beat.ops.importers import mapping

    url = f"sqlite:///{tmp_path}/django.sqlite3"
    make_django_db(url, ROWS)
    monkeypatch.setattr(mapping, "MAX_TOTAL_READ", 500)
    r = cli(app, "import", "django-celery-beat", "--db", url)
    assert r.returncode == 1 and "more than 500 characters of schedules to read" in r.stderr
    assert stored(app) == {}
