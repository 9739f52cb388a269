"""The Celery glue: what ``celery beat -S celery_cluster_beat.Scheduler`` runs.

Owns the :class:`~.scheduler.Scheduler` Celery calls (heap of next fires,
leadership, store back-off), the send pipeline (:mod:`.pipeline`: claim,
publish, mark sent, retries, stale-claim resends), publishing with Celery's
own messages (:mod:`.publisher`, built once per entry and stamped per occurrence:
:mod:`.messages`), the overlap guard and watchdog
(:mod:`.guard`), catch-up planning (:mod:`.catchup`), jitter (:mod:`.jitter`)
and outcome reports (:mod:`.outcomes`).

May import: config, store, leader, schedules, errors, signals, base. Nothing
imports beat except the package's lazy ``Scheduler`` attribute.
"""
