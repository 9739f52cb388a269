"""The ledger task base class: run each scheduled occurrence once, however often it is delivered.

``@app.task(base=LedgerTask)`` for one task, or ``Celery(..., task_cls=LedgerTask)``
(``"celery_cluster_beat:LedgerTask"``) for every task of the app. For a message
that carries beat's ``cluster_beat_*`` headers, the run is started in the claim
store before the body runs (:meth:`~..store.ledger.LedgerQueries.start_run`):

* the first delivery of the occurrence runs; any other delivery of it (a same-id
  resend, a broker redelivery, a producer's duplicate) is **not run**: it is logged,
  reported as ``duplicate-skipped`` through :data:`~..signals.run_handled`, counted on
  the row (``duplicates``) and ends with :class:`celery.exceptions.Ignore`, so the result
  backend keeps the real run's result;
* Celery's retries (``self.retry``: same task id, ``retries`` > 0) continue the run;
* **acks_late**: a task with ``acks_late`` whose worker died mid-run gets its message
  redelivered; that redelivery runs again only once the previous start is older than
  the entry's ``max_run_time`` (sent by beat in ``cluster_beat_max_run_time``; the app's
  ``cluster_beat_max_run_time``, default 600 s, when missing). A redelivery before that
  (the broker's visibility timeout is shorter, or a producer's duplicate) is not run, but
  since its worker may have died, a copy of the message is published with a countdown to
  that moment (same task id and headers): if the run is still ``running`` then, it runs
  again; if it ended, the copy is an ordinary duplicate. So a merely slow run is never run
  twice within ``max_run_time``, and a dead one is not lost. Without acks_late a running
  run is never taken over (its message was acknowledged before the run started, so no
  redelivery can stand for a lost run);
* when the body returns or raises, the row records finished time, runtime, outcome
  (succeeded / failed / retried) and the error's class and first line.

A task called directly, or a message without the headers (``delay()`` from your own
code), runs exactly as without the base class. The store is opened lazily, once per
process (after the pool forks), from ``cluster_beat_db_url`` (the default of beat:
``sqlite:///celerybeat-cluster.sqlite3``, relative to the worker's directory).

**The claim database does not answer** when a run would start: the worker keeps
trying for :attr:`LedgerTask.ledger_wait` seconds (30), then does not run the body:
an acks_late task's message is rejected with requeue, so it comes back once the
database does; any other task fails with :class:`LedgerUnavailable` (logged, FAILURE
in the result backend, ``ledger-unavailable`` through the signal). Nothing is then run
twice and nothing is dropped unseen. A finish the database does not take is retried
briefly and then logged; the row stays ``running``, which the overlap guard counts as
in flight until ``max_run_time``.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any, Dict, Optional, Tuple

from celery import Task, current_task
from celery.exceptions import Ignore, Reject, Retry

from .. import signals
from ..base import MAX_NODE_ID_LENGTH, clip
from ..config.settings import default_db_url
from ..signals import RunOutcome
from ..store import ClaimStore, StoreUnavailable
from ..store.ledger import RunStart, StartOutcome, error_summary
from ..store.schema import RunState
from .protocol import HEADERS, OccurrenceContext, ProtocolError

logger = logging.getLogger("celery_cluster_beat.worker")

#: max_run_time when neither the message nor the app's configuration says (beat's default).
DEFAULT_MAX_RUN_TIME = 600.0
#: Tries of a finish record the database does not take, and the pause between them (seconds).
FINISH_TRIES = 3
FINISH_PAUSE = 0.5

_START_OUTCOME = {
    StartOutcome.STARTED: RunOutcome.STARTED,
    StartOutcome.CONTINUED: RunOutcome.CONTINUED,
    StartOutcome.RERUN: RunOutcome.RERUN,
}

_stores: Dict[Tuple[int, str], ClaimStore] = {}
_stores_lock = threading.Lock()


class LedgerUnavailable(RuntimeError):
    """The claim database did not answer for ``ledger_wait`` seconds: the run was not started."""


def ledger_store(app: Any) -> ClaimStore:
    """This process's claim store for *app* (``cluster_beat_db_url``), opened on first use.

    One per process and URL: a pool child opens its own after the fork, never
    reusing connections its parent made. Threads of one process share it.
    """
    url = app.conf.get("cluster_beat_db_url") or default_db_url(app.conf)  # beat_schedule_filename, as beat
    key = (os.getpid(), url)
    store = _stores.get(key)
    if store is not None:
        return store
    with _stores_lock:
        store = _stores.get(key)
        if store is None:
            node = clip(f"worker:{socket.gethostname()}:{os.getpid()}", MAX_NODE_ID_LENGTH)
            store = ClaimStore(url, node_id=node)
            store.open()  # StoreUnavailable when down: not cached, the next run tries again
            _stores[key] = store
    return store


def current_occurrence() -> Optional[OccurrenceContext]:
    """The occurrence the task running in this thread serves, or None (not sent by beat, no
    task running, or headers that do not parse)."""
    task = current_task
    if task is None or not task:
        return None
    try:
        return OccurrenceContext.from_request(task.request)
    except ProtocolError:
        return None


class LedgerTask(Task):
    """Celery task base class: a scheduled occurrence runs once per occurrence (see the module docstring)."""

    #: Seconds to keep trying the claim database before a run is given up (see the module docstring).
    ledger_wait: float = 30.0
    #: Beat's overlap guard reads this task's runs from the ledger (config.observing.LEDGER_MARK).
    cluster_beat_ledger = True

    @property
    def occurrence(self) -> Optional[OccurrenceContext]:
        """The occurrence this run serves (None when not sent by beat)."""
        try:
            return OccurrenceContext.from_request(self.request)
        except ProtocolError:
            return None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        if request.called_directly:
            return super().__call__(*args, **kwargs)
        try:
            occ = OccurrenceContext.from_request(request)
        except ProtocolError as exc:
            logger.warning("cluster-beat ledger: %s[%s]: %s; run without the ledger", self.name, request.id, exc)
            occ = None
        if occ is None:
            return super().__call__(*args, **kwargs)
        worker = request.hostname or socket.gethostname()
        start = self._start(occ, worker)
        if not start.runs:
            logger.warning(
                "cluster-beat ledger: %s[%s]: duplicate delivery of %s at %s not run (run %s, worker %s)",
                self.name, occ.task_id, occ.schedule, occ.scheduled_at.isoformat(), start.found_state or "started",
                start.found_worker or "?")
            self._report(RunOutcome.DUPLICATE_SKIPPED, occ, worker)
            if start.rerun_in is not None and start.found_worker is not None:
                self._check_later(occ, start.rerun_in)
            raise Ignore()
        if start.outcome is not StartOutcome.STARTED or start.inserted:
            logger.info("cluster-beat ledger: %s[%s]: %s %s at %s%s", self.name, occ.task_id, start.outcome.value,
                        occ.schedule, occ.scheduled_at.isoformat(),
                        " (no claim row: recorded by the worker)" if start.inserted else "")
        self._report(_START_OUTCOME[start.outcome], occ, worker)
        began = time.monotonic()
        token = start.token or ""
        try:
            retval = super().__call__(*args, **kwargs)
        except Retry:
            self._finish(occ, worker, token, RunState.RETRIED, time.monotonic() - began, None)
            raise
        except Reject as exc:
            if exc.requeue and self.acks_late:  # the message comes back: its next delivery starts afresh
                self._release(occ, token)
            else:
                self._finish(occ, worker, token, RunState.FAILED, time.monotonic() - began, error_summary(exc))
            raise
        except Ignore:
            self._finish(occ, worker, token, RunState.SUCCEEDED, time.monotonic() - began, None)
            raise
        except BaseException as exc:
            self._finish(occ, worker, token, RunState.FAILED, time.monotonic() - began, error_summary(exc))
            raise
        if getattr(request, "_cluster_beat_retried", False):
            # self.retry(throw=False): the retry is on its way and continues this run.
            self._finish(occ, worker, token, RunState.RETRIED, time.monotonic() - began, None)
        else:
            self._finish(occ, worker, token, RunState.SUCCEEDED, time.monotonic() - began, None)
        return retval

    def retry(self, args: Any = None, kwargs: Any = None, exc: Any = None, throw: bool = True, eta: Any = None,
              countdown: Any = None, max_retries: Any = None, **options: Any) -> Any:
        """Celery's retry, with the occurrence's headers carried on the retry message (so the
        retry continues the occurrence)."""
        if not self.request.called_directly:
            headers = self._occurrence_headers()
            if headers:
                options["headers"] = {**headers, **(options.get("headers") or {})}
        result = super().retry(args=args, kwargs=kwargs, exc=exc, throw=throw, eta=eta, countdown=countdown,
                               max_retries=max_retries, **options)
        if not self.request.called_directly:
            # Reached only with throw=False (else Retry was raised): the body returns normally
            # after this, but the run goes on in the retry: record it 'retried', not 'succeeded'.
            self.request._cluster_beat_retried = True
        return result

    # -- the ledger's steps ------------------------------------------------------------
    def _max_run_time(self, occ: OccurrenceContext) -> Optional[float]:
        """How old a running start must be before a redelivery runs again; None: never (the task
        acknowledges early, so a redelivery of a started run cannot be a lost one)."""
        if not self.acks_late:
            return None
        if occ.max_run_time is not None:
            return occ.max_run_time
        configured = self.app.conf.get("cluster_beat_max_run_time")
        try:
            return float(configured) if configured else DEFAULT_MAX_RUN_TIME
        except (TypeError, ValueError):
            return DEFAULT_MAX_RUN_TIME

    def _start(self, occ: OccurrenceContext, worker: str) -> RunStart:
        deadline = time.monotonic() + self.ledger_wait
        pause = 0.2
        while True:
            try:
                return ledger_store(self.app).start_run(
                    occ.schedule, occ.scheduled_at, task_id=occ.task_id, worker=worker, pid=os.getpid(),
                    retries=occ.attempt - 1, max_run_time=self._max_run_time(occ))
            except StoreUnavailable as exc:
                if time.monotonic() + pause > deadline:
                    return self._give_up(occ, worker, exc)
                logger.warning("cluster-beat ledger: %s[%s]: cannot start the run (%s); retrying", self.name,
                               occ.task_id, exc)
            time.sleep(pause)
            pause = min(pause * 2, 5.0)

    def _give_up(self, occ: OccurrenceContext, worker: str, exc: StoreUnavailable) -> RunStart:
        self._report(RunOutcome.LEDGER_UNAVAILABLE, occ, worker, error=str(exc))
        if self.acks_late:
            logger.error("cluster-beat ledger: %s[%s]: claim database unavailable for %gs (%s); not run, "
                         "message requeued", self.name, occ.task_id, self.ledger_wait, exc)
            raise Reject(str(exc), requeue=True)
        logger.error("cluster-beat ledger: %s[%s]: claim database unavailable for %gs (%s); not run",
                     self.name, occ.task_id, self.ledger_wait, exc)
        raise LedgerUnavailable(f"run of {occ.schedule} at {occ.scheduled_at.isoformat()} not started: "
                                f"the claim database did not answer for {self.ledger_wait:g}s ({exc})")

    def _finish(self, occ: OccurrenceContext, worker: str, token: str, state: RunState, runtime: float,
                error: Optional[str]) -> None:
        outcome = RunOutcome(state.value)
        for attempt in range(1, FINISH_TRIES + 1):
            try:
                if not ledger_store(self.app).finish_run(occ.schedule, occ.scheduled_at, token, state, runtime, error):
                    logger.info("cluster-beat ledger: %s[%s]: run of %s at %s was taken over before it ended; "
                                "its end is not recorded", self.name, occ.task_id, occ.schedule,
                                occ.scheduled_at.isoformat())
                break
            except StoreUnavailable as exc:
                if attempt == FINISH_TRIES:
                    logger.error("cluster-beat ledger: %s[%s]: cannot record the %s run of %s at %s (%s); "
                                 "it stays 'running' until max_run_time", self.name, occ.task_id, state.value,
                                 occ.schedule, occ.scheduled_at.isoformat(), exc)
                else:
                    time.sleep(FINISH_PAUSE)
        self._report(outcome, occ, worker, runtime=runtime, error=error)

    def _occurrence_headers(self) -> Dict[str, Any]:
        """The request's headers, with the cluster_beat_* ones it carries (a copy of the message keeps them)."""
        request = self.request
        headers = dict(request.headers or {})
        for name in HEADERS:
            value = request.get(name)
            if value is not None:
                headers.setdefault(name, value)
        return headers

    def _check_later(self, occ: OccurrenceContext, delay: float) -> None:
        """acks_late: the run this delivery duplicates may have died with its worker; publish a
        copy of the message for when it may be re-run (see the module docstring)."""
        countdown = delay + 1.0  # past the limit by the database's clock, whatever this host's says
        try:
            self.signature_from_request(self.request, countdown=countdown,
                                        headers=self._occurrence_headers()).apply_async()
        except Exception as exc:
            # Not acknowledged either: the broker redelivers this message instead.
            logger.error("cluster-beat ledger: %s[%s]: cannot schedule the check of the running run (%r); "
                         "message requeued", self.name, occ.task_id, exc)
            raise Reject(repr(exc), requeue=True)
        logger.info("cluster-beat ledger: %s[%s]: checking again in %.0fs whether the run of %s at %s ended "
                    "(acks_late: its worker may have died)", self.name, occ.task_id, countdown, occ.schedule,
                    occ.scheduled_at.isoformat())

    def _release(self, occ: OccurrenceContext, token: str) -> None:
        try:
            ledger_store(self.app).release_run(occ.schedule, occ.scheduled_at, token)
        except StoreUnavailable as exc:
            logger.error("cluster-beat ledger: %s[%s]: cannot release the rejected run (%s); a redelivery "
                         "runs only after max_run_time", self.name, occ.task_id, exc)

    def _report(self, outcome: RunOutcome, occ: OccurrenceContext, worker: str, *, runtime: Optional[float] = None,
                error: Optional[str] = None) -> None:
        try:
            signals.run_handled.send(sender=self, outcome=outcome, schedule=occ.schedule,
                                     scheduled_at=occ.scheduled_at, task_id=occ.task_id, worker=worker,
                                     runtime=runtime, error=error)
        except Exception:  # a receiver's bug must not change what the run does
            logger.exception("cluster-beat ledger: a run_handled receiver failed")


__all__ = ["LedgerTask", "LedgerUnavailable", "current_occurrence", "ledger_store", "OccurrenceContext"]
