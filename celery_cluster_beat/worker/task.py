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
* a delivery beat cannot have sent is **refused** (not run, nothing recorded, one WARNING,
  reported as ``refused``, :class:`~celery.exceptions.Ignore`): a row-less instant ahead of the
  claim database's clock, or its schedule's task is not this task (a config entry's from this
  worker's ``beat_schedule``, a stored schedule's from its row unless it changed since the
  instant; a schedule nobody names runs, with one WARNING: :mod:`..store.provenance`);
* Celery's retries (``self.retry``: same task id, ``retries`` > 0, any number of them)
  continue the run;
* **liveness, not age, decides a re-run** (acks_late): the row names the process that runs
  the body (``host:pid:random``), which heartbeats from a thread of its own
  (:mod:`.liveness`, every ``cluster_beat_worker_grace`` / 4 s, default grace 45 s). A
  delivery that finds the run ``running`` runs it again only when that process is known
  gone by the database's clock (heartbeat older than its grace, or recorded gone by its
  worker's main process, :mod:`.outcomes`), or finds it ``lost`` (the pool child died and
  Celery requeued the message): a live run is never started twice, however long it runs,
  and a dead one is re-run once. ``max_run_time`` plays no part;
* **at most one "check later" copy per run** (acks_late): a duplicate delivery that finds
  the run alive may be the broker's only copy of the message (Redis hands out an unacked
  message again after its visibility timeout and this delivery's ack consumes it), so
  unless a copy is pending it takes the row's one "check later" mark (atomically) and
  publishes one copy of the message (same task id and headers, plus the mark's id, no
  ``expires``), due when the process could be judged gone. The copy re-runs the run if
  its process is gone then, is a plain duplicate if the run ended, and otherwise takes the
  mark for the next check. Every other delivery meanwhile is a counted duplicate and is
  acknowledged. Without acks_late a running run is never taken over (its message was
  acknowledged before the run started, so no redelivery can stand for a lost run);
* when the body returns or raises, the row records finished time, runtime, outcome
  (succeeded / failed / retried) and the error's class and first line; a pool child that
  died, hit the hard time limit or was terminated by a revoke has its end recorded by its
  worker's main process (:mod:`.outcomes`: ``lost`` when the message is requeued,
  else ``failed`` with the reason).

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
briefly, logged, and handed to the process's heartbeat thread, which writes it once the
database answers (meanwhile the row reads ``running``, held by a live process).
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from functools import partial
from typing import Any, Dict, Optional, Tuple

from celery import Task, current_task
from celery.exceptions import Ignore, Reject, Retry

from .. import signals
from ..base import MAX_NODE_ID_LENGTH, clip
from ..config.settings import db_timeout_setting, default_db_url
from ..config.values import shown
from ..signals import RunOutcome
from ..store import ClaimStore, StoreUnavailable
from ..store.dialects.base import new_token
from ..store.ledger import RunStart, StartOutcome, error_summary
from ..store.liveness import ProcessGone
from ..store.schema import RunState
from .calls import enters_delivery
from .liveness import defer, process_id, renew_identity, start_heartbeat, worker_grace
from .protocol import HEADER_CHECK, HEADERS, OccurrenceContext, ProtocolError
from .provenance import configured_task, refusal_text, warn_unchecked
from .tracking import TrackStarted, TrackStartedType, store_started

logger = logging.getLogger("celery_cluster_beat.worker")

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


def _db_url(app: Any) -> str:
    return app.conf.get("cluster_beat_db_url") or default_db_url(app.conf)  # beat_schedule_filename, as beat


def ledger_store(app: Any, *, heartbeat: bool = True) -> ClaimStore:
    """This process's claim store for *app* (``cluster_beat_db_url``), opened on first use.

    One per process and URL: a pool child opens its own after the fork, never
    reusing connections its parent made. Threads of one process share it. With
    *heartbeat* (a process that runs ledger tasks), this process's heartbeat thread
    is started too (worker/liveness.py); a worker's main process that only records
    its pool children's losses (worker/outcomes.py) passes False.
    """
    url = _db_url(app)
    key = (os.getpid(), url)
    store = _stores.get(key)
    if store is not None:
        if heartbeat:
            start_heartbeat(store, app)
        return store
    with _stores_lock:
        store = _stores.get(key)
        if store is None:
            node = clip(f"worker:{socket.gethostname()}:{os.getpid()}", MAX_NODE_ID_LENGTH)
            store = ClaimStore(url, node_id=node, db_timeout=db_timeout_setting(app.conf))
            store.open()  # StoreUnavailable when down: not cached, the next run tries again
            _stores[key] = store
    if heartbeat:
        start_heartbeat(store, app)
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


