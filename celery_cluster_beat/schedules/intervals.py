"""Fire instants of fixed intervals: the epoch grid and the daily baseline grid.

Integer microseconds throughout, so a float interval such as 2.5 s lands on
the same instants on every host (no float drift, no dependency on when a
process started).
"""
from __future__ import annotations

import re
from datetime import date, datetime, time, timedelta, tzinfo
from .errors import ScheduleError
from .instants import EPOCH
from .tzwall import resolve

_DAY = timedelta(days=1)
_BASELINE = re.compile(r"^([01]\d|2[0-3]):([0-5]\d)$")


def interval_micros(interval: object, what: str = "every") -> int:
    """The interval as whole microseconds (at least one second)."""
    if isinstance(interval, timedelta):
        micros = interval // timedelta(microseconds=1)
    elif isinstance(interval, bool) or not isinstance(interval, (int, float)):
        raise ScheduleError(f"{what}: interval {interval!r} is not a number of seconds or a timedelta")
    else:
        if interval != interval or interval in (float("inf"), float("-inf")):
            raise ScheduleError(f"{what}: interval {interval!r} is not a finite number")
        micros = round(interval * 1_000_000)
    if micros < 1_000_000:
        raise ScheduleError(f"{what}: interval {interval!r} is under the 1 second minimum")
    return micros


def parse_baseline(text: object, what: str = "every") -> time:
    if not isinstance(text, str) or not _BASELINE.match(text):
        raise ScheduleError(f"{what}: baseline {text!r} is not a time of day HH:MM between 00:00 and 23:59")
    return time(int(text[:2]), int(text[3:]))


def _micros(at: datetime) -> int:
    delta = at - EPOCH
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def _from_micros(us: int) -> datetime:
    return EPOCH + timedelta(microseconds=us)


def epoch_next(step_us: int, after: datetime) -> datetime:
    """First instant ``k * step`` since the Unix epoch strictly after *after*."""
    return _from_micros((_micros(after) // step_us + 1) * step_us)


def anchor(tz: tzinfo, day: date, at: time) -> datetime:
    """The day's baseline instant, resolved like a fixed cron time.

    A baseline in a gap fires at the gap end; in a repeated hour, in the first
    pass: the same rule as ``cron('MM HH * * *')`` so the two never disagree.
    """
    return resolve(tz, datetime.combine(day, at))[1][0]


def baseline_next(step_us: int, tz: tzinfo, at: time, after: datetime) -> datetime:
    """Next slot of "every *step* from *at* each day" strictly after *after*.

    Slots run from the day's anchor in elapsed time; a slot at or after the
    next day's anchor is dropped, because that anchor re-aligns the grid.
    """
    day = after.astimezone(tz).date()
    start = anchor(tz, day, at)
    while start > after:  # after falls before today's anchor: yesterday's grid applies
        day -= _DAY
        start = anchor(tz, day, at)
    while True:
        nxt_anchor = anchor(tz, day + _DAY, at)
        k = (_micros(after) - _micros(start)) // step_us + 1
        slot = _from_micros(_micros(start) + k * step_us)
        if slot < nxt_anchor:
            return slot
        if nxt_anchor > after:
            return nxt_anchor
        day += _DAY
        start = nxt_anchor
