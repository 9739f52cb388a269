"""The Celery glue: what ``celery beat -S celery_cluster_beat.Scheduler`` runs.

Owns the :class:`~.scheduler.Scheduler` Celery calls, a thin wiring of rooms that
share one :class:`~.state.NodeState` (queue of next fires, entries, store back-off):
bringing the node up (:mod:`.bringup`), leadership (:mod:`.leadership`), the due
pass with claim-ahead and catch-up (:mod:`.duepass`), stored schedules and the
horizon (:mod:`.stored`), operators' controls (:mod:`.controls`; backfill requests:
:mod:`.backfills`; ``pause_after_failures``: :mod:`.failures`), housekeeping and
pruning (:mod:`.upkeep`), building messages ahead (:mod:`.prepare`); the send
pipeline (:mod:`.pipeline`: claim, publish, mark sent, retries, stale-claim
resends), publishing with Celery's own messages (:mod:`.publisher`, built once per
entry and stamped per occurrence: :mod:`..messages`), the overlap guard and watchdog
(:mod:`.guard`), catch-up planning (:mod:`.catchup`), jitter (:mod:`.jitter`)
and outcome reports (:mod:`.outcomes`).

May import: config, store, leader, schedules, errors, signals, base. Nothing
imports beat except the package's lazy ``Scheduler`` attribute.
"""
