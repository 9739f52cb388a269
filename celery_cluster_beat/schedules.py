"""Public schedule objects: :class:`cron` and :class:`every`.

They speak two languages: ours (``next_fire`` / ``fires_between``, UTC
instants every replica agrees on) and Celery's ``BaseSchedule`` (``is_due`` /
``remaining_estimate``), so the same object also works in a ``beat_schedule``
under stock Celery beat.
"""
from __future__ import annotations

from datetime import datetime, timedelta, tzinfo
from functools import lru_cache
from typing import Any, List, Optional, Tuple, Union

from celery import schedules as celery_schedules

from .cronexpr import CronSpec, parse_cron, spec_from_sets
from .crontimes import CronTimes, ensure_aware
from .errors import ScheduleError
from .intervals import baseline_next, epoch_next, interval_micros, parse_baseline
from .tzwall import UTC, get_zone, zone_name

__all__ = ["cron", "every", "ClusterSchedule", "as_schedule"]

Interval = Union[int, float, timedelta]


@lru_cache(maxsize=4096)
def _parse(expr: str) -> CronSpec:
    return parse_cron(expr)


@lru_cache(maxsize=16384)
def _cron_times(spec: CronSpec, tz: tzinfo) -> CronTimes:
    # Many entries share an expression: one calculator per (spec, zone).
    return CronTimes(spec, tz)


def _zone(what: str, name: Optional[str]) -> Optional[tzinfo]:
    if name is None:
        return None
    if not isinstance(name, str):
        name = zone_name(name)
    try:
        return get_zone(name)
    except ScheduleError as exc:
        raise ScheduleError(f"{what}: {exc}") from None


class ClusterSchedule(celery_schedules.BaseSchedule):
    """Common behaviour: fire instants in UTC plus Celery's ``BaseSchedule`` interface."""

    tz_name: Optional[str]

    def _zone(self) -> tzinfo:
        """Explicit zone, else the Celery app's ``timezone`` setting, else UTC."""
        if self.tz_name is not None:
            return get_zone(self.tz_name)
        app = self._app
        if app is None:  # follows whichever app is current: resolve every time
            try:
                return self._app_zone(self.app)
            except Exception:  # no current app: UTC, as documented
                return UTC
        cached = getattr(self, "_zone_cache", None)
        if cached is None or cached[0] is not app:  # bound app: read its config once, not per call
            cached = self._zone_cache = (app, self._app_zone(app))
        return cached[1]

    @staticmethod
    def _app_zone(app) -> tzinfo:
        name = app.conf.timezone
        return get_zone(name if isinstance(name, str) else zone_name(name)) if name else UTC

    def next_fire(self, after: datetime) -> datetime:  # pragma: no cover - abstract
        raise NotImplementedError

    def fires_between(self, start: datetime, end: datetime, limit: Optional[int] = None) -> List[datetime]:
        """Scheduled instants in (start, end], oldest first; at most *limit* of them."""
        t = ensure_aware(start, "start")
        end = ensure_aware(end, "end")
        out: List[datetime] = []
        while limit is None or len(out) < limit:
            t = self.next_fire(t)
            if t > end:
                break
            out.append(t)
        return out

    # -- Celery's BaseSchedule interface ---------------------------------------
    def _aware(self, dt: datetime) -> datetime:
        if dt.tzinfo is None:
            dt = self.maybe_make_aware(dt)
        return dt.astimezone(UTC)

    def remaining_estimate(self, last_run_at: datetime) -> timedelta:
        now = self._aware(self.now())
        return self.next_fire(self._aware(last_run_at)) - now

    def is_due(self, last_run_at: datetime) -> celery_schedules.schedstate:
        now = self._aware(self.now())
        due = self.next_fire(self._aware(last_run_at)) <= now
        return celery_schedules.schedstate(due, (self.next_fire(now) - now).total_seconds())

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


