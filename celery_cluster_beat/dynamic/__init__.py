"""Schedules made at run time: stored in the claim database, changed without restarting beat.

Owns the Python API an application uses to add, change, enable, disable and
remove schedules (:mod:`.api`) and the conversion between a stored row and the
:class:`~celery_cluster_beat.config.Entry` beat schedules (:mod:`.convert`),
validated with the very checks and messages of ``beat_schedule`` entries.
Arguments are JSON, never pickle, bounded in size and nesting; options pass an
allow-list (:mod:`..config.options`), as a schedule's author is not trusted like
the Celery config.

May import: store (the rows), config (validation, settings), leader (the
change notice), schedules (text form), errors, base. Never beat or worker.
"""
from .api import StoredSchedule, StoredSchedules
from .convert import entry_from_row

__all__ = ["StoredSchedules", "StoredSchedule", "entry_from_row"]
