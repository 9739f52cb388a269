"""``at(when)``: one instant, then nothing. An aware ``when`` is that instant whatever the zone; a
naive one is a wall time read like a fixed cron time (a gap fires at its end, a repeated hour in its
first pass), so ``at`` and ``cron`` never disagree on the same wall time. Its text round-trips."""
from __future__ import annotations

import pickle
from datetime import datetime, timedelta, timezone

import pytest
from celery import Celery
from hypothesis import given, settings, strategies as st

from celery_cluster_beat import ScheduleError, at, cron
from celery_cluster_beat.schedules.text import parse_schedule_text, schedule_text

UTC = timezone.utc
T = datetime(2026, 12, 7, 15, 0, tzinfo=UTC)


def test_it_fires_once_at_its_instant_then_has_no_further_one():
    rule = at(T)
    assert rule.next_fire(T - timedelta(days=400)) == T
    assert rule.next_fire(T - timedelta(microseconds=1)) == T
    assert rule.next_fire(T) is None and rule.next_fire(T + timedelta(days=1)) is None
    assert rule.fires_between(T - timedelta(days=1), T + timedelta(days=1)) == [T]
    assert rule.fires_between(T, T + timedelta(days=1)) == []


@pytest.mark.parametrize("when", ["2026-12-07T15:00:00Z", "2026-12-07T16:00:00+01:00", "2026-12-07T15:00:00z",
                                  datetime(2026, 12, 7, 10, 0, tzinfo=timezone(timedelta(hours=-5)))])
def test_an_aware_instant_is_that_instant_in_any_form_and_zone(when):
    assert at(when).fire_at() == T
    assert at(when, tz="Asia/Tokyo").fire_at() == T  # an exact instant: no zone reads it
    assert at(when) == at(T)


@pytest.mark.parametrize("wall, zone, expected", [
    # spring-forward gap (02:00-03:00 EST->EDT): the gap's end, 03:00 EDT, as cron('30 2 * * *')
    (datetime(2026, 3, 8, 2, 30), "America/New_York", datetime(2026, 3, 8, 7, 0, tzinfo=UTC)),
    # fall-back repeated hour: the first pass, 01:30 EDT
    (datetime(2026, 11, 1, 1, 30), "America/New_York", datetime(2026, 11, 1, 5, 30, tzinfo=UTC)),
    # a plain wall time
    (datetime(2026, 7, 1, 9, 0), "Europe/Paris", datetime(2026, 7, 1, 7, 0, tzinfo=UTC)),
    # Lord Howe's 30-minute shift: 02:15 is skipped, fires at 02:30 LHDT
    (datetime(2026, 10, 4, 2, 15), "Australia/Lord_Howe", datetime(2026, 10, 3, 15, 30, tzinfo=UTC)),
])
def test_a_naive_wall_time_in_a_gap_or_fold_fires_as_a_fixed_cron_time_does(wall, zone, expected):
    rule = at(wall, tz=zone)
    assert rule.fire_at() == expected
    fixed = cron(f"{wall.minute} {wall.hour} {wall.day} {wall.month} *", tz=zone)
    assert fixed.next_fire(datetime(wall.year, wall.month, wall.day, tzinfo=UTC) - timedelta(days=1)) == expected


def test_a_naive_wall_time_without_a_zone_follows_the_app_zone_as_cron_does():
    app = Celery("z", set_as_current=False)
    app.conf.timezone = "America/Chicago"
    rule = at(datetime(2026, 12, 7, 9, 0), app=app)
    assert rule.fire_at() == T
    assert at(datetime(2026, 12, 7, 15, 0)).fire_at() == T  # no app: UTC, as cron


@pytest.mark.parametrize("when, tz, message", [
    ("tomorrow", None, "not an ISO-8601 date and time"),
    (1765119600, None, "expected a datetime or ISO-8601 text, got int"),
    (datetime(2026, 12, 7, 9), "Mars/Olympus", "unknown time zone 'Mars/Olympus'"),
])
def test_bad_input_is_a_schedule_error_naming_it(when, tz, message):
    with pytest.raises(ScheduleError, match=message):
        at(when, tz=tz)


@pytest.mark.parametrize("rule, text, zone", [
    (at(T), "at 2026-12-07T15:00:00Z", None),
    (at(T + timedelta(microseconds=250)), "at 2026-12-07T15:00:00.000250Z", None),
    (at(datetime(2026, 3, 8, 2, 30), tz="America/New_York"), "at 2026-03-08T02:30:00", "America/New_York"),
])
def test_its_text_round_trips(rule, text, zone):
    assert schedule_text(rule) == (text, zone)
    back = parse_schedule_text(text, zone)
    assert back == rule and back.fire_at() == rule.fire_at()


@settings(max_examples=200, deadline=None)
@given(st.datetimes(min_value=datetime(1971, 1, 1), max_value=datetime(9998, 12, 31)))
def test_any_instant_round_trips_to_the_microsecond(naive):
    rule = at(naive.replace(tzinfo=UTC))
    assert parse_schedule_text(*schedule_text(rule)).fire_at() == naive.replace(tzinfo=UTC)


@pytest.mark.parametrize("rule", [at(T), at(datetime(2026, 3, 8, 2, 30), tz="America/New_York"),
                                  at(datetime(2026, 3, 8, 2, 30))])
def test_it_pickles_equal(rule):
    back = pickle.loads(pickle.dumps(rule))
    assert back == rule and hash(back) == hash(rule) and back.fire_at() == rule.fire_at()


def test_celery_face_says_not_due_after_its_instant():
    rule = at(T, nowfun=lambda: T + timedelta(seconds=1))
    assert rule.is_due(T - timedelta(seconds=5)).is_due is True
    state = rule.is_due(T)
    assert state.is_due is False and state.next > 3600


@pytest.mark.parametrize("when", ["2026-12-07T15:00:00Z", "2026-12-07T15:00:00"])
def test_a_zone_that_does_not_exist_is_refused_whether_the_instant_is_aware_or_not(when):
    from celery_cluster_beat.schedules.rules import AtRule
    with pytest.raises(ScheduleError, match="Nope/Zone"):
        AtRule(when, tz="Nope/Zone")
