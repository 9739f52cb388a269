"""``beat_schedule`` entries with ``at()`` and the bound keys: checked at start-up with one message
per problem naming the entry, the field and the reason, like every other key."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from celery_cluster_beat import ConfigError, ScheduleError, at, cron, every
from celery_cluster_beat.config.entries import build_entries

UTC = timezone.utc
T = datetime(2026, 12, 7, 15, 0, tzinfo=UTC)


def test_an_at_entry_and_bounds_are_accepted():
    entries = build_entries({
        "once": {"task": "t.x", "schedule": at(T)},
        "window": {"task": "t.x", "schedule": cron("0 * * * *"), "start_at": T, "end_at": "2026-12-08T15:00:00Z"},
        "twice": {"task": "t.x", "schedule": every(60), "max_runs": 2, "start_at": "2026-12-07T16:00:00+01:00"},
    })
    assert entries["once"].schedule.next_fire(T - timedelta(1)) == T
    assert entries["window"].schedule.fires_between(T - timedelta(days=1), T + timedelta(days=5))[-1] == \
        T + timedelta(days=1)
    assert entries["twice"].schedule.fires_between(T - timedelta(1), T + timedelta(1)) == [T, T + timedelta(minutes=1)]
    assert build_entries({"plain": {"task": "t.x", "schedule": every(60)}})["plain"].schedule == every(60)


def test_every_problem_is_reported_at_once_naming_entry_field_and_reason():
    with pytest.raises(ConfigError) as info:
        build_entries({
            "a": {"task": "t.x", "schedule": every(60), "start_at": datetime(2026, 1, 1)},
            "b": {"task": "t.x", "schedule": every(60), "start_at": T, "end_at": T - timedelta(seconds=1)},
            "c": {"task": "t.x", "schedule": every(60), "max_runs": 0},
            "d": {"task": "t.x", "schedule": every(60), "max_runs": 2.5},
            "e": {"task": "t.x", "schedule": every(60), "end_at": "next week"},
            "f": {"task": "t.x", "schedule": every(60), "stop_at": T},
        })
    message = str(info.value)
    for expected in ("beat_schedule entry 'a': start_at: 2026-01-01T00:00:00 is a naive datetime",
                     "beat_schedule entry 'b': end_at: 2026-12-07T14:59:59+00:00 is before start_at "
                     "2026-12-07T15:00:00+00:00",
                     "beat_schedule entry 'c': max_runs: 0 is less than 1",
                     "beat_schedule entry 'd': max_runs: expected a whole number of runs of at least 1, got 2.5",
                     "beat_schedule entry 'e': end_at: 'next week' is not an ISO-8601 date and time",
                     "beat_schedule entry 'f': stop_at: unknown key"):
        assert expected in message, message
    assert "start_at, end_at, max_runs" in message


def test_a_bad_at_is_refused_where_it_is_written_as_a_bad_cron_is():
    with pytest.raises(ScheduleError, match="at\\('tomorrow'\\): 'tomorrow' is not an ISO-8601 date and time"):
        at("tomorrow")


def test_max_runs_past_year_9999_is_one_clear_config_error_naming_the_entry_and_field():
    from celery_cluster_beat.config.entries import build_entry
    from celery_cluster_beat import every as _every
    entry, problems = build_entry("late", {"task": "t.x", "schedule": _every(60), "start_at": "9999-12-30T00:00:00Z",
                                           "max_runs": 10_000})
    assert entry is None
    assert len(problems) == 1 and "'late'" in problems[0] and "max_runs" in problems[0] and "9999" in problems[0]
