"""``celery -A proj cluster-beat import redbeat --redis URL --key-prefix P`` on real RedBeat entries
(issue 22, item 6).

Entries are saved by RedBeat itself (``RedBeatSchedulerEntry(...).save()``) into a real Redis under a
key prefix of the test's own; the command reads its hashes and sorted set without RedBeat:

* crontabs become cron text in the app's zone (RedBeat's crontab has none), intervals ``every``
  on the epoch grid, args / kwargs / options kept, a disabled entry stays disabled;
* an rrule and a Friday-the-13th crontab are refused by name; a static entry (from RedBeat's
  ``beat_schedule``) is skipped; an oversized definition or a key that is not a hash, written past RedBeat, is refused unread;
* a second run is all ``unchanged``; a password is never printed.
"""
from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest
import redis
from celery import Celery
from celery.schedules import crontab, schedule

from test_import_django import app, stored  # noqa: F401  (the app fixture: a prepared claim store)
from test_cli import cli

UTC = timezone.utc


@pytest.fixture
def redbeat_app(redis_url, redis_prefix):
    source = Celery("redbeat_source", broker=redis_url, set_as_current=False)
    source.conf.redbeat_redis_url = redis_url
    source.conf.redbeat_key_prefix = redis_prefix
    yield source
    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(match=redis_prefix + "*", count=500))
    if keys:
        client.delete(*keys)
    client.close()


def save(source, name, task, rule, **fields):
    from redbeat import RedBeatSchedulerEntry

    RedBeatSchedulerEntry(name, task, rule, app=source, **fields).save()


def test_redbeat_entries_are_imported_and_a_second_run_changes_nothing(app, redbeat_app, redis_url,  # noqa: F811
                                                                       redis_prefix):
    from redbeat.schedules import rrule

    save(redbeat_app, "weekday", "reports.run", crontab(minute=0, hour=9, day_of_week="mon-fri"), args=[1],
         kwargs={"fmt": "csv"}, options={"queue": "reports", "priority": 3})
    save(redbeat_app, "ping", "ops.ping", schedule(timedelta(seconds=45)))
    save(redbeat_app, "paused", "ops.tidy", schedule(timedelta(hours=1)), enabled=False)
    save(redbeat_app, "first-monday", "reports.month", crontab(minute=0, hour=9, day_of_month="1-7", day_of_week=1))
    save(redbeat_app, "friday-13th", "t.record", crontab(minute=0, hour=0, day_of_month=13, day_of_week=5))
    save(redbeat_app, "minutely", "t.record", rrule("MINUTELY", dtstart=datetime.now(UTC), count=5))
    save(redbeat_app, "static-one", "t.record", schedule(timedelta(minutes=5)))
    client = redis.Redis.from_url(redis_url)
    client.sadd(redis_prefix + ":statics", "static-one")
    client.hset(redis_prefix + "huge", "definition", "x" * 300_000)  # written past RedBeat
    client.set(redis_prefix + "plain", "not a hash")
    client.zadd(redis_prefix + ":schedule", {redis_prefix + "huge": 0, redis_prefix + "plain": 0})
    client.close()

    r = cli(app, "import", "redbeat", "--redis", redis_url, "--key-prefix", redis_prefix, "--json")
    assert r.returncode == 1, r.stderr
    seen = {s["name"]: s for s in json.loads(r.stdout)["schedules"]}
    assert {n for n, s in seen.items() if s["status"] == "created"} == {"weekday", "ping", "paused", "first-monday"}
    assert "both day fields are restricted" in seen["friday-13th"]["reason"]
    assert "rrule" in seen["minutely"]["reason"] and seen["minutely"]["status"] == "refused"
    assert seen["static-one"]["status"] == "skipped" and "beat_schedule" in seen["static-one"]["reason"]
    assert seen["huge"]["status"] == "refused" and "300000 bytes" in seen["huge"]["reason"]
    assert seen["plain"]["status"] == "refused" and "not a hash" in seen["plain"]["reason"]

    rows = stored(app)
    weekday = rows["weekday"]
    assert (weekday.task, weekday.schedule, weekday.zone) == ("reports.run", "0 9 * * mon-fri", "UTC")
    assert (weekday.args, weekday.kwargs, weekday.options) == ([1], {"fmt": "csv"}, {"queue": "reports",
                                                                                     "priority": 3})
    assert (rows["ping"].schedule, rows["ping"].zone) == ("every 45s", None)
    assert rows["paused"].enabled is False and rows["first-monday"].schedule == "0 9 * * 1#1"

    versions = {n: s.version for n, s in rows.items()}
    r = cli(app, "import", "redbeat", "--redis", redis_url, "--key-prefix", redis_prefix)
    assert r.returncode == 1
    assert sum(line.startswith("unchanged") for line in r.stdout.splitlines()) == 4
    assert {n: s.version for n, s in stored(app).items()} == versions


def test_no_redbeat_schedule_under_the_prefix_and_a_password_are_one_line(app, redis_url, redis_prefix):  # noqa: F811
    r = cli(app, "import", "redbeat", "--redis", redis_url, "--key-prefix", redis_prefix)
    assert r.returncode == 1 and "no key" in r.stderr and "--key-prefix" in r.stderr
    r = cli(app, "import", "redbeat", "--redis", "redis://:s3cret@127.0.0.1:1/0", "--dry-run")
    assert r.returncode == 1 and "s3cret" not in r.stdout + r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("error: ")


def test_redbeat_reads_are_bounded_in_all(app, redbeat_app, redis_url, redis_prefix, monkeypatch):  # noqa: F811
    from celery_cluster_beat.ops.importers import mapping

    for i in range(3):
        save(redbeat_app, f"job-{i}", "t.record", schedule(timedelta(minutes=5)), args=["x" * 200])
    monkeypatch.setattr(mapping, "MAX_TOTAL_READ", 500)
    r = cli(app, "import", "redbeat", "--redis", redis_url, "--key-prefix", redis_prefix)
    assert r.returncode == 1 and "more than 500 characters" in r.stderr and stored(app) == {}
