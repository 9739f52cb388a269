"""Review checks of extended cron (issue 22, item 3): what replicas must agree on and where a search ends.

* the nth-weekday mapping (``mon-wed#2``, ``L5``) is our own reading, croniter's only
  checked against it: a croniter release that read a term otherwise would change the
  instants of one replica, so such a reading is refused instead;
* ``parse_cron(..., day_rule=AND)`` cannot silently give croniter's OR for ``L``/``W``/``#``;
* rare days (``#5`` in February, ``30W`` in February, ``L``) are found decades ahead at
  once, and a search past the calendar's end is a ScheduleError, not a hang;
* a seconds job through a transition that is not on a whole minute (Amsterdam's 28-second
  gap of 1937) fires at the instants a second-by-second walk of the wall clock gives;
* extended expressions survive pickling and the stored text form, equal and with equal hashes;
* away from DST, accepted day-extension combinations agree with croniter's own ``get_next``.
"""
from __future__ import annotations

import itertools
import pickle
import time
from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest
from croniter import croniter as Croniter

from celery_cluster_beat import ScheduleError, cron
from celery_cluster_beat.schedules.cronexpr import DayRule, parse_cron
from celery_cluster_beat.schedules.text import parse_schedule_text, schedule_text
from celery_cluster_beat.schedules.tzwall import EXISTS, REPEATED, resolve

UTC = timezone.utc


def test_nth_weekdays_do_not_follow_another_croniter_reading(monkeypatch):
    """A croniter release reading ``mon-wed#2`` as the second Wednesday only: refused, never adopted."""
    real = Croniter.expand

    def skewed(expr, *args, **kwargs):
        expanded, nth = real(expr, *args, **kwargs)
        if "#" in expr:
            wednesday = max(nth)
            expanded = expanded[:4] + [[wednesday]]
            nth = {wednesday: nth[wednesday]}
        return expanded, nth

    assert parse_cron("0 0 * * mon-wed#2").selector.nth == ((1, frozenset({2})), (2, frozenset({2})),
                                                            (3, frozenset({2})))
    monkeypatch.setattr(Croniter, "expand", staticmethod(skewed))
    with pytest.raises(ScheduleError) as info:
        parse_cron("0 0 * * mon-wed#2")
    assert str(info.value).startswith("cron '0 0 * * mon-wed#2': day-of-week "), info.value
    assert parse_cron("0 0 * * L5").selector.nth == ((5, frozenset({-1})),)  # what both read alike stays


def test_our_reading_of_weekday_terms():
    assert parse_cron("0 0 * * fri-mon#1").selector.nth == tuple((w, frozenset({1})) for w in (0, 1, 5, 6))
    assert parse_cron("0 0 * * L7,7#1").selector.nth == ((0, frozenset({1, -1})),)
    for expr, words in [("0 0 * * L9", "out of range"), ("0 0 * * 8#1", "out of range"),
                        ("0 0 * * mon-mon#1", "croniter"), ("0 0 * * sun-sat#1", "croniter")]:
        with pytest.raises(ScheduleError, match=words) as info:
            parse_cron(expr)
        assert f"cron {expr!r}: day-of-week " in str(info.value)


def test_and_day_rule_is_refused_for_day_extensions():
    """The selector combines the day fields as croniter does; an AND asked for must not become OR."""
    with pytest.raises(ScheduleError, match="day rule 'and'"):
        parse_cron("0 0 L * 5", day_rule=DayRule.AND)
    with pytest.raises(ScheduleError, match="day rule 'and'"):
        parse_cron("0 0 13 * fri#2", day_rule=DayRule.AND)
    assert parse_cron("0 0 13 * 5", day_rule=DayRule.AND).day_rule == DayRule.AND  # plain fields: as before
    assert parse_cron("0 0 13 * 5 30", day_rule=DayRule.AND).day_rule == DayRule.AND


RARE = [
    ("0 0 * 2 5#5", "2093-01-01T00:00Z", ["2104-02-29T00:00Z", "2132-02-29T00:00Z"]),  # 2100 is no leap year
    ("0 0 29 2 1#5", "2016-03-01T00:00Z", ["2044-02-29T00:00Z"]),
    ("0 0 30W 2 *", "2026-01-01T00:00Z", ["2026-02-27T00:00Z", "2027-02-26T00:00Z", "2028-02-29T00:00Z"]),
    ("0 0 L 2 *", "2027-03-01T00:00Z", ["2028-02-29T00:00Z"]),
    ("0 0 * 2 5#5 30", "2009-01-01T00:00Z", ["2036-02-29T05:00:30Z"]),  # in New York
]


@pytest.mark.parametrize("expr, after, expected", RARE, ids=[r[0] for r in RARE])
def test_rare_days_are_found_decades_ahead_at_once(expr, after, expected):
    schedule = cron(expr, tz="America/New_York" if expr.endswith(" 30") else "UTC")
    t = datetime.fromisoformat(after.replace("Z", "+00:00"))
    started = time.process_time()
    got = []
    for _ in expected:
        t = schedule.next_fire(t)
        got.append(t)
    assert got == [datetime.fromisoformat(e.replace("Z", "+00:00")) for e in expected]
    assert time.process_time() - started < 5  # milliseconds in fact: a day-by-day walk of decades is bounded


