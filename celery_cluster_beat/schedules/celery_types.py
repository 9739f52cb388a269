"""Celery's side of the schedules: ``cron`` and ``every`` as Celery schedules,
and conversion of Celery's own schedule types.

The only module of :mod:`celery_cluster_beat.schedules` that imports Celery.
The rules (:mod:`.rules`) decide when a schedule fires; this adds Celery's
``BaseSchedule`` interface (``is_due`` / ``remaining_estimate``), so the same
object also works in a ``beat_schedule`` under stock Celery beat, and makes a
rule without a zone follow the Celery app's ``timezone``.
"""
from __future__ import annotations

import weakref
from datetime import datetime, timedelta, tzinfo
from typing import Any, Optional

from celery import schedules as celery_schedules

from .bounds import BoundedRule
from .cronexpr import CronSpec, spec_from_sets
from .errors import ScheduleError
from .instants import UTC
from .rules import AtRule, CronRule, EveryRule, Interval, ScheduleRule
from .tzwall import get_zone, zone_name

__all__ = ["cron", "every", "at", "bounded", "ClusterSchedule", "as_schedule", "app_zone", "local_zone"]

#: What Celery's ``is_due`` says of a rule with no further instant: not due, look again in a day
#: (stock Celery beat keeps the entry; our scheduler drops it).
_ENDED_RECHECK = 86400.0

#: The zone of each app that schedules were bound to, read from its configuration at first use.
_APP_ZONES: "weakref.WeakKeyDictionary[Any, tzinfo]" = weakref.WeakKeyDictionary()


def app_zone(app: Any) -> tzinfo:
    """The zone of a Celery app's ``timezone`` setting, as Celery reads it.

    Unset, it is UTC, unless ``enable_utc`` is False: then it is the server's local
    zone (:func:`local_zone`), as Celery's ``app.timezone`` has it.
    """
    conf = app.conf
    name = conf.timezone
    if name:
        return get_zone(name if isinstance(name, str) else zone_name(name))
    if not getattr(conf, "enable_utc", True):  # Celery's rule: any false value
        return local_zone()
    return UTC


def local_zone() -> tzinfo:
    """The server's local zone as an IANA zone, found as Celery finds it (``celery.utils.time.timezone.local``:
    ``tzlocal`` reads the ``TZ`` variable, then ``/etc/timezone``, ``/etc/localtime``...).

    Replicas must compute the same instants, so a local zone without an IANA name (a POSIX
    ``TZ`` rule such as ``<+03>-3``, a copied ``/etc/localtime``) is a :class:`ScheduleError`
    asking for the ``timezone`` setting, never a guessed fixed offset.
    """
    from celery.utils.time import timezone as celery_zones

    zone = celery_zones.local  # Celery logs why when it cannot find one
    key = getattr(zone, "key", None)
    if not key:
        raise ScheduleError(f"enable_utc=False without a timezone means the server's local zone, which has no "
                            f"IANA name here ({zone!r}): set timezone (e.g. 'Europe/London')")
    return get_zone(key)


class ClusterSchedule(ScheduleRule, celery_schedules.BaseSchedule):
    """A rule that is also a Celery ``BaseSchedule``; without a zone of its own it
    follows the app's ``timezone`` (UTC when unset; the local zone with ``enable_utc=False``)."""

    def _fallback_zone(self) -> tzinfo:
        app = self._app
        if app is None:  # follows whichever app is current: resolve every time
            try:
                return app_zone(self.app)
            except ScheduleError:  # a zone the app names but we cannot use: never UTC in its place
                raise
            except Exception:  # no current app: UTC, as documented
                return UTC
        cached = getattr(self, "_zone_cache", None)
        if cached is None or cached[0] is not app:  # bound app: read its config once, not per call
            try:
                zone = _APP_ZONES.get(app)
                if zone is None:  # once per app, as Celery's own app.timezone: 20,000 entries, one read
                    zone = _APP_ZONES[app] = app_zone(app)
            except TypeError:  # an app object that cannot be weakly referenced: once per schedule
                zone = app_zone(app)
            cached = self._zone_cache = (app, zone)
        return cached[1]

    # -- Celery's BaseSchedule interface ---------------------------------------
    def _aware(self, dt: datetime) -> datetime:
        if dt.tzinfo is None:
            dt = self.maybe_make_aware(dt)
        return dt.astimezone(UTC)

    def remaining_estimate(self, last_run_at: datetime) -> timedelta:
        now = self._aware(self.now())
        nxt = self.next_fire(self._aware(last_run_at))
        return timedelta(seconds=_ENDED_RECHECK) if nxt is None else nxt - now

    def is_due(self, last_run_at: datetime) -> celery_schedules.schedstate:
        now = self._aware(self.now())
        nxt = self.next_fire(self._aware(last_run_at))
        due = nxt is not None and nxt <= now
        after = self.next_fire(now)
        return celery_schedules.schedstate(due, _ENDED_RECHECK if after is None else (after - now).total_seconds())

    # BaseSchedule defines these too: the rule's value equality wins.
    __eq__ = ScheduleRule.__eq__
    __ne__ = ScheduleRule.__ne__
    __hash__ = ScheduleRule.__hash__


