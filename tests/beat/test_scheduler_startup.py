"""Starting the scheduler: what beat's two constructions open, what bad input does,
what is printed, and the ways ``-S`` can name the scheduler.

``celery beat`` builds the scheduler twice: a lazy instance for its banner
(``Scheduler(app, lazy=True)``, only ``.info`` is read) and the real one. The
lazy one must open nothing; bad configuration must stop the process before
anything is created, with every problem in one message; and no URL password
may reach the output. Real ``celery beat`` processes, real PostgreSQL and Redis.
"""
from __future__ import annotations

import sys
import time
from datetime import datetime
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis
from celery import Celery
from sqlalchemy.engine import make_url

from celery_cluster_beat import Scheduler, every
from celery_cluster_beat.errors import ConfigError
from celery_cluster_beat.schedules.occurrence import occurrence_task_id

from procs import Proc, start_beat, wait_for, write_app

BROKER_DB = 7  # a Redis database of these tests' own; every app also has its own queue


# --------------------------------------------------------------------------- helpers


@pytest.fixture
def broker(redis_url) -> str:
    parts = urlsplit(redis_url)
    return urlunsplit(parts._replace(path=f"/{BROKER_DB}"))


@pytest.fixture
def cleanup_queues():
    """Delete the queues the test's apps used (nobody consumes them)."""
    apps = []
    yield apps
    for app in apps:
        client = redis.Redis.from_url(app.broker)
        try:
            client.delete(app.queue)
        finally:
            client.close()


def _app(**conf) -> Celery:
    app = Celery("ccb_startup", broker=conf.pop("broker", "memory://"))
    app.conf.update(conf)
    return app


def _wait_exit(proc: Proc, timeout: float) -> int:
    try:
        return proc.popen.wait(timeout)
    except Exception:
        raise AssertionError(f"beat still running after {timeout:.0f}s:\n{proc.log()[-3000:]}") from None


def _beat_args(app, tmp: Path, label: str, scheduler: str) -> list:
    return [sys.executable, "-m", "celery", "-A", app.module, "beat", "-S", scheduler,
            "-l", "info", "--pidfile=", "-s", str(tmp / f"unused-{label}")]


# --------------------------------------------------------------------------- the lazy banner instance


def test_lazy_instance_opens_nothing_and_its_info_masks_passwords(tmp_path):
    """The banner's lazy instance connects to nothing and creates nothing, even
    with unreachable URLs; ``.info`` names both URLs with the password replaced
    by ``***``; ``close()`` twice is harmless."""
    app = _app(
        broker="redis://:secret@127.0.0.1:1/0",
        cluster_beat_db_url="postgresql+psycopg://u:secret@127.0.0.1:1/x",
        cluster_beat_redis_url="redis://:secret@127.0.0.1:1/0",
        beat_schedule={"tick": {"task": "t.record", "schedule": every(60)}},
    )
    started = time.monotonic()
    sched = Scheduler(app, lazy=True)
    assert time.monotonic() - started < 5.0
    info = sched.info
    assert "secret" not in info
    assert "postgresql+psycopg://u:***@127.0.0.1:1/x" in info
    assert "redis://:***@127.0.0.1:1/0" in info
    assert "secret" not in repr(sched.settings)
    sched.close()
    sched.close()

    # The same with SQLite: no file appears (the store is created by the real instance only).
    db = tmp_path / "claims.sqlite3"
    app2 = _app(cluster_beat_db_url=f"sqlite:///{db}", cluster_beat_redis_url="",
                beat_schedule={"tick": {"task": "t.record", "schedule": every(60)}})
    lazy = Scheduler(app2, lazy=True)
    assert "lease -> off" in lazy.info
    lazy.close()
    lazy.close()
    assert list(tmp_path.iterdir()) == []


def test_close_is_idempotent_on_a_real_instance_and_unknown_kwargs_are_accepted(tmp_path):
    """A real (non-lazy) instance opens its store; ``close()`` twice is harmless and
    a closed scheduler's tick just returns a positive sleep. Beat passes keyword
    arguments of its own (``schedule_filename=``...) that we accept and ignore."""
    db = tmp_path / "claims.sqlite3"
    app = _app(cluster_beat_db_url=f"sqlite:///{db}", cluster_beat_redis_url="",
               beat_schedule={"tick": {"task": "t.record", "schedule": every(3600)}})
    sched = Scheduler(app, lazy=False, schedule_filename=str(tmp_path / "celerybeat-schedule"),
                      max_interval=2.0, some_future_option=True)
    try:
        assert db.exists()  # the real instance did open the store
        assert 0 < sched.tick() <= 2.0
    finally:
        sched.close()
    sched.close()
    assert sched.tick() > 0
    assert not (tmp_path / "celerybeat-schedule").exists()  # beat's shelve file is never used