def test_a_search_past_the_calendar_end_is_a_schedule_error():
    schedule = cron("0 0 * 2 5#5", tz="UTC")
    with pytest.raises(ScheduleError, match="no matching day"):
        schedule.next_fire(datetime(9990, 1, 1, tzinfo=UTC))


def _fires_second_by_second(expr, zone, start, end):
    """Each matching wall second of the local days around (start, end], resolved on its own."""
    spec, tz = parse_cron(expr), ZoneInfo(zone)
    day = start.astimezone(tz).replace(tzinfo=None, hour=0, minute=0, second=0, microsecond=0) - timedelta(days=1)
    out = set()
    while day <= end.astimezone(tz).replace(tzinfo=None):
        for h, m, s in itertools.product(spec.hours, spec.minutes, spec.seconds):
            kind, instants = resolve(tz, day.replace(hour=h, minute=m, second=s))
            if kind == EXISTS or (kind == REPEATED and not spec.wildcard):
                out.add(instants[0])
            elif kind == REPEATED:
                out.update(instants)
            elif not spec.wildcard:  # skipped, fixed job: the gap end
                out.add(instants[0])
        day += timedelta(days=1)
    return sorted(t for t in out if start < t <= end)


@pytest.mark.parametrize("expr", ["* 23,0 * * * */1", "0-59 23,0 * * * 0-59", "0 0 * * * 10,40",
                                  "59 23 * * * 50", "0 0 * * * */20"])
def test_seconds_through_a_transition_inside_a_minute(expr):
    """Amsterdam, 1937-07-01: +1:19:32 to +1:20, so 00:00:00-00:00:27 never happened there."""
    start, end = datetime(1937, 6, 30, 22, 30, tzinfo=UTC), datetime(1937, 6, 30, 22, 50, tzinfo=UTC)
    got = cron(expr, tz="Europe/Amsterdam").fires_between(start, end)
    assert got == _fires_second_by_second(expr, "Europe/Amsterdam", start, end)
    assert got  # the window holds fires of each expression


@pytest.mark.parametrize("expr", ["0 0 L * *", "0 0 * * 1#3,L5", "0 0 15W * *", "30 1 * * * */20",
                                  "0 0 L * L5 30", "0 22-2 * * fri-mon", "0\t0  15-L * *"])
def test_extended_expressions_survive_pickling_and_the_stored_text(expr):
    schedule = cron(expr, tz="America/New_York")
    after = datetime(2026, 1, 1, tzinfo=UTC)
    for copy in (pickle.loads(pickle.dumps(schedule)), parse_schedule_text(*schedule_text(schedule))):
        assert copy == schedule and hash(copy) == hash(schedule)
        assert copy.next_fire(after) == schedule.next_fire(after)
    assert schedule_text(schedule) == (expr, "America/New_York")


DOMS = ["L", "15W", "13", "1-L", "L,1", "30W"]
DOWS = ["5", "fri#2", "L5", "mon-wed#2", "0#5", "fri-mon#1"]


def test_accepted_day_extensions_agree_with_croniter():
    """Neither field starts with '*' (there Vixie's AND rule is ours, croniter's OR its own)."""
    start = datetime(2024, 1, 1, tzinfo=UTC)
    accepted = 0
    for dom, dow, month in itertools.product(DOMS, DOWS, ["*", "2,4"]):
        expr = f"0 0 {dom} {month} {dow}"
        try:
            schedule = cron(expr, tz="UTC")
        except ScheduleError:
            with pytest.raises(Exception):  # croniter finds no date either
                Croniter(expr, start).get_next(datetime)
            continue
        accepted += 1
        theirs = Croniter(expr, start)
        assert schedule.fires_between(start, datetime(2200, 1, 1, tzinfo=UTC), limit=4) == [
            theirs.get_next(datetime) for _ in range(4)], expr
    assert accepted >= 20


ZERO_SECOND_WINDOWS = [
    ("America/New_York", datetime(2026, 3, 7, tzinfo=UTC), datetime(2026, 3, 10, tzinfo=UTC)),
    ("America/New_York", datetime(2026, 10, 31, tzinfo=UTC), datetime(2026, 11, 3, tzinfo=UTC)),
    ("Australia/Lord_Howe", datetime(2026, 4, 3, tzinfo=UTC), datetime(2026, 4, 6, tzinfo=UTC)),
    ("Australia/Lord_Howe", datetime(2026, 10, 2, tzinfo=UTC), datetime(2026, 10, 5, tzinfo=UTC)),
    ("Europe/Amsterdam", datetime(1937, 6, 29, tzinfo=UTC), datetime(1937, 7, 2, tzinfo=UTC)),
]


@pytest.mark.parametrize("expr", ["30 2 * * *", "*/15 1-3 * * *", "59 1 * * *", "* 2 * * *", "15 2 L * *",
                                  "0-59/7 0-3 * * 0#1,L0"])
def test_a_zero_seconds_field_fires_as_the_five_field_expression(expr):
    """``m h dom mon dow 0`` is the five-field job: same gap, repeated-hour and day rules, over DST days."""
    fired = 0
    for zone, start, end in ZERO_SECOND_WINDOWS:
        five = cron(expr, tz=zone).fires_between(start, end)
        assert cron(expr + " 0", tz=zone).fires_between(start, end) == five, zone
        fired += len(five)
    assert fired  # some window holds fires of each expression