class cron(ClusterSchedule):
    """A 5-field cron expression with Vixie semantics in an IANA zone.

    ``tz=None`` follows the Celery app's ``timezone`` (UTC when unset).
    Invalid input raises :class:`ScheduleError` here, at construction, so a
    bad entry is reported at start-up rather than at its first fire.
    """

    def __init__(self, expr: str, tz: Optional[str] = None, *, nowfun=None, app=None, _spec: Optional[CronSpec] = None):
        super().__init__(nowfun=nowfun, app=app)
        self.spec = _spec if _spec is not None else _parse(expr)
        self.expr = expr
        _zone(f"cron {expr!r}", tz)
        self.tz_name = tz if tz is None or isinstance(tz, str) else zone_name(tz)

    def next_fire(self, after: datetime) -> datetime:
        """First scheduled instant strictly after *after* (aware), as aware UTC."""
        return _cron_times(self.spec, self._zone()).next_after(ensure_aware(after))

    def _key(self) -> Tuple:
        return (self.spec, self.tz_name)

    def __reduce__(self):
        if self.spec.text == self.expr and self.spec.day_rule == "vixie":
            return (_rebuild_cron, (self.expr, self.tz_name))
        return (_rebuild_cron, (self.expr, self.tz_name, self.spec))

    def __repr__(self) -> str:
        return f"<cron {self.expr!r}{' tz=' + self.tz_name if self.tz_name else ''}>"

    @classmethod
    def from_crontab(cls, c: celery_schedules.crontab, app=None) -> "cron":
        """Convert Celery's crontab, keeping its field sets and its AND day rule."""
        label = "crontab({})".format(
            ", ".join(
                f"{k}={getattr(c, '_orig_' + k)!r}"
                for k in ("minute", "hour", "day_of_week", "day_of_month", "month_of_year")
            )
        )
        wildcard = any(str(getattr(c, "_orig_" + k)).startswith("*") for k in ("minute", "hour"))
        spec = spec_from_sets(
            label, c.minute, c.hour, c.day_of_month, c.month_of_year, c.day_of_week, wildcard=wildcard
        )
        tz = c.__dict__.get("tz")
        return cls(label, tz=zone_name(tz) if tz is not None else None, app=app, _spec=spec)


def _rebuild_cron(expr: str, tz: Optional[str], spec: Optional[CronSpec] = None) -> cron:
    return cron(expr, tz, _spec=spec)


class every(ClusterSchedule):
    """A fixed interval on a grid every replica computes alike.

    Without *baseline*: the instants ``k * interval`` since 1970-01-01T00:00Z
    (unlike Celery's ``schedule``, which counts from the last run and so
    differs per process). With ``baseline="HH:MM"``: anchored at that wall time
    in *tz* every day, then every *interval* of elapsed time until the next
    day's anchor.
    """

    def __init__(
        self,
        interval: Interval,
        *,
        baseline: Optional[str] = None,
        tz: Optional[str] = None,
        nowfun=None,
        app=None,
    ):
        super().__init__(nowfun=nowfun, app=app)
        what = f"every({interval!r})"
        self.step_us = interval_micros(interval, what)
        self.interval = timedelta(microseconds=self.step_us)
        self.baseline = baseline
        self._baseline_time = parse_baseline(baseline, what) if baseline is not None else None
        _zone(what, tz)
        self.tz_name = tz if tz is None or isinstance(tz, str) else zone_name(tz)

    @property
    def run_every(self) -> timedelta:
        return self.interval

    def next_fire(self, after: datetime) -> datetime:
        """First scheduled instant strictly after *after* (aware), as aware UTC."""
        after = ensure_aware(after)
        if self._baseline_time is None:
            return epoch_next(self.step_us, after)
        return baseline_next(self.step_us, self._zone(), self._baseline_time, after)

    def _key(self) -> Tuple:
        return (self.step_us, self.baseline, self.tz_name if self.baseline else None)

    def __reduce__(self):
        return (_rebuild_every, (self.step_us, self.baseline, self.tz_name))

    def __repr__(self) -> str:
        seconds = self.step_us / 1_000_000
        text = f"{seconds:g}s"
        if self.baseline:
            text += f" from {self.baseline}" + (f" {self.tz_name}" if self.tz_name else "")
        return f"<every {text}>"


def _rebuild_every(step_us: int, baseline: Optional[str], tz: Optional[str]) -> every:
    return every(timedelta(microseconds=step_us), baseline=baseline, tz=tz)


def as_schedule(value: Any, app=None) -> ClusterSchedule:
    """Our schedule for a ``beat_schedule`` value (ours or Celery's).

    * ``crontab`` keeps its field sets and Celery's AND rule for the two day
      fields, in the crontab's own zone (``c.tz``) or the app's;
    * ``schedule``, ``timedelta`` and plain seconds become :class:`every` on the
      epoch grid (Celery counts from the last run; we do not);
    * a string is read as a cron expression in the app's zone.
    """
    if isinstance(value, ClusterSchedule):
        if app is not None and value._app is None:
            value.app = app
        return value
    if isinstance(value, str):  # a cron expression written as text: checked here, field by field
        return cron(value, app=app)
    if isinstance(value, celery_schedules.crontab):
        return cron.from_crontab(value, app=app)
    if isinstance(value, celery_schedules.schedule) and type(value) is celery_schedules.schedule:
        return every(value.run_every, app=app)
    if isinstance(value, timedelta) or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        return every(value, app=app)
    raise ScheduleError(
        f"schedule {value!r} is not supported: use cron(), every(), a cron expression string, "
        "celery's crontab or schedule, a timedelta or a number of seconds"
    )
