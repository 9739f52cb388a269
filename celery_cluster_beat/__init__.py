"""celery-cluster-beat: a Celery beat scheduler for several replicas.

``celery -A proj beat -S celery_cluster_beat.Scheduler``
"""
from __future__ import annotations

from typing import Any

from .errors import ConfigError, ScheduleError
from .schedules import as_schedule, cron, every

__all__ = ["cron", "every", "as_schedule", "ScheduleError", "ConfigError", "Scheduler"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    # The scheduler pulls in celery.beat and SQLAlchemy; schedules alone should not.
    if name == "Scheduler":
        from .scheduler import Scheduler

        return Scheduler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
