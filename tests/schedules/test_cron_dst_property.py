"""Property: around every DST transition of 2026, ``cron`` fires exactly when Vixie cron would.

The reference is ``vixie_oracle``, a minute-by-minute replay of Vixie cron's main
loop against a fake clock (real UTC minutes, wall time from zoneinfo). It shares no
code with the package. For each transition (found by scanning ``utcoffset``, not
hard-coded) the window is the transition +/- 36 hours.

Checked, for hand-picked and for generated expressions:

* ``fires_between(start, end)`` equals the oracle's instants in (start, end];
* repeatedly calling ``next_fire`` from ``start`` walks the same instants.
"""
from __future__ import annotations

import calendar
from datetime import datetime, timedelta, timezone
from functools import lru_cache
from zoneinfo import ZoneInfo

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import vixie_oracle
from celery_cluster_beat import cron

UTC = timezone.utc
YEAR = 2026
HALF_WINDOW = timedelta(hours=36)

# Asia/Tehran has had no DST since 2022, so it has no 2026 transition; America/Havana
# (midnight transitions) and Africa/Casablanca (Ramadan: clocks go *back* in spring)
# take its place.
ZONES = [
    "America/New_York",
    "Europe/London",
    "Europe/Berlin",
    "Australia/Sydney",
    "Australia/Lord_Howe",  # 30-minute shift
    "Pacific/Chatham",  # shifts at 02:45/03:45 local, offsets +12:45/+13:45
    "America/Santiago",  # transitions at local midnight
    "America/Havana",  # transitions at local midnight
    "Africa/Casablanca",
]


def _transitions(zone_name: str, year: int) -> list[datetime]:
    """UTC instants in *year* at which the zone's utcoffset changes (to the second)."""
    zone = ZoneInfo(zone_name)

    def offset(t: datetime) -> timedelta:
        return t.astimezone(zone).utcoffset()

    found = []
    t = datetime(year, 1, 1, tzinfo=UTC)
    end = datetime(year + 1, 1, 1, tzinfo=UTC)
    while t < end:
        nxt = t + timedelta(hours=1)
        if offset(nxt) != offset(t):
            lo, hi = t, nxt  # offset(lo) != offset(hi): bisect to the second
            while hi - lo > timedelta(seconds=1):
                mid = lo + (hi - lo) / 2
                mid = mid.replace(microsecond=0)
                if offset(mid) == offset(lo):
                    lo = mid
                else:
                    hi = mid
            found.append(hi)
        t = nxt
    return found


TRANSITIONS = [(z, t) for z in ZONES for t in _transitions(z, YEAR)]
TRANSITION_IDS = [f"{z}@{t:%m-%dT%H:%MZ}" for z, t in TRANSITIONS]


def test_every_zone_has_its_two_2026_transitions():
    """The scan finds a spring and an autumn transition in each zone (else the property below tests nothing)."""
    per_zone = {z: [t for zz, t in TRANSITIONS if zz == z] for z in ZONES}
    assert {z: len(ts) for z, ts in per_zone.items()} == {z: 2 for z in ZONES}
    # spot-check the scan against known dates
    assert datetime(2026, 3, 8, 7, tzinfo=UTC) in per_zone["America/New_York"]
    assert datetime(2026, 10, 3, 15, 30, tzinfo=UTC) in per_zone["Australia/Lord_Howe"]
    for z, t in TRANSITIONS:
        assert t.second == 0, f"{z} transition {t} is not on a whole minute; the oracle needs minutes"


def _window(at: datetime) -> tuple[datetime, datetime]:
    return at - HALF_WINDOW, at + HALF_WINDOW


@lru_cache(maxsize=None)
def _oracle_many(exprs: tuple[str, ...], tz: str, start: datetime, end: datetime):
    jobs = [vixie_oracle.parse(e) for e in exprs]
    return dict(zip(exprs, vixie_oracle.simulate(jobs, tz, start, end)))


def _walk_next_fire(schedule, start: datetime, end: datetime, limit: int = 10_000) -> list[datetime]:
    out = []
    t = start
    for _ in range(limit):
        t = schedule.next_fire(t)
        if t > end:
            return out
        out.append(t)
    raise AssertionError("next_fire did not get past the window end")


def _fmt(instants, zone) -> list[str]:
    z = ZoneInfo(zone)
    return [f"{t:%m-%dT%H:%MZ}({t.astimezone(z):%H:%M%z})" for t in instants]


