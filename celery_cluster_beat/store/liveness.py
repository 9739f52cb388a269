"""Worker processes' liveness, by the database's clock: what lets the ledger take a run over.

Each worker process that runs ledger tasks (a prefork pool child, or the worker itself
for the solo and threads pools) has a row in ``cluster_beat_workers`` that a thread of its
own refreshes (:meth:`WorkerLiveness.worker_heartbeat`, every grace / 4). The row says
until when the process counts as alive (``expires_at``: the database's time of its last
heartbeat plus its grace, so the process's own setting decides, not the reader's), and
``gone_at`` once its worker's main process saw it die (a lost pool child, a hard time
limit, a terminating revoke: :meth:`~.ledger.LedgerQueries.end_lost_run`, for the one process
its run row names), or once one of its runs was taken over (in the take-over's transaction).

**Gone is for good, and an identity is never shared.** A process is named ``host:pid:random``
(never by host and pid alone: two containers sharing a host name have the same small pids),
and a heartbeat never revives a row that is gone: its runs may have been re-run. Such a
heartbeat answers False (:class:`ProcessGone` from ``start_run``); the process then takes a
new identity and goes on under it (worker/liveness.py), so nothing runs under a name the
database counts as dead. A row that merely *expired* (an outage longer than the grace) with
none of its runs taken over is refreshed: its runs in progress stay its own and alive, rather
than all becoming re-runnable for good while their bodies still run; a take-over in the
meantime would have recorded it gone.

A process is **alive** while its row has no ``gone_at`` and ``expires_at`` is not past,
both by the database's clock; a process without a row is not alive (a run recorded by a
release that had no heartbeats, or a row pruned a week after it expired). Nothing else,
least of all how long a run has been going, makes a run over.

Mixed into :class:`~.claims.ClaimStore` through :class:`~.ledger.LedgerQueries`.
"""
from __future__ import annotations

from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Callable, Optional

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..base import MAX_NODE_ID_LENGTH, clip
from .errors import database_errors
from .schema import RUN_ERROR_LENGTH, workers_table

#: Rows of processes whose heartbeat expired this long ago are deleted by the heartbeat
#: thread's occasional sweep (a missing row reads as "not alive", as the expired one did).
WORKER_ROW_KEEP = timedelta(days=7)


class ProcessGone(RuntimeError):
    """The process named in a ledger call is recorded gone (or its heartbeat expired): the call did
    nothing. The process takes a new identity and tries again (worker/liveness.py)."""


def alive_until(conn: Connection, process: Optional[str], now: datetime) -> Optional[datetime]:
    """When *process* stops counting as alive (its ``expires_at``), or None when it is not alive now."""
    if not process:
        return None
    w = workers_table
    expires = conn.execute(
        sa.select(w.c.expires_at).where(w.c.process == process, w.c.gone_at.is_(None))).scalar_one_or_none()
    return expires if expires is not None and expires >= now else None


def mark_gone(conn: Connection, process: str, now: datetime, reason: str) -> int:
    """Record *process* gone at *now* (if it is not already); returns rows changed."""
    w = workers_table
    return int(conn.execute(sa.update(w).where(w.c.process == process, w.c.gone_at.is_(None)).values(
        gone_at=now, gone_reason=clip(reason, RUN_ERROR_LENGTH) or None)).rowcount)


class WorkerLiveness:
    """The heartbeat rows' statements; ClaimStore provides ``_run``, ``_now`` and ``_dialect``."""

    if TYPE_CHECKING:  # pragma: no cover
        _dialect: Any

        def _run(self, work: Callable[[Connection], Any], *, write: bool = True) -> Any: ...

        def _now(self, conn: Connection) -> datetime: ...

    def _beat(self, conn: Connection, process: str, host: str, pid: int, grace: float) -> bool:
        """Refresh (or create) the row of *process*; False when it was recorded gone (never revived:
        see the module docstring)."""
        now = self._now(conn)
        w = workers_table
        expires = now + timedelta(seconds=float(grace))
        changed = conn.execute(sa.update(w).where(w.c.process == process, w.c.gone_at.is_(None))
                               .values(heartbeat_at=now, expires_at=expires)).rowcount
        if changed:
            return True
        self._dialect.insert_if_absent(conn, w, [{
            "process": process, "host": clip(host, MAX_NODE_ID_LENGTH), "pid": int(pid), "started_at": now,
            "heartbeat_at": now, "expires_at": expires, "gone_at": None, "gone_reason": None,
        }], ["process"])
        return conn.execute(sa.select(w.c.gone_at).where(w.c.process == process)).scalar_one_or_none() is None

    @database_errors
    def worker_heartbeat(self, process: str, *, host: str, pid: int, grace: float) -> bool:
        """Say *process* is alive for *grace* more seconds (database clock). Returns False when the
        process was recorded gone: it is never revived, its runs may have been taken over."""
        if not process or len(process) > MAX_NODE_ID_LENGTH:
            raise ValueError(f"worker process id must have 1 to {MAX_NODE_ID_LENGTH} characters")
        if not grace > 0:
            raise ValueError(f"grace must be positive, got {grace!r}")
        return bool(self._run(lambda conn: self._beat(conn, process, host, pid, grace)))

    @database_errors
    def worker_gone(self, process: str, *, reason: str = "") -> int:
        """Record *process* gone (by its id, never by host and pid: see the module docstring). Its
        running runs can then be taken over at once. Returns rows changed."""
        if not process:
            raise ValueError("worker_gone() needs the process id")
        return int(self._run(lambda conn: mark_gone(conn, process, self._now(conn), reason)))

    @database_errors
    def prune_workers(self) -> int:
        """Delete the rows of processes whose heartbeat expired over :data:`WORKER_ROW_KEEP` ago."""
        w = workers_table

        def work(conn: Connection) -> int:
            return int(conn.execute(sa.delete(w).where(w.c.expires_at < self._now(conn) - WORKER_ROW_KEEP)).rowcount)

        return int(self._run(work))

    @database_errors
    def worker_alive(self, process: str) -> bool:
        """Whether *process* counts as alive now (database clock)."""
        def read(conn: Connection) -> bool:
            return alive_until(conn, process, self._now(conn)) is not None

        return bool(self._run(read, write=False))


__all__ = ["WORKER_ROW_KEEP", "ProcessGone", "WorkerLiveness", "alive_until", "mark_gone"]
