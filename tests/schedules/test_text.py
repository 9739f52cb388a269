"""The stored text form of a schedule: every cron and every() it accepts reads back as the same
rule, and what it cannot store exactly is refused with a ScheduleError, never guessed."""
from datetime import timedelta

import pytest
from celery.schedules import crontab, schedule
from hypothesis import given, settings, strategies as st

from celery_cluster_beat import ScheduleError, cron, every
from celery_cluster_beat.schedules.text import parse_schedule_text, schedule_text


@pytest.mark.parametrize("value, text, zone", [
    ("*/5 * * * *", "*/5 * * * *", None),
    (cron("0 9 * * 1-5", tz="Europe/Paris"), "0 9 * * 1-5", "Europe/Paris"),
    (every(30), "every 30s", None),
    (every(1.5), "every 1.5s", None),
    (timedelta(hours=1), "every 3600s", None),
    (every(7200, baseline="09:00", tz="America/New_York"), "every 7200s from 09:00", "America/New_York"),
])
def test_a_schedule_is_stored_as_its_text_and_zone_and_reads_back_equal(value, text, zone):
    assert schedule_text(value) == (text, zone)
    back = parse_schedule_text(text, zone)
    assert schedule_text(back) == (text, zone)


@settings(max_examples=200, deadline=None)
@given(st.integers(1_000_000, 10**12), st.one_of(st.none(), st.from_regex(r"\A([01]\d|2[0-3]):[0-5]\d\Z")))
def test_every_interval_round_trips_to_the_microsecond(micros, baseline):
    rule = every(timedelta(microseconds=micros), baseline=baseline, tz="Europe/Berlin" if baseline else None)
    back = parse_schedule_text(*schedule_text(rule))
    assert back.step_us == micros and back.baseline == baseline


@pytest.mark.parametrize("value", [crontab(minute="*/5"), schedule(timedelta(seconds=30))])
def test_celery_schedule_types_are_refused_rather_than_stored_as_something_else(value):
    with pytest.raises(ScheduleError, match="no exact text form"):
        schedule_text(value)


@pytest.mark.parametrize("text", ["", "every", "every 0.5s", "every 10m", "every 10s from 25:00", "61 * * * *"])
def test_bad_text_is_a_schedule_error(text):
    with pytest.raises(ScheduleError):
        parse_schedule_text(text)