def _assert_same(expr, tz, start, end, expected):
    s = cron(expr, tz=tz)
    got = s.fires_between(start, end)
    assert _fmt(got, tz) == _fmt(expected, tz), (
        f"fires_between for cron({expr!r}, {tz!r}) over ({start:%m-%dT%H:%M:%SZ}, {end:%m-%dT%H:%M:%SZ}]")
    walked = _walk_next_fire(s, start, end)
    assert _fmt(walked, tz) == _fmt(expected, tz), (
        f"next_fire walk for cron({expr!r}, {tz!r}) from {start:%m-%dT%H:%M:%SZ}")


HAND_PICKED = (
    "30 2 * * *",
    "0 */2 * * *",
    "*/15 * * * *",
    "45 1 * * *",
    "15 2 * * *",
    "0 0 * * *",
    "0 1-3 * * *",
    "*/30 2 * * *",
    "0 2,3 * * *",
)


def test_oracle_reproduces_the_spec_rules_it_stands_for():
    """Sanity check of the oracle itself against rules stated in the spec (New York, 2026)."""
    start, end = _window(datetime(2026, 3, 8, 7, tzinfo=UTC))
    spring = _oracle_many(HAND_PICKED, "America/New_York", start, end)
    d8 = lambda h, m=0: datetime(2026, 3, 8, h, m, tzinfo=UTC)  # noqa: E731
    # fixed 02:30 skipped -> at the end of the gap (07:00Z = 03:00 EDT)
    assert d8(7) in spring["30 2 * * *"]
    # '0 2,3' fixed: skipped 02:00 and the real 03:00 collapse into one instant
    assert [t for t in spring["0 2,3 * * *"] if t.date() == d8(0).date()] == [d8(7)]
    # wildcard '*/30 2': nothing on the spring-forward day
    assert not [t for t in spring["*/30 2 * * *"] if d8(0) <= t < d8(23)]
    start, end = _window(datetime(2026, 11, 1, 6, tzinfo=UTC))
    fall = _oracle_many(HAND_PICKED, "America/New_York", start, end)
    n1 = lambda h, m=0: datetime(2026, 11, 1, h, m, tzinfo=UTC)  # noqa: E731
    # wildcard: both passes of 01:xx; fixed 01:45 only in the first (EDT) pass
    assert n1(5, 15) in fall["*/15 * * * *"] and n1(6, 15) in fall["*/15 * * * *"]
    assert n1(5, 45) in fall["45 1 * * *"] and n1(6, 45) not in fall["45 1 * * *"]


@pytest.mark.parametrize("zone, transition", TRANSITIONS, ids=TRANSITION_IDS)
def test_hand_picked_expressions_fire_like_vixie_around_transition(zone, transition):
    """Each hand-picked expression fires exactly at the oracle's instants within transition +/- 36 h."""
    start, end = _window(transition)
    expected = _oracle_many(HAND_PICKED, zone, start, end)
    for expr in HAND_PICKED:
        _assert_same(expr, zone, start, end, expected[expr])


# --- generated expressions -------------------------------------------------------

def _numbers(lo: int, hi: int, favourites: list[int]):
    return st.one_of(st.sampled_from(sorted(set(favourites))), st.integers(lo, hi))


def _fixed_field(lo: int, hi: int, favourites: list[int]):
    """Field text that does not start with '*': n, a,b(,c), a-b, a-b/s."""
    n = _numbers(lo, hi, favourites)
    single = n.map(str)
    listed = st.lists(n, min_size=2, max_size=4, unique=True).map(lambda v: ",".join(map(str, v)))
    ranged = st.tuples(n, n).map(sorted).map(lambda ab: f"{ab[0]}-{ab[1]}")
    stepped = st.tuples(n, n).map(sorted).flatmap(
        lambda ab: st.integers(1, max(1, ab[1] - ab[0])).map(lambda s: f"{ab[0]}-{ab[1]}/{s}"))
    mixed = st.tuples(single, ranged).map(lambda p: ",".join(p))
    return st.one_of(single, listed, ranged, stepped, mixed)


def _star_field(size: int):
    """Field text starting with '*': '*' or '*/s' with s smaller than the field size."""
    return st.one_of(st.just("*"), st.integers(1, size - 1).map(lambda s: f"*/{s}"))


def _days_in_month_max(month: int) -> int:
    return 29 if month == 2 else calendar.monthrange(2001, month)[1]


def _can_fire(dom_text: str, month_text: str, dow_text: str) -> bool:
    """False only for day/month combinations that never occur (rejected by cron())."""
    if not dom_text.startswith("*") and not dow_text.startswith("*"):
        return True  # OR rule: the weekday part always occurs in any month
    job = vixie_oracle.parse(f"0 0 {dom_text} {month_text} {dow_text}")
    return any(d <= _days_in_month_max(m) for m in job.months for d in job.doms)


