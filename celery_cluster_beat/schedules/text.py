"""A schedule as text and back: how a schedule made at run time is stored.

Stored schedules keep their rule as plain text plus a zone name (never a
pickle), so any replica, release or operator reads the same thing:

* cron: the fields as written, e.g. ``*/5 9-17 * * 1-5`` or ``0 0 L * fri 30`` (six with seconds last);
* every: ``every <seconds>s`` on the epoch grid, or ``every <seconds>s from HH:MM``
  anchored daily in the zone;
* at: ``at 2026-12-07T15:00:00Z`` for an exact instant (UTC, microseconds only when
  present), or ``at 2026-12-07T09:00:00`` (no offset) for a wall time in the zone.

Bounds (``start_at``, ``end_at``, ``max_runs``) are not part of the text: stored schedules keep
them in columns of their own.

Celery's ``crontab`` has no exact text form (its day fields combine with AND,
not Vixie's OR), so it is refused here rather than stored as something else.
"""
from __future__ import annotations

import re
from datetime import timedelta
from decimal import Decimal
from typing import Any, Optional, Tuple

from .celery_types import ClusterSchedule, as_schedule, at, bounded, cron, every
from .errors import ScheduleError
from .instants import utc_iso

_EVERY = re.compile(r"^every (\d+(?:\.\d{1,6})?)s(?: from (\d\d:\d\d))?$")


def schedule_text(value: Any) -> Tuple[str, Optional[str]]:
    """``(text, zone)`` of a schedule given as cron()/every(), cron text, a timedelta or seconds."""
    if isinstance(value, str):
        value = cron(value)
    elif not isinstance(value, ClusterSchedule):
        if value.__class__.__module__.startswith("celery."):
            raise ScheduleError(f"schedule {value!r}: Celery's schedule types have no exact text form; "
                                "use cron('m h dom mon dow', tz=...) or every(seconds)")
        value = as_schedule(value)
    if isinstance(value, bounded):  # its bounds are columns of their own
        value = value.rule
    if isinstance(value, at):
        if value.instant is not None:
            return f"at {utc_iso(value.instant)}", None
        return f"at {value.wall.isoformat()}", value.tz_name
    if isinstance(value, cron):
        if value.spec.text != value.expr:
            raise ScheduleError(f"schedule {value.expr!r} was converted from Celery's crontab and has no exact "
                                "text form; write it as cron('m h dom mon dow')")
        return value.expr, value.tz_name
    if isinstance(value, every):
        seconds = Decimal(value.step_us) / 1_000_000
        text = f"every {seconds.normalize():f}s"
        if value.baseline is not None:
            return f"{text} from {value.baseline}", value.tz_name
        return text, None
    raise ScheduleError(f"schedule {value!r} is not supported for stored schedules")  # pragma: no cover


def parse_schedule_text(text: str, zone: Optional[str] = None) -> ClusterSchedule:
    """The schedule *text* names, in *zone* (None: the app's zone); :class:`ScheduleError` when bad."""
    if not isinstance(text, str) or not text.strip():
        raise ScheduleError(f"schedule {text!r} is empty or not text")
    m = _EVERY.match(text.strip())
    if m:
        return every(timedelta(microseconds=int(Decimal(m.group(1)) * 1_000_000)), baseline=m.group(2), tz=zone)
    if text.strip().startswith("at "):
        return at(text.strip()[3:].strip(), tz=zone)
    if text.strip().startswith("every"):
        raise ScheduleError(f"schedule {text!r}: expected 'every <seconds>s' or 'every <seconds>s from HH:MM'")
    return cron(text, tz=zone)
