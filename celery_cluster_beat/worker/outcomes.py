"""Ends a pool child cannot record: the worker's main process writes them on the run's row.

A pool child killed mid-run (SIGKILL, the OOM killer, a hard ``task_time_limit``, a
``revoke(terminate=True)``) never reaches the ledger's finish. Its worker's main process
learns of it in the task's :class:`~celery.worker.request.Request` (``on_failure`` with
``WorkerLostError``, ``TimeLimitExceeded``, ``Terminated`` or a ``SystemExit``), so
:class:`LedgerRequest`, the ``Request`` of every :class:`~.task.LedgerTask`, records it
there, on the run's row, and records the child gone: only the process that row names, and
only when its heartbeat row has the dead child's pid (host and pid alone name no process:
containers sharing a host name have the same small pids). What it records follows what
Celery actually does with the message:

* Celery puts it back (``reject(requeue=True)``: ``task_reject_on_worker_lost`` with
  acks_late, a 5.7 time limit with ``acks_on_timeout`` false; or it leaves it unacknowledged
  after cancelling the task on a connection loss, ``_already_cancelled``): the run is
  ``lost``, written *before* the message is requeued, so its redelivery runs it again at
  once (the process is known gone, no need to wait out the grace);
* Celery 5.7's ``retry_on_worker_lost`` published the retry: ``retried`` (the retry
  continues the run);
* anything else, the message does not come back (acknowledged, rejected without requeue, a
  terminating revoke, which acknowledged it already, a retry beyond ``max_retries`` or whose
  publish failed): the run is ``failed`` with the reason (``WorkerLostError: ...``,
  ``TimeLimitExceeded: ...``, ``revoked (terminated): ...``), and the overlap guard is freed.

A run taken over meanwhile by another process is left alone. ``Request.on_failure`` and
``Request.reject`` are overridden and call Celery's; ``_already_cancelled`` is read with a
default (missing: ``failed`` rather than ``lost``); Celery's private ``_retry_worker_lost`` is
wrapped only where it exists, to learn whether a retry was sent (a Celery with
``retry_on_worker_lost`` but without it: ``lost``, which a retry still continues).
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


#: Celery 5.7 retries a lost task in this private method (returns whether the retry was sent).
_KNOWS_RETRY = callable(getattr(Request, "_retry_worker_lost", None))


class LedgerRequest(Request):
    """Celery's Request, recording on the ledger a run its pool child could not (module docstring)."""

    _cluster_beat_loss: Optional[str] = None
    _cluster_beat_retry_sent = False

    def _loss_reason(self, exc: Any) -> Optional[str]:
        """Why the child's run ended without its own record, or None (the child recorded it)."""
        cancelled = bool(getattr(self, "_already_cancelled", False))
        if isinstance(exc, Terminated):
            return "cancelled by Celery" if cancelled else f"revoked (terminated): {error_summary(exc)}"
        if isinstance(exc, (SystemExit, KeyboardInterrupt)):
            if getattr(self, "_already_revoked", False) and not cancelled:
                return f"revoked (terminated): {error_summary(exc)}"
            return f"worker process exited: {error_summary(exc)}"
        if isinstance(exc, (WorkerLostError, TimeLimitExceeded)):
            return error_summary(exc)
        return None

    def on_failure(self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False) -> Any:
        exc = _unwrap(exc_info.exception)
        reason = self._loss_reason(exc)
        if reason is None:
            return super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)
        if (isinstance(exc, (Terminated, SystemExit, KeyboardInterrupt))
                and bool(getattr(self, "_already_cancelled", False))):
            # Cancelled on a connection loss: Celery leaves the message unacknowledged, it comes back.
            self._record(RunState.LOST, reason)
            return super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)
        self._cluster_beat_loss = reason  # reject(requeue=True) below records 'lost' first
        self._cluster_beat_retry_sent = False
        try:
            return super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)
        finally:
            pending, self._cluster_beat_loss = self._cluster_beat_loss, None
            if pending is not None:
                if self._cluster_beat_retry_sent:
                    state = RunState.RETRIED
                elif (isinstance(exc, WorkerLostError) and getattr(self.task, "retry_on_worker_lost", False)
                      and not _KNOWS_RETRY):
                    state = RunState.LOST  # cannot tell whether a retry went out: one would continue 'lost'
                else:
                    state = RunState.FAILED
                self._record(state, pending)

    if _KNOWS_RETRY:
        def _retry_worker_lost(self, exc: Any, exc_info: Any) -> Any:
            """Celery 5.7's retry of a lost task: note whether the retry message was sent."""
            sent = super()._retry_worker_lost(exc, exc_info)  # type: ignore[misc]
            if sent:
                self._cluster_beat_retry_sent = True
            return sent

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
                       {RunState.LOST: "lost; its redelivery runs it again", RunState.RETRIED: "lost; its retry continues it"}
                       .get(state, "failed"), reason)
        try:
            signals.run_handled.send(sender=self.task, outcome=RunOutcome(state.value), schedule=occ.schedule,
                                     scheduled_at=occ.scheduled_at, task_id=self.id, worker=self.hostname,
                                     runtime=runtime, error=reason)
        except Exception:
            logger.exception("cluster-beat ledger: a run_handled receiver failed")


__all__ = ["LedgerRequest"]