@st.composite
def case(draw):
    zone, transition = draw(st.sampled_from(TRANSITIONS))
    local = ZoneInfo(zone)
    start, end = _window(transition)
    # wall hours/minutes near the transition, on both sides of it
    near = [(transition + timedelta(minutes=m)).astimezone(local) for m in range(-120, 121, 15)]
    hours = [t.hour for t in near]
    minutes = [0, 15, 30, 45, 59] + [t.minute for t in near]
    days = sorted({(start + timedelta(hours=h)).astimezone(local).date() for h in range(0, 73, 6)})
    minute = draw(st.one_of(_fixed_field(0, 59, minutes), _star_field(60)))
    hour = draw(st.one_of(_fixed_field(0, 23, hours), _star_field(24)))
    dom = draw(st.one_of(
        st.just("*"), st.just("*/2"),
        st.sampled_from([d.day for d in days]).map(str),
        st.lists(st.sampled_from([d.day for d in days]), min_size=2, max_size=3, unique=True).map(
            lambda v: ",".join(map(str, v))),
        st.integers(1, 31).map(str),
    ))
    month_names = ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"]
    month = draw(st.one_of(
        st.just("*"),
        st.sampled_from([d.month for d in days]).map(str),
        st.sampled_from([d.month for d in days]).map(lambda m: month_names[m - 1]),
        st.sampled_from([d.month for d in days]).map(lambda m: month_names[m - 1].upper()),
        st.sampled_from([d.month for d in days]).map(lambda m: f"{max(1, m - 1)}-{min(12, m + 1)}"),
    ))
    dow_names = ["sun", "mon", "tue", "wed", "thu", "fri", "sat"]
    weekdays = [(d.isoweekday() % 7) for d in days]
    dow = draw(st.one_of(
        st.just("*"), st.just("*/2"),
        st.sampled_from(weekdays).map(str),
        st.sampled_from(weekdays).map(lambda w: dow_names[w].capitalize()),
        st.just("7"), st.just("1-5"), st.just("Mon-Fri"), st.just("0-6"), st.just("sat,sun"),
    ))
    assume(_can_fire(dom, month, dow))
    # a sub-window, not necessarily on whole minutes
    span = int((end - start).total_seconds())
    a = draw(st.integers(0, span))
    b = draw(st.integers(a, span))
    return zone, start, end, f"{minute} {hour} {dom} {month} {dow}", a, b


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case())
@pytest.mark.timeout(300)  # CPU-heavy: room on a loaded 2-core machine
def test_generated_expressions_fire_like_vixie_around_transitions(data):
    """Random fixed/wildcard expressions agree with the oracle on the full window and on a random sub-window."""
    zone, start, end, expr, a, b = data
    expected = _oracle_many((expr,), zone, start, end)[expr]
    _assert_same(expr, zone, start, end, expected)
    sub_start, sub_end = start + timedelta(seconds=a), start + timedelta(seconds=b)
    s = cron(expr, tz=zone)
    assert _fmt(s.fires_between(sub_start, sub_end), zone) == _fmt(
        [t for t in expected if sub_start < t <= sub_end], zone), (
        f"fires_between sub-window for cron({expr!r}, {zone!r})")
    later = [t for t in expected if t > sub_start]
    if later:
        assert s.next_fire(sub_start) == later[0], f"next_fire({sub_start}) for cron({expr!r}, {zone!r})"


@pytest.mark.parametrize("zone, transition", TRANSITIONS, ids=TRANSITION_IDS)
def test_next_fire_at_and_around_each_fire_and_the_transition_instant(zone, transition):
    """next_fire(t) for t = each oracle fire -1us, exactly, +1us, and the transition instant +/-1us."""
    start, end = _window(transition)
    expected = _oracle_many(HAND_PICKED, zone, start, end)
    tick = timedelta(microseconds=1)
    for expr in HAND_PICKED:
        fires = expected[expr]
        s = cron(expr, tz=zone)
        probes = [transition - tick, transition, transition + tick]
        probes += [t + d for t in fires for d in (-tick, timedelta(0), tick)]
        for probe in probes:
            later = [t for t in fires if t > probe]
            if not later or probe <= start:
                continue
            assert s.next_fire(probe) == later[0], (
                f"cron({expr!r}, {zone!r}).next_fire({probe.isoformat()})")
