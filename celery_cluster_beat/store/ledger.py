"""The worker-side execution ledger: one atomic transition per run, on the occurrence's claim row.

A message beat sends carries its occurrence (schedule, nominal instant). Before
the task body runs, the worker moves that occurrence's claim row from "not
started" to ``running`` (:meth:`LedgerQueries.start_run`); exactly one delivery
of the occurrence can make that move, so a second delivery (a same-id resend, a
broker redelivery, a duplicate from a producer) is recognised and not run. When
the body ends, the holder of the run records how it went
(:meth:`LedgerQueries.finish_run`). The claim rows thus become the run history,
pruned like any claim row; the overlap guard reads them back in one SELECT
(:meth:`LedgerQueries.run_states`).

Each decision is one conditional UPDATE in a short transaction, so it is exact
under concurrency on every server: PostgreSQL and MySQL/MariaDB (READ
COMMITTED) re-check the WHERE clause on the latest committed row after waiting
for a concurrent writer's lock, and SQLite writers are serialised (BEGIN
IMMEDIATE). Rules, in the order they are tried:

* **started**: the row has no run yet (``run_state`` NULL), whatever its claim
  status: a message can reach a worker before beat marks its row ``sent``.
* **continued**: a Celery retry (``retries`` > 0, same task id) takes the run over
  from an earlier attempt, ``retried`` or still ``running``: the retry message is
  published before the attempt that raised ``Retry`` records it. Which attempt holds
  the run is the zero-padded prefix of ``run_token``, so a duplicate of one retry
  message still finds its own attempt there and is not run twice.
* **rerun**: with ``max_run_time`` given (the task acknowledges late, so a worker that
  died mid-run has its message redelivered), a ``running`` row whose start is older
  than ``max_run_time`` by the database's clock is taken over and run again.
* otherwise **duplicate**: not run; the row's ``duplicates`` counter goes up. When re-runs
  are allowed and the run is still ``running``, the answer says how long until it may be
  re-run (``rerun_in``), so an acks_late worker can check again then instead of dropping
  what may be the only copy of a message whose worker died.
* **no row** (pruned, never claimed, or beat writes another store): the worker inserts
  the row itself (status ``sent``, reason saying so) with its run already started, by an
  insert-if-absent, so exactly one delivery still wins; a row beat inserts meanwhile
  is simply decided by the rules above.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Iterable, Optional

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..base import MAX_NAME_LENGTH, MAX_NODE_ID_LENGTH, StrEnum, clip
from ..schedules.instants import require_aware
from ..schedules.occurrence import occurrence_task_id
from .dialects.base import chunks, new_token
from .errors import database_errors
from .schema import RUN_ERROR_LENGTH, TASK_ID_LENGTH, ClaimStatus, RunState, claims_table

#: Width of the attempt number that prefixes a run token (see the module docstring).
_ATTEMPT_DIGITS = 4
_MAX_ATTEMPT = 10 ** _ATTEMPT_DIGITS - 1
#: Keys per SELECT of :meth:`LedgerQueries.run_states`.
_READ_CHUNK = 200
#: The reason written on a claim row the ledger had to create.
NO_CLAIM_REASON = "no claim row when the run started: recorded by the worker"


class StartOutcome(StrEnum):
    """What :meth:`LedgerQueries.start_run` decided for one delivery."""

    STARTED = "started"  # first run of the occurrence
    CONTINUED = "continued"  # a Celery retry of the run (same task id, retries > 0)
    RERUN = "rerun"  # redelivery after the previous start passed max_run_time (acks_late)
    DUPLICATE = "duplicate"  # another delivery holds or held the run: do not run


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
    #: For a duplicate that found the run ``running`` while re-runs are allowed (*max_run_time*
    #: given): seconds until its start is older than max_run_time, by the database's clock.
    rerun_in: Optional[float] = None

    @property
    def runs(self) -> bool:
        """Whether this delivery runs the body."""
        return self.outcome is not StartOutcome.DUPLICATE


@dataclass(frozen=True)
class LedgerState:
    """What the overlap guard reads of one occurrence's row (:meth:`LedgerQueries.run_states`)."""

    status: str  # a ClaimStatus value
    run_state: Optional[str]  # a RunState value, None before the run starts
    claimed_at: datetime
    sent_at: Optional[datetime]
    started_at: Optional[datetime]
    finished_at: Optional[datetime]


def attempt_token(retries: int) -> str:
    """A fresh run token for attempt *retries* (0 for the first run): the attempt, zero-padded,
    then random hex, 32 characters in all."""
    attempt = min(max(int(retries), 0), _MAX_ATTEMPT)
    return f"{attempt:0{_ATTEMPT_DIGITS}d}" + new_token()[: 32 - _ATTEMPT_DIGITS]


