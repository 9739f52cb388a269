"""Reading the store's state back: the leader term, where catch-up resumes, schedules, nodes, claim rows.

The scheduler reads per-schedule state at start-up and after a failover
(:meth:`StateQueries.last_occurrences`, which :meth:`StateQueries.register` feeds
for schedules never claimed yet) and the overlap guard reads it per due entry
(:meth:`StateQueries.schedule_states`); operators and tests read nodes and
claim rows. Each is one short transaction; lookups by name go in chunks so
thousands of schedules never make one giant statement. Rows come back as the
dataclasses of :mod:`.schema`, never SQLAlchemy rows. (The reports behind the
``cluster-beat`` command's status and history pages are :mod:`.opsqueries`'s.)

Mixed into :class:`~.claims.ClaimStore`.
"""
from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..schedules.instants import require_aware
from .dialects.base import chunks
from .errors import database_errors as _database_errors
from .schema import ClaimRow, NodeState, ScheduleState, claims_table, leader_table, nodes_table, schedules_table

#: Above this many names, :meth:`StateQueries.last_occurrences` reads the whole table once and
#: filters, instead of looking the names up 500 at a time.
_READ_ALL_ABOVE = 2000

_CLAIM_ROW_FIELDS = ClaimRow.__dataclass_fields__.values()


class StateQueries:
    """Mixed into :class:`~.claims.ClaimStore`: it provides ``_run``, ``_now`` and ``_dialect``."""

    if TYPE_CHECKING:  # pragma: no cover
        url_masked: str
        _dialect: Any

        def _run(self, work: Callable[[Connection], Any], *, write: bool = True) -> Any: ...

        def _now(self, conn: Connection) -> datetime: ...

    @_database_errors
    def current_term(self) -> int:
        """The highest leader term any node has claimed with (0 before any)."""
        value = self._run(
            lambda conn: conn.execute(sa.select(leader_table.c.term).where(leader_table.c.id == 1)).scalar(),
            write=False,
        )
        return int(value or 0)

    @_database_errors
    def last_occurrences(self, names: Iterable[str] | None = None) -> dict[str, datetime]:
        """Per schedule (only *names*, if given), where catch-up resumes: its latest recorded
        instant, or for a schedule nothing was ever recorded of, the time a scheduling node
        first saw it (:meth:`register`)."""
        t = schedules_table
        stmt = sa.select(t.c.name, sa.func.coalesce(t.c.last_occurrence, t.c.registered_at)).where(
            sa.or_(t.c.last_occurrence.is_not(None), t.c.registered_at.is_not(None)))
        if names is None:
            return {name: at for name, at in self._run(lambda conn: conn.execute(stmt).all(), write=False)}
        wanted = sorted(set(names))
        if len(wanted) > _READ_ALL_ABOVE:  # every entry at start-up: one read may beat a lookup per 500

            def read_all(conn: Connection) -> dict[str, datetime] | None:
                total = conn.execute(sa.select(sa.func.count()).select_from(t)).scalar_one()
                if total > 2 * len(wanted):  # mostly other schedules' rows (stored ones): look up
                    return None
                keep = set(wanted)
                return {name: at for name, at in conn.execute(stmt) if name in keep}

            found = self._run(read_all, write=False)
            if found is not None:
                return found

        def read(conn: Connection) -> dict[str, datetime]:
            out: dict[str, datetime] = {}
            for part in chunks(wanted, 500):
                out.update((name, at) for name, at in conn.execute(stmt.where(t.c.name.in_(list(part)))))
            return out

        return self._run(read, write=False)

    @_database_errors
    def register(self, names: Sequence[str]) -> datetime:
        """Record that a scheduling node knows these schedules from now on (database clock);
        names already known keep their record. Returns that time.

        A schedule's first occurrence that falls due while no node schedules (a
        failover) is then caught up from here instead of being skipped unseen.
        """

        def work(conn: Connection) -> datetime:
            now = self._now(conn)
            self._dialect.insert_names(conn, schedules_table, sorted(set(names)), now)
            return now

        return self._run(work)

    @_database_errors
    def schedule_states(self, names: Iterable[str] | None = None) -> list[ScheduleState]:
        """Per-schedule state and counters, by name, for operators and the overlap guard (only *names*, if given)."""
        t = schedules_table
        if names is None:
            rows = self._run(lambda conn: conn.execute(sa.select(t).order_by(t.c.name)).all(), write=False)
        else:
            wanted = sorted(set(names))

            def read(conn: Connection) -> list[Any]:
                out: list[Any] = []
                for chunk in chunks(wanted, self._dialect.batch):
                    out.extend(conn.execute(sa.select(t).where(t.c.name.in_(chunk)).order_by(t.c.name)).all())
                return out

            rows = self._run(read, write=False) if wanted else []
        return [ScheduleState(**row._asdict()) for row in rows]

    @_database_errors
    def nodes(self) -> list[NodeState]:
        """Every node that has heartbeated to this store, most recent first."""
        n = nodes_table
        rows = self._run(
            lambda conn: conn.execute(
                sa.select(n.c.node, n.c.started_at, n.c.heartbeat_at, n.c.scheduling, n.c.clock_offset,
                          n.c.stopped_at)
                .order_by(n.c.heartbeat_at.desc(), n.c.node)
            ).all(),
            write=False,
        )
        return [NodeState(r.node, r.started_at, r.heartbeat_at, bool(r.scheduling), r.clock_offset, r.stopped_at)
                for r in rows]

    @_database_errors
    def claims(
        self,
        schedule: str | None = None,
        since: datetime | None = None,
        *,
        limit: int | None = None,
    ) -> list[ClaimRow]:
        """Claim rows by scheduled instant, optionally of one schedule / from *since* on."""
        c = claims_table
        stmt = sa.select(*(c.c[f.name] for f in _CLAIM_ROW_FIELDS))
        if schedule is not None:
            stmt = stmt.where(c.c.schedule == schedule)
        if since is not None:
            stmt = stmt.where(c.c.scheduled_at >= require_aware(since, "since"))
        stmt = stmt.order_by(c.c.scheduled_at, c.c.schedule)
        if limit is not None:
            stmt = stmt.limit(limit)
        rows = self._run(lambda conn: conn.execute(stmt).all(), write=False)
        return [ClaimRow(*row) for row in rows]
