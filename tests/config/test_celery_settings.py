"""Celery's own settings, honoured, proven with real processes.

* ``enable_utc=False`` without ``timezone`` means the server's local zone, as in Celery
  (``TZ=America/New_York`` here): a cron without a zone of its own fires at New York
  wall times, in the arithmetic and in a real ``celery beat``. A local zone without an
  IANA name is a start-up error naming ``timezone``, never a silent UTC.
* ``-s`` / ``beat_schedule_filename`` names the claim database when
  ``cluster_beat_db_url`` is unset: ``<schedule file>-cluster.sqlite3``; with the
  setting in the conf, beat, the worker's ledger and the stored-schedules API agree.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from datetime import datetime, timedelta, timezone
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
import redis

from procs import REPO, App, Proc, wait_for, wait_for_log, write_app

NEW_YORK = ZoneInfo("America/New_York")
START = 90  # seconds a beat may take to start on a loaded host
SENDING = "Sending due task"


def run_python(code: str, *, cwd: Path, env: dict, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def env_with(**extra: str) -> dict:
    import os

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def beat(app: App, tmp: Path, label: str, *extra: str, env: dict) -> Proc:
    """A real ``celery beat`` of *app*; unlike ``procs.start_beat`` no ``-s`` unless given in *extra*."""
    args = [sys.executable, "-m", "celery", "-A", app.module, "beat", "-S", "celery_cluster_beat.Scheduler",
            "-l", "info", "--pidfile=", *extra]
    return Proc(args, cwd=app.directory, env=app.env(**env), log=tmp / f"beat-{label}.log")


def drop_queue(app: App) -> None:
    client = redis.Redis.from_url(app.broker)
    try:
        client.delete(app.queue)
    finally:
        client.close()


# --------------------------------------------------------------------------- enable_utc=False: the local zone

ARITHMETIC = """
    import json
    from datetime import datetime, timezone
    from celery import Celery
    from celery.schedules import crontab
    from celery_cluster_beat import cron
    from celery_cluster_beat.config import build_entries, load_settings

    app = Celery("tz-test", broker="memory://")
    app.conf.update(enable_utc=False)
    load_settings(app.conf, has_result_backend=lambda: False)
    entries = build_entries({
        "cron": {"task": "t", "schedule": cron("0 9 * * *")},
        "text": {"task": "t", "schedule": "0 9 * * *"},
        "crontab": {"task": "t", "schedule": crontab(minute=0, hour=9)},
    }, app=app)
    out = {"celery": getattr(app.timezone, "key", str(app.timezone))}
    for name, entry in entries.items():
        out[name] = [entry.schedule.next_fire(datetime(2026, m, 15, tzinfo=timezone.utc)).isoformat() for m in (1, 7)]
    print(json.dumps(out))
