"""Operators' reads of the claim store: what ``celery ... cluster-beat status / list / history`` show.

Read-only, each one short read transaction. Mixed into :class:`~.claims.ClaimStore`
beside the other query families; callers get plain row objects, never SQLAlchemy.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Optional, Tuple

import sqlalchemy as sa

from .controls import ControlRow, control_columns, control_row
from .dialects.base import chunks
from .errors import database_errors
from .schema import (
    ClaimRow,
    ClaimStatus,
    NodeState,
    claims_table,
    controls_table,
    leader_table,
    meta_table,
    nodes_table,
    schedules_table,
    stored_schedules_table,
)

if TYPE_CHECKING:  # pragma: no cover
    from sqlalchemy.engine import Connection

_CLAIM_FIELDS = [f.name for f in fields(ClaimRow)]


@dataclass(frozen=True)
class StoreOverview:
    """What the claim store says about the cluster as a whole, read in one transaction."""

    now: datetime  #: the database's clock
    schema_version: Optional[int]  #: as recorded in the database
    term: int  #: the highest leader term any node claimed with
    term_node: Optional[str]  #: the node that last raised it
    term_at: Optional[datetime]
    nodes: Tuple[NodeState, ...]  #: nodes whose heartbeat is recent, most recent first
    stored_schedules: int  #: live stored schedules (disabled ones included)
    paused: Tuple[str, ...]  #: names an operator paused
    unsent: int  #: rows still ``claimed`` although claimed longer than the grace ago
    unsent_rows: Tuple[ClaimRow, ...]  #: the oldest of them (at most the limit asked)
    paused_count: Optional[int] = None  #: how many are paused, when ``paused`` was limited
    #: The control rows of ``paused``, same order: who paused each, when, and why.
    paused_rows: Tuple[ControlRow, ...] = ()


class OpsQueries:
    """Mixed into :class:`~.claims.ClaimStore`: it provides ``_run`` and ``_now``."""

    if TYPE_CHECKING:  # pragma: no cover
        url_masked: str
        _dialect: Any

        def _run(self, work: Callable[["Connection"], Any], *, write: bool = True) -> Any: ...

        def _now(self, conn: "Connection") -> datetime: ...

    @database_errors
    def overview(self, *, grace: float, recent: float = 3600.0, unsent_limit: int = 20,
                 paused_limit: Optional[int] = None) -> StoreOverview:
        """The cluster as the store sees it: nodes heard from within *recent* seconds, and the
        occurrences claimed more than *grace* seconds ago and still not sent (by the database's clock)."""
        c, n, lt = claims_table, nodes_table, leader_table

        def read(conn: "Connection") -> StoreOverview:
            now = self._now(conn)
            version = conn.execute(sa.select(meta_table.c.value).where(meta_table.c.key == "schema_version")).scalar()
            leader = conn.execute(sa.select(lt.c.term, lt.c.node, lt.c.updated_at).where(lt.c.id == 1)).first()
            nodes = conn.execute(
                sa.select(n.c.node, n.c.started_at, n.c.heartbeat_at, n.c.scheduling, n.c.clock_offset,
                          n.c.stopped_at)
                .where(n.c.heartbeat_at >= now - timedelta(seconds=recent))
                .order_by(n.c.heartbeat_at.desc(), n.c.node)).all()
            s = stored_schedules_table
            stored = conn.execute(sa.select(sa.func.count()).select_from(s).where(s.c.deleted == sa.false())).scalar()
            k = controls_table
            paused_rows = [control_row(r) for r in conn.execute(
                sa.select(*control_columns()).where(k.c.paused == sa.true()).order_by(k.c.name)
                .limit(paused_limit))]  # limit None: all of them
            paused = [r.name for r in paused_rows]
            paused_count = None if paused_limit is None else conn.execute(
                sa.select(sa.func.count()).select_from(k).where(k.c.paused == sa.true())).scalar()
            # One SELECT: the oldest unsent rows with their total count (a window function,
            # which SQLite >= 3.25, PostgreSQL and MariaDB >= 10.2 have).
            late = conn.execute(
                sa.select(*(c.c[f] for f in _CLAIM_FIELDS), sa.func.count().over().label("total"))
                .where(c.c.status == ClaimStatus.CLAIMED.value, c.c.claimed_at < now - timedelta(seconds=grace))
                .order_by(c.c.scheduled_at, c.c.schedule).limit(max(1, unsent_limit))).all()
            return StoreOverview(
                now=now,
                schema_version=int(version) if version is not None else None,
                term=int(leader.term) if leader is not None else 0,
                term_node=(leader.node or None) if leader is not None else None,
                term_at=leader.updated_at if leader is not None else None,
                nodes=tuple(NodeState(r.node, r.started_at, r.heartbeat_at, bool(r.scheduling), r.clock_offset,
                                      r.stopped_at) for r in nodes),
                stored_schedules=int(stored or 0),
                paused=tuple(paused),
                paused_rows=tuple(paused_rows),
                paused_count=len(paused) if paused_count is None else int(paused_count),
                unsent=int(late[0].total) if late else 0,
                unsent_rows=tuple(ClaimRow(*r[:len(_CLAIM_FIELDS)]) for r in late[:unsent_limit]),
            )

        return self._run(read, write=False)

    @database_errors
    def latest_claims(self, names: Optional[Iterable[str]] = None) -> Dict[str, ClaimRow]:
        """Per schedule (only *names*, if given), the claim row of its last recorded occurrence,
        when that row is still there (not pruned)."""
        c, t = claims_table, schedules_table
        stmt = sa.select(*(c.c[f] for f in _CLAIM_FIELDS)).select_from(
            c.join(t, sa.and_(t.c.name == c.c.schedule, t.c.last_occurrence == c.c.scheduled_at)))
        if names is None:
            return {r.schedule: ClaimRow(*r) for r in self._run(lambda conn: conn.execute(stmt).all(), write=False)}
        return self._by_schedule(stmt, t.c.name, names)

    def _by_schedule(self, stmt: Any, column: Any, names: Iterable[str]) -> Dict[str, ClaimRow]:
        """Claim rows of *stmt* by schedule, for *names* (500 to a statement: bounded IN lists)."""
        wanted = sorted(set(names))

        def read(conn: "Connection") -> Dict[str, ClaimRow]:
            out: Dict[str, ClaimRow] = {}
            for part in chunks(wanted, 500):
                out.update((r.schedule, ClaimRow(*r)) for r in conn.execute(stmt.where(column.in_(list(part)))))
            return out

        return self._run(read, write=False) if wanted else {}

    @database_errors
    def recent_claims(self, schedule: str, *, limit: int = 50) -> List[ClaimRow]:
        """The last *limit* claim rows of *schedule*, newest occurrence first."""
        if limit <= 0:
            raise ValueError(f"limit must be positive, got {limit!r}")
        c = claims_table
        stmt = (sa.select(*(c.c[f] for f in _CLAIM_FIELDS)).where(c.c.schedule == schedule)
                .order_by(c.c.scheduled_at.desc()).limit(limit))
        return [ClaimRow(*r) for r in self._run(lambda conn: conn.execute(stmt).all(), write=False)]

    @database_errors
    def latest_claims_before(self, names: Iterable[str], at: datetime) -> Dict[str, ClaimRow]:
        """Per schedule of *names*, its newest claim row for an occurrence at or before *at*: what
        happened last, where the newest row is claimed ahead of its instant. One statement per
        500 names."""
        c, older = claims_table, claims_table.alias("older")
        newest = (sa.select(sa.func.max(older.c.scheduled_at))
                  .where(older.c.schedule == c.c.schedule, older.c.scheduled_at <= at).scalar_subquery())
        stmt = sa.select(*(c.c[f] for f in _CLAIM_FIELDS)).where(c.c.scheduled_at == newest)
        return self._by_schedule(stmt, c.c.schedule, names)
