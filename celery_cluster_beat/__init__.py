"""celery-cluster-beat: a Celery beat scheduler for several replicas.

``celery -A proj beat -S celery_cluster_beat.Scheduler``

The package is one folder per concern; arrows point down only::

    beat      the Celery glue: Scheduler, send pipeline, overlap guard, catch-up, jitter
    ops       operators' tools: the cluster-beat command, metrics, the HTTP status page
    worker    the task base class that runs each occurrence once (the ledger), the message headers
    dynamic   schedules made at run time: the StoredSchedules API, stored rows as entries
    config    cluster_beat_* settings, beat_schedule entries, Celery configuration knowledge
    leader    the Redis lease and change notices, the Redis client factory, URL masking
    store     the SQL claim store (dialects behind one seam)
    schedules pure time arithmetic: cron, intervals, zones, occurrences

plus ``errors`` (ConfigError, ScheduleError), ``signals``, ``faults`` (test-only fault points) and ``base`` (shared
limits and the enum base), which every concern may import.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from .base import lazy_attributes
from .errors import ConfigError, ScheduleError

if TYPE_CHECKING:
    from .beat.scheduler import Scheduler
    from .schedules import as_schedule, at, cron, every
    from .worker import LedgerTask, current_occurrence

__all__ = ["cron", "every", "at", "as_schedule", "ScheduleError", "ConfigError", "Scheduler", "LedgerTask",
           "current_occurrence"]
__version__ = "0.1.0"

#: Attributes imported on first use (PEP 562), and where each lives. Celery imports this
#: package for every ``celery`` command (the ``cluster-beat`` plugin loads at start), so
#: importing it costs nothing: ``cron`` / ``every`` bring ``celery.schedules``, the scheduler
#: and the worker side bring SQLAlchemy, and each only when asked for.
_LAZY = {"cron": ".schedules", "every": ".schedules", "at": ".schedules", "as_schedule": ".schedules",
         "Scheduler": ".beat.scheduler", "LedgerTask": ".worker", "current_occurrence": ".worker"}


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, __all__)
