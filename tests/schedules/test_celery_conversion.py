"""Celery integration: ``as_schedule`` converts Celery schedules, and our schedules are Celery schedules.

* ``crontab(...)`` becomes our ``cron`` with the same field sets and Celery's AND
  rule for the two day fields; on ordinary (non-DST) days it fires exactly when
  Celery's own crontab would (Celery's answer is taken from
  ``crontab.remaining_delta``, the computation its ``is_due`` uses);
* ``schedule(timedelta)`` and plain numbers become ``every`` on the epoch grid;
* our own ``cron`` / ``every`` pass through unchanged; anything else is refused;
* ``cron`` and ``every`` implement ``celery.schedules.BaseSchedule``: ``is_due``,
  ``remaining_estimate``, pickling, equality and hashing.
"""
from __future__ import annotations

import pickle
import random
from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest
from celery import Celery
from celery.schedules import BaseSchedule, crontab, schedstate, schedule, solar

from celery_cluster_beat import ScheduleError, cron, every
from celery_cluster_beat.schedules import as_schedule

UTC = timezone.utc
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def utc(*args) -> datetime:
    return datetime(*args, tzinfo=UTC)


def celery_next(c: crontab, after: datetime, tz: str) -> datetime:
    """Celery's own next run time of *c* after *after*: last_run_at + the ffwd it computes."""
    last, delta, _now = c.remaining_delta(after, tz=ZoneInfo(tz))
    return (last + delta).astimezone(UTC)


def _has_dst_trouble(at: datetime, tz: str) -> bool:
    """True when the wall time of *at* is within 3 hours of a utcoffset change (Celery's
    wall-clock arithmetic is only trusted away from those)."""
    zone = ZoneInfo(tz)
    offsets = {(at + timedelta(hours=h)).astimezone(zone).utcoffset() for h in (-3, 0, 3)}
    return len(offsets) > 1


CRONTABS = [
    dict(),
    dict(minute="*/15"),
    dict(minute=0, hour="*/3"),
    dict(minute=30, hour=2),
    dict(minute=0, hour=9, day_of_week="mon-fri"),
    dict(minute="15,45", hour="8-18"),
    dict(minute=0, hour=0, day_of_month=1),
    dict(minute=0, hour=12, day_of_month="1-7", day_of_week="mon"),
    dict(minute=5, hour=4, day_of_month=15, month_of_year="1,4,7,10"),
    dict(minute=0, hour=0, day_of_month=13, day_of_week=5),
    dict(minute=0, hour=0, day_of_month=29, month_of_year=2),
    dict(minute="0-59/20", hour="0,12", day_of_week="sat,sun"),
]


@pytest.mark.parametrize("tz", ["UTC", "Europe/Berlin", "America/New_York"])
@pytest.mark.parametrize("fields", CRONTABS, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()) or "*")
def test_converted_crontab_fires_when_celery_would_on_ordinary_days(fields, tz):
    """For many `after` instants, our next_fire equals Celery's crontab answer (DST neighbourhoods skipped)."""
    c = crontab(**fields)
    c.tz = ZoneInfo(tz)
    ours = as_schedule(c)
    assert isinstance(ours, cron)
    rng = random.Random(f"{fields}{tz}")
    base = utc(2026, 1, 1)
    afters = [base + timedelta(seconds=rng.randrange(0, 2 * 365 * 86400)) for _ in range(120)]
    # also exactly on, and just before, scheduled minutes
    afters += [base + timedelta(days=rng.randrange(0, 700), hours=h, minutes=m)
               for h in (0, 2, 4, 9, 12) for m in (0, 5, 15, 30, 45)]
    afters += [a - timedelta(microseconds=1) for a in afters[-10:]]
    compared = 0
    for after in afters:
        expected = celery_next(c, after, tz)
        if _has_dst_trouble(after, tz) or _has_dst_trouble(expected, tz):
            continue
        assert ours.next_fire(after) == expected, f"crontab({fields}) tz={tz} after {after.isoformat()}"
        compared += 1
    assert compared > 100


def test_converted_crontab_uses_celerys_and_rule_for_day_fields():
    """crontab(day_of_month=13, day_of_week=5) fires only on Friday the 13th after conversion."""
    ours = as_schedule(_in_tz(crontab(minute=0, hour=0, day_of_month=13, day_of_week=5), "UTC"))
    assert ours.fires_between(utc(2026, 1, 1), utc(2028, 1, 1)) == [
        utc(2026, 2, 13), utc(2026, 3, 13), utc(2026, 11, 13), utc(2027, 8, 13)]


def test_cron_string_uses_vixie_or_rule_unlike_celery():
    """cron('0 0 13 * 5') fires on every 13th AND every Friday (the documented difference)."""
    got = cron("0 0 13 * 5", tz="UTC").fires_between(utc(2026, 1, 31), utc(2026, 2, 28))
    assert got == [utc(2026, 2, d) for d in (6, 13, 20, 27)]
    got = cron("0 0 13 * 5", tz="UTC").fires_between(utc(2026, 3, 31), utc(2026, 4, 30))
    assert got == [utc(2026, 4, d) for d in (3, 10, 13, 17, 24)]  # the 13th is a Monday


