"""Schedules: pure time arithmetic, what every replica must compute alike.

Owns cron parsing (:mod:`.cronexpr`), wall times in a zone and their DST rules
(:mod:`.tzwall`), cron next-fire (:mod:`.crontimes`), interval grids
(:mod:`.intervals`), the rules (:mod:`.rules`), an occurrence's identity and
task id (:mod:`.occurrence`), aware-UTC helpers (:mod:`.instants`), and
Celery's face of the public ``cron`` / ``every`` plus conversion of Celery's
own types (:mod:`.celery_types`, the one module here that imports Celery).

May import: the standard library and Celery (in :mod:`.celery_types` only).
Nothing from the rest of the package: every other concern builds on this one.
No I/O.
"""
from .celery_types import ClusterSchedule, as_schedule, cron, every
from .errors import ScheduleError
from .occurrence import Occurrence, occurrence_task_id

__all__ = ["cron", "every", "as_schedule", "ClusterSchedule", "ScheduleError", "Occurrence", "occurrence_task_id"]