def error_summary(exc: BaseException) -> str:
    """The error text a run keeps: class and first line of the message, at most RUN_ERROR_LENGTH."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0]}" if lines and lines[0] else type(exc).__name__
    return clip(text, RUN_ERROR_LENGTH)


class LedgerQueries:
    """The ledger's statements; mixed into :class:`~.claims.ClaimStore`."""

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
        max_run_time: Optional[float] = None,
    ) -> RunStart:
        """Try to start the run of occurrence (*schedule*, *scheduled_at*) for this delivery.

        One short transaction; exactly one of several concurrent deliveries of one
        occurrence gets STARTED (see the module docstring for CONTINUED, RERUN and the
        row-less case). *max_run_time* None means a running row is never taken over.
        Raises StoreUnavailable when the database cannot answer, ValueError for a name
        or instant the claim table cannot hold.
        """
        at = require_aware(scheduled_at, "scheduled_at")
        if not schedule or len(schedule) > MAX_NAME_LENGTH:
            raise ValueError(f"schedule name must have 1 to {MAX_NAME_LENGTH} characters")
        self._dialect.check_name(schedule)
        if not task_id or len(task_id) > TASK_ID_LENGTH:
            task_id = occurrence_task_id(schedule, at)
        worker = clip(worker or "?", MAX_NODE_ID_LENGTH)
        token = attempt_token(retries)
        c = claims_table
        key = (c.c.schedule == schedule, c.c.scheduled_at == at)

        def take(conn: Connection, now: datetime, *cond: Any) -> bool:
            result = conn.execute(
                sa.update(c).where(*key, *cond).values(
                    run_state=RunState.RUNNING.value, run_token=token, worker=worker, worker_pid=int(pid),
                    started_at=now, finished_at=None, runtime=None, run_error=None,
                )
            )
            return result.rowcount == 1

        def work(conn: Connection) -> RunStart:
            now = self._now(conn)
            inserted = False
            for _ in range(3):
                if take(conn, now, c.c.run_state.is_(None)):
                    return RunStart(StartOutcome.STARTED, token, inserted=inserted)
                if retries > 0 and take(
                    conn, now,
                    c.c.run_state.in_([RunState.RETRIED.value, RunState.RUNNING.value]),
                    sa.or_(c.c.run_token.is_(None), c.c.run_token < token[:_ATTEMPT_DIGITS]),
                ):
                    return RunStart(StartOutcome.CONTINUED, token)
                if max_run_time is not None and take(
                    conn, now,
                    c.c.run_state == RunState.RUNNING.value,
                    c.c.started_at < now - timedelta(seconds=float(max_run_time)),
                ):
                    return RunStart(StartOutcome.RERUN, token)
                row = conn.execute(
                    sa.select(c.c.run_state, c.c.run_token, c.c.worker, c.c.started_at).where(*key)).first()
                if row is not None:
                    if row.run_token == token:  # the row this call inserted just now
                        return RunStart(StartOutcome.STARTED, token, inserted=True)
                    conn.execute(sa.update(c).where(*key).values(duplicates=sa.func.coalesce(c.c.duplicates, 0) + 1))
                    rerun_in = None
                    if max_run_time is not None and row.run_state == RunState.RUNNING.value and row.started_at:
                        age = (now - row.started_at).total_seconds()
                        rerun_in = max(0.0, float(max_run_time) - age)
                    return RunStart(StartOutcome.DUPLICATE, None, found_state=row.run_state,
                                    found_worker=row.worker, rerun_in=rerun_in)
                # No row: create it with the run started. Another delivery (or beat's claim)
                # inserting the same key meanwhile wins the insert; the next round decides.
                self._dialect.insert_if_absent(conn, c, [{
                    "schedule": schedule, "scheduled_at": at, "claimed_at": now, "node": worker, "term": None,
                    "task_id": task_id, "status": ClaimStatus.SENT.value, "reason": NO_CLAIM_REASON,
                    "attempts": 1, "sent_at": now, "run_state": RunState.RUNNING.value, "run_token": token,
                    "worker": worker, "worker_pid": int(pid), "started_at": now,
                }], ["schedule", "scheduled_at"])
                inserted = True
            raise RuntimeError("claim row kept changing while a run started")  # pragma: no cover

        return self._run(work)

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
                .values(run_state=None, run_token=None, worker=None, worker_pid=None, started_at=None)
            )
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
        cols = (c.c.schedule, c.c.scheduled_at, c.c.status, c.c.run_state, c.c.claimed_at, c.c.sent_at,
                c.c.started_at, c.c.finished_at)

        def read(conn: Connection) -> list[Any]:
            rows: list[Any] = []
            for chunk in chunks(wanted, _READ_CHUNK):
                cond = sa.or_(*(sa.and_(c.c.schedule == s, c.c.scheduled_at == at) for s, at in chunk))
                rows.extend(conn.execute(sa.select(*cols).where(cond)).all())
            return rows

        out: dict[tuple[str, datetime], LedgerState] = {}
        for r in self._run(read, write=False):
            out[(r.schedule, r.scheduled_at)] = LedgerState(r.status, r.run_state, r.claimed_at, r.sent_at,
                                                            r.started_at, r.finished_at)
        return out


__all__ = ["LedgerQueries", "LedgerState", "RunStart", "StartOutcome", "attempt_token", "error_summary",
           "NO_CLAIM_REASON"]