def _in_tz(c: crontab, tz: str) -> crontab:
    c.tz = ZoneInfo(tz)
    return c


def test_converted_crontab_keeps_its_time_zone():
    """A crontab whose .tz is Europe/London converts to a cron running in London time."""
    ours = as_schedule(_in_tz(crontab(minute=30, hour=2), "Europe/London"))
    assert ours.next_fire(utc(2026, 6, 1)) == utc(2026, 6, 1, 1, 30)  # 02:30 BST
    assert ours.next_fire(utc(2026, 12, 1)) == utc(2026, 12, 1, 2, 30)  # 02:30 GMT


def test_converted_crontab_without_tz_uses_its_apps_timezone():
    """A crontab bound to an app with timezone Asia/Tokyo fires at Tokyo wall time."""
    app = Celery("ccb-conversion-tests", set_as_current=False)
    app.conf.timezone = "Asia/Tokyo"
    ours = as_schedule(crontab(minute=0, hour=9, app=app), app=app)
    assert ours.next_fire(utc(2026, 6, 1)) == utc(2026, 6, 2, 0, 0)  # 09:00 JST = 00:00Z


def test_converted_crontab_matches_the_equivalent_cron_string():
    """crontab(minute='*/15', hour='9-17', day_of_week='mon-fri') fires like cron('*/15 9-17 * * 1-5')."""
    ours = as_schedule(_in_tz(crontab(minute="*/15", hour="9-17", day_of_week="mon-fri"), "UTC"))
    ref = cron("*/15 9-17 * * 1-5", tz="UTC")
    window = (utc(2026, 5, 1), utc(2026, 5, 15))
    assert ours.fires_between(*window) == ref.fires_between(*window)


@pytest.mark.parametrize("value, seconds", [
    (schedule(timedelta(seconds=30)), 30),
    (schedule(timedelta(minutes=5)), 300),
    (30, 30),
    (2.5, 2.5),
    (timedelta(hours=1), 3600),
], ids=["schedule(30s)", "schedule(5min)", "int 30", "float 2.5", "timedelta(1h)"])
def test_intervals_convert_to_every_on_the_epoch_grid(value, seconds):
    """Celery schedule objects and plain numbers become every(...) on the epoch grid."""
    ours = as_schedule(value)
    assert isinstance(ours, every)
    after = utc(2026, 4, 1, 12, 0, 1)
    got = ours.fires_between(after, after + timedelta(seconds=10 * seconds))
    step = timedelta(seconds=seconds)
    assert len(got) == 10
    assert all((t - EPOCH) % step == timedelta(0) for t in got)
    assert [b - a for a, b in zip(got, got[1:])] == [step] * 9
    assert got[0] - step <= after < got[0]


@pytest.mark.parametrize("ours", [cron("*/5 * * * *", tz="Europe/Paris"),
                                  every(90),
                                  every(timedelta(hours=6), baseline="02:30", tz="America/New_York")],
                         ids=["cron", "every", "every-baseline"])
def test_our_schedules_pass_through_unchanged(ours):
    """as_schedule returns our own schedule objects as they are."""
    assert as_schedule(ours) is ours


def _solar_without_ephem() -> solar:
    """A real celery solar instance (ephem, which its constructor needs, is not installed here)."""
    s = solar.__new__(solar)
    s.event, s.lat, s.lon = "sunrise", 51.5, -0.1
    BaseSchedule.__init__(s)
    return s


def test_a_string_is_read_as_a_cron_expression():
    """`"schedule": "*/5 * * * *"` means cron("*/5 * * * *") in the app's zone."""
    assert as_schedule("*/5 * * * *") == cron("*/5 * * * *")


def test_a_bad_cron_string_names_its_field():
    """A string goes through the cron parser, so its error names the field like cron() does."""
    with pytest.raises(ScheduleError, match=r"cron '61 \* \* \* \*': minute"):
        as_schedule("61 * * * *")


@pytest.mark.parametrize("value", [_solar_without_ephem(), "every 5 minutes", None, object()],
                         ids=["solar", "text", "None", "object"])
def test_anything_else_is_refused(value):
    """Schedules we cannot reproduce exactly (solar), free text and other objects raise ScheduleError."""
    with pytest.raises(ScheduleError):
        as_schedule(value)


# --- the celery.schedules.BaseSchedule interface -------------------------------------------

SCHEDULES = {
    "cron": lambda: cron("*/5 * * * *", tz="Europe/Berlin"),
    "every": lambda: every(300),
    "every-baseline": lambda: every(timedelta(hours=6), baseline="02:30", tz="America/New_York"),
}


@pytest.mark.parametrize("make", SCHEDULES.values(), ids=SCHEDULES.keys())
def test_is_a_celery_base_schedule(make):
    """cron and every subclass celery.schedules.BaseSchedule, so beat accepts them."""
    assert isinstance(make(), BaseSchedule)


