"""The worker-side execution ledger: one atomic transition per run, on the occurrence's claim row.

A message beat sends carries its occurrence (schedule, nominal instant). Before
the task body runs, the worker moves that occurrence's claim row from "not
started" to ``running`` (:meth:`LedgerQueries.start_run`); exactly one delivery
of the occurrence can make that move, so a second delivery (a same-id resend, a
broker redelivery, a duplicate from a producer) is recognised and not run. When
the body ends, the holder of the run records how it went
(:meth:`LedgerQueries.finish_run`); when the process running it dies, its worker's
main process records the end instead (:meth:`LedgerQueries.end_lost_run`). The claim
rows thus become the run history, pruned like any claim row; the overlap guard reads
them back in one SELECT (:meth:`LedgerQueries.run_states`), where a ``running`` row
whose process is known gone reads as ``failed`` (over).

Each decision is one conditional UPDATE in a short transaction, exact under concurrency on
every server: PostgreSQL and MySQL/MariaDB (READ COMMITTED) re-check the WHERE clause on the
latest committed row after waiting for a writer's lock, SQLite serialises writers (BEGIN
IMMEDIATE). Rules, in the order they are tried:

* **started**: the row has no run yet (``run_state`` NULL), whatever its claim
  status: a message can reach a worker before beat marks its row ``sent``.
* **continued**: a Celery retry (``retries`` > 0, same task id) takes the run over
  from an earlier attempt, ``retried``, ``lost`` or still ``running``: the retry message is
  published before the attempt that raised ``Retry`` records it. The row keeps the
  attempt holding the run (``run_attempt``, any integer), so a duplicate of one retry
  message finds its own attempt there and is not run twice, and a late copy of an
  earlier attempt is a duplicate.
* **rerun** (only when the caller allows take-overs: the task acknowledges late, so a
  worker that died mid-run has its message redelivered): a ``lost`` row (its worker's
  main process saw the pool child die and Celery requeued the message), or a ``running``
  row whose process (``run_process``) is known gone by the database's clock (see
  :mod:`.liveness`: heartbeat expired or recorded gone) is taken over, by a
  compare-and-set on the holder's token, so one delivery re-runs it; the old holder is
  recorded gone in the same transaction, so a late heartbeat of it cannot revive it (it
  takes a new identity instead). How long the run has been going never matters: a live run
  is never started twice. A row written without a process (an older release) is never judged.
* otherwise **duplicate**: not run; the row's ``duplicates`` counter goes up. When the
  run is ``running`` under a live process and take-overs are allowed, the delivery may
  take the row's one "check later" mark (``check_token``, ``check_at``; atomically): when
  it is the pending copy itself (its ``cluster_beat_check`` header matches), or no copy is
  pending (none, or one a minute overdue, taken as lost). It then publishes one copy of
  the message due when the process could be judged gone (``check_in``), so a run whose
  worker dies after the broker's last copy was acknowledged is still re-run.
* **this delivery's own start**: the row is ``running`` under the token the caller passed
  (one token per delivery, kept across its retries of ``start_run``): an earlier call of this
  delivery committed but its answer was lost (a connection cut during COMMIT); STARTED
  again, so the body runs, instead of a DUPLICATE that would drop the run unseen.
* **no row** (pruned, never claimed, or beat writes another store): the worker inserts
  the row itself (status ``sent``, reason saying so) with its run already started, by an
  insert-if-absent, so exactly one delivery still wins; a row beat inserts meanwhile
  is simply decided by the rules above.

First of all, a delivery whose headers beat cannot have written is **refused** (not run, nothing
written): a row-less instant well ahead of the database's clock, or a schedule that runs another
task; one whose task nobody can check runs, flagged ``unchecked`` (:mod:`.provenance`).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any, Iterable, Optional

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..base import MAX_NAME_LENGTH, MAX_NODE_ID_LENGTH, StrEnum, clip
from ..schedules.instants import require_aware
from ..schedules.occurrence import occurrence_task_id
from .dialects.base import chunks, new_token
from .errors import database_errors
from .liveness import ProcessGone, WorkerLiveness, alive_until, mark_gone
from .provenance import FUTURE_MARGIN, Provenance, Refusal, Unchecked, provenance
from .schema import RUN_ERROR_LENGTH, TASK_ID_LENGTH, ClaimStatus, RunState, claims_table, workers_table

#: Run states a Celery retry (a later attempt, same task id) continues.
_CONTINUABLE = (RunState.RETRIED.value, RunState.RUNNING.value, RunState.LOST.value)
#: A "check later" copy this much past its due time counts as lost: another may be sent.
CHECK_LOST_AFTER = timedelta(seconds=60)
#: Keys per SELECT of :meth:`LedgerQueries.run_states`.
_READ_CHUNK = 200
#: The reason written on a claim row the ledger had to create.
NO_CLAIM_REASON = "no claim row when the run started: recorded by the worker"


class StartOutcome(StrEnum):
    """What :meth:`LedgerQueries.start_run` decided for one delivery."""

    STARTED = "started"  # first run of the occurrence
    CONTINUED = "continued"  # a Celery retry of the run (same task id, retries > 0)
    RERUN = "rerun"  # redelivery of a run whose process is known gone (acks_late)
    DUPLICATE = "duplicate"  # another delivery holds or held the run: do not run
    REFUSED = "refused"  # the headers cannot be those of a message beat sent: do not run (see Refusal)


@dataclass(frozen=True)
class RunStart:
    """The answer of :meth:`LedgerQueries.start_run`."""

    outcome: StartOutcome
    #: The token the run is held by (pass it to finish_run); None for a duplicate.
    token: Optional[str]
    #: The run state found on the row when this delivery is a duplicate (None: not started
    #: yet, which a duplicate never sees) and who held it, for the log line.
    found_state: Optional[str] = None
    found_worker: Optional[str] = None
    #: True when no claim row existed and the ledger created it.
    inserted: bool = False
    #: For a duplicate that found the run ``running`` under a live process while take-overs are
    #: allowed, and no "check later" copy pending: this delivery publishes the one copy, with
    #: this id (header ``cluster_beat_check``), due in *check_in* seconds, when the process
    #: could be judged gone by the database's clock. None otherwise.
    check_token: Optional[str] = None
    check_in: Optional[float] = None
    #: For a refused delivery: why, the database's time of the decision, and the schedule's task
    #: (None when the schedule is unknown).
    refusal: Optional[Refusal] = None
    db_now: Optional[datetime] = None
    schedule_task: Optional[str] = None
    #: Why the delivered task went unchecked (it runs), or None: it was checked (or not asked for).
    unchecked: Optional[Unchecked] = None

    @property
    def runs(self) -> bool:
        """Whether this delivery runs the body."""
        return self.outcome not in (StartOutcome.DUPLICATE, StartOutcome.REFUSED)


@dataclass(frozen=True)
class LedgerState:
    """What the overlap guard reads of one occurrence's row (:meth:`LedgerQueries.run_states`)."""

    status: str  # a ClaimStatus value
    run_state: Optional[str]  # a RunState value, None before the run starts
    claimed_at: datetime
    sent_at: Optional[datetime]
    started_at: Optional[datetime]
    finished_at: Optional[datetime]
    #: The row says ``running`` but its process is known gone: reported as ``failed`` (over).
    worker_gone: bool = False