class cron(ClusterSchedule, CronRule):
    """A 5-field cron expression with Vixie semantics in an IANA zone (croniter's ``L``, ``W``,
    ``#``, wrapping ranges and sixth seconds field too: :mod:`.cronexpr`).

    ``tz=None`` follows the Celery app's ``timezone`` (UTC when unset, the server's local
    zone when ``enable_utc`` is False, as in Celery).
    Invalid input raises :class:`ScheduleError` here, at construction, so a
    bad entry is reported at start-up rather than at its first fire.
    """

    def __init__(self, expr: str, tz: Optional[str] = None, *, nowfun=None, app=None,
                 _spec: Optional[CronSpec] = None):
        celery_schedules.BaseSchedule.__init__(self, nowfun=nowfun, app=app)
        CronRule.__init__(self, expr, tz, _spec=_spec)

    def __reduce__(self):
        return (_rebuild_cron, self._rebuild_args())

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


class every(ClusterSchedule, EveryRule):
    """A fixed interval on a grid every replica computes alike (see :class:`.rules.EveryRule`)."""

    def __init__(self, interval: Interval, *, baseline: Optional[str] = None, tz: Optional[str] = None,
                 nowfun=None, app=None):
        celery_schedules.BaseSchedule.__init__(self, nowfun=nowfun, app=app)
        EveryRule.__init__(self, interval, baseline=baseline, tz=tz)

    def __reduce__(self):
        return (_rebuild_every, (self.step_us, self.baseline, self.tz_name))


def _rebuild_every(step_us: int, baseline: Optional[str], tz: Optional[str]) -> every:
    return every(timedelta(microseconds=step_us), baseline=baseline, tz=tz)


class at(ClusterSchedule, AtRule):
    """A one-off: fires once at *when* (see :class:`.rules.AtRule`), then never again.

    ``at(datetime(2026, 12, 7, 15, tzinfo=timezone.utc))``, ``at("2026-12-07T15:00:00Z")``, or a
    wall time ``at(datetime(2026, 12, 7, 9), tz="America/Chicago")`` (without *tz*: the app's zone).
    """

    def __init__(self, when: Any, tz: Optional[str] = None, *, nowfun=None, app=None):
        celery_schedules.BaseSchedule.__init__(self, nowfun=nowfun, app=app)
        AtRule.__init__(self, when, tz)

    def __reduce__(self):
        return (_rebuild_at, (self.instant or self.wall, self.tz_name))


def _rebuild_at(when: datetime, tz: Optional[str]) -> at:
    return at(when, tz)


class bounded(ClusterSchedule, BoundedRule):
    """A schedule with ``start_at`` / ``end_at`` / ``max_runs`` (see :mod:`.bounds`); built from an
    entry's keys or a stored row's columns, in its rule's zone (the rule's app decides it)."""

    def __init__(self, rule: ClusterSchedule, *, start_at: Optional[datetime] = None,
                 end_at: Optional[datetime] = None, max_runs: Optional[int] = None,
                 origin: Optional[datetime] = None, runs_end: Optional[datetime] = None, nowfun=None, app=None):
        celery_schedules.BaseSchedule.__init__(self, nowfun=nowfun, app=app)
        BoundedRule.__init__(self, rule, start_at=start_at, end_at=end_at, max_runs=max_runs, origin=origin,
                             runs_end=runs_end)

    def __reduce__(self):
        return (_rebuild_bounded, (self.rule, self.start_at, self.end_at, self.max_runs, self.origin, self.runs_end))


def _rebuild_bounded(rule: ClusterSchedule, start_at, end_at, max_runs, origin, runs_end=None) -> bounded:
    return bounded(rule, start_at=start_at, end_at=end_at, max_runs=max_runs, origin=origin, runs_end=runs_end)


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
        if isinstance(value, bounded):
            as_schedule(value.rule, app=app)  # the zone it runs in is its rule's
        return value
    if isinstance(value, str):  # a cron expression written as text: checked here, field by field
        return cron(value, app=app)
    if isinstance(value, celery_schedules.crontab):
        return cron.from_crontab(value, app=app)
    if isinstance(value, celery_schedules.schedule) and type(value) is celery_schedules.schedule:
        return every(value.run_every, app=app)
    if isinstance(value, timedelta) or (isinstance(value, (int, float)) and not isinstance(value, bool)):
        return every(value, app=app)
    if isinstance(value, celery_schedules.solar):
        raise ScheduleError(
            f"schedule {value!r}: Celery's solar schedules are not supported: their instants come from "
            "astronomical floating-point arithmetic that replicas need not agree on to the second; use cron() "
            "at a fixed wall time, or compute the times and store them as schedules"
        )
    raise ScheduleError(
        f"schedule {value!r} is not supported: use cron(), every(), a cron expression string, "
        "celery's crontab or schedule, a timedelta or a number of seconds"
    )