@pytest.mark.parametrize("make", SCHEDULES.values(), ids=SCHEDULES.keys())
def test_is_due_after_a_missed_fire_returns_schedstate_true(make):
    """A fire between last_run_at and now makes is_due true; `next` is the seconds to the following fire."""
    s = make()
    now = datetime.now(UTC)
    last = now - timedelta(days=1)
    state = s.is_due(last)
    assert isinstance(state, schedstate)
    assert state.is_due is True
    upcoming = (s.next_fire(datetime.now(UTC)) - datetime.now(UTC)).total_seconds()
    assert 0 <= state.next <= upcoming + 2


@pytest.mark.parametrize("make", SCHEDULES.values(), ids=SCHEDULES.keys())
def test_is_due_right_after_a_fire_returns_false_and_the_wait(make):
    """With last_run_at at the latest fire, is_due is false and `next` is about the time to the next fire."""
    s = make()
    now = datetime.now(UTC)
    # the most recent fire at or before now
    prev = [t for t in s.fires_between(now - timedelta(days=1), now)][-1]
    upcoming = s.next_fire(now)
    state = s.is_due(prev)
    assert isinstance(state, schedstate)
    assert state.is_due is False
    wait = (upcoming - datetime.now(UTC)).total_seconds()
    assert wait - 2 <= state.next <= wait + 2


@pytest.mark.parametrize("make", SCHEDULES.values(), ids=SCHEDULES.keys())
def test_remaining_estimate_is_the_timedelta_to_the_next_fire_after_last_run(make):
    """remaining_estimate(last_run_at) is next_fire(last_run_at) - now, as a timedelta."""
    s = make()
    last = datetime.now(UTC)
    got = s.remaining_estimate(last)
    assert isinstance(got, timedelta)
    expected = s.next_fire(last) - datetime.now(UTC)
    assert abs(got - expected) < timedelta(seconds=2)
    # a last run long ago: the estimate is negative or zero (overdue), never a future wait
    assert s.remaining_estimate(last - timedelta(days=2)) <= timedelta(0)


PAIRS = [
    (lambda: cron("0 2 * * *", tz="Europe/London"), lambda: cron("0 2 * * *", tz="Europe/London"),
     [lambda: cron("0 2 * * *", tz="Europe/Paris"), lambda: cron("0 3 * * *", tz="Europe/London")]),
    (lambda: every(300), lambda: every(timedelta(minutes=5)),
     [lambda: every(301)]),
    (lambda: every(3600, baseline="02:30", tz="UTC"), lambda: every(3600, baseline="02:30", tz="UTC"),
     [lambda: every(3600, baseline="02:31", tz="UTC"), lambda: every(3600, baseline="02:30", tz="Asia/Tokyo"),
      lambda: every(7200, baseline="02:30", tz="UTC"), lambda: every(3600)]),
]


@pytest.mark.parametrize("make_a, make_b, others", PAIRS, ids=["cron", "every", "every-baseline"])
def test_equality_and_hash_follow_the_defining_values(make_a, make_b, others):
    """Equal by (expression, tz) or (interval, baseline, tz); equal objects hash alike; any difference is unequal."""
    a, b = make_a(), make_b()
    assert a == b and hash(a) == hash(b)
    assert len({a, b}) == 1
    for make_other in others:
        other = make_other()
        assert a != other, repr(other)
    assert a != object() and a != "0 2 * * *"


@pytest.mark.parametrize("make", SCHEDULES.values(), ids=SCHEDULES.keys())
def test_pickle_round_trip_gives_an_equal_working_schedule(make):
    """Beat persists schedules with pickle: the copy is equal, hashes alike and fires alike."""
    s = make()
    copy = pickle.loads(pickle.dumps(s, protocol=pickle.HIGHEST_PROTOCOL))
    assert copy == s and hash(copy) == hash(s)
    after = utc(2026, 3, 7)
    end = utc(2026, 3, 10)
    assert copy.fires_between(after, end) == s.fires_between(after, end)


def test_cron_and_every_are_never_equal_to_each_other():
    """Different kinds of schedule are unequal even when they fire alike."""
    assert cron("* * * * *", tz="UTC") != every(60)


# --- tz=None: the Celery app's timezone --------------------------------------------------

@pytest.fixture
def fresh_current_app():
    """A new Celery app without a timezone setting, current for the test; the previous one is restored."""
    from celery import current_app

    previous = current_app._get_current_object()
    app = Celery("ccb-conversion-current", set_as_current=True)
    try:
        yield app
    finally:
        previous.set_current()


def test_cron_without_tz_runs_in_utc_when_the_app_has_no_timezone(fresh_current_app):
    """cron(expr) with tz=None and no `timezone` setting is UTC."""
    assert fresh_current_app.conf.timezone is None
    assert cron("0 12 * * *").next_fire(utc(2026, 6, 1)) == utc(2026, 6, 1, 12)


def test_cron_without_tz_runs_in_the_apps_timezone(fresh_current_app):
    """cron(expr) with tz=None follows the app's `timezone` setting (Asia/Tokyo: 12:00 = 03:00Z)."""
    fresh_current_app.conf.timezone = "Asia/Tokyo"
    assert cron("0 12 * * *").next_fire(utc(2026, 6, 1)) == utc(2026, 6, 1, 3)
