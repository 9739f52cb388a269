"""Wall-clock times in an IANA zone, resolved to UTC instants.

The only place that knows about gaps (spring forward) and repeated hours (fall
back). Pure: zoneinfo data in, UTC instants out, so every replica computes the
same answers.

A wall time is one of:

* ``exists``: one instant;
* ``repeated``: two instants, first pass (``fold=0``) then second (``fold=1``);
* ``skipped``: no instant; the *gap end* (the transition instant, the first
  instant after the gap) is what a fixed cron job fires at, as in Vixie cron.
"""
from __future__ import annotations

import bisect
from datetime import datetime, timedelta, tzinfo
from enum import Enum
from functools import lru_cache
from typing import List, Tuple
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from .errors import ScheduleError
from .instants import EPOCH, UTC

class WallKind(str, Enum):
    """How a wall time maps to instants in a zone."""

    EXISTS = "exists"
    REPEATED = "repeated"
    SKIPPED = "skipped"


EXISTS, REPEATED, SKIPPED = WallKind.EXISTS, WallKind.REPEATED, WallKind.SKIPPED


@lru_cache(maxsize=None)
def get_zone(name: str) -> tzinfo:
    """The zone for an IANA name; ``ScheduleError`` naming it when unknown."""
    if name.upper() in ("UTC", "Z", "ETC/UTC", "GMT"):
        return UTC
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError, TypeError) as exc:
        raise ScheduleError(f"unknown time zone {name!r}: not an IANA zone name (e.g. 'Europe/London')") from exc


def zone_name(tz: tzinfo) -> str:
    return "UTC" if tz is UTC else getattr(tz, "key", None) or str(tz)


def resolve(tz: tzinfo, wall: datetime) -> Tuple[WallKind, Tuple[datetime, ...]]:
    """Classify naive *wall* in *tz* and give its UTC instant(s).

    For ``skipped`` the single instant returned is the transition (gap end).
    """
    if tz is UTC:
        return EXISTS, (wall.replace(tzinfo=UTC),)
    first = wall.replace(tzinfo=tz, fold=0).astimezone(UTC)
    second = wall.replace(tzinfo=tz, fold=1).astimezone(UTC)
    if first == second:
        return EXISTS, (first,)
    if first < second:
        return REPEATED, (first, second)
    # Gap: fold=1 applies the post-transition offset (earlier instant),
    # fold=0 the pre-transition one (later instant); the transition is between.
    return SKIPPED, (_transition_between(tz, second, first),)


def _transition_between(tz: tzinfo, lo: datetime, hi: datetime) -> datetime:
    """First instant in (lo, hi] whose UTC offset differs from lo's (binary search on seconds)."""
    before = lo.astimezone(tz).utcoffset()
    lo_s = int((lo - EPOCH).total_seconds())
    hi_s = int((hi - EPOCH).total_seconds())
    while hi_s - lo_s > 1:
        mid = (lo_s + hi_s) // 2
        if (EPOCH + timedelta(seconds=mid)).astimezone(tz).utcoffset() == before:
            lo_s = mid
        else:
            hi_s = mid
    return EPOCH + timedelta(seconds=hi_s)


@lru_cache(maxsize=4096)
def _year_transitions(tz: tzinfo, year: int) -> Tuple[datetime, ...]:
    """UTC instants in *year* where *tz*'s offset changes, found by probing every 12 hours.

    Real transitions are weeks apart at the least, so a 12-hour probe cannot
    step over two of them.
    """
    step = timedelta(hours=12)
    start = datetime(year, 1, 1, tzinfo=UTC) - step
    end = datetime(year + 1, 1, 1, tzinfo=UTC)
    found: List[datetime] = []
    t = start
    prev = t.astimezone(tz).utcoffset()
    while t < end:
        nxt = t + step
        off = nxt.astimezone(tz).utcoffset()
        if off != prev:
            found.append(_transition_between(tz, t, nxt))
            prev = off
        t = nxt
    return tuple(x for x in found if x.year == year)


def has_transition(tz: tzinfo, lo: datetime, hi: datetime) -> bool:
    """Whether *tz* changes offset at some instant in (lo, hi]."""
    if tz is UTC:
        return False
    for year in range(lo.year, hi.year + 1):
        trans = _year_transitions(tz, year)
        if not trans:
            continue
        i = bisect.bisect_right(trans, lo)
        if i < len(trans) and trans[i] <= hi:
            return True
    return False
