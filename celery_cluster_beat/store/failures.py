"""The reads behind ``pause_after_failures``: runs that failed lately, and a schedule's last ended runs.

Both are indexed: the first goes through ``ix_cluster_beat_claims_run_state_finished_at`` (version
6), so a pass finding nothing failed reads nothing else, however many schedules and rows there
are; the second walks one schedule's rows backwards along the primary key (schedule, instant).
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Tuple

import sqlalchemy as sa

from .errors import database_errors
from .schema import RunState, claims_table

if TYPE_CHECKING:  # pragma: no cover
    from sqlalchemy.engine import Connection

#: Run states that end a run for the streak: a success resets it, a failure extends it.
ENDED = (RunState.SUCCEEDED.value, RunState.FAILED.value)


@dataclass(frozen=True)
class EndedRun:
    """One run that ended, as the failure streak reads it."""

    scheduled_at: datetime
    run_state: RunState  # succeeded or failed
    finished_at: Optional[datetime]
    run_error: Optional[str]
    task_id: str


class FailureQueries:
    """Mixed into :class:`~.claims.ClaimStore`: it provides ``_run``."""

    if TYPE_CHECKING:  # pragma: no cover
        def _run(self, work: Callable[["Connection"], Any], *, write: bool = True) -> Any: ...

    @database_errors
    def failed_since(self, since: datetime, *, limit: int = 500,
                     after: Optional[Tuple[datetime, str, datetime]] = None) -> List[Tuple[str, datetime, datetime]]:
        """(schedule, instant, finished_at) of runs recorded ``failed`` after *since* (database clock),
        oldest first by (finished_at, schedule, instant): one indexed SELECT. *after*, the
        (finished_at, schedule, instant) of the last row of a full page, reads the next page instead
        (runs that finished at the same time as that row included: none is skipped at a page's edge)."""
        c = claims_table
        cond = [c.c.run_state == RunState.FAILED.value]
        if after is None:
            cond.append(c.c.finished_at > since)
        else:
            at, name, instant = after
            cond.append(sa.or_(c.c.finished_at > at, sa.and_(c.c.finished_at == at, sa.or_(
                c.c.schedule > name, sa.and_(c.c.schedule == name, c.c.scheduled_at > instant)))))
        stmt = (sa.select(c.c.schedule, c.c.scheduled_at, c.c.finished_at).where(*cond)
                .order_by(c.c.finished_at, c.c.schedule, c.c.scheduled_at).limit(limit))
        return [tuple(r) for r in self._run(lambda conn: conn.execute(stmt).all(), write=False)]

    @database_errors
    def last_ended_runs(self, name: str, count: int, *, after: Optional[datetime] = None) -> List[EndedRun]:
        """The *count* latest runs of *name* (by instant, newest first) that ended succeeded or failed,
        those that finished after *after* only (a resume: the streak restarts there)."""
        c = claims_table
        cond = [c.c.schedule == name, c.c.run_state.in_(ENDED)]
        if after is not None:
            cond.append(c.c.finished_at > after)
        stmt = (sa.select(c.c.scheduled_at, c.c.run_state, c.c.finished_at, c.c.run_error, c.c.task_id)
                .where(*cond).order_by(c.c.scheduled_at.desc()).limit(count))
        return [EndedRun(at, RunState(state), *rest)
                for at, state, *rest in self._run(lambda conn: conn.execute(stmt).all(), write=False)]
