"""Ends a pool child cannot record: the worker's main process writes them on the run's row.

A pool child killed mid-run (SIGKILL, the OOM killer, a hard ``task_time_limit``, a
``revoke(terminate=True)``) never reaches the ledger's finish. Its worker's main process
learns of it in the task's :class:`~celery.worker.request.Request` (``on_failure`` with
``WorkerLostError``, ``TimeLimitExceeded`` or ``Terminated``), so :class:`LedgerRequest`,
the ``Request`` of every :class:`~.task.LedgerTask`, records it there, by the run's key
and the child's (host, pid), and records the child gone (its heartbeat row):

* the message goes back to the broker (``task_reject_on_worker_lost`` with acks_late, a
  5.7 time limit with ``acks_on_timeout`` false, a task cancelled on connection loss):
  the run is ``lost``, written *before* the message is requeued, so its redelivery runs it
  again at once (the process is known gone, no need to wait out the grace);
* it does not (Celery's default: the message is acknowledged and the result is FAILURE):
  the run is ``failed`` with the reason (``WorkerLostError: ...``, ``TimeLimitExceeded:
  ...``, ``revoked (terminated): ...``), and the overlap guard is freed.

A run taken over meanwhile by another process is left alone (the statement matches the
child's process). Public Celery API only: ``Request.on_failure`` and ``Request.reject`` are
overridden and call Celery's; the ``_already_cancelled`` flag is read with a default (a
Celery without it: the run is recorded ``failed`` rather than ``lost``).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Optional

from billiard.exceptions import Terminated, TimeLimitExceeded, WorkerLostError
from celery.worker.request import Request

from .. import signals
from ..signals import RunOutcome
from ..store import StoreUnavailable
from ..store.ledger import error_summary
from ..store.schema import RunState
from .liveness import host_name
from .protocol import OccurrenceContext, ProtocolError
from .task import ledger_store

logger = logging.getLogger("celery_cluster_beat.worker")


def _unwrap(exc: Any) -> Any:
    return getattr(exc, "exc", exc) if type(exc).__name__ == "ExceptionWithTraceback" else exc


class LedgerRequest(Request):
    """Celery's Request, recording on the ledger a run its pool child could not (module docstring)."""

    _cluster_beat_loss: Optional[str] = None

    def _loss_reason(self, exc: Any) -> Optional[str]:
        """Why the child's run ended without its own record, or None (the child recorded it)."""
        cancelled = bool(getattr(self, "_already_cancelled", False))
        if isinstance(exc, Terminated):
            return "cancelled by Celery" if cancelled else f"revoked (terminated): {error_summary(exc)}"
        if isinstance(exc, (SystemExit, KeyboardInterrupt)):
            return f"worker process exited: {error_summary(exc)}"
        if isinstance(exc, (WorkerLostError, TimeLimitExceeded)):
            return error_summary(exc)
        return None

    def on_failure(self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False) -> Any:
        exc = _unwrap(exc_info.exception)
        reason = self._loss_reason(exc)
        if reason is None:
            return super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)
        already = bool(getattr(self, "_already_cancelled", False) or getattr(self, "_already_revoked", False))
        comes_back = (
            # Celery leaves the message unacknowledged: the broker redelivers it.
            (isinstance(exc, (SystemExit, KeyboardInterrupt)) and already)
            or (isinstance(exc, Terminated) and bool(getattr(self, "_already_cancelled", False)))
            # 5.7 retry_on_worker_lost: a retry (next attempt) continues a lost run.
            or (isinstance(exc, WorkerLostError) and bool(getattr(self.task, "retry_on_worker_lost", False)))
        )
        if comes_back:
            self._record(RunState.LOST, reason)
            return super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)
        self._cluster_beat_loss = reason  # reject(requeue=True) below records 'lost' first
        try:
            return super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)
        finally:
            pending, self._cluster_beat_loss = self._cluster_beat_loss, None
            if pending is not None:
                self._record(RunState.FAILED, pending)

    def reject(self, requeue: bool = False) -> Any:
        pending = self._cluster_beat_loss
        if requeue and pending is not None:
            self._cluster_beat_loss = None
            self._record(RunState.LOST, pending)  # before the message is back in the queue
        return super().reject(requeue=requeue)

    def _record(self, state: RunState, reason: str) -> None:
        """Write the end of the child's run (by key and the child's pid) and report it; never raises."""
        try:
            occ = OccurrenceContext.from_request(self.request_dict)
        except ProtocolError:
            occ = None
        pid = self.worker_pid
        if occ is None or not pid:
            return
        runtime = max(0.0, time.time() - self.time_start) if self.time_start else None
        try:
            changed = ledger_store(self.task.app, heartbeat=False).end_lost_run(
                occ.schedule, occ.scheduled_at, host=host_name(), pid=int(pid), state=state, error=reason,
                runtime=runtime)
        except (StoreUnavailable, ValueError) as exc:
            logger.error("cluster-beat ledger: %s[%s]: cannot record that the run of %s at %s ended (%s: %s); it "
                         "reads as running until its worker process's heartbeat expires", self.task.name, self.id,
                         occ.schedule, occ.scheduled_at.isoformat(), reason, exc)
            return
        except Exception:  # never break Celery's own handling of the failure
            logger.exception("cluster-beat ledger: recording a lost run failed")
            return
        if not changed:
            return
        logger.warning("cluster-beat ledger: %s[%s]: run of %s at %s %s: %s", self.task.name, self.id, occ.schedule,
                       occ.scheduled_at.isoformat(),
                       "lost; its redelivery runs it again" if state is RunState.LOST else "failed", reason)
        try:
            signals.run_handled.send(sender=self.task, outcome=RunOutcome(state.value), schedule=occ.schedule,
                                     scheduled_at=occ.scheduled_at, task_id=self.id, worker=self.hostname,
                                     runtime=runtime, error=reason)
        except Exception:
            logger.exception("cluster-beat ledger: a run_handled receiver failed")


__all__ = ["LedgerRequest"]
