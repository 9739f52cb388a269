"""STARTED in the result backend only for a delivery the ledger runs (``task_track_started``).

Celery's tracer stores STARTED *before* it calls the task (``build_tracer`` in
celery/app/trace.py, 5.3 to 5.7 alike: after ``task_prerun`` and the loader's
``on_task_init``, before ``before_start`` and the task's ``__call__``; 5.3-5.6 read
``task.track_started`` once when the tracer is built, 5.7 at each delivery). No task
hook runs before that store, so a duplicate delivery that the ledger then refuses
would already have written STARTED over the real run's SUCCESS, FAILURE or RETRY
(or over a running run's own STARTED), and nothing would ever write it back.

So a ledger task shows the tracer ``track_started`` false, always, and stores STARTED
itself, with the tracer's meta (pid, hostname), once the ledger has let the delivery
run: a refused duplicate never writes to the result backend. The setting is still the
user's: the task's ``track_started`` (decorator option, class attribute,
``task_annotations``, an assignment) is kept in ``ledger_track_started``; None means
the app's ``task_track_started``. Honoured as Celery does: not for eager calls, not
when the result is ignored. Only public names are used (``Task.track_started`` is a
documented attribute); the 5.7 per-request ``ignore_result`` is read when present.
"""
from __future__ import annotations

import os
import socket
from typing import Any, Optional

from celery import states

try:  # Celery 5.7: a request may override the task's ignore_result
    from celery.app.task import get_actual_ignore_result as _actual_ignore_result
except ImportError:  # 5.3-5.6: the tracer reads task.ignore_result only
    _actual_ignore_result = None

#: Where a ledger task keeps its own track_started setting (None: the app's task_track_started).
SETTING = "ledger_track_started"
_UNSET = object()


class TrackStarted:
    """``LedgerTask.track_started``: Celery's tracer reads False; a value assigned is the setting."""

    def __get__(self, obj: Any, owner: Any = None) -> bool:
        return False

    def __set__(self, obj: Any, value: Any) -> None:
        setattr(obj, SETTING, value)


def adopt_track_started(cls: type) -> None:
    """Move a ``track_started`` given in a ledger task class's body into :data:`SETTING`, so the
    tracer keeps reading False (a class attribute would hide the descriptor)."""
    value = cls.__dict__.get("track_started", _UNSET)
    if value is _UNSET or isinstance(value, TrackStarted):
        return
    type.__delattr__(cls, "track_started")
    type.__setattr__(cls, SETTING, value)


class TrackStartedType(type):
    """Metaclass of the ledger task: ``track_started`` given to a class, in its body (the task
    decorator's option), later (``task_annotations``, ``MyTask.track_started = True``), is the
    setting; the attribute Celery's tracer reads stays False."""

    def __init__(cls, name: str, bases: tuple, namespace: dict, **kwargs: Any) -> None:
        super().__init__(name, bases, namespace, **kwargs)
        adopt_track_started(cls)

    def __setattr__(cls, name: str, value: Any) -> None:
        if name == "track_started" and not isinstance(value, TrackStarted):
            name = SETTING
        super().__setattr__(name, value)


def _ignores_result(task: Any, request: Any) -> bool:
    if _actual_ignore_result is not None:
        try:
            return bool(_actual_ignore_result(task, request))
        except Exception:  # a different signature: the task's own setting, as 5.3-5.6
            pass
    return bool(task.ignore_result)


def tracks_started(task: Any, request: Any) -> bool:
    """Whether Celery would have stored STARTED for this delivery of *task*."""
    value: Optional[Any] = getattr(task, SETTING, None)
    if value is None:
        value = task.app.conf.get("task_track_started")
    if not value or getattr(request, "is_eager", False):
        return False
    return not _ignores_result(task, request)


def store_started(task: Any, request: Any) -> None:
    """Store STARTED for the delivery *request* of *task*, as Celery's tracer would have."""
    if tracks_started(task, request):
        meta = {"pid": os.getpid(), "hostname": getattr(request, "hostname", None) or socket.gethostname()}
        task.backend.store_result(request.id, meta, states.STARTED, request=request)


__all__ = ["SETTING", "TrackStarted", "TrackStartedType", "adopt_track_started", "store_started", "tracks_started"]
