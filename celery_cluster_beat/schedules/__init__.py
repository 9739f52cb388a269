"""Schedules: pure time arithmetic, what every replica must compute alike.

Owns cron parsing (:mod:`.cronexpr`, croniter's extensions in :mod:`.cronext`), wall
times in a zone and their DST rules (:mod:`.tzwall`), cron next-fire (:mod:`.crontimes`), interval grids
(:mod:`.intervals`), the rules (:mod:`.rules`, one-offs included), bounds on any rule (:mod:`.bounds`), an occurrence's identity and
task id (:mod:`.occurrence`), aware-UTC helpers (:mod:`.instants`), and
Celery's face of the public ``cron`` / ``every`` plus conversion of Celery's
own types (:mod:`.celery_types`, the one module here that imports Celery).

May import: the standard library, Celery (in :mod:`.celery_types` only) and croniter (in
:mod:`.cronext` only, on first use: it parses ``L``/``W``/``#``, never a plain Vixie expression).
Nothing from the rest of the package: every other concern builds on this one.
No I/O.
"""
from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any, List

from .errors import ScheduleError

if TYPE_CHECKING:
    from .celery_types import ClusterSchedule, as_schedule, at, bounded, cron, every
    from .occurrence import Occurrence, occurrence_task_id

__all__ = ["cron", "every", "at", "bounded", "as_schedule", "ClusterSchedule", "ScheduleError", "Occurrence", "occurrence_task_id"]

#: Attributes imported on first use (PEP 562), and the submodule each comes from. Every
#: ``celery`` command imports this package (``errors`` builds on ``.errors`` here, and the
#: ``cluster-beat`` plugin loads at start); ``celery.schedules`` should load only for a schedule.
_LAZY = {"cron": ".celery_types", "every": ".celery_types", "at": ".celery_types", "bounded": ".celery_types", "as_schedule": ".celery_types",
         "ClusterSchedule": ".celery_types", "Occurrence": ".occurrence", "occurrence_task_id": ".occurrence"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(__all__))
