"""Pruning finished claim rows: bounded batches, each its own short transaction.

Claim rows are the occurrence history (and, with the worker ledger, the run
history), so the table grows by every occurrence of every schedule; pruning
must keep up with any rate of new rows without holding locks long or holding
up the scheduler's loop. So it deletes by key in batches (select the keys, then
delete them: MySQL refuses a DELETE whose subquery reads its own table, and
DELETE ... LIMIT is not portable), bounds each statement where the server can
(:data:`PRUNE_STATEMENT_TIMEOUT`), and stops after a number of batches or a
time budget. Rows still ``claimed`` are never pruned: they await a (re)send.

Mixed into :class:`~.claims.ClaimStore`.
"""
from __future__ import annotations

import time
from datetime import datetime
from typing import TYPE_CHECKING, Any, Callable

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..schedules.instants import require_aware
from .dialects.base import KEY_COLUMNS, chunks
from .errors import database_errors as _database_errors
from .schema import ClaimStatus, claims_table

#: Seconds one prune statement may run (where the server can bound it).
PRUNE_STATEMENT_TIMEOUT = 5.0


class PruneQueries:
    """Mixed into :class:`~.claims.ClaimStore`: it provides ``_run`` and ``_dialect``."""

    if TYPE_CHECKING:  # pragma: no cover
        url_masked: str
        _dialect: Any

        def _run(self, work: Callable[[Connection], Any], *, write: bool = True) -> Any: ...

    @_database_errors
    def prune(self, older_than: datetime, *, batch: int = 1000, max_batches: int | None = None) -> int:
        """Delete finished claim rows scheduled before *older_than*; returns how many.

        Each batch is its own short transaction so pruning a large backlog
        never holds locks long. Rows still ``claimed`` are kept: they await a
        (re)send. Per-schedule state lives in ``cluster_beat_schedules`` and is
        untouched.
        """
        return self._prune(older_than, batch=batch, max_batches=max_batches)[0]

    @_database_errors
    def prune_pass(self, older_than: datetime, *, time_budget: float, batch: int = 1000) -> tuple[int, bool]:
        """Prune like :meth:`prune` for at most *time_budget* seconds; (rows deleted, done).

        The scheduler calls this a pass at a time, so pruning keeps up with any
        rate of new rows without ever holding up the loop for long.
        """
        return self._prune(older_than, batch=batch, deadline=time.monotonic() + time_budget)

    def _prune(self, older_than: datetime, *, batch: int, max_batches: int | None = None,
               deadline: float | None = None) -> tuple[int, bool]:
        cutoff = require_aware(older_than, "older_than")
        if batch <= 0:
            raise ValueError(f"batch must be positive, got {batch!r}")
        c = claims_table
        timeout = self._dialect.statement_timeout_sql(PRUNE_STATEMENT_TIMEOUT)

        def one_batch(conn: Connection) -> tuple[int, int]:
            if timeout is None:
                return delete_batch(conn)
            set_timeout, reset = timeout
            conn.exec_driver_sql(set_timeout)
            try:
                return delete_batch(conn)
            finally:
                if reset:
                    conn.exec_driver_sql(reset)

        def delete_batch(conn: Connection) -> tuple[int, int]:
            # Select the keys first, then delete by key: MySQL refuses a
            # DELETE whose subquery reads the same table, and DELETE ... LIMIT
            # is not portable.
            keys = conn.execute(
                sa.select(*KEY_COLUMNS)
                .where(c.c.scheduled_at < cutoff, c.c.status != ClaimStatus.CLAIMED.value)
                .order_by(c.c.scheduled_at, c.c.schedule)
                .limit(batch)
            ).all()
            if not keys:
                return 0, 0
            removed = 0
            for chunk in chunks([tuple(k) for k in keys], self._dialect.batch):
                removed += self._dialect.delete_finished(conn, chunk)
            return len(keys), removed

        deleted = 0
        batches = 0
        while True:
            selected, removed = self._run(one_batch)
            batches += 1
            deleted += removed
            if selected < batch:
                return deleted, True
            if (max_batches is not None and batches >= max_batches) or (
                    deadline is not None and time.monotonic() >= deadline):
                return deleted, False
