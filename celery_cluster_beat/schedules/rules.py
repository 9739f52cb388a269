"""The schedule rules themselves: when a cron expression or an interval fires.

Pure: no Celery, no I/O. A rule answers ``next_fire(after)`` with an aware UTC
instant that every replica computes alike. Where a rule has no zone of its own
it asks :meth:`ScheduleRule._fallback_zone`, which is UTC here and the Celery
app's ``timezone`` in :mod:`.celery_types`, where the public ``cron`` and
``every`` add Celery's ``BaseSchedule`` face to these rules.
"""
from __future__ import annotations

from datetime import datetime, timedelta, tzinfo
from functools import lru_cache
from typing import Any, List, Optional, Tuple, Union

from .cronexpr import CronSpec, DayRule, parse_cron
from .crontimes import CronTimes, cron_times
from .errors import ScheduleError
from .instants import UTC, require_aware
from .intervals import baseline_next, epoch_next, interval_micros, parse_baseline
from .tzwall import get_zone, resolve, zone_name

__all__ = ["ScheduleRule", "CronRule", "EveryRule", "AtRule", "Interval", "parse_instant"]

Interval = Union[int, float, timedelta]


@lru_cache(maxsize=4096)
def _parse(expr: str) -> CronSpec:
    return parse_cron(expr)


@lru_cache(maxsize=16384)
def _cron_times(spec: CronSpec, tz: tzinfo) -> CronTimes:
    # Many entries share an expression: one calculator per (spec, zone).
    return cron_times(spec, tz)


def _zone_name(what: str, tz: Any) -> Optional[str]:
    """The IANA name of *tz* (a name or a tzinfo), checked; ScheduleError naming *what*."""
    if tz is None:
        return None
    name = tz if isinstance(tz, str) else zone_name(tz)
    try:
        get_zone(name)
    except ScheduleError as exc:
        raise ScheduleError(f"{what}: {exc}") from None
    return name


class ScheduleRule:
    """Fire instants in UTC, equality by value (two replicas' rules compare equal)."""

    tz_name: Optional[str]
    #: At most one instant (a one-off): it has no previous run to guard against.
    once = False

    def _zone(self) -> tzinfo:
        if self.tz_name is not None:
            return get_zone(self.tz_name)
        return self._fallback_zone()

    def _fallback_zone(self) -> tzinfo:
        """The zone of a rule that names none."""
        return UTC

    def next_fire(self, after: datetime) -> Optional[datetime]:  # pragma: no cover - abstract
        """First instant strictly after *after*, aware UTC; None when the rule has no further
        instant (a one-off that fired, a bounded rule past its end): every caller handles None."""
        raise NotImplementedError

    def fires_key(self) -> Tuple:
        """Equal for two rules that fire at the same instants: the rule and the zone it runs in
        (a rule without a zone runs in its app's). Lets a caller compute one next fire for
        thousands of entries sharing a rule."""
        return (self, self._zone())

    def fires_between(self, start: datetime, end: datetime, limit: Optional[int] = None) -> List[datetime]:
        """Scheduled instants in (start, end], oldest first; at most *limit* of them."""
        t = require_aware(start, "start")
        end = require_aware(end, "end")
        out: List[datetime] = []
        while limit is None or len(out) < limit:
            nxt = self.next_fire(t)
            if nxt is None or nxt > end:
                break
            t = nxt
            out.append(t)
        return out

    def _key(self) -> Tuple:  # pragma: no cover - abstract
        raise NotImplementedError

    def __eq__(self, other: Any) -> bool:
        if type(other) is type(self):
            return self._key() == other._key()
        return NotImplemented

    def __ne__(self, other: Any) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    def __hash__(self) -> int:
        return hash((type(self).__name__,) + self._key())


class CronRule(ScheduleRule):
    """A 5-field cron expression with Vixie semantics in an IANA zone (plus croniter's
    extensions: ``L``, ``W``, ``#``, wrapping ranges, a sixth seconds field; see :mod:`.cronexpr`).

    Invalid input raises :class:`ScheduleError` at construction, so a bad entry
    is reported at start-up rather than at its first fire.
    """

    def __init__(self, expr: str, tz: Any = None, *, _spec: Optional[CronSpec] = None) -> None:
        if _spec is None and not isinstance(expr, str):  # before the cache: a list is not even hashable
            raise ScheduleError(f"cron {expr!r}: expected the expression as text, got {type(expr).__name__}")
        self.spec = _spec if _spec is not None else _parse(expr)
        self.expr = expr
        self.tz_name = _zone_name(f"cron {expr!r}", tz)

    def next_fire(self, after: datetime) -> datetime:
        """First scheduled instant strictly after *after* (aware), as aware UTC."""
        return _cron_times(self.spec, self._zone()).next_after(require_aware(after))

    def _key(self) -> Tuple:
        return (self.spec, self.tz_name)

    def _rebuild_args(self) -> Tuple:
        """What pickling needs to build an equal rule (the spec only when the text cannot give it)."""
        if self.spec.text == self.expr and self.spec.day_rule == DayRule.VIXIE:
            return (self.expr, self.tz_name)
        return (self.expr, self.tz_name, self.spec)

    def __repr__(self) -> str:
        return f"<cron {self.expr!r}{' tz=' + self.tz_name if self.tz_name else ''}>"