# --------------------------------------------------------------------------- bad input at start-up


BAD_SCHEDULE = """{
    'bad-cron': {'task': 't.record', 'schedule': '61 * * * *'},
    'unknown-key': {'task': 't.record', 'schedule': every(60), 'colour': 'blue'},
    'no-task': {'schedule': every(60)},
    'bad-tz': {'task': 't.record', 'schedule': BAD_TZ},
    'neg-jitter': {'task': 't.record', 'schedule': every(60), 'jitter': -1},
    'zero': {'task': 't.record', 'schedule': 0},
    'good': {'task': 't.record', 'schedule': every(60)},
}"""

# crontab in a zone given as a (misspelt) name, set where Celery keeps a crontab's zone
BAD_TZ_PRELUDE = "BAD_TZ = crontab(minute=0)\nBAD_TZ.tz = 'Mars/Olympus'\n"


def _write_with_prelude(app, prelude: str) -> None:
    path = app.directory / f"{app.module}.py"
    path.write_text(path.read_text().replace("app = Celery(", prelude + "app = Celery(", 1))


def test_bad_entries_and_settings_stop_beat_listing_every_problem_before_anything_is_created(tmp_path, broker):
    """A real ``celery beat`` with six invalid entries and one bad setting exits
    non-zero within seconds; its output has one ConfigError listing every problem
    (entry name, field, reason) and no claim database was created."""
    db = tmp_path / "claims.sqlite3"
    app = write_app(tmp_path, broker=broker, db_url=f"sqlite:///{db}", schedule=BAD_SCHEDULE,
                    conf="{'cluster_beat_lock_ttl': 'x'}")
    _write_with_prelude(app, BAD_TZ_PRELUDE)
    beat = start_beat(app, tmp_path, "bad")
    try:
        rc = _wait_exit(beat, 30)
        out = beat.log()
    finally:
        beat.stop()
    assert rc != 0, out
    assert "7 problems in the celery-cluster-beat configuration" in out, out
    # one message: all seven problems appear in the same ConfigError text
    message = out[out.index("7 problems in the celery-cluster-beat configuration"):]
    expected = [
        ("setting cluster_beat_lock_ttl", "expected a number of seconds, got 'x'"),
        ("beat_schedule entry 'bad-cron': schedule", "cron '61 * * * *': minute value 61 is out of range 0-59"),
        ("beat_schedule entry 'unknown-key': colour", "unknown key"),
        ("beat_schedule entry 'no-task': task", "expected a task name"),
        ("beat_schedule entry 'bad-tz': schedule", "unknown time zone 'Mars/Olympus'"),
        ("beat_schedule entry 'neg-jitter': jitter", "must be zero or positive, got -1"),
        ("beat_schedule entry 'zero': schedule", "interval 0 is under the 1 second minimum"),
    ]
    for where, why in expected:
        lines = [line for line in message.splitlines() if where in line]
        assert lines, f"{where!r} missing from:\n{message}"
        assert any(why in line for line in lines), f"{where!r}: expected {why!r} in {lines}"
    assert "'good'" not in message
    assert not db.exists(), "the claim database was created although the configuration was refused"
    assert "beat: Starting" not in out


def test_a_bad_cron_expression_stops_beat_naming_field_and_reason(tmp_path, broker):
    """``cron('61 * * * *')`` in the app module stops ``celery beat`` with the
    expression, the field and the reason; nothing is created. (cron() checks its
    expression when built, so this problem surfaces at import, on its own.)"""
    db = tmp_path / "claims.sqlite3"
    app = write_app(tmp_path, broker=broker, db_url=f"sqlite:///{db}",
                    schedule="{'bad-cron': {'task': 't.record', 'schedule': cron('61 * * * *')}}")
    beat = start_beat(app, tmp_path, "badcron")
    try:
        rc = _wait_exit(beat, 30)
        out = beat.log()
    finally:
        beat.stop()
    assert rc != 0, out
    assert "cron '61 * * * *': minute value 61 is out of range 0-59" in out, out
    assert not db.exists()


