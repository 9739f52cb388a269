"""The one error the schedule arithmetic raises for bad input."""
from __future__ import annotations


class ScheduleError(ValueError):
    """A schedule (cron expression, interval, baseline, time zone) is invalid.

    The message always names the expression, the field and the reason, so an
    operator can fix the entry without reading our source. A ``ValueError``, so
    callers that already guard configuration with ``except ValueError`` keep working.
    """