class LedgerTask(Task, metaclass=TrackStartedType):
    """Celery task base class: a scheduled occurrence runs once per occurrence (see the module docstring)."""

    #: Seconds to keep trying the claim database before a run is given up (see the module docstring).
    ledger_wait: float = 30.0
    #: Beat's overlap guard reads this task's runs from the ledger (config.observing.LEDGER_MARK).
    cluster_beat_ledger = True
    #: The worker's main process records here what a pool child could not (worker/outcomes.py).
    Request = "celery_cluster_beat.worker.outcomes:LedgerRequest"
    #: task_track_started for this task (None: the app's); Celery's tracer reads ``track_started``
    #: False and the ledger stores STARTED once the delivery may run (worker/tracking.py).
    ledger_track_started: Optional[bool] = None
    track_started = TrackStarted()

    @property
    def occurrence(self) -> Optional[OccurrenceContext]:
        """The occurrence this run serves (None when not sent by beat)."""
        try:
            return OccurrenceContext.from_request(self.request)
        except ProtocolError:
            return None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        if not enters_delivery(self, request):  # a direct call, inside a run too: a plain call (worker/calls.py)
            return super().__call__(*args, **kwargs)
        try:
            occ = OccurrenceContext.from_request(request)
        except ProtocolError as exc:
            logger.warning("cluster-beat ledger: %s[%s]: %s; run without the ledger", self.name, request.id, exc)
            occ = None
        if occ is None:
            store_started(self, request)
            return super().__call__(*args, **kwargs)
        worker = request.hostname or socket.gethostname()
        start = self._start(occ, worker)
        if start.outcome is StartOutcome.REFUSED:  # headers beat cannot have written (worker/provenance.py)
            logger.warning("cluster-beat ledger: %s[%s]: delivery for %s at %s refused: %s; not run, nothing "
                           "recorded", self.name, request.id, shown(occ.schedule, 300), occ.scheduled_at.isoformat(),
                           refusal_text(start, self.name, occ.schedule))
            self._report(RunOutcome.REFUSED, occ, worker)
            raise Ignore()
        if start.unchecked:
            warn_unchecked(logger, occ.schedule, self.name, start.unchecked)
        if not start.runs:
            logger.warning(
                "cluster-beat ledger: %s[%s]: duplicate delivery of %s at %s not run (run %s, worker %s)",
                self.name, occ.task_id, occ.schedule, occ.scheduled_at.isoformat(), start.found_state or "started",
                start.found_worker or "?")
            self._report(RunOutcome.DUPLICATE_SKIPPED, occ, worker)
            if start.check_token is not None and start.check_in is not None:
                self._check_later(occ, start.check_in, start.check_token)
            raise Ignore()
        if start.outcome is not StartOutcome.STARTED or start.inserted:
            logger.info("cluster-beat ledger: %s[%s]: %s %s at %s%s", self.name, occ.task_id, start.outcome.value,
                        occ.schedule, occ.scheduled_at.isoformat(),
                        " (no claim row: recorded by the worker)" if start.inserted else "")
        self._report(_START_OUTCOME[start.outcome], occ, worker)
        began = time.monotonic()
        token = start.token or ""
        try:
            store_started(self, request)  # only now: a duplicate never writes STARTED (worker/tracking.py)
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
        except (SystemExit, KeyboardInterrupt) as exc:
            # This process is being stopped mid-run (a terminating revoke, a cold shutdown). With
            # acks_late its message may come back: 'lost' lets that delivery run it again; the main
            # process overrides this with 'failed' when Celery acknowledges the message (outcomes.py).
            self._finish(occ, worker, token, RunState.LOST if self.acks_late else RunState.FAILED,
                         time.monotonic() - began, f"worker process stopped mid-run: {error_summary(exc)}")
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
    def _start(self, occ: OccurrenceContext, worker: str) -> RunStart:
        """Start the run for this delivery, retrying while the database does not answer.

        One token for the delivery, passed to every try: a try whose COMMIT went through although
        the answer was lost (the connection cut by the store's watchdog) is found again as this
        delivery's own start, never as a duplicate (which would drop the run unseen). A try that
        finds this process recorded gone retries at once under a new identity (worker/liveness.py).
        """
        deadline = time.monotonic() + self.ledger_wait
        pause = 0.2
        token = new_token()[:32]
        renewed = 0
        while True:
            process = process_id()
            try:
                return ledger_store(self.app).start_run(
                    occ.schedule, occ.scheduled_at, task_id=occ.task_id, worker=worker, pid=os.getpid(),
                    retries=occ.attempt - 1, process=process, grace=worker_grace(self.app),
                    takeover=bool(self.acks_late), check=self._check_header(), token=token, task=self.name,
                    schedule_task=configured_task(self.app, occ.schedule))
            except ProcessGone:
                renew_identity(process)
                renewed += 1
                if renewed < 3:
                    continue  # at once: the new identity's row is written by the same call
                raise  # pragma: no cover  (a fresh identity is never gone: a bug, not an outage)
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
                                 "this process's heartbeat thread keeps trying", self.name, occ.task_id,
                                 state.value, occ.schedule, occ.scheduled_at.isoformat(), exc)
                    store = _stores.get((os.getpid(), _db_url(self.app)))
                    if store is not None:
                        defer(partial(store.finish_run, occ.schedule, occ.scheduled_at, token, state, runtime,
                                      error))
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

    def _check_header(self) -> Optional[str]:
        value = self.request.get(HEADER_CHECK) or (self.request.headers or {}).get(HEADER_CHECK)
        return value if isinstance(value, str) else None

    def _check_later(self, occ: OccurrenceContext, delay: float, check: str) -> None:
        """acks_late: this delivery found the run alive and holds the row's one "check later" mark:
        publish the one copy of the message, due when the run's process could be judged gone
        (see the module docstring). The copy carries the mark's id and no ``expires``."""
        countdown = delay + 1.0  # past the limit by the database's clock, whatever this host's says
        headers = {**self._occurrence_headers(), HEADER_CHECK: check}
        try:
            self.signature_from_request(self.request, countdown=countdown, expires=None,
                                        headers=headers).apply_async()
        except Exception as exc:
            # Not acknowledged either: the broker redelivers this message instead, and the mark is
            # given back so that delivery (or another) sends the copy.
            logger.error("cluster-beat ledger: %s[%s]: cannot schedule the check of the running run (%r); "
                         "message requeued", self.name, occ.task_id, exc)
            try:
                ledger_store(self.app).drop_check(occ.schedule, occ.scheduled_at, check)
            except StoreUnavailable:
                pass  # the mark counts as lost a minute after it was due
            raise Reject(repr(exc), requeue=True)
        logger.info("cluster-beat ledger: %s[%s]: checking again in %.0fs whether the run of %s at %s is alive "
                    "(acks_late: its worker may die)", self.name, occ.task_id, countdown, occ.schedule,
                    occ.scheduled_at.isoformat())

    def _release(self, occ: OccurrenceContext, token: str) -> None:
        try:
            ledger_store(self.app).release_run(occ.schedule, occ.scheduled_at, token)
        except StoreUnavailable as exc:
            logger.error("cluster-beat ledger: %s[%s]: cannot release the rejected run (%s); a redelivery "
                         "runs it once this process is gone", self.name, occ.task_id, exc)

    def _report(self, outcome: RunOutcome, occ: OccurrenceContext, worker: str, *, runtime: Optional[float] = None,
                error: Optional[str] = None) -> None:
        try:
            signals.run_handled.send(sender=self, outcome=outcome, schedule=occ.schedule,
                                     scheduled_at=occ.scheduled_at, task_id=occ.task_id, worker=worker,
                                     runtime=runtime, error=error)
        except Exception:  # a receiver's bug must not change what the run does
            logger.exception("cluster-beat ledger: a run_handled receiver failed")


__all__ = ["LedgerTask", "LedgerUnavailable", "current_occurrence", "ledger_store", "OccurrenceContext"]
