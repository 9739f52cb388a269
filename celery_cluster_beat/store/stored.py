"""Stored schedules' queries: definitions written at run time, and the leader's view of them.

Every change bumps the one-row change counter first, in the same transaction:
its row lock makes changers queue, so versions commit in increasing order and
"rows changed since version N" (:meth:`StoredScheduleQueries.stored_changes`)
misses nothing. A removal leaves a tombstone for the same reason.

The leader keeps only the schedules due within its horizon in memory; for the
rest ``next_at`` is exact in the table (:meth:`stored_due` reads a time window
of it through its index), so neither start-up nor a change walks all rows.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import datetime
from typing import TYPE_CHECKING, Any, Callable, Collection, Dict, List, Mapping, Optional, Sequence, Tuple

import sqlalchemy as sa

from .dialects.base import chunks
from .errors import database_errors
from .schema import schedule_version_table, stored_schedules_table

if TYPE_CHECKING:  # pragma: no cover
    from sqlalchemy.engine import Connection

#: Rows per statement when many schedules are written or read by name at once.
_BATCH = 500
#: A change inserting at least this many rows refreshes the table's planner statistics.
_BULK = 1000


@dataclass(frozen=True)
class StoredRow:
    """One row of ``cluster_beat_stored_schedules`` (JSON fields still as text)."""

    name: str
    task: str
    schedule: str
    zone: Optional[str]
    args: str
    kwargs: str
    options: str
    overlap: Optional[str]
    max_run_time: Optional[float]
    jitter: Optional[float]
    catchup: Optional[str]
    catchup_window: Optional[float]
    description: Optional[str]
    owner: Optional[str]
    enabled: bool
    deleted: bool
    version: int
    created_at: datetime
    changed_at: datetime
    next_at: Optional[datetime]
    #: Version 6: pause after this many consecutive failed runs (None: never). Last, with a default,
    #: so rows built by position before it existed still read right.
    pause_after_failures: Optional[int] = None
    start_at: Optional[datetime] = None
    end_at: Optional[datetime] = None
    max_runs: Optional[int] = None
    #: When its rule was found to have no further occurrence (database clock); next_at is then None.
    ended_at: Optional[datetime] = None
    #: The last instant max_runs allows, computed when the row is written (*next_fire* of a change).
    runs_end_at: Optional[datetime] = None


_FIELDS = [f.name for f in fields(StoredRow)]
#: Columns a change writes (the rest are the store's: version, times, tombstone, end).
DEFINITION = [f for f in _FIELDS if f not in ("version", "created_at", "changed_at", "next_at", "deleted",
                                              "ended_at", "runs_end_at")]

#: ``change(existing, now) -> (rows to write, names to remove)``: *existing* maps each asked
#: name to its live row (tombstones left out); *now* is the database's time. Raising aborts
#: the whole change.
Change = Callable[[Dict[str, StoredRow], datetime], Tuple[List[Dict[str, Any]], List[str]]]


def _row(r: Any) -> StoredRow:
    return StoredRow(*(bool(v) if k in ("enabled", "deleted") else v for k, v in zip(_FIELDS, r)))


class StoredScheduleQueries:
    """Mixed into :class:`~.claims.ClaimStore`: it provides ``_run``, ``_now``, ``_fence`` (:mod:`.claiming`)
    and ``url_masked``."""

    if TYPE_CHECKING:  # pragma: no cover
        url_masked: str
        _dialect: Any

        def _run(self, work: Callable[[Connection], Any], *, write: bool = True) -> Any: ...

        def _now(self, conn: Connection) -> datetime: ...

        def _fence(self, conn: Connection, term: Optional[int]) -> None: ...

    @database_errors
    def stored_version(self) -> int:
        """The change counter: bumped by every change to a stored schedule."""
        t = schedule_version_table
        return int(self._run(lambda conn: conn.execute(sa.select(t.c.version).where(t.c.id == 1)).scalar() or 0,
                             write=False))

    @database_errors
    def stored_change(self, names: Sequence[str], change: Change,
                      next_fire: Callable[[Mapping[str, Any], datetime], Optional[datetime]]) -> int:
        """Apply *change* to the stored schedules *names* in one transaction; the new version.

        *next_fire(row, now)* gives a written row's next occurrence after the change
        (None when disabled, or when its rule has no further one: the row is then marked ended);
        a changed schedule restarts from the change time. *row* has ``created_at`` too (where
        ``max_runs`` counts from), and *next_fire* sets its ``runs_end_at`` (where max_runs ends).
        """
        t = stored_schedules_table
        wanted = sorted(set(names))

        def work(conn: Connection) -> int:
            v = schedule_version_table
            conn.execute(sa.update(v).where(v.c.id == 1).values(version=v.c.version + 1))
            version = int(conn.execute(sa.select(v.c.version).where(v.c.id == 1)).scalar_one())
            now = self._now(conn)
            found: Dict[str, StoredRow] = {}
            for part in chunks(wanted, _BATCH):
                for r in conn.execute(sa.select(*(t.c[f] for f in _FIELDS)).where(t.c.name.in_(list(part)))):
                    row = _row(r)
                    found[row.name] = row
            live = {n: r for n, r in found.items() if not r.deleted}
            writes, removes = change(live, now)
            inserts, updates = [], []
            for w in writes:
                # Columns added after a change caller was written may be left out: None (unset).
                values = {k: w.get(k) for k in DEFINITION}
                # A tombstone coming back to life is a new schedule: its creation time is now.
                live_row = live.get(w["name"])
                values["created_at"] = live_row.created_at if live_row is not None else now
                values["runs_end_at"] = None
                nxt = next_fire(values, now)
                ended = now if nxt is None and values["enabled"] else None
                if nxt is None and live_row is not None and live_row.ended_at is not None:
                    ended = live_row.ended_at  # still ended: when it ended stays (only a revival clears it)
                values.update(version=version, changed_at=now, deleted=False, next_at=nxt, ended_at=ended)
                if w["name"] in found:
                    updates.append(values)
                else:
                    inserts.append(values)
            for part in chunks(inserts, _BATCH):
                conn.execute(sa.insert(t), list(part))
            if len(inserts) >= _BULK:
                self._dialect.refresh_statistics(conn, t)
            if updates:
                cols = [k for k in updates[0] if k != "name"]
                stmt = (sa.update(t).where(t.c.name == sa.bindparam("b_name"))
                        .values({k: sa.bindparam("b_" + k) for k in cols}))
                conn.execute(stmt, [{"b_" + k: v for k, v in u.items()} for u in updates])
            gone = sorted(set(removes) & set(live))
            for part in chunks(gone, _BATCH):
                conn.execute(sa.update(t).where(t.c.name.in_(list(part)))
                             .values(deleted=True, enabled=False, next_at=None, version=version, changed_at=now))
            return version

        return int(self._run(work))

    @database_errors
    def stored_changes(self, since: int, *, after_name: Optional[str] = None, limit: int = 1000) -> List[StoredRow]:
        """Rows changed after version *since* (tombstones included), oldest change first, by name
        within a version. With *after_name*, the rest of version *since* after that name comes
        first: one change can write more rows than one read takes (``add_many``)."""
        t = stored_schedules_table
        newer = t.c.version > since
        if after_name is not None:
            newer = sa.or_(newer, sa.and_(t.c.version == since, t.c.name > after_name))
        stmt = (sa.select(*(t.c[f] for f in _FIELDS)).where(newer)
                .order_by(t.c.version, t.c.name).limit(limit))
        return [_row(r) for r in self._run(lambda conn: conn.execute(stmt).all(), write=False)]

    @database_errors
    def stored_due(self, before: datetime, *, since: Optional[datetime] = None,
                   limit: Optional[int] = None) -> List[StoredRow]:
        """Live, enabled rows whose next occurrence is before *before* (and not before *since*)."""
        t = stored_schedules_table
        stmt = sa.select(*(t.c[f] for f in _FIELDS)).where(t.c.next_at < before, t.c.enabled == sa.true(),
                                                           t.c.deleted == sa.false())
        if since is not None:
            stmt = stmt.where(t.c.next_at >= since)
        stmt = stmt.order_by(t.c.next_at, t.c.name)
        if limit is not None:
            stmt = stmt.limit(limit)
        return [_row(r) for r in self._run(lambda conn: conn.execute(stmt).all(), write=False)]

    @database_errors
    def stored_get(self, names: Sequence[str]) -> List[StoredRow]:
        """The live rows of *names* (unknown and removed ones left out)."""
        t = stored_schedules_table
        wanted = sorted(set(names))

        def read(conn: Connection) -> List[StoredRow]:
            out = []
            for part in chunks(wanted, _BATCH):
                stmt = sa.select(*(t.c[f] for f in _FIELDS)).where(t.c.name.in_(list(part)), t.c.deleted == sa.false())
                out.extend(_row(r) for r in conn.execute(stmt))
            return out

        return self._run(read, write=False)

    @database_errors
    def stored_clashes(self, names: Collection[str]) -> List[StoredRow]:
        """The live stored schedules named like one of *names* (beat_schedule entries).

        Thousands of names are matched against one read of the stored names, not a lookup
        each; a few are looked up."""
        if not names:
            return []
        if len(names) <= _BATCH:
            return self.stored_get(list(names))
        t = stored_schedules_table

        def read(conn: Connection) -> Optional[List[str]]:
            total = conn.execute(sa.select(sa.func.count()).select_from(t)).scalar_one()
            if total > 2 * len(names):  # many stored schedules: looking the names up reads less
                return None
            return list(conn.execute(sa.select(t.c.name).where(t.c.deleted == sa.false())).scalars())

        stored = self._run(read, write=False)
        if stored is None:
            return self.stored_get(list(names))
        both = set(stored).intersection(names)
        return self.stored_get(sorted(both)) if both else []

    @database_errors
    def stored_list(self, *, owner: Optional[str] = None, limit: Optional[int] = None) -> List[StoredRow]:
        """Live rows by name, optionally of one *owner*."""
        t = stored_schedules_table
        stmt = sa.select(*(t.c[f] for f in _FIELDS)).where(t.c.deleted == sa.false())
        if owner is not None:
            stmt = stmt.where(t.c.owner == owner)
        stmt = stmt.order_by(t.c.name)
        if limit is not None:
            stmt = stmt.limit(limit)
        return [_row(r) for r in self._run(lambda conn: conn.execute(stmt).all(), write=False)]

    @database_errors
    def stored_count(self) -> int:
        t = stored_schedules_table
        return int(self._run(lambda conn: conn.execute(
            sa.select(sa.func.count()).select_from(t).where(t.c.deleted == sa.false())).scalar_one(), write=False))

    @database_errors
    def stored_set_next(self, items: Sequence[Tuple[str, int, Optional[datetime]]], *,
                        term: Optional[int] = None) -> int:
        """Record ``(name, version, next occurrence)`` of schedules the leader stops holding in memory
        (None: the schedule has ended: ``next_at`` NULL, ``ended_at`` now).

        Conditional on the version it loaded: a definition changed meanwhile keeps the
        next occurrence its change computed (the leader learns of it from the change feed).
        Fenced by the leader's *term* like a claim (:class:`~.errors.StaleTermError`, nothing
        written, once a newer term is recorded), and never backwards: a leader paused between
        firing a schedule and handing it back must not write, after its successor moved the
        schedule on, an instant the successor's window has already passed (it would never be
        read again, so the schedule would never fire until changed).
        """
        if not items:
            return 0
        t = stored_schedules_table
        nxt = sa.bindparam("b_next")
        same = (t.c.name == sa.bindparam("b_name"), t.c.version == sa.bindparam("b_version"))
        stmt = sa.update(t).where(*same, sa.or_(t.c.next_at.is_(None), t.c.next_at <= nxt)).values(next_at=nxt)
        rows = [{"b_name": n, "b_version": v, "b_next": at} for n, v, at in sorted(items, key=lambda i: i[:2])
                if at is not None]
        # No further occurrence (a one-off that fired, a bound passed): ended, whichever leader says
        # so (the rule decides, not the leader), and never loaded again; kept as history.
        ended = [{"b_name": n, "b_version": v} for n, v, at in sorted(items, key=lambda i: i[:2]) if at is None]

        def work(conn: Connection) -> int:
            self._fence(conn, term)  # first: the leader row's lock orders it with every fenced write
            done = 0
            for part in chunks(rows, _BATCH):
                result = conn.execute(stmt, list(part))
                done += max(result.rowcount or 0, 0)
            if ended:
                end = sa.update(t).where(*same, t.c.ended_at.is_(None)).values(next_at=None, ended_at=self._now(conn))
                for part in chunks(ended, _BATCH):
                    result = conn.execute(end, list(part))
                    done += max(result.rowcount or 0, 0)
            return done

        return int(self._run(work))

    @database_errors
    def stored_prune_removed(self, older_than: datetime) -> int:
        """Delete tombstones of schedules removed before *older_than*."""
        t = stored_schedules_table
        return int(self._run(lambda conn: conn.execute(
            sa.delete(t).where(t.c.deleted == sa.true(), t.c.changed_at < older_than)).rowcount or 0))
