"""Configuration: what the operator wrote, read once and validated before anything opens.

Owns the ``cluster_beat_*`` settings (:mod:`.settings`), the ``beat_schedule``
entries (:mod:`.entries`), the value kinds both share: policies and durations
(:mod:`.values`), what a schedule's ``options`` may ask of Celery's send
(:mod:`.options`: checked for config entries, allow-listed for stored schedules), and every other piece of knowledge about Celery's own
configuration (:mod:`.celeryconf`): result backend, the lease's Redis client
options, default entries. Bad input is one :class:`~celery_cluster_beat.errors.ConfigError`
listing every problem, each naming the setting or the entry and field.

May import: schedules (to validate schedules), leader (to build the very Redis
client it validates), errors, base. Never store or beat.
"""
from .celeryconf import RedisOptions, default_entries, has_result_backend
from .entries import Entry, build_entries
from .settings import Settings, load_settings
from .values import CatchupPolicy, OverlapPolicy

__all__ = ["Entry", "build_entries", "Settings", "load_settings", "CatchupPolicy", "OverlapPolicy",
           "RedisOptions", "has_result_backend", "default_entries"]