class EveryRule(ScheduleRule):
    """A fixed interval on a grid every replica computes alike.

    Without *baseline*: the instants ``k * interval`` since 1970-01-01T00:00Z
    (unlike Celery's ``schedule``, which counts from the last run and so
    differs per process). With ``baseline="HH:MM"``: anchored at that wall time
    in *tz* every day, then every *interval* of elapsed time until the next
    day's anchor.
    """

    def __init__(self, interval: Interval, *, baseline: Optional[str] = None, tz: Any = None) -> None:
        what = f"every({interval!r})"
        self.step_us = interval_micros(interval, what)
        self.interval = timedelta(microseconds=self.step_us)
        self.baseline = baseline
        self._baseline_time = parse_baseline(baseline, what) if baseline is not None else None
        self.tz_name = _zone_name(what, tz)

    @property
    def run_every(self) -> timedelta:
        return self.interval

    def next_fire(self, after: datetime) -> datetime:
        """First scheduled instant strictly after *after* (aware), as aware UTC."""
        after = require_aware(after)
        if self._baseline_time is None:
            return epoch_next(self.step_us, after)
        return baseline_next(self.step_us, self._zone(), self._baseline_time, after)

    def _key(self) -> Tuple:
        return (self.step_us, self.baseline, self.tz_name if self.baseline else None)

    def __repr__(self) -> str:
        seconds = self.step_us / 1_000_000
        text = f"{seconds:g}s"
        if self.baseline:
            text += f" from {self.baseline}" + (f" {self.tz_name}" if self.tz_name else "")
        return f"<every {text}>"


def parse_instant(value: Any, what: str, *, naive_ok: bool = False) -> datetime:
    """*value* (a datetime, or ISO-8601 text such as ``2026-12-07T15:00:00Z``) as a datetime:
    aware UTC, or, with *naive_ok*, naive when it names no offset (a wall time). Anything else
    is a :class:`ScheduleError` naming *what* (if not empty): a naive value is refused unless
    *naive_ok*, because whether it meant UTC or some zone's wall time cannot be guessed."""
    lead = f"{what}: " if what else ""
    if isinstance(value, str):
        text = value.strip()
        if text[-1:] in ("Z", "z"):
            text = text[:-1] + "+00:00"
        try:
            value = datetime.fromisoformat(text)
        except ValueError:
            raise ScheduleError(f"{lead}{value!r} is not an ISO-8601 date and time "
                                "(e.g. '2026-12-07T15:00:00Z' or '2026-12-07T16:00:00+01:00')") from None
    elif not isinstance(value, datetime):
        raise ScheduleError(f"{lead}expected a datetime or ISO-8601 text, got {type(value).__name__}")
    if value.tzinfo is None or value.utcoffset() is None:
        if naive_ok:
            return value.replace(tzinfo=None)
        raise ScheduleError(f"{lead}{value.isoformat()} is a naive datetime: give its offset "
                            "(e.g. '+00:00' or 'Z', or an aware datetime)")
    return value.astimezone(UTC)


class AtRule(ScheduleRule):
    """One instant: fires once, then has no further instant (``next_fire`` gives None).

    *when* aware (or ISO text with an offset or ``Z``): that instant, whatever *tz* says. Naive
    (or ISO text without an offset): a wall time in *tz*, or without one in the app's zone, as
    ``cron`` reads its fields; a wall time in a spring-forward gap fires at the gap's end, one in
    a repeated hour in its first pass: the rule of a fixed cron time, so ``at`` and ``cron`` agree.
    """

    once = True

    def __init__(self, when: Any, tz: Any = None) -> None:
        what = f"at({when!r})"
        value = parse_instant(when, what, naive_ok=True)
        if value.tzinfo is None:
            self.instant: Optional[datetime] = None
            self.wall: Optional[datetime] = value
            self.tz_name = _zone_name(what, tz)
        else:
            _zone_name(what, tz)  # checked all the same: a zone that does not exist is a mistake
            self.instant, self.wall = value, None
            self.tz_name = None  # an exact instant: no zone reads it

    def fire_at(self) -> datetime:
        """The one instant, aware UTC (a wall time resolved in its zone now: zone data decide)."""
        if self.instant is not None:
            return self.instant
        return resolve(self._zone(), self.wall)[1][0]

    def next_fire(self, after: datetime) -> Optional[datetime]:
        at = self.fire_at()
        return at if at > require_aware(after) else None

    def _key(self) -> Tuple:
        return (self.instant, self.wall, self.tz_name)

    def __repr__(self) -> str:
        if self.instant is not None:
            return f"<at {self.instant.isoformat()}>"
        return f"<at {self.wall.isoformat()}{' tz=' + self.tz_name if self.tz_name else ''}>"
