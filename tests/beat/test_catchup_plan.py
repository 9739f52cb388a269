"""Catch-up planning, pure: given a schedule, the last handled instant and now, which
occurrences are sent and which are recorded as missed. The end-to-end behaviour with a
real beat and claim database is specified in test_catchup.py."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from celery_cluster_beat import cron, every
from celery_cluster_beat.beat.catchup import ON_TIME, plan_catchup
from celery_cluster_beat.config import CatchupPolicy

UTC = timezone.utc
T0 = datetime(2026, 3, 1, 12, 0, tzinfo=UTC)
MIN = timedelta(minutes=1)
minutely = every(60)


def plan(policy, *, since=T0, now=T0 + 5 * MIN + timedelta(seconds=1), window=None, max_count=100, **kw):
    return plan_catchup(minutely, since, now, policy=policy, window=window, max_count=max_count, **kw)


def fires(*minutes):
    return [T0 + k * MIN for k in minutes]


def test_nothing_due_is_an_empty_plan():
    p = plan(CatchupPolicy.LATEST, now=T0 + timedelta(seconds=59))
    assert p.send == [] and p.missed == []


def test_latest_sends_the_most_recent_and_records_the_rest_missed():
    p = plan(CatchupPolicy.LATEST)
    assert p.send == fires(5) and p.missed == fires(1, 2, 3, 4)


def test_all_sends_each_oldest_first():
    p = plan(CatchupPolicy.ALL)
    assert p.send == fires(1, 2, 3, 4, 5) and p.missed == []


def test_all_is_bounded_by_max_count_keeping_the_most_recent():
    p = plan(CatchupPolicy.ALL, max_count=2)
    assert p.send == fires(4, 5) and p.missed == fires(1, 2, 3)


def test_none_sends_only_an_occurrence_that_is_on_time():
    assert plan(CatchupPolicy.NONE).send == fires(5), "due 1 s ago: on time"
    late = plan(CatchupPolicy.NONE, now=T0 + 5 * MIN + ON_TIME + timedelta(seconds=1))
    assert late.send == [] and late.missed == fires(1, 2, 3, 4, 5)


def test_the_window_drops_older_occurrences_whatever_the_policy():
    p = plan(CatchupPolicy.ALL, window=150)
    assert p.send == fires(3, 4, 5) and p.missed == fires(1, 2)


def test_missed_rows_are_bounded_and_the_plan_says_it_truncated():
    p = plan(CatchupPolicy.LATEST, now=T0 + 3000 * MIN, record_limit=1000)
    assert p.send == fires(3000)
    assert len(p.missed) == 1000 and p.missed_truncated
    assert p.missed[0] == T0 + MIN, "the oldest are recorded first"


def test_a_long_outage_costs_work_proportional_to_what_is_sent():
    """Two weeks of an every-second schedule: planning 'latest' looks back from now, it
    does not walk every missed second (the missed list is capped)."""
    p = plan_catchup(every(1), T0, T0 + timedelta(days=14), policy=CatchupPolicy.LATEST, window=None,
                     max_count=100, record_limit=10)
    assert p.send == [T0 + timedelta(days=14)] and len(p.missed) == 10


@pytest.mark.parametrize("policy", list(CatchupPolicy))
def test_a_cron_schedule_plans_on_its_own_instants(policy):
    hourly = cron("0 * * * *")
    p = plan_catchup(hourly, T0, T0 + timedelta(hours=3, seconds=1), policy=policy, window=None, max_count=100)
    due = [T0 + timedelta(hours=h) for h in (1, 2, 3)]
    assert sorted(p.send + p.missed) == due
