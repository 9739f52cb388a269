"""Celery-style signals for what the scheduler decides, and for what the worker-side ledger does.

Receivers run synchronously, in the beat process (``lease_changed``,
``occurrence_handled``, ``watchdog_fired``, ``paused_after_failures``) or in the worker process that runs
the task (``run_handled``): keep them quick. They are how the ops tooling
(events, metrics) and users' own monitoring hook in.
"""
from celery.utils.dispatch import Signal

from .base import StrEnum

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

#: The leader paused a schedule after ``pause_after_failures`` consecutive failed runs (in the beat
#: process): ``schedule``, ``failures`` (N), ``last_error`` (class and first line of the last
#: failure, or None), ``note`` (the pause note operators read), ``task_ids`` (the failed runs).
paused_after_failures = Signal(name="cluster_beat_paused_after_failures",
                               providing_args={"schedule", "failures", "last_error", "note", "task_ids"})


class RunOutcome(StrEnum):
    """What the worker-side ledger did with one delivery of a scheduled occurrence (``run_handled``)."""

    STARTED = "started"  # first run of the occurrence
    CONTINUED = "continued"  # a Celery retry (same task id) took the run over
    RERUN = "rerun"  # redelivered after the process running it was known gone (acks_late)
    DUPLICATE_SKIPPED = "duplicate-skipped"  # another delivery holds or held the run: body not run
    #: Headers beat cannot have written (a row-less instant ahead of the database's clock, a schedule
    #: that runs another task): body not run, nothing recorded on the claim row (store/provenance.py).
    REFUSED = "refused"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    RETRIED = "retried"  # the body called self.retry(): the retry continues the occurrence
    #: The pool child running it died (killed, a hard time limit, cancelled) and Celery requeued the
    #: message: its redelivery runs it again. Sent by the worker's main process. (Without a requeue
    #: the loss is FAILED, with the reason in ``error``.)
    LOST = "lost"
    LEDGER_UNAVAILABLE = "ledger-unavailable"  # the claim database did not answer: body not run (see LedgerTask)


#: The worker-side ledger handled one delivery: ``outcome`` (a :class:`RunOutcome`), ``schedule``,
#: ``scheduled_at`` (aware UTC), ``task_id``, ``worker`` (hostname), ``runtime`` (seconds, on
#: succeeded / failed / retried / lost, else None), ``error`` (class and first line, or None).
run_handled = Signal(
    name="cluster_beat_run",
    providing_args={"outcome", "schedule", "scheduled_at", "task_id", "worker", "runtime", "error"},
)
