"""Next fire instants of a cron spec in a time zone, with Vixie's DST rules.

Pure arithmetic. The common case (no offset change between *after* and the
answer) jumps straight to the next matching wall time with bisection over the
sorted field values: no minute-by-minute walk. Only when a transition lies in
that span do we fall back to resolving each candidate wall time of the days
around it, which is where the gap/repeated-hour rules apply:

* fixed job (neither minute nor hour field starts with ``*``): a skipped wall
  time fires once at the gap end; a repeated one fires in the first pass only;
* wildcard job: fires at the wall times that exist, in both passes of a
  repeated hour; skipped wall times are not made up.
"""
from __future__ import annotations

import bisect
import calendar
from datetime import date, datetime, timedelta, tzinfo
from typing import Iterator, List

from .cronexpr import CronSpec, DayRule
from .errors import ScheduleError
from .tzwall import EXISTS, REPEATED, has_transition, resolve

_MINUTE = timedelta(minutes=1)
_DAY = timedelta(days=1)
_MAX_YEARS = 400  # the Gregorian calendar repeats after 400 years


class CronTimes:
    """Computes fire instants for one (spec, zone); cache and share it between entries."""

    __slots__ = ("spec", "tz", "_dom_only_days")

    def __init__(self, spec: CronSpec, tz: tzinfo) -> None:
        self.spec = spec
        self.tz = tz
        every_weekday = len(spec.weekdays) == 7
        dom_decides = every_weekday and (spec.dow_star or spec.dom_star or spec.day_rule == DayRule.AND)
        self._dom_only_days = tuple(sorted(spec.days)) if dom_decides else None

    # -- calendar (naive wall times, no zone) --------------------------------
    def _day_ok(self, d: date) -> bool:
        return self.spec.day_matches(d.day, (d.weekday() + 1) % 7)

    def _matching_days(self, d: date) -> Iterator[date]:
        """Matching dates from *d* on, jumping over months not in the spec."""
        months = self.spec.months
        days = self._dom_only_days
        limit = min(d.year + _MAX_YEARS, 9998)
        while d.year <= limit:
            if d.month not in months:
                i = bisect.bisect_right(months, d.month)
                d = date(d.year, months[i], 1) if i < len(months) else date(d.year + 1, months[0], 1)
                continue
            if days is not None:  # only day-of-month decides: jump to the next listed day
                i = bisect.bisect_left(days, d.day)
                if i < len(days) and days[i] <= calendar.monthrange(d.year, d.month)[1]:
                    d = d.replace(day=days[i])
                    yield d
                    d += _DAY
                else:
                    d = date(d.year, d.month, 1) + timedelta(days=32)
                    d = d.replace(day=1)
                continue
            if self._day_ok(d):
                yield d
            d += _DAY
        raise ScheduleError(f"cron {self.spec.text!r}: no matching day within {_MAX_YEARS} years")

    def next_wall(self, naive: datetime) -> datetime:
        """First matching wall time strictly after naive *naive* (minute resolution)."""
        t = naive.replace(second=0, microsecond=0) + _MINUTE
        hours, minutes = self.spec.hours, self.spec.minutes
        first_day = t.date()
        for d in self._matching_days(first_day):
            if d == first_day:
                i = bisect.bisect_left(hours, t.hour)
                if i < len(hours):
                    if hours[i] == t.hour:
                        j = bisect.bisect_left(minutes, t.minute)
                        if j < len(minutes):
                            return datetime(d.year, d.month, d.day, hours[i], minutes[j])
                        i += 1
                    if i < len(hours):
                        return datetime(d.year, d.month, d.day, hours[i], minutes[0])
                continue
            return datetime(d.year, d.month, d.day, hours[0], minutes[0])
        raise AssertionError("unreachable")  # pragma: no cover

    # -- instants --------------------------------------------------------------
    def next_after(self, after: datetime) -> datetime:
        """First fire instant strictly after aware *after*, as aware UTC."""
        tz = self.tz
        local = after.astimezone(tz)
        wall = self.next_wall(local.replace(tzinfo=None))
        kind, instants = resolve(tz, wall)
        if kind in (EXISTS, REPEATED):
            candidate = instants[0]
            if candidate > after and not has_transition(tz, after, candidate):
                return candidate
        return self._next_near_transition(after, local.date())

    def _day_instants(self, d: date) -> List[datetime]:
        wildcard = self.spec.wildcard
        out = set()
        for h in self.spec.hours:
            for m in self.spec.minutes:
                kind, instants = resolve(self.tz, datetime(d.year, d.month, d.day, h, m))
                if kind == EXISTS or (kind == REPEATED and not wildcard):
                    out.add(instants[0])
                elif kind == REPEATED:
                    out.update(instants)
                elif not wildcard:  # skipped wall time of a fixed job: once, at the gap end
                    out.add(instants[0])
        return sorted(out)

    def _next_near_transition(self, after: datetime, local_day: date) -> datetime:
        for d in self._matching_days(local_day - _DAY):
            later = [t for t in self._day_instants(d) if t > after]
            if later:
                return later[0]
        raise AssertionError("unreachable")  # pragma: no cover

