"""Property: where croniter and we read an expression alike, we fire at croniter's instants.

croniter runs with ``implement_cron_bug=True``, its Vixie day rule (a day field whose text
starts with ``*`` makes the two day fields AND), which is ours. Compared:

* the common subset (Vixie fields, wrapping ranges, a seconds field), in UTC and in a zone
  without DST: on every instant;
* each extension (``L``, ``15-L``, ``W``, ``#``, ``L<n>``), in UTC, Asia/Tokyo (no DST) and
  America/New_York on dates away from its transitions (DST is where our rules differ, on
  purpose: see test_cron_extensions.py and the README's semantics table).

Kept cheap (a few seconds in all): modest ``max_examples``, no deadline.
"""
from __future__ import annotations

from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

from croniter import CroniterBadDateError, croniter
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from celery_cluster_beat import ScheduleError, cron

UTC = timezone.utc
SETTINGS = dict(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MONTHS = ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"]
WEEKDAYS = ["sun", "mon", "tue", "wed", "thu", "fri", "sat"]


def _field(lo: int, hi: int, names=None):
    """Vixie field text: '*', '*/s', n, lists, ascending ranges (with steps), and wrapping ranges
    (with and without steps). Never an equal-bound range ('5-5'), which croniter reads as the whole field."""
    size = hi - lo + 1
    value = st.integers(lo, hi)
    text = value.map(str) if names is None else st.one_of(value.map(str), value.map(lambda v: names[v - lo]))
    pair = st.tuples(value, value).filter(lambda ab: ab[0] != ab[1])
    ranged = pair.map(lambda ab: f"{ab[0]}-{ab[1]}")
    stepped = st.tuples(pair, st.integers(2, max(2, size // 2))).map(lambda p: f"{p[0][0]}-{p[0][1]}/{p[1]}")
    return st.one_of(
        st.just("*"), st.integers(1, size - 1).map(lambda s: f"*/{s}"), text,
        st.lists(value, min_size=2, max_size=4, unique=True).map(lambda v: ",".join(map(str, v))),
        ranged, stepped, st.tuples(text, ranged).map(",".join))


PLAIN = {
    "minute": _field(0, 59), "hour": _field(0, 23), "dom": _field(1, 31),
    "month": _field(1, 12, MONTHS), "dow": _field(0, 6, WEEKDAYS), "second": _field(0, 59),
}


def _instant(year_lo: int = 2020, year_hi: int = 2030):
    return st.integers(0, (year_hi - year_lo) * 366 * 86400).map(
        lambda s: datetime(year_lo, 1, 1, tzinfo=UTC) + timedelta(seconds=s, microseconds=s % 7 * 100_000))


def _croniter_next(expr: str, tz: str, after: datetime) -> datetime:
    return croniter(expr, after.astimezone(ZoneInfo(tz)), implement_cron_bug=True).get_next(datetime)


def _ours(expr: str, tz: str):
    try:
        return cron(expr, tz=tz)
    except ScheduleError:
        assume(False)  # never fires (0 0 30 2 *), refused as croniter would fail to find a date


def _transition_between(tz: str, a: datetime, b: datetime) -> bool:
    zone = ZoneInfo(tz)
    t, step = a, timedelta(hours=6)
    offset = a.astimezone(zone).utcoffset()
    while t < b + step:
        if t.astimezone(zone).utcoffset() != offset:
            return True
        t += step
    return False


@settings(**SETTINGS)
@given(st.fixed_dictionaries(PLAIN), st.booleans(), st.sampled_from(["UTC", "Asia/Tokyo"]), _instant())
def test_common_subset_agrees_with_croniter(fields, with_seconds, tz, after):
    expr = " ".join(fields[k] for k in ("minute", "hour", "dom", "month", "dow"))
    if with_seconds:
        expr += " " + (fields["second"] if fields["second"] != "*" else "*/1")  # a bare '*' is refused
    schedule = _ours(expr, tz)
    t = after
    for _ in range(3):  # a short walk: each instant, not just the first
        ours = schedule.next_fire(t)
        assert ours == _croniter_next(expr, tz, t), f"cron({expr!r}, {tz!r}).next_fire({t.isoformat()})"
        t = ours


DOM_EXT = st.one_of(
    st.just("L"), st.integers(1, 31).map(lambda d: f"{d}W"), st.integers(1, 31).map(lambda d: f"W{d}"),
    st.integers(1, 30).map(lambda d: f"{d}-L"), st.integers(1, 31).map(lambda d: f"{d},L"),
    st.tuples(st.integers(1, 20), st.integers(2, 9)).map(lambda p: f"{p[0]}-L/{p[1]}"))
DOW_EXT = st.one_of(
    st.tuples(st.integers(0, 7), st.integers(1, 5)).map(lambda p: f"{p[0]}#{p[1]}"),
    st.tuples(st.sampled_from(WEEKDAYS), st.integers(1, 5)).map(lambda p: f"{p[0]}#{p[1]}"),
    st.integers(0, 6).map(lambda d: f"L{d}"),
    st.lists(st.integers(0, 6), min_size=2, max_size=3, unique=True).map(lambda v: ",".join(f"L{d}" for d in v)),
    st.tuples(st.integers(0, 6), st.integers(1, 4), st.integers(0, 6)).map(lambda p: f"{p[0]}#{p[1]},L{p[2]}"))


@st.composite
def extended(draw):
    dom, dow = draw(st.sampled_from([("ext", "*"), ("*", "ext"), ("ext", "plain"), ("plain", "ext"), ("ext", "ext")]))
    dom_text = draw(DOM_EXT) if dom == "ext" else draw(PLAIN["dom"]) if dom == "plain" else "*"
    dow_text = draw(DOW_EXT) if dow == "ext" else draw(PLAIN["dow"]) if dow == "plain" else "*"
    minute = draw(st.one_of(st.just("0"), st.just("*/20"), st.integers(0, 59).map(str)))
    hour = draw(st.one_of(st.just("9"), st.just("*/6"), st.integers(0, 23).map(str)))
    month = draw(st.one_of(st.just("*"), PLAIN["month"]))
    seconds = draw(st.one_of(st.just(""), st.just(" 30"), st.just(" */15")))
    return f"{minute} {hour} {dom_text} {month} {dow_text}{seconds}"


@settings(**SETTINGS)
@given(extended(), st.sampled_from(["UTC", "Asia/Tokyo", "America/New_York"]), _instant())
def test_extensions_agree_with_croniter_away_from_dst(expr, tz, after):
    if tz == "America/New_York":  # summer only: no transition between the start and the fires
        after = after.replace(month=5, day=1) + timedelta(days=after.day * 2)
    try:
        schedule = cron(expr, tz=tz)
    except ScheduleError as exc:
        if "never" in str(exc):  # refused because croniter finds no date for it: check that it does not
            try:
                croniter(expr, after, implement_cron_bug=True).get_next(datetime)
            except CroniterBadDateError:
                return
            raise AssertionError(f"{expr!r} refused ({exc}) but croniter finds a date")
        raise
    ours = schedule.next_fire(after)
    assume(not _transition_between(tz, after, ours))
    assert ours == _croniter_next(expr, tz, after), f"cron({expr!r}, {tz!r}).next_fire({after.isoformat()})"
