"""Which runs beat can observe, to guard them: result state, or the worker-side ledger.

Knowledge of Celery's configuration (result backend, ``ignore_result``) plus one mark
the worker's task base class carries, read here without importing the worker side:
the start-up check of ``beat_schedule`` and the stored-schedule API refuse alike an
explicit overlap guard on runs nothing can observe.
"""
from __future__ import annotations

from typing import Iterable, List

from .celeryconf import has_result_backend
from .entries import Entry
from .settings import Settings
from .values import OverlapPolicy

#: Class attribute set on :class:`celery_cluster_beat.worker.LedgerTask`: its runs go through the ledger.
LEDGER_MARK = "cluster_beat_ledger"


def uses_ledger(app, task_name: str) -> bool:
    """Whether the worker runs *task_name* through the ledger: a registered task that is a
    :class:`~celery_cluster_beat.worker.LedgerTask`, or, for a task beat does not know, the
    app's ``task_cls`` is one."""
    task = app.tasks.get(task_name)
    if task is not None:
        return bool(getattr(task, LEDGER_MARK, False))
    try:
        return bool(getattr(app.Task, LEDGER_MARK, False))
    except Exception:  # a task_cls Celery cannot resolve: the worker would fail the same way
        return False


def ignores_results(app, entry: Entry) -> bool:
    """Whether runs of *entry* store no result state: the task's ``ignore_result`` (the app's
    ``task_ignore_result`` for a task beat does not know), or ``ignore_result`` in the entry's options."""
    if entry.options.get("ignore_result"):
        return True
    task = app.tasks.get(entry.task)
    if task is not None:
        return bool(task.ignore_result)
    return bool(app.conf.task_ignore_result)


def configuration_problems(app, settings: Settings, entries: Iterable[Entry], *,
                           label: str = "beat_schedule entry") -> List[str]:
    """Start-up errors: an explicit guard (entry ``overlap``, or ``cluster_beat_overlap``) on an
    entry whose runs nothing can observe. Such a guard would block every fire after the first for
    ``max_run_time`` (the run stays PENDING forever), silently; each line names the entry, the
    field and the fixes."""
    problems: List[str] = []
    backend = has_result_backend(app)
    for entry in sorted(entries, key=lambda e: e.name):
        explicit = entry.overlap or (settings.overlap if settings.overlap_explicit else None)
        if explicit is None or explicit == OverlapPolicy.ALLOW or uses_ledger(app, entry.task):
            continue
        where = "overlap" if entry.overlap else f"overlap (cluster_beat_overlap={settings.overlap.value!r})"
        if not backend:
            why = "the app has no result backend"
        elif ignores_results(app, entry):
            why = f"task {entry.task!r} ignores its results"
        else:
            continue
        problems.append(
            f"{label} {entry.name!r}: {where}: {explicit.value!r} cannot see when a run ends "
            f"({why}); use base=celery_cluster_beat.LedgerTask for the task, or store its results, "
            f"or set overlap='allow' on the entry")
    return problems