def test_an_unknown_app_timezone_stops_beat_before_the_store_is_created(tmp_path, broker):
    """Entries without a zone of their own follow the app's ``timezone``; an
    unknown zone there is a start-up error like any other (listed with the other
    problems), not a crash after the claim database was created."""
    db = tmp_path / "claims.sqlite3"
    app = write_app(tmp_path, broker=broker, db_url=f"sqlite:///{db}",
                    schedule="{'nightly': {'task': 't.record', 'schedule': cron('0 3 * * *')},"
                             " 'neg-jitter': {'task': 't.record', 'schedule': every(60), 'jitter': -1}}",
                    conf="{'timezone': 'Mars/Olympus'}")
    beat = start_beat(app, tmp_path, "badappzone")
    try:
        rc = _wait_exit(beat, 30)
        out = beat.log()
    finally:
        beat.stop()
    assert rc != 0, out
    assert "2 problems in the celery-cluster-beat configuration" in out, out
    assert "unknown time zone 'Mars/Olympus'" in out
    assert "beat_schedule entry 'neg-jitter': jitter" in out
    assert not db.exists(), "the claim database was created before the time zone was checked"
    assert "beat: Starting" not in out


def test_the_scheduler_refuses_bad_input_in_process_with_one_config_error():
    """The same validation in-process: one ConfigError (a ValueError) whose
    ``problems`` list has one item per problem, raised before anything opens."""
    app = _app(cluster_beat_db_url="postgresql+psycopg://u:secret@127.0.0.1:1/x",
               cluster_beat_lock_ttl=-1, cluster_beat_catchup="sometimes",
               beat_schedule={"a": {"task": "t", "schedule": every(60), "jitter": "soon"},
                              "b": {"task": "", "schedule": every(60)}})
    with pytest.raises(ConfigError) as info:
        Scheduler(app, lazy=False)
    problems = info.value.problems
    assert len(problems) == 4, problems
    assert isinstance(info.value, ValueError)
    assert "secret" not in str(info.value)


# --------------------------------------------------------------------------- output


def test_beat_output_masks_the_claim_database_password(tmp_path, pg_url, broker, cleanup_queues):
    """A beat whose claim database URL carries a password (PostgreSQL with trust
    auth ignores it) runs and sends; its whole output shows ``***`` and never
    the password."""
    password = "Pw-s3cret-4711"
    url = make_url(pg_url).set(password=password).render_as_string(hide_password=False)
    assert password in url
    app = write_app(tmp_path, broker=broker, db_url=url,
                    schedule="{'tick': {'task': 't.record', 'schedule': every(1)}}")
    cleanup_queues.append(app)
    beat = start_beat(app, tmp_path, "pw")
    try:
        wait_for(lambda: len(app.queued_messages()) >= 2, 30, what="two messages from beat")
        out = beat.log()
        assert beat.alive(), out
    finally:
        beat.stop()
    out = beat.log()
    assert password not in out
    assert "postgresql+psycopg://postgres:***@" in out, out
    assert "cluster-beat: node" in out


# --------------------------------------------------------------------------- naming the scheduler


def test_colon_form_and_entry_point_alias_name_the_scheduler(tmp_path, broker, cleanup_queues):
    """``-S celery_cluster_beat:Scheduler`` and ``-S cluster`` (the entry point of
    the installed package) both run our scheduler: its banner lines appear and
    messages carry our headers and occurrence task ids."""
    procs = {}
    apps = {}
    for label, name in (("colon", "celery_cluster_beat:Scheduler"), ("alias", "cluster")):
        d = tmp_path / label
        d.mkdir()
        app = write_app(d, broker=broker, db_url=f"sqlite:///{d}/claims.sqlite3",
                        schedule="{'tick': {'task': 't.record', 'schedule': every(1)}}")
        cleanup_queues.append(app)
        apps[label] = app
        procs[label] = Proc(_beat_args(app, d, label, name), cwd=d, env=app.env(), log=d / "beat.log")
    try:
        for label, app in apps.items():
            wait_for(lambda: len(app.queued_messages()) >= 1, 30, what=f"a message from the {label} beat")
    finally:
        for proc in procs.values():
            proc.stop()
    for label, app in apps.items():
        out = procs[label].log()
        assert "scheduler -> celery_cluster_beat.beat.scheduler.Scheduler" in out, out
        assert "    . lease -> off" in out
        schedule, at, node, task_id = app.sent_occurrences()[0]
        assert schedule == "tick" and node
        assert task_id == occurrence_task_id("tick", datetime.fromisoformat(at.replace("Z", "+00:00")))
