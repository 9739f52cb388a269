"""Schedules the worker's ledger knows, for tests that publish beat's messages themselves.

The ledger runs an occurrence only when its schedule runs the delivered task (a ``beat_schedule``
entry of the worker's app, or a stored schedule: celery_cluster_beat/worker/provenance.py). A test
whose worker app has no ``beat_schedule`` stores the schedule first, disabled (no beat fires it).
"""
from __future__ import annotations

from typing import Set, Tuple

from celery import Celery

from celery_cluster_beat import every
from celery_cluster_beat.dynamic import StoredSchedules

_known: Set[Tuple[str, str, str]] = set()


def known_schedule(db_url: str, name: str, task: str) -> None:
    """Store schedule *name* of *task* (disabled) in the claim database *db_url*, once."""
    if (db_url, name, task) in _known:
        return
    app = Celery("known-schedules", set_as_current=False)
    app.conf.update(cluster_beat_db_url=db_url, cluster_beat_redis_url="", beat_schedule={})
    with StoredSchedules(app) as api:
        if api.get(name) is None:
            api.add(name, task, every(3600), enabled=False)
        else:
            api.update(name, task=task)
    _known.add((db_url, name, task))