"""


def test_without_enable_utc_and_timezone_a_cron_fires_at_local_wall_time(tmp_path):
    """TZ=America/New_York, enable_utc=False, no timezone: '0 9 * * *' is 09:00 in New York,
    14:00Z in winter and 13:00Z in summer, for cron(), cron text and Celery's crontab alike;
    Celery itself reads the same zone. Fails if the local zone is ignored (09:00Z)."""
    done = run_python(ARITHMETIC, cwd=tmp_path, env=env_with(TZ="America/New_York"))
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out.pop("celery") == "America/New_York"
    for name, fires in out.items():
        assert fires == ["2026-01-15T14:00:00+00:00", "2026-07-15T13:00:00+00:00"], name


def test_with_enable_utc_the_local_zone_is_not_used(tmp_path):
    """The default (enable_utc=True, no timezone) stays UTC whatever TZ says."""
    code = ARITHMETIC.replace("enable_utc=False", "enable_utc=True")
    done = run_python(code, cwd=tmp_path, env=env_with(TZ="America/New_York"))
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    out.pop("celery")
    for name, fires in out.items():
        assert fires == ["2026-01-15T09:00:00+00:00", "2026-07-15T09:00:00+00:00"], name


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_real_beat_without_enable_utc_sends_at_new_york_wall_times(tmp_path, redis_url):
    """A real ``celery beat`` with TZ=America/New_York and enable_utc=False: entries firing every
    minute of the current New York hour (and the next) send within about a minute, at whole New
    York minutes of those hours. Read as UTC those hours are 4-5 hours away: nothing would be sent."""
    now = datetime.now(NEW_YORK)
    hours = f"{now.hour},{(now.hour + 1) % 24}"
    app = write_app(tmp_path, broker=redis_url, db_url=f"sqlite:///{tmp_path}/claims.sqlite3", schedule=f"""{{
        'ny-cron': {{'task': 't.record', 'schedule': cron('* {hours} * * *')}},
        'ny-crontab': {{'task': 't.record', 'schedule': crontab(minute='*', hour='{hours}')}},
    }}""", conf="{'enable_utc': False, 'timezone': None}")
    proc = beat(app, tmp_path, "ny", "-s", str(tmp_path / "unused-schedule"), env={"TZ": "America/New_York"})
    try:
        wait_for(lambda: {s for s, *_ in app.sent_occurrences()} >= {"ny-cron", "ny-crontab"}, START + 70,
                 interval=0.5, what="both entries sent")
        sent = app.sent_occurrences()
    except AssertionError:
        raise AssertionError(proc.log()[-4000:]) from None
    finally:
        proc.stop()
        drop_queue(app)
    for name, at, _node, _id in sent:
        local = datetime.fromisoformat(at).astimezone(NEW_YORK)
        assert local.hour in {now.hour, (now.hour + 1) % 24} and local.second == 0, (name, at)
        assert abs(datetime.now(timezone.utc) - datetime.fromisoformat(at)) < timedelta(minutes=5), (name, at)


def test_a_local_zone_without_an_iana_name_stops_beat_naming_timezone(tmp_path, redis_url):
    """TZ='<+03>-3' (a POSIX rule, no IANA name) with enable_utc=False and no timezone: beat
    refuses to start, saying to set ``timezone``; it never falls back to UTC or a fixed offset."""
    app = write_app(tmp_path, broker=redis_url, db_url=f"sqlite:///{tmp_path}/claims.sqlite3",
                    schedule="{'nine': {'task': 't.record', 'schedule': cron('0 9 * * *')}}",
                    conf="{'enable_utc': False}")
    proc = beat(app, tmp_path, "posix-tz", env={"TZ": "<+03>-3"})
    try:
        rc = proc.popen.wait(START)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"beat did not stop:\n{proc.log()[-3000:]}") from None
    finally:
        proc.stop()
    out = proc.log()
    assert rc != 0, out
    assert "setting timezone" in out and "IANA" in out, out[-3000:]
    assert SENDING not in out


# --------------------------------------------------------------------------- -s / beat_schedule_filename


def test_beat_s_names_the_claim_database_when_no_url_is_set(tmp_path, redis_url):
    """``celery beat -s <dir>/sched`` without cluster_beat_db_url: the claims go to
    ``<dir>/sched-cluster.sqlite3``, nothing to the working directory."""
    state = tmp_path / "state"
    state.mkdir()
    app = write_app(tmp_path, broker=redis_url, db_url=None,
                    schedule="{'tick': {'task': 't.record', 'schedule': every(1)}}")
    proc = beat(app, tmp_path, "dash-s", "-s", str(state / "sched"), env={})
    try:
        wait_for_log(proc, SENDING, START)
    finally:
        proc.stop()
        drop_queue(app)
    assert (state / "sched-cluster.sqlite3").exists(), proc.log()[-3000:]
    assert f"db -> sqlite:///{state / 'sched'}-cluster.sqlite3" in proc.log()
    assert not (tmp_path / "celerybeat-cluster.sqlite3").exists()
    assert not (state / "sched").exists() and not list(state.glob("sched.*")), "beat's shelve is never written"


AGREEMENT = """
    import json
    from {module} import app
    from celery_cluster_beat.dynamic.api import StoredSchedules
    from celery_cluster_beat.worker.task import ledger_store

    print(json.dumps({{"worker": ledger_store(app).url_masked, "api": StoredSchedules(app).settings.db_url}}))
"""


def test_beat_schedule_filename_in_the_conf_makes_beat_worker_and_api_agree(tmp_path, redis_url):
    """``beat_schedule_filename`` in the conf (no -s, no URL): beat's claims, the worker's ledger
    and the stored-schedules API all use ``<file>-cluster.sqlite3``."""
    sched = tmp_path / "state" / "beat-schedule"
    sched.parent.mkdir()
    expected = f"sqlite:///{sched}-cluster.sqlite3"
    app = write_app(tmp_path, broker=redis_url, db_url=None,
                    schedule="{'tick': {'task': 't.record', 'schedule': every(1)}}",
                    conf=f"{{'beat_schedule_filename': {str(sched)!r}}}")
    proc = beat(app, tmp_path, "conf", env={})
    try:
        wait_for_log(proc, SENDING, START)
    finally:
        proc.stop()
        drop_queue(app)
    assert f"db -> {expected}" in proc.log(), proc.log()[-3000:]
    assert Path(f"{sched}-cluster.sqlite3").exists()
    done = run_python(AGREEMENT.format(module=app.module), cwd=tmp_path / "state", env=app.env())
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"worker": expected, "api": expected}
    assert not (tmp_path / "celerybeat-cluster.sqlite3").exists()
    assert not (tmp_path / "state" / "celerybeat-cluster.sqlite3").exists()


# --------------------------------------------------------------------------- solar: named as unsupported


def test_celery_solar_schedules_are_refused_by_name():
    """A solar entry is a start-up problem naming the entry and saying solar is not supported."""
    from celery.schedules import BaseSchedule, solar

    from celery_cluster_beat import ConfigError, ScheduleError, as_schedule
    from celery_cluster_beat.config import build_entries

    sunrise = solar.__new__(solar)  # its constructor needs ephem, which is not installed here
    sunrise.event, sunrise.lat, sunrise.lon = "sunrise", 51.5, -0.1
    BaseSchedule.__init__(sunrise)
    with pytest.raises(ScheduleError, match="Celery's solar schedules are not supported: "):
        as_schedule(sunrise)
    with pytest.raises(ConfigError) as info:
        build_entries({"dawn": {"task": "t", "schedule": sunrise}})
    assert "'dawn'" in str(info.value) and "solar schedules are not supported" in str(info.value)
