"""Rows a gone node left ``claimed``: node liveness, handing claims over, and the sweep that adopts them.

A claimed row is sent by its claimant; another node may send it only once the
claimant is known to be gone, and "gone" is decided by the database's clock,
never a node's own: its heartbeat in ``cluster_beat_nodes`` is older than the
grace (:meth:`TakeoverQueries.heartbeat` keeps it fresh), the claim is older than
the claimant's current start (it restarted), or the claimant handed its rows
over when it stopped scheduling (:meth:`TakeoverQueries.release`). The sweep
(:meth:`TakeoverQueries.take_over_stale`) adopts such rows exactly once even when
sweepers race, and keeps their task ids so the resend is the same task.

Mixed into :class:`~.claims.ClaimStore`; uses the fence and per-schedule
counters of :mod:`.claiming`.
"""
from __future__ import annotations

from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Callable, Sequence

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..base import clip
from ..schedules.instants import EPOCH
from ..schedules.occurrence import Occurrence
from .dialects.base import KEY_COLUMNS, KeyedUpdate, Merge, chunks, new_token
from .errors import database_errors as _database_errors
from .schema import CLAIM_KEY, ClaimStatus, claims_table, nodes_table

#: The node a released claim is given: no node has this id (node ids are never empty),
#: so the row reads as its claimant's being gone and the next sweep takes it at once.
RELEASED = ""


class TakeoverQueries:
    """Mixed into :class:`~.claims.ClaimStore`: it provides ``_run``, ``_now``, ``_dialect``,
    ``node_id``, ``_fence`` and ``_upsert_schedules``."""

    if TYPE_CHECKING:  # pragma: no cover
        node_id: str
        url_masked: str
        _dialect: Any

        def _run(self, work: Callable[[Connection], Any], *, write: bool = True) -> Any: ...

        def _now(self, conn: Connection) -> datetime: ...

        def _fence(self, conn: Connection, term: int | None) -> None: ...

        def _upsert_schedules(self, conn: Connection, rows: list[dict[str, Any]], *, now: datetime,
                              add: Sequence[str] = (), greatest: Sequence[str] = (), assign: Sequence[str] = (),
                              forward: tuple[str, Sequence[str]] | None = None) -> None: ...

    @_database_errors
    def take_over_stale(self, grace: float, *, term: int | None = None, limit: int = 500) -> list[Occurrence]:
        """Adopt rows left ``claimed`` by a node that is gone, so they get sent.

        Gone, by the database's clock: the claimant's heartbeat is older than
        *grace* seconds, or the claim predates the claimant's current start (it
        restarted), or it handed the row over (:meth:`release`), or it never
        heartbeated at all. A row is taken only once it is itself older than
        *grace*, and not before its instant (a leader claims a moment ahead). This node's own rows older than *grace* are adopted too: they
        are ones it lost track of (the caller skips those it is retrying).

        The UPDATE repeats each row's old node and claimed_at in its WHERE, so
        when two sweepers race, the second finds the row changed and skips
        it: each stale row is adopted exactly once. The returned occurrences
        keep their task id, so the resend is recognisable as the same task.
        Fenced like :meth:`claim`.
        """
        if limit <= 0:
            return []
        c, n = claims_table, nodes_table

        def work(conn: Connection) -> list[Occurrence]:
            self._fence(conn, term)
            now = self._now(conn)
            cutoff = now - timedelta(seconds=grace)
            gone = sa.or_(n.c.node.is_(None), n.c.heartbeat_at < cutoff, c.c.claimed_at < n.c.started_at,
                          c.c.node == self.node_id)
            query = (
                sa.select(*KEY_COLUMNS, c.c.node, c.c.claimed_at, c.c.task_id)
                .select_from(c.outerjoin(n, n.c.node == c.c.node))
                # Claimed ahead of its instant and handed over: not published before the instant.
                .where(c.c.status == ClaimStatus.CLAIMED.value, c.c.claimed_at < cutoff, gone,
                       c.c.scheduled_at <= now)
                .order_by(c.c.claimed_at, *KEY_COLUMNS)
                .limit(limit)
            )
            stale = conn.execute(self._dialect.lock_stale(query)).all()
            if not stale:
                return []
            stale = sorted(stale)
            taken: list[Any] = []
            for rows in chunks(stale, self._dialect.batch):
                update = KeyedUpdate(
                    cols=(*CLAIM_KEY, "node", "claimed_at"),
                    keys=[(r[0], r[1], r[2], r[3]) for r in rows],
                    where={"status": ClaimStatus.CLAIMED.value},
                    values={"node": self.node_id, "claimed_at": now, "term": term},
                    returning=(*KEY_COLUMNS, c.c.task_id),
                    expected=[(r[0], r[1], r[4]) for r in rows],
                )
                taken.extend(self._dialect.update_by_keys(conn, update))
            per: dict[str, dict[str, Any]] = {}
            for schedule, _at, _task_id in taken:
                per.setdefault(schedule, {"name": schedule, "resent": 0})["resent"] += 1
            self._upsert_schedules(conn, list(per.values()), now=now, add=("resent",))
            return [Occurrence(s, at, task_id=task_id) for s, at, task_id in sorted(taken)]

        return self._run(work)

    @_database_errors
    def release(self) -> int:
        """Hand every row this node holds in ``claimed`` to the next sender; returns how many.

        For a node that stops scheduling (lease lost, shut down): its unsent
        claims are taken over by the next sweep instead of after the grace.
        Call it only once every message this node published is marked sent.
        """
        c = claims_table

        def work(conn: Connection) -> int:
            result = conn.execute(
                sa.update(c)
                .where(c.c.node == self.node_id, c.c.status == ClaimStatus.CLAIMED.value)
                .values(node=RELEASED, claimed_at=EPOCH, reason=clip(f"released by {self.node_id}"),
                        op_token=new_token())
            )
            return max(result.rowcount, 0)

        return self._run(work)

    @_database_errors
    def heartbeat(self, *, scheduling: bool, clock_offset: float | None = None, register: bool = False) -> datetime:
        """Record that this node is alive (by the database's clock) and return that time.

        *register* starts a new incarnation: claims this node id made before
        now count as a stopped node's and may be taken over, and a clean stop
        recorded of an earlier one (:meth:`node_stopped`) is cleared.
        """

        def work(conn: Connection) -> datetime:
            now = self._now(conn)
            row = {"node": self.node_id, "started_at": now, "heartbeat_at": now, "scheduling": bool(scheduling),
                   "clock_offset": clock_offset, "stopped_at": None}
            assign = ("heartbeat_at", "scheduling", "clock_offset") + (("started_at", "stopped_at") if register else ())
            self._dialect.upsert(conn, nodes_table, [row], "node", Merge(assign=assign))
            return now

        return self._run(work)

    @_database_errors
    def node_stopped(self) -> datetime | None:
        """Record that this node shut down cleanly (database clock) and no longer schedules; the
        time recorded, None when the node never heartbeated (no row to mark).

        Only what operators read: ``status`` shows the node ``stopped`` rather than ``gone``.
        Whether its claims may be taken over is judged as before (:meth:`take_over_stale`
        reads neither column), so a clean stop changes no hand-over."""
        n = nodes_table

        def work(conn: Connection) -> datetime | None:
            now = self._now(conn)
            result = conn.execute(sa.update(n).where(n.c.node == self.node_id)
                                  .values(stopped_at=now, scheduling=False))
            return now if result.rowcount else None

        return self._run(work)

