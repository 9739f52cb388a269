"""``every(interval, baseline=None, tz=None)``: fixed intervals on a grid every replica agrees on.

* Without a baseline the instants are k x interval after the Unix epoch (UTC), so
  any process, whatever its local time zone or start time, computes the same ones.
* With ``baseline="HH:MM"`` the grid restarts every local day at that wall time in
  the schedule's tz: slots are anchor + k x interval (elapsed time) and a slot at or
  after the next day's anchor is dropped.
* ``next_fire`` is strictly after ``after``; ``fires_between`` is (start, end].
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import date, datetime, timedelta, timezone
from datetime import time as dtime
from pathlib import Path
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_cluster_beat import ScheduleError, every

UTC = timezone.utc
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
REPO = Path(__file__).resolve().parents[2]


def utc(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).astimezone(UTC)


def utcs(*texts: str) -> list[datetime]:
    return [utc(t) for t in texts]


# --- the epoch grid ------------------------------------------------------------------

@settings(max_examples=200, deadline=None)
@given(
    seconds=st.integers(1, 40 * 86400),
    after=st.datetimes(datetime(1990, 1, 1), datetime(2090, 1, 1)),
)
def test_integer_interval_fires_on_multiples_of_the_interval_since_epoch(seconds, after):
    """next_fire(after) is the smallest k*interval after the epoch that is strictly after `after`."""
    after = after.replace(tzinfo=UTC)
    micro = (after - EPOCH) // timedelta(microseconds=1)
    step = seconds * 1_000_000
    expected = EPOCH + timedelta(microseconds=(micro // step + 1) * step)
    assert every(seconds).next_fire(after) == expected


@settings(max_examples=200, deadline=None)
@given(
    millis=st.integers(1000, 10_000_000),
    after=st.datetimes(datetime(1990, 1, 1), datetime(2090, 1, 1)),
)
def test_float_interval_grid_is_exact_to_the_microsecond(millis, after):
    """A float interval such as 1.1 s is exact: instants are k * timedelta(seconds=1.1) since the epoch, no float drift."""
    interval = millis / 1000
    after = after.replace(tzinfo=UTC)
    step = timedelta(seconds=interval) // timedelta(microseconds=1)
    micro = (after - EPOCH) // timedelta(microseconds=1)
    expected = EPOCH + timedelta(microseconds=(micro // step + 1) * step)
    assert every(interval).next_fire(after) == expected


@pytest.mark.parametrize("interval", [30, 30.0, timedelta(seconds=30)], ids=["int", "float", "timedelta"])
def test_int_float_and_timedelta_intervals_mean_the_same(interval):
    """30, 30.0 and timedelta(seconds=30) give the same grid."""
    got = every(interval).fires_between(utc("2026-01-01T00:00:00Z"), utc("2026-01-01T00:02:00Z"))
    assert got == utcs("2026-01-01T00:00:30Z", "2026-01-01T00:01:00Z", "2026-01-01T00:01:30Z",
                       "2026-01-01T00:02:00Z")


def test_fractional_interval_fires_on_its_own_grid():
    """every(2.5) fires at k * 2.5 s since the epoch (2026-01-01T00:00Z is a multiple of 2.5 s)."""
    s = every(2.5)
    assert s.next_fire(utc("2026-01-01T00:00:00Z")) == utc("2026-01-01T00:00:02.5Z")
    assert s.next_fire(utc("2026-01-01T00:00:01Z")) == utc("2026-01-01T00:00:02.5Z")
    assert s.fires_between(utc("2026-01-01T00:00:00Z"), utc("2026-01-01T00:00:10Z")) == utcs(
        "2026-01-01T00:00:02.5Z", "2026-01-01T00:00:05Z", "2026-01-01T00:00:07.5Z", "2026-01-01T00:00:10Z")


def test_timedelta_interval_of_five_minutes_is_on_the_hour_grid():
    """timedelta(minutes=5) fires at :00, :05, ... UTC (300 s divides the epoch's hours)."""
    s = every(timedelta(minutes=5))
    assert s.next_fire(utc("2026-07-04T10:02:13Z")) == utc("2026-07-04T10:05Z")


def test_grid_is_independent_of_the_time_zone_without_baseline():
    """Without a baseline the tz does not move the grid: 7 h slots are k*7h since the epoch."""
    after = utc("2026-03-08T00:00Z")
    a = every(timedelta(hours=7), tz="America/New_York").next_fire(after)
    b = every(timedelta(hours=7), tz="Asia/Kolkata").next_fire(after)
    assert a == b
    assert (a - EPOCH) % timedelta(hours=7) == timedelta(0)


def test_next_fire_is_strictly_after_a_grid_instant():
    """An `after` on the grid yields the following slot."""
    s = every(60)
    assert s.next_fire(utc("2026-01-01T00:01:00Z")) == utc("2026-01-01T00:02:00Z")
    assert s.next_fire(utc("2026-01-01T00:00:59.999999Z")) == utc("2026-01-01T00:01:00Z")


def test_fires_between_excludes_start_and_includes_end():
    """fires_between(start, end) is the half-open (start, end], ascending."""
    s = every(3600)
    assert s.fires_between(utc("2026-01-01T00:00Z"), utc("2026-01-01T03:00Z")) == utcs(
        "2026-01-01T01:00Z", "2026-01-01T02:00Z", "2026-01-01T03:00Z")
    assert s.fires_between(utc("2026-01-01T00:00Z"), utc("2026-01-01T00:59:59Z")) == []


def test_results_are_aware_utc_and_naive_after_is_refused():
    """Instants come back in datetime.timezone.utc; a naive `after` raises ValueError."""
    s = every(90)
    assert s.next_fire(utc("2026-01-01T00:00Z")).tzinfo is timezone.utc
    with pytest.raises(ValueError):
        s.next_fire(datetime(2026, 1, 1))


def test_one_second_interval_is_the_smallest_accepted():
    """every(1) is valid and fires every second."""
    got = every(1).fires_between(utc("2026-01-01T00:00:00Z"), utc("2026-01-01T00:00:03Z"))
    assert got == utcs("2026-01-01T00:00:01Z", "2026-01-01T00:00:02Z", "2026-01-01T00:00:03Z")


_CHILD = r"""
import json, sys, time
from datetime import datetime, timedelta, timezone
from celery_cluster_beat import every, cron
start = datetime(2026, 3, 7, tzinfo=timezone.utc)
end = datetime(2026, 3, 10, tzinfo=timezone.utc)
out = {
    "local": time.strftime("%Z"),
    "every_7h13s": [t.isoformat() for t in every(7 * 3600 + 13).fires_between(start, end)],
    "every_5min": [t.isoformat() for t in every(timedelta(minutes=5)).fires_between(start, start + timedelta(hours=1))],
    "every_2.5": [t.isoformat() for t in every(2.5).fires_between(start, start + timedelta(seconds=20))],
    "every_6h_0230_ny": [t.isoformat() for t in every(timedelta(hours=6), baseline="02:30", tz="America/New_York").fires_between(start, end)],
    "cron_ny": [t.isoformat() for t in cron("30 2 * * *", tz="America/New_York").fires_between(start, end)],
}
print(json.dumps(out))
"""


def test_separate_processes_in_different_local_zones_compute_identical_instants():
    """Three OS processes with TZ=UTC, Asia/Kolkata and America/New_York agree exactly."""
    results = {}
    for tz in ("UTC", "Asia/Kolkata", "America/New_York"):
        env = dict(os.environ, TZ=tz, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.run([sys.executable, "-c", _CHILD], env=env, cwd=str(REPO),
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        results[tz] = json.loads(proc.stdout.strip().splitlines()[-1])
    # the children really ran in different local zones
    assert len({r.pop("local") for r in results.values()}) == 3
    assert results["UTC"] == results["Asia/Kolkata"] == results["America/New_York"]
    # and what they agree on is the epoch grid
    got = [datetime.fromisoformat(t) for t in results["UTC"]["every_7h13s"]]
    assert got and all((t - EPOCH) % timedelta(seconds=7 * 3600 + 13) == timedelta(0) for t in got)
    assert results["UTC"]["every_2.5"][:2] == ["2026-03-07T00:00:02.500000+00:00", "2026-03-07T00:00:05+00:00"]


# --- baseline: a daily grid anchored at a local wall time ---------------------------------

def test_six_hours_from_0230_fires_four_times_on_an_ordinary_day():
    """every 6h from 02:30 fires at 02:30, 08:30, 14:30, 20:30 local (New York, EDT = UTC-4)."""
    s = every(timedelta(hours=6), baseline="02:30", tz="America/New_York")
    got = s.fires_between(utc("2026-06-15T04:00Z"), utc("2026-06-16T04:00Z"))  # local 00:00..24:00
    assert got == utcs("2026-06-15T06:30Z", "2026-06-15T12:30Z", "2026-06-15T18:30Z", "2026-06-16T00:30Z")


def test_slots_at_or_after_the_next_anchor_are_dropped():
    """every 5h from 00:00 fires 00, 05, 10, 15, 20 and then 00 of the next day (01:00 is dropped).

    Berlin in June is UTC+2: local 00:00 = 22:00Z the day before.
    """
    s = every(timedelta(hours=5), baseline="00:00", tz="Europe/Berlin")
    got = s.fires_between(utc("2026-06-14T21:59Z"), utc("2026-06-15T23:30Z"))
    assert got == utcs("2026-06-14T22:00Z", "2026-06-15T03:00Z", "2026-06-15T08:00Z", "2026-06-15T13:00Z",
                       "2026-06-15T18:00Z", "2026-06-15T22:00Z")
    assert utc("2026-06-15T23:00Z") not in got  # 20:00 + 5 h = 01:00 local, past the next anchor


@pytest.fixture
def fresh_current_app():
    """A new Celery app without a timezone setting, current for the test; the previous one is restored."""
    from celery import Celery, current_app

    previous = current_app._get_current_object()
    app = Celery("ccb-every-tests", set_as_current=True)
    try:
        yield app
    finally:
        previous.set_current()


def test_baseline_without_tz_uses_utc_when_the_app_has_no_timezone(fresh_current_app):
    """tz=None means the Celery app's timezone, UTC when unset."""
    assert fresh_current_app.conf.timezone is None
    s = every(timedelta(hours=12), baseline="06:00")
    assert s.fires_between(utc("2026-06-15T00:00Z"), utc("2026-06-16T00:00Z")) == utcs(
        "2026-06-15T06:00Z", "2026-06-15T18:00Z")


def test_baseline_without_tz_follows_the_app_timezone(fresh_current_app):
    """With the app's timezone set to Asia/Tokyo (UTC+9), 06:00 is 21:00Z the day before."""
    fresh_current_app.conf.timezone = "Asia/Tokyo"
    s = every(timedelta(hours=12), baseline="06:00")
    assert s.fires_between(utc("2026-06-15T00:00Z"), utc("2026-06-16T00:00Z")) == utcs(
        "2026-06-15T09:00Z", "2026-06-15T21:00Z")


# New York 2026: spring forward Sun 2026-03-08 02:00 EST -> 03:00 EDT (07:00Z);
#                fall back      Sun 2026-11-01 02:00 EDT -> 01:00 EST (06:00Z).
# London 2026:   spring forward Sun 2026-03-29 01:00 GMT -> 02:00 BST (01:00Z);
#                fall back      Sun 2026-10-25 02:00 BST -> 01:00 GMT (01:00Z).
# Slots are anchor + k * interval in *elapsed* time, kept while before the next
# local day's anchor; so a spring-forward day is 23 h long and a fall-back day 25 h.

def test_new_york_spring_forward_day_has_23_hours():
    """every 5h from 00:00, 2026-03-08 (New York).

    anchor 00:00 EST = 05:00Z; next anchor 2026-03-09 00:00 EDT = 04:00Z (23 h later).
    Slots at +0, +5, +10, +15, +20 h (all < 23 h): 05:00Z, 10:00Z, 15:00Z, 20:00Z, 01:00Z,
    i.e. local 00:00 EST, 06:00 EDT, 11:00, 16:00, 21:00 EDT (elapsed time, not wall time).
    """
    s = every(timedelta(hours=5), baseline="00:00", tz="America/New_York")
    got = s.fires_between(utc("2026-03-08T04:59Z"), utc("2026-03-09T04:00Z"))
    assert got == utcs("2026-03-08T05:00Z", "2026-03-08T10:00Z", "2026-03-08T15:00Z", "2026-03-08T20:00Z",
                       "2026-03-09T01:00Z", "2026-03-09T04:00Z")


def test_new_york_fall_back_day_has_25_hours_and_the_25h_slot_is_the_next_anchor():
    """every 5h from 00:00, 2026-11-01 (New York).

    anchor 00:00 EDT = 04:00Z; next anchor 2026-11-02 00:00 EST = 05:00Z (25 h later).
    Slots +0..+20 h: 04:00Z, 09:00Z, 14:00Z, 19:00Z, 00:00Z(11-02) = local 00:00 EDT,
    04:00 EST, 09:00, 14:00, 19:00 EST. The +25 h slot equals the next anchor, so it
    is the next day's first fire, once.
    """
    s = every(timedelta(hours=5), baseline="00:00", tz="America/New_York")
    got = s.fires_between(utc("2026-11-01T03:59Z"), utc("2026-11-02T05:00Z"))
    assert got == utcs("2026-11-01T04:00Z", "2026-11-01T09:00Z", "2026-11-01T14:00Z", "2026-11-01T19:00Z",
                       "2026-11-02T00:00Z", "2026-11-02T05:00Z")


def test_london_spring_forward_day_has_23_hours():
    """every 6h from 00:00, 2026-03-29 (London).

    anchor 00:00 GMT = 00:00Z; next anchor 2026-03-30 00:00 BST = 2026-03-29T23:00Z.
    Slots +0, +6, +12, +18 h (< 23 h): 00:00Z, 06:00Z, 12:00Z, 18:00Z = local 00:00 GMT,
    07:00, 13:00, 19:00 BST.
    """
    s = every(timedelta(hours=6), baseline="00:00", tz="Europe/London")
    got = s.fires_between(utc("2026-03-28T23:59Z"), utc("2026-03-30T05:00Z"))
    assert got == utcs("2026-03-29T00:00Z", "2026-03-29T06:00Z", "2026-03-29T12:00Z", "2026-03-29T18:00Z",
                       "2026-03-29T23:00Z", "2026-03-30T05:00Z")


def test_london_fall_back_day_has_25_hours_so_six_hourly_fires_five_times():
    """every 6h from 00:00, 2026-10-25 (London).

    anchor 00:00 BST = 2026-10-24T23:00Z; next anchor 2026-10-26 00:00 GMT = 00:00Z (25 h later).
    Slots +0, +6, +12, +18, +24 h (all < 25 h): 23:00Z, 05:00Z, 11:00Z, 17:00Z, 23:00Z =
    local 00:00 BST, 05:00, 11:00, 17:00, 23:00 GMT; then the next anchor at 00:00Z.
    """
    s = every(timedelta(hours=6), baseline="00:00", tz="Europe/London")
    got = s.fires_between(utc("2026-10-24T22:59Z"), utc("2026-10-26T00:00Z"))
    assert got == utcs("2026-10-24T23:00Z", "2026-10-25T05:00Z", "2026-10-25T11:00Z", "2026-10-25T17:00Z",
                       "2026-10-25T23:00Z", "2026-10-26T00:00Z")


def test_anchor_inside_the_spring_forward_gap_moves_to_the_end_of_the_gap():
    """every 6h from 02:30, New York, 2026-03-08: 02:30 does not exist, the day anchors at 03:00 EDT.

    The previous day's slots (from 02:30 EST = 07:30Z on 03-07) end with 01:30Z on 03-08,
    because 07:30Z is past the new anchor 07:00Z (03:00 EDT). Then 07:00Z, 13:00Z, 19:00Z.
    """
    s = every(timedelta(hours=6), baseline="02:30", tz="America/New_York")
    got = s.fires_between(utc("2026-03-08T00:00Z"), utc("2026-03-08T20:00Z"))
    assert got == utcs("2026-03-08T01:30Z", "2026-03-08T07:00Z", "2026-03-08T13:00Z", "2026-03-08T19:00Z")


def test_anchor_inside_the_repeated_hour_uses_the_first_pass():
    """every 6h from 01:30, New York, 2026-11-01: 01:30 happens twice; the anchor is 01:30 EDT = 05:30Z."""
    s = every(timedelta(hours=6), baseline="01:30", tz="America/New_York")
    assert s.next_fire(utc("2026-11-01T00:00Z")) == utc("2026-11-01T05:30Z")
    got = s.fires_between(utc("2026-11-01T00:00Z"), utc("2026-11-01T12:00Z"))
    assert got == utcs("2026-11-01T05:30Z", "2026-11-01T11:30Z")  # not 06:30Z (01:30 EST)


# --- baseline property: a reference model of the daily re-anchored grid --------------------

_DST_ZONES = ["America/New_York", "Europe/London", "Australia/Lord_Howe", "Pacific/Chatham",
              "America/Santiago", "America/Havana", "Africa/Casablanca"]


def _offset_changes(zone: ZoneInfo, year: int) -> list[datetime]:
    out, t = [], datetime(year, 1, 1, tzinfo=UTC)
    while t.year == year:
        nxt = t + timedelta(minutes=15)
        if t.astimezone(zone).utcoffset() != nxt.astimezone(zone).utcoffset():
            out.append(nxt)
        t = nxt
    return out


def _reference_anchor(day: date, hh: int, mm: int, zone: ZoneInfo) -> datetime:
    """The instant of wall time day HH:MM: the first pass when it occurs twice, the end of the
    gap (the transition instant) when it does not occur."""
    wall = datetime.combine(day, dtime(hh, mm))
    first = wall.replace(tzinfo=zone, fold=0).astimezone(UTC)
    if first.astimezone(zone).replace(tzinfo=None) == wall:
        return first
    # fold=1 applies the later offset (an instant before the gap), fold=0 the earlier one
    # (an instant after it); bisect, in whole seconds, for the instant the offset changes
    lo = int(wall.replace(tzinfo=zone, fold=1).timestamp())
    hi = int(first.timestamp())
    before = datetime.fromtimestamp(lo, UTC).astimezone(zone).utcoffset()
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if datetime.fromtimestamp(mid, UTC).astimezone(zone).utcoffset() == before:
            lo = mid
        else:
            hi = mid
    return datetime.fromtimestamp(hi, UTC)


def _reference_slots(interval: timedelta, hh: int, mm: int, zone: ZoneInfo,
                     start: datetime, end: datetime) -> list[datetime]:
    out = []
    day = start.astimezone(zone).date() - timedelta(days=2)
    while True:
        anchor = _reference_anchor(day, hh, mm, zone)
        if anchor > end:
            return out
        nxt = _reference_anchor(day + timedelta(days=1), hh, mm, zone)
        t = anchor
        while t < nxt:
            if start < t <= end:
                out.append(t)
            t += interval
        day += timedelta(days=1)


_BASELINE_TRANSITIONS = [(z, t) for z in _DST_ZONES for t in _offset_changes(ZoneInfo(z), 2026)]


@settings(max_examples=150, deadline=None)
@given(
    where=st.sampled_from(_BASELINE_TRANSITIONS),
    minutes=st.one_of(st.sampled_from([60, 90, 300, 360, 420, 480, 720, 1440]), st.integers(10, 1440)),
    hh=st.one_of(st.sampled_from([0, 1, 2, 3, 23]), st.integers(0, 23)),
    mm=st.one_of(st.sampled_from([0, 15, 30, 45, 59]), st.integers(0, 59)),
    lead=st.integers(0, 36 * 3600),
    span=st.integers(0, 72 * 3600),
)
def test_baseline_grid_matches_the_reference_model_around_dst(where, minutes, hh, mm, lead, span):
    """Around each 2026 transition, every(interval, baseline) fires at anchor + k*interval (< next anchor)
    for each local day, anchors resolved as: repeated time -> first pass, skipped time -> end of the gap."""
    zone_name, transition = where
    zone = ZoneInfo(zone_name)
    start = transition - timedelta(seconds=lead)
    end = start + timedelta(seconds=span)
    s = every(timedelta(minutes=minutes), baseline=f"{hh:02d}:{mm:02d}", tz=zone_name)
    expected = _reference_slots(timedelta(minutes=minutes), hh, mm, zone, start, end)
    assert s.fires_between(start, end) == expected
    if expected:
        assert s.next_fire(start) == expected[0]


@pytest.mark.parametrize("baseline", ["00:00", "07:05", "23:59"])
def test_valid_baselines_are_accepted(baseline):
    """HH:MM from 00:00 to 23:59 is accepted; the first slot of the day is at that wall time."""
    s = every(timedelta(days=1), baseline=baseline, tz="UTC")
    hh, mm = map(int, baseline.split(":"))
    assert s.next_fire(utc("2026-06-15T00:00Z") - timedelta(microseconds=1)) == utc(
        "2026-06-15T00:00Z") + timedelta(hours=hh, minutes=mm)


# --- bad input ----------------------------------------------------------------------------

@pytest.mark.parametrize("interval", [0, 0.5, 0.999, -1, -60, timedelta(0), timedelta(milliseconds=500),
                                      timedelta(seconds=-30)],
                         ids=lambda v: repr(v))
def test_interval_under_one_second_is_refused(interval):
    """Intervals below 1 s (including zero and negative ones) raise ScheduleError naming the interval."""
    with pytest.raises(ScheduleError) as info:
        every(interval)
    assert isinstance(info.value, ValueError)
    assert "interval" in str(info.value).lower()


@pytest.mark.parametrize("interval", ["30", None, "5m", [30], float("nan"), float("inf")], ids=repr)
def test_interval_that_is_not_a_number_is_refused(interval):
    """Strings, None and other non-numbers raise ScheduleError (not TypeError) naming the interval."""
    with pytest.raises(ScheduleError) as info:
        every(interval)
    assert "interval" in str(info.value).lower()


@pytest.mark.parametrize("baseline", ["24:00", "7:5", "12:60", "noon", "", "12:00:00", "-1:00"])
def test_baseline_not_hh_mm_is_refused(baseline):
    """A baseline outside HH:MM 00:00-23:59 raises ScheduleError quoting the baseline."""
    with pytest.raises(ScheduleError) as info:
        every(3600, baseline=baseline, tz="UTC")
    message = str(info.value)
    assert "baseline" in message.lower()
    assert repr(baseline) in message or f'"{baseline}"' in message, message
    assert "HH:MM" in message, message


@pytest.mark.parametrize("tz", ["Mars/Olympus_Mons", "Europe/Londn"])
def test_unknown_time_zone_is_refused(tz):
    """An unknown zone raises ScheduleError naming the zone."""
    with pytest.raises(ScheduleError) as info:
        every(3600, baseline="02:00", tz=tz)
    assert tz in str(info.value)
