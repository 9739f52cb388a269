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

from typing import Any

from .errors import ConfigError, ScheduleError
from .schedules import as_schedule, cron, every

__all__ = ["cron", "every", "as_schedule", "ScheduleError", "ConfigError", "Scheduler", "LedgerTask",
           "current_occurrence"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # The scheduler pulls in celery.beat and SQLAlchemy; schedules alone should not.
    if name == "Scheduler":
        from .beat.scheduler import Scheduler

        return Scheduler
    if name in ("LedgerTask", "current_occurrence"):
        # The worker side pulls in SQLAlchemy too; only when asked for.
        from . import worker

        return getattr(worker, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
