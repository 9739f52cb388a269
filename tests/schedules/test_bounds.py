"""Bounds on any rule: instants before start_at or after end_at are not fired, and max_runs keeps
the first N instants at or after the start (start_at, else the schedule's origin), computed once:
every replica agrees without counting rows, whatever became of each occurrence."""
from __future__ import annotations

import pickle
import time
from datetime import datetime, timedelta, timezone

import pytest

from celery_cluster_beat import ScheduleError, at, cron, every
from celery_cluster_beat.schedules import bounded
from celery_cluster_beat.schedules.bounds import MAX_RUNS, nth_fire

UTC = timezone.utc
T0 = datetime(2026, 6, 1, 12, 0, tzinfo=UTC)


def _all(rule, start=T0 - timedelta(days=2), end=T0 + timedelta(days=30)):
    return rule.fires_between(start, end)


def test_start_at_and_end_at_are_inclusive_and_cut_the_rest():
    rule = bounded(every(60), start_at=T0, end_at=T0 + timedelta(minutes=3))
    assert _all(rule) == [T0 + timedelta(minutes=m) for m in range(4)]
    assert rule.next_fire(T0 + timedelta(minutes=3)) is None
    assert rule.next_fire(T0 - timedelta(days=1)) == T0


def test_max_runs_counts_from_start_at():
    rule = bounded(every(2), start_at=T0 + timedelta(seconds=1), max_runs=2)
    assert _all(rule) == [T0 + timedelta(seconds=2), T0 + timedelta(seconds=4)]


def test_max_runs_counts_from_the_origin_without_start_at_and_before_the_origin_nothing_fires():
    rule = bounded(cron("0 * * * *"), max_runs=3, origin=T0 + timedelta(minutes=10))
    assert _all(rule) == [T0 + timedelta(hours=h) for h in (1, 2, 3)]
    assert rule.next_fire(T0 + timedelta(hours=1)) == T0 + timedelta(hours=2)  # a missed one still counts


def test_the_earlier_of_end_at_and_the_last_run_ends_it():
    rule = bounded(every(60), start_at=T0, end_at=T0 + timedelta(minutes=1), max_runs=5)
    assert _all(rule) == [T0, T0 + timedelta(minutes=1)]
    rule = bounded(every(60), start_at=T0, end_at=T0 + timedelta(days=1), max_runs=2)
    assert rule.last_instant() == T0 + timedelta(minutes=1)


def test_max_runs_without_a_known_start_waits_for_its_origin():
    rule = bounded(every(60), max_runs=2)
    assert rule.needs_origin
    bound = rule.with_origin(T0)
    assert not bound.needs_origin and _all(bound) == [T0, T0 + timedelta(minutes=1)]
    assert bound != rule and bound == rule.with_origin(T0)


def test_a_bounded_one_off():
    assert _all(bounded(at(T0), end_at=T0 - timedelta(seconds=1))) == []
    assert _all(bounded(at(T0), start_at=T0, max_runs=1)) == [T0]


def test_a_cron_in_a_zone_keeps_its_dst_rules_inside_the_bounds():
    rule = bounded(cron("30 2 * * *", tz="America/New_York"), start_at=datetime(2026, 3, 7, tzinfo=UTC), max_runs=2)
    assert _all(rule, datetime(2026, 3, 1, tzinfo=UTC), datetime(2026, 4, 1, tzinfo=UTC)) == [
        datetime(2026, 3, 7, 7, 30, tzinfo=UTC), datetime(2026, 3, 8, 7, 0, tzinfo=UTC)]  # gap end on the 8th


def test_the_last_run_is_computed_once_not_per_fire():
    rule = bounded(cron("* * * * * */1"), start_at=T0, max_runs=MAX_RUNS)
    began = time.perf_counter()
    first = rule.next_fire(T0)
    first_cost = time.perf_counter() - began
    began = time.perf_counter()
    for _ in range(1000):
        rule.next_fire(T0)
    assert first == T0 + timedelta(seconds=1)
    assert rule.last_instant() == T0 + timedelta(seconds=MAX_RUNS - 1)
    assert time.perf_counter() - began < max(0.5, first_cost)  # a comparison per call, not a walk


def test_every_on_the_epoch_grid_finds_its_last_run_by_arithmetic():
    assert nth_fire(every(2), T0, MAX_RUNS) == T0 + timedelta(seconds=2 * MAX_RUNS)


@pytest.mark.parametrize("kwargs, message", [
    (dict(start_at=T0, end_at=T0 - timedelta(seconds=1)), "end_at .* is before start_at"),
    (dict(max_runs=0), "max_runs: 0 is less than 1"),
    (dict(max_runs=MAX_RUNS + 1), "more than the 10000 runs allowed"),
    (dict(max_runs=2.0), "expected a whole number"),
])
def test_bad_bounds_are_schedule_errors(kwargs, message):
    with pytest.raises(ScheduleError, match=message):
        bounded(every(60), **kwargs)


def test_naive_bounds_are_refused():
    with pytest.raises(ValueError, match="naive"):
        bounded(every(60), start_at=datetime(2026, 1, 1))


def test_it_pickles_equal_and_reads_like_its_rule():
    rule = bounded(cron("0 9 * * 1-5", tz="Europe/Paris"), start_at=T0, end_at=T0 + timedelta(days=9), max_runs=3)
    back = pickle.loads(pickle.dumps(rule))
    assert back == rule and _all(back) == _all(rule)
    assert (rule.expr, rule.tz_name) == ("0 9 * * 1-5", "Europe/Paris")