def error_summary(exc: BaseException) -> str:
    """The error text a run keeps: class and first line of the message, at most RUN_ERROR_LENGTH."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0]}" if lines and lines[0] else type(exc).__name__
    return clip(text, RUN_ERROR_LENGTH)


class LedgerQueries(WorkerLiveness):
    """The ledger's statements (and the worker heartbeats they judge by); mixed into :class:`~.claims.ClaimStore`."""

    # ClaimStore provides _dialect, url_masked, _run(work, write=...) and _now(conn).
    _dialect: Any
    url_masked: str

    @database_errors
    def start_run(
        self,
        schedule: str,
        scheduled_at: datetime,
        *,
        task_id: str,
        worker: str,
        pid: int,
        retries: int = 0,
        process: Optional[str] = None,
        grace: Optional[float] = None,
        takeover: bool = False,
        check: Optional[str] = None,
        token: Optional[str] = None,
        task: Optional[str] = None,
        schedule_task: Optional[str] = None,
    ) -> RunStart:
        """Try to start the run of occurrence (*schedule*, *scheduled_at*) for this delivery.

        One short transaction; exactly one of several concurrent deliveries of one
        occurrence gets STARTED (see the module docstring for CONTINUED, RERUN, the
        "check later" copy and the row-less case). *process* is the id of the process that
        will run the body (its heartbeat row decides whether the run is alive); *takeover*
        (the task acknowledges late) allows a run whose process is gone to be run again;
        *check* is the id of the "check later" copy this delivery is, if it is one. With
        *grace*, the process's heartbeat is refreshed in the same transaction (so a run never
        names a process the database has not heard of); when that process is recorded gone,
        nothing is done and :class:`~.liveness.ProcessGone` is raised (take a new identity).
        *token* identifies this delivery (generated when None): pass the same one to every
        retry of this call for one delivery, so a start that committed although its caller saw
        an error is recognised as this delivery's own (STARTED), not as a duplicate.
        *task* (delivered) must be the schedule's: *schedule_task* (its config entry's) or its stored
        row's, else REFUSED, as a row-less future instant always is (None: no task check; see
        :mod:`.provenance`). Raises
        StoreUnavailable when the database cannot answer, ValueError for a name or instant the claim
        table cannot hold.
        """
        at = require_aware(scheduled_at, "scheduled_at")
        if not schedule or len(schedule) > MAX_NAME_LENGTH:
            raise ValueError(f"schedule name must have 1 to {MAX_NAME_LENGTH} characters")
        self._dialect.check_name(schedule)
        if not task_id or len(task_id) > TASK_ID_LENGTH:
            task_id = occurrence_task_id(schedule, at)
        worker = clip(worker or "?", MAX_NODE_ID_LENGTH)
        process = clip(process, MAX_NODE_ID_LENGTH) if process else None
        attempt = max(int(retries), 0)
        token = (token or new_token())[:32]
        c = claims_table
        key = (c.c.schedule == schedule, c.c.scheduled_at == at)

        def take(conn: Connection, now: datetime, *cond: Any) -> bool:
            result = conn.execute(
                sa.update(c).where(*key, *cond).values(
                    run_state=RunState.RUNNING.value, run_token=token, worker=worker, worker_pid=int(pid),
                    run_process=process, run_attempt=attempt, started_at=now, finished_at=None, runtime=None,
                    run_error=None, check_token=None, check_at=None,
                )
            )
            return result.rowcount == 1

        def work(conn: Connection) -> Optional[RunStart]:
            now = self._now(conn)
            found = provenance(conn, schedule, at, now, task, schedule_task)
            if found.refusal is not None:
                return RunStart(StartOutcome.REFUSED, None, refusal=found.refusal, db_now=now,
                                schedule_task=found.schedule_task)
            checked.append(found)
            if process is not None and grace is not None:
                if not self._beat(conn, process, process.rsplit(":", 2)[0], pid, grace):
                    return None  # ProcessGone, raised below
            inserted = False
            for _ in range(3):
                if take(conn, now, c.c.run_state.is_(None)):
                    return RunStart(StartOutcome.STARTED, token, inserted=inserted)
                if attempt > 0 and take(
                    conn, now,
                    c.c.run_state.in_(_CONTINUABLE),
                    sa.or_(c.c.run_attempt.is_(None), c.c.run_attempt < attempt),
                ):
                    return RunStart(StartOutcome.CONTINUED, token)
                row = conn.execute(sa.select(
                    c.c.run_state, c.c.run_token, c.c.run_attempt, c.c.run_process, c.c.worker, c.c.check_token,
                    c.c.check_at).where(*key)).first()
                if row is None:
                    # No row: create it with the run started. Another delivery (or beat's claim)
                    # inserting the same key meanwhile wins the insert; the next round decides.
                    self._dialect.insert_if_absent(conn, c, [{
                        "schedule": schedule, "scheduled_at": at, "claimed_at": now, "node": worker, "term": None,
                        "task_id": task_id, "status": ClaimStatus.SENT.value, "reason": NO_CLAIM_REASON,
                        "attempts": 1, "sent_at": now, "run_state": RunState.RUNNING.value, "run_token": token,
                        "worker": worker, "worker_pid": int(pid), "run_process": process, "run_attempt": attempt,
                        "started_at": now,
                    }], ["schedule", "scheduled_at"])
                    inserted = True
                    continue
                if row.run_token == token and row.run_state == RunState.RUNNING.value:
                    # The row this call inserted just now, or this delivery's own earlier start
                    # whose answer was lost (see the module docstring): the body runs.
                    return RunStart(StartOutcome.STARTED, token, inserted=inserted)
                if row.run_state is None:  # released meanwhile: the next round starts it
                    continue
                stale = row.run_attempt is not None and row.run_attempt > attempt  # an earlier attempt's copy
                # A running row names its process; one written without (an older release) is never
                # judged: it is neither taken over nor checked on.
                judged = row.run_state == RunState.RUNNING.value and row.run_process is not None
                alive = alive_until(conn, row.run_process, now) if judged else None
                if takeover and not stale and (row.run_state == RunState.LOST.value or (judged and alive is None)):
                    # Compare-and-set on the holder's token: of concurrent deliveries deciding the
                    # same dead run, one re-runs it; the others find the new holder next round.
                    if take(conn, now, c.c.run_token == row.run_token, c.c.run_state == row.run_state):
                        if row.run_process is not None:  # a late heartbeat must not revive it
                            mark_gone(conn, row.run_process, now, "its run was taken over")
                        return RunStart(StartOutcome.RERUN, token)
                    continue
                conn.execute(sa.update(c).where(*key).values(duplicates=sa.func.coalesce(c.c.duplicates, 0) + 1))
                check_token, check_in = None, None
                if takeover and alive is not None:
                    check_token, check_in = self._pending_check(conn, key, row, check, alive, now)
                return RunStart(StartOutcome.DUPLICATE, None, found_state=row.run_state, found_worker=row.worker,
                                check_token=check_token, check_in=check_in)
            raise RuntimeError("claim row kept changing while a run started")  # pragma: no cover

        checked: list[Provenance] = []
        started = self._run(work)
        if started is None:
            raise ProcessGone(f"worker process {process} is recorded gone: take a new identity")
        return replace(started, unchecked=checked[-1].unchecked) if checked else started

    def _pending_check(self, conn: Connection, key: Any, row: Any, check: Optional[str], due: datetime,
                       now: datetime) -> tuple[Optional[str], Optional[float]]:
        """Take the row's one "check later" mark for this delivery, if it may: it is the pending
        copy itself, or no copy is pending (none, or one overdue by a full :data:`CHECK_LOST_AFTER`,
        taken as lost). Returns (copy id, seconds until due) or (None, None)."""
        c = claims_table
        if check is not None and row.check_token == check:
            cond: Any = c.c.check_token == check  # the pending copy, finding the run alive: the next one
        elif row.check_token is None:
            cond = c.c.check_token.is_(None)
        elif row.check_at is not None and row.check_at < now - CHECK_LOST_AFTER:
            cond = c.c.check_token == row.check_token
        else:
            return None, None
        new = new_token()[:32]
        if conn.execute(sa.update(c).where(*key, cond).values(check_token=new, check_at=due)).rowcount != 1:
            return None, None
        return new, max(0.0, (due - now).total_seconds())

    @database_errors
    def finish_run(
        self,
        schedule: str,
        scheduled_at: datetime,
        token: str,
        state: RunState,
        runtime: Optional[float] = None,
        error: Optional[str] = None,
    ) -> bool:
        """Record how the run held by *token* ended (SUCCEEDED, FAILED or RETRIED).

        Only the holder writes: a run taken over meanwhile (a retry that already
        continued it, a rerun) is not overwritten. Returns whether the row changed.
        """
        state = RunState(state)
        if state is RunState.RUNNING:
            raise ValueError("finish_run() records an end state, not 'running'")
        at = require_aware(scheduled_at, "scheduled_at")
        c = claims_table

        def work(conn: Connection) -> bool:
            result = conn.execute(
                sa.update(c)
                .where(c.c.schedule == schedule, c.c.scheduled_at == at, c.c.run_token == token,
                       c.c.run_state == RunState.RUNNING.value)
                .values(run_state=state.value, finished_at=self._now(conn),
                        runtime=None if runtime is None else float(runtime),
                        run_error=None if error is None else clip(str(error), RUN_ERROR_LENGTH))
            )
            return result.rowcount == 1

        return bool(self._run(work))

    @database_errors
    def release_run(self, schedule: str, scheduled_at: datetime, token: str) -> bool:
        """Undo the start of the run held by *token* (the task rejected its message for a
        requeue): the next delivery starts it afresh. Returns whether the row changed."""
        at = require_aware(scheduled_at, "scheduled_at")
        c = claims_table

        def work(conn: Connection) -> bool:
            result = conn.execute(
                sa.update(c)
                .where(c.c.schedule == schedule, c.c.scheduled_at == at, c.c.run_token == token,
                       c.c.run_state == RunState.RUNNING.value)
                .values(run_state=None, run_token=None, worker=None, worker_pid=None, started_at=None,
                        run_process=None, run_attempt=None, check_token=None, check_at=None)
            )
            return result.rowcount == 1

        return bool(self._run(work))

    @database_errors
    def drop_check(self, schedule: str, scheduled_at: datetime, check_token: str) -> bool:
        """Clear the "check later" mark *check_token* (its copy could not be published), so the
        next delivery that finds the run alive sends one."""
        at = require_aware(scheduled_at, "scheduled_at")
        c = claims_table

        def work(conn: Connection) -> bool:
            return conn.execute(sa.update(c).where(c.c.schedule == schedule, c.c.scheduled_at == at,
                                                   c.c.check_token == check_token)
                                .values(check_token=None, check_at=None)).rowcount == 1

        return bool(self._run(work))

    @database_errors
    def end_lost_run(
        self,
        schedule: str,
        scheduled_at: datetime,
        *,
        host: str,
        pid: int,
        state: RunState,
        error: Optional[str],
        runtime: Optional[float] = None,
        worker: Optional[str] = None,
    ) -> bool:
        """Record the end of the run of (*schedule*, *scheduled_at*) whose pool child (*pid* on
        *host*) its worker's main process saw die (lost, killed at a hard time limit, terminated
        by a revoke), and record that child gone, in one transaction.

        Only the process the run's row names (``run_process``) is judged, and only when its
        heartbeat row has this *host* and *pid* (and the row's ``worker`` is *worker*, when
        given): host and pid alone do not name a process (containers sharing a host name have
        the same small pids), so no other process is ever recorded gone. A run taken over
        meanwhile is left alone, and so is the dead child's own row (it expires).

        *state* LOST (Celery requeued the message: its next delivery runs it again at once),
        RETRIED (Celery published a retry, which continues the run) or FAILED (the run is
        over). Returns whether the run's row changed.
        """
        state = RunState(state)
        if state not in (RunState.LOST, RunState.FAILED, RunState.RETRIED):
            raise ValueError("end_lost_run() records 'lost', 'retried' or 'failed'")
        at = require_aware(scheduled_at, "scheduled_at")
        c, w = claims_table, workers_table
        host = clip(host, MAX_NODE_ID_LENGTH)
        summary = None if error is None else clip(str(error), RUN_ERROR_LENGTH)
        key = (c.c.schedule == schedule, c.c.scheduled_at == at)

        def work(conn: Connection) -> bool:
            now = self._now(conn)
            run = conn.execute(sa.select(c.c.run_process, c.c.worker).where(*key)).first()
            if run is None or run.run_process is None or (worker is not None and run.worker != clip(
                    worker, MAX_NODE_ID_LENGTH)):
                return False
            proc = conn.execute(sa.select(w.c.host, w.c.pid).where(w.c.process == run.run_process)).first()
            if proc is None or proc.host != host or proc.pid != int(pid):
                return False
            mark_gone(conn, run.run_process, now, summary or "")
            result = conn.execute(
                sa.update(c)
                .where(*key,
                       # 'lost': the child's own guess as it was stopped; the main process knows better.
                       c.c.run_state.in_([RunState.RUNNING.value, RunState.LOST.value]),
                       c.c.run_process == run.run_process)
                .values(run_state=state.value, finished_at=now, runtime=None if runtime is None else float(runtime),
                        run_error=summary))
            return result.rowcount == 1

        return bool(self._run(work))

    @database_errors
    def run_states(self, keys: Iterable[tuple[str, datetime]]) -> dict[tuple[str, datetime], LedgerState]:
        """The ledger state of each (schedule, nominal instant) that has a row, in one SELECT
        (a few for many keys); keys without a row are left out."""
        wanted = sorted({(s, require_aware(at, "scheduled_at")) for s, at in keys})
        if not wanted:
            return {}
        c = claims_table
        w = workers_table
        # A running row is alive while its process's heartbeat row is (see .liveness).
        alive = sa.exists().where(w.c.process == c.c.run_process, w.c.gone_at.is_(None),
                                  w.c.expires_at >= sa.bindparam("now"))
        cols = (c.c.schedule, c.c.scheduled_at, c.c.status, c.c.run_state, c.c.claimed_at, c.c.sent_at,
                c.c.started_at, c.c.finished_at, c.c.run_process, alive.label("alive"))

        def read(conn: Connection) -> tuple[datetime, list[Any]]:
            now = self._now(conn)
            rows: list[Any] = []
            for chunk in chunks(wanted, _READ_CHUNK):
                cond = sa.or_(*(sa.and_(c.c.schedule == s, c.c.scheduled_at == at) for s, at in chunk))
                rows.extend(conn.execute(sa.select(*cols).where(cond), {"now": now}).all())
            return now, rows

        out: dict[tuple[str, datetime], LedgerState] = {}
        _, rows = self._run(read, write=False)
        for r in rows:
            state, gone = r.run_state, False
            if state == RunState.RUNNING.value and r.run_process is not None and not r.alive:
                # Its process is known gone: the run is over as far as anyone waiting on it goes
                # (an acks_late redelivery may still run it again, as a new start).
                state, gone = RunState.FAILED.value, True
            out[(r.schedule, r.scheduled_at)] = LedgerState(r.status, state, r.claimed_at, r.sent_at,
                                                            r.started_at, r.finished_at, gone)
        return out


__all__ = ["LedgerQueries", "LedgerState", "RunStart", "StartOutcome", "Refusal", "Unchecked", "error_summary",
           "FUTURE_MARGIN", "NO_CLAIM_REASON"]
