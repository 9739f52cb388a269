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

:class:`ExtendedCronTimes` adds the extensions (:func:`cron_times` picks it):
a day selector (``L``, ``W``, ``#``) asked day by day, and a seconds field, for
which a wall *minute* is resolved once and its seconds follow it (a wall minute
is skipped, repeated or plain as a whole, except in the rare zone whose
transition is not on a whole minute, resolved second by second).
"""
from __future__ import annotations

import bisect
import calendar
from datetime import date, datetime, timedelta, tzinfo
from typing import Dict, Iterator, List, Optional, Tuple

from .cronexpr import CronSpec, DayRule
from .errors import ScheduleError
from .tzwall import EXISTS, REPEATED, has_transition, resolve

_SECOND = timedelta(seconds=1)
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



#: One wall minute's fire instants: (first instant, the seconds after it), or (instant, None) for one instant.
_Block = Tuple[datetime, Optional[Tuple[int, ...]]]


class ExtendedCronTimes(CronTimes):
    """Fire instants of a spec with a day selector and/or a seconds field (same DST rules)."""

    __slots__ = ("_blocks",)

    def __init__(self, spec: CronSpec, tz: tzinfo) -> None:
        super().__init__(spec, tz)
        if spec.selector is not None:
            self._dom_only_days = None  # the selector decides, day by day
        self._blocks: Dict[date, List[_Block]] = {}

    def _day_ok(self, d: date) -> bool:
        selector = self.spec.selector
        if selector is None:
            return super()._day_ok(d)
        return selector.matches(d.year, d.month, d.day, (d.weekday() + 1) % 7)

    def next_wall(self, naive: datetime) -> datetime:
        """First matching wall time strictly after *naive* (second resolution with a seconds field)."""
        seconds = self.spec.seconds
        if seconds is None:
            return super().next_wall(naive)
        t = naive.replace(microsecond=0) + _SECOND
        hours, minutes = self.spec.hours, self.spec.minutes
        first_day = t.date()
        for d in self._matching_days(first_day):
            if d == first_day:
                for h in hours[bisect.bisect_left(hours, t.hour):]:
                    if h > t.hour:
                        return datetime(d.year, d.month, d.day, h, minutes[0], seconds[0])
                    for m in minutes[bisect.bisect_left(minutes, t.minute):]:
                        if m > t.minute:
                            return datetime(d.year, d.month, d.day, h, m, seconds[0])
                        k = bisect.bisect_left(seconds, t.second)
                        if k < len(seconds):
                            return datetime(d.year, d.month, d.day, h, m, seconds[k])
                continue
            return datetime(d.year, d.month, d.day, hours[0], minutes[0], seconds[0])
        raise AssertionError("unreachable")  # pragma: no cover

    def _next_near_transition(self, after: datetime, local_day: date) -> datetime:
        if self.spec.seconds is None:
            return super()._next_near_transition(after, local_day)
        for d in self._matching_days(local_day - _DAY):
            best = None
            for start, seconds in self._day_blocks(d):
                if seconds is None:
                    candidate = start if start > after else None
                else:
                    k = bisect.bisect_right(seconds, (after - start).total_seconds())
                    candidate = start + timedelta(seconds=seconds[k]) if k < len(seconds) else None
                if candidate is not None and (best is None or candidate < best):
                    best = candidate
            if best is not None:
                return best
        raise AssertionError("unreachable")  # pragma: no cover

    def _day_blocks(self, d: date) -> List[_Block]:
        """The fire instants of day *d*, a block per wall minute (cached: a walk asks for the same days)."""
        blocks = self._blocks.get(d)
        if blocks is None:
            if len(self._blocks) > 8:
                self._blocks.clear()
            blocks = self._blocks[d] = self._compute_blocks(d)
        return blocks

    def _compute_blocks(self, d: date) -> List[_Block]:
        wildcard, tz, seconds = self.spec.wildcard, self.tz, self.spec.seconds
        assert seconds is not None
        out: List[_Block] = []
        for h in self.spec.hours:
            for m in self.spec.minutes:
                wall = datetime(d.year, d.month, d.day, h, m)
                kind, instants = resolve(tz, wall)
                end_kind, end_instants = resolve(tz, wall + timedelta(seconds=59))
                same = kind == end_kind and (kind not in (EXISTS, REPEATED) or all(
                    b - a == timedelta(seconds=59) for a, b in zip(instants, end_instants)))
                if not same:  # a transition inside this wall minute: second by second
                    for s in seconds:
                        out.extend((t, None) for t in self._wall_instants(wall.replace(second=s)))
                elif kind == EXISTS or (kind == REPEATED and not wildcard):
                    out.append((instants[0], seconds))
                elif kind == REPEATED:
                    out.extend((t, seconds) for t in instants)
                elif not wildcard:  # skipped wall minute of a fixed job: once, at the gap end
                    out.append((instants[0], None))
        return out

    def _wall_instants(self, wall: datetime) -> List[datetime]:
        kind, instants = resolve(self.tz, wall)
        if kind == EXISTS or (kind == REPEATED and not self.spec.wildcard):
            return [instants[0]]
        if kind == REPEATED:
            return list(instants)
        return [] if self.spec.wildcard else [instants[0]]


def cron_times(spec: CronSpec, tz: tzinfo) -> CronTimes:
    """The calculator for *spec* in *tz*: plain Vixie specs keep :class:`CronTimes` as it was."""
    if spec.selector is None and spec.seconds is None:
        return CronTimes(spec, tz)
    return ExtendedCronTimes(spec, tz)
