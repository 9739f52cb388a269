"""Celery-style signals for what the scheduler decides.

Receivers run in the beat process, synchronously: keep them quick. They are
how the ops tooling (events, metrics) and users' own monitoring hook in.
"""
from celery.utils.dispatch import Signal

#: A lease transition: ``event`` (acquired, renewed_late, lost, released,
#: stepped_down, redis_down, redis_back), ``node``, ``term``, ``info`` (dict).
lease_changed = Signal(name="cluster_beat_lease_changed", providing_args={"event", "node", "term", "info"})

#: What happened to one occurrence: ``outcome`` (sent, resent, skipped-overlap,
#: buffered, replaced, missed, claim-lost, failed), ``schedule``,
#: ``scheduled_at`` (aware UTC), ``task_id``, ``reason``.
occurrence_handled = Signal(
    name="cluster_beat_occurrence", providing_args={"outcome", "schedule", "scheduled_at", "task_id", "reason"}
)

#: The overlap guard let a fire through because the previous run exceeded
#: ``max_run_time``: ``schedule``, ``task_id`` (the old run), ``age`` (seconds).
watchdog_fired = Signal(name="cluster_beat_watchdog", providing_args={"schedule", "task_id", "age"})
