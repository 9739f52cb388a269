"""The send path's statements: claim, confirm, mark sent or failed, fenced by the leader's term.

An occurrence is sent by the node whose insert-if-absent won its claim row
(:meth:`ClaimQueries.claim`), and only while the row is still that node's:
it confirms just before publishing (:meth:`ClaimQueries.confirm`) and marks the
row afterwards (:meth:`ClaimQueries.mark_sent`, :meth:`ClaimQueries.mark_failed`).
Occurrences deliberately not sent take the claim key the same way
(:meth:`ClaimQueries.record`), so no other replica sends what this one skipped.

Writes that decide who sends are fenced (:meth:`ClaimQueries._fence`): the
transaction first raises the recorded leader term to its own, or is refused
with :class:`~.errors.StaleTermError` before it writes anything. The
per-schedule counters and "last run" move in the same transaction as the
rows they count (:meth:`ClaimQueries._upsert_schedules`). Every statement
takes its locks in one global order (leader row, claim keys sorted, schedule
names sorted) so replicas queue instead of deadlocking.

Mixed into :class:`~.claims.ClaimStore`; the sweep that adopts rows a gone
node left (:mod:`.takeover`) builds on the fence and the counters here.
"""
from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from .. import faults
from ..base import MAX_NAME_LENGTH, clip
from ..errors import ConfigError
from ..schedules.occurrence import Occurrence
from .dialects.base import KEY_COLUMNS, ClaimValues, KeyedUpdate, Merge, chunks, claim_key, new_token
from .errors import StaleTermError, StoreUnavailable
from .errors import database_errors as _database_errors
from .schema import CLAIM_KEY, TASK_ID_LENGTH, ClaimStatus, claims_table, leader_table, nodes_table, schedules_table


def _unique(occurrences: Iterable[Occurrence]) -> list[Occurrence]:
    """Input order, first of each (schedule, instant) kept."""
    seen: set[tuple[str, datetime]] = set()
    out = []
    for occ in occurrences:
        k = claim_key(occ)
        if k not in seen:
            seen.add(k)
            out.append(occ)
    return out


class ClaimQueries:
    """Mixed into :class:`~.claims.ClaimStore`: it provides ``_run``, ``_now``, ``_dialect``,
    ``node_id`` and ``_insert_leader_row``."""

    if TYPE_CHECKING:  # pragma: no cover
        node_id: str
        url_masked: str
        _dialect: Any

        def _run(self, work: Callable[[Connection], Any], *, write: bool = True) -> Any: ...

        def _now(self, conn: Connection) -> datetime: ...

        def _insert_leader_row(self, conn: Connection) -> None: ...

    def _fence(self, conn: Connection, term: int | None) -> None:
        """Raise the recorded term to *term*, or refuse: it holds the leader row
        lock until commit, so fenced writers are serialized on it.

        An equal term is ours only if we recorded it: two nodes holding "the
        same" term (two leases over one store) are refused, not both admitted.
        """
        if term is None:
            return
        term = int(term)
        lt = leader_table
        for _ in range(2):
            result = conn.execute(
                sa.update(lt)
                .where(lt.c.id == 1, sa.or_(lt.c.term < term, sa.and_(lt.c.term == term, lt.c.node == self.node_id)))
                .values(term=term, node=self.node_id, updated_at=self._now(conn))
            )
            if result.rowcount:
                return
            seen = conn.execute(sa.select(lt.c.term).where(lt.c.id == 1)).scalar()
            if seen is not None:
                raise StaleTermError(int(seen), term)
            # Row deleted by hand: recreate it, then fence again.
            self._insert_leader_row(conn)
        raise RuntimeError("cluster_beat_leader row 1 cannot be written")  # pragma: no cover

    def _upsert_schedules(
        self,
        conn: Connection,
        rows: list[dict[str, Any]],
        *,
        now: datetime,
        add: Sequence[str] = (),
        greatest: Sequence[str] = (),
        assign: Sequence[str] = (),
        forward: tuple[str, Sequence[str]] | None = None,
    ) -> None:
        """Insert or merge per-schedule state: counters in *add* are summed,
        datetimes in *greatest* keep the later value, *assign* overwrites,
        *forward* assigns only what is not older (see :class:`~.dialects.base.Merge`)."""
        if not rows:
            return
        rows = sorted(rows, key=lambda r: r["name"])  # global lock order
        for row in rows:
            row["updated_at"] = now
        merge = Merge(add=add, greatest=greatest, assign=(*assign, "updated_at"), forward=forward)
        self._dialect.upsert(conn, schedules_table, rows, "name", merge)

    def _validate(self, occurrences: Sequence[Occurrence]) -> list[Occurrence]:
        # Refuse what the columns cannot hold exactly: a truncated name would
        # claim another schedule's key.
        unique = _unique(occurrences)
        for occ in unique:
            if not occ.schedule or len(occ.schedule) > MAX_NAME_LENGTH:
                raise ValueError(f"schedule name must have 1 to {MAX_NAME_LENGTH} characters: {occ.schedule!r}")
            if len(occ.task_id) > TASK_ID_LENGTH:
                raise ValueError(
                    f"task id longer than {TASK_ID_LENGTH} characters for {occ.schedule!r}: {occ.task_id!r}"
                )
            self._dialect.check_name(occ.schedule)
        return unique

    def check_names(self, names: Iterable[str]) -> None:
        """Refuse (ConfigError) schedule names this database would compare equal to others."""
        problems = []
        for name in names:
            try:
                self._dialect.check_name(name)
            except ValueError as exc:
                problems.append(f"beat_schedule entry {name!r}: name: {exc}")
        if problems:
            raise ConfigError(problems)

    # ------------------------------------------------------------------ claiming

    @_database_errors
    def claim(self, occurrences: Sequence[Occurrence], *, term: int | None = None, token: str | None = None,
              resume: bool = False, reason: str | None = None) -> list[Occurrence]:
        """Claim occurrences for sending; only the returned ones may be sent by this node.

        One transaction: fence with *term*, insert-if-absent every
        occurrence, update per-schedule state. The result is exactly the
        occurrences this call inserted (input order); the rest were already
        claimed by some node and are counted as ``claim_lost``.

        *token* marks the rows written. With *resume*, a claim retried after an
        error (a commit whose reply was lost) passes the failed attempt's token:
        rows that attempt wrote count as won, not as claimed by another node.

        *reason* stays on the rows (``manual`` for an operator's run-now).

        Raises StaleTermError (and writes nothing) when a higher term than
        *term* is recorded.
        """
        won = self._insert(occurrences, status=ClaimStatus.CLAIMED, reason=reason, term=term,
                           token=token or new_token(), resume=resume)
        faults.hit("claim-committed", error=StoreUnavailable)  # committed; the reply may yet be lost
        return won

    @_database_errors
    def record(
        self,
        occurrences: Sequence[Occurrence],
        *,
        status: str,
        reason: str,
        term: int | None = None,
    ) -> list[Occurrence]:
        """Record occurrences that will deliberately not be sent (``skipped`` or ``missed``).

        They take the claim key like a send would, so no other replica sends
        what this one decided to skip; fenced and exact like :meth:`claim`.
        """
        if status not in (ClaimStatus.SKIPPED, ClaimStatus.MISSED):
            raise ValueError(
                f"record() status must be {ClaimStatus.SKIPPED.value!r} or {ClaimStatus.MISSED.value!r}, "
                f"not {status!r}"
            )
        if not reason:
            raise ValueError("record() needs a reason (e.g. 'overlap', 'catchup')")
        return self._insert(occurrences, status=ClaimStatus(status), reason=clip(str(reason)), term=term,
                            token=new_token())

    def _insert(
        self, occurrences: Sequence[Occurrence], *, status: ClaimStatus, reason: str | None, term: int | None,
        token: str, resume: bool = False,
    ) -> list[Occurrence]:
        unique = self._validate(occurrences)
        if not unique:
            return []
        ordered = sorted(unique, key=claim_key)  # same lock order in every replica
        claiming = status is ClaimStatus.CLAIMED

        def work(conn: Connection) -> set[tuple[str, datetime]]:
            self._fence(conn, term)
            faults.hit("claim-in-transaction")
            now = self._now(conn)
            shared = ClaimValues(claimed_at=now, node=self.node_id, term=term, status=status.value, reason=reason,
                                 token=token)
            won = self._dialect.insert_claims(conn, ordered, shared)
            if resume:
                rest = [occ for occ in ordered if claim_key(occ) not in won]
                if rest:
                    won |= self._dialect.keys_written(conn, token, rest)
            per: dict[str, dict[str, Any]] = {}
            counter = "claim_lost" if claiming else status.value
            for occ in ordered:
                state = per.setdefault(
                    occ.schedule, {"name": occ.schedule, "last_occurrence": occ.at, "claim_lost": 0, counter: 0}
                )
                if occ.at > state["last_occurrence"]:
                    state["last_occurrence"] = occ.at
                if claim_key(occ) in won:
                    if not claiming:
                        state[counter] += 1
                else:
                    state["claim_lost"] += 1
            add = ("claim_lost",) if claiming else ("claim_lost", counter)
            self._upsert_schedules(conn, list(per.values()), now=now, add=add, greatest=("last_occurrence",))
            return won

        won = self._run(work)
        return [occ for occ in unique if claim_key(occ) in won]

    @_database_errors
    def confirm(self, occurrences: Sequence[Occurrence], *, term: int | None = None) -> list[Occurrence]:
        """The occurrences still claimed by this node, with their claims refreshed; the one
        statement a sender runs just before publishing them.

        Rows another node took over meanwhile are not returned (and must not
        be published here). Fenced like :meth:`claim`; refreshes this node's
        heartbeat too, so a long burst keeps it alive.
        """
        unique = sorted(_unique(occurrences), key=claim_key)
        if not unique:
            return []

        def work(conn: Connection) -> list[Any]:
            self._fence(conn, term)
            now = self._now(conn)
            mine: list[Any] = []
            for chunk in chunks(unique, self._dialect.batch):
                update = KeyedUpdate(
                    cols=CLAIM_KEY,
                    keys=[claim_key(o) for o in chunk],
                    where={"node": self.node_id, "status": ClaimStatus.CLAIMED.value},
                    values={"claimed_at": now},
                    returning=KEY_COLUMNS,
                    expected=[claim_key(o) for o in chunk],
                )
                mine.extend(self._dialect.update_by_keys(conn, update))
            conn.execute(sa.update(nodes_table).where(nodes_table.c.node == self.node_id).values(heartbeat_at=now))
            return mine

        kept = {(r[0], r[1]) for r in self._run(work)}
        return [occ for occ in occurrences if claim_key(occ) in kept]

    @_database_errors
    def mark_sent(self, occurrences: Sequence[Occurrence]) -> int:
        """Record that these claimed occurrences were published.

        Only rows this node still owns in status ``claimed`` change: if a
        sweeper took a row over meanwhile, that node will (re)send it and
        owns its bookkeeping. Returns how many rows changed.
        """
        unique = _unique(occurrences)
        if not unique:
            return 0
        ordered = sorted(unique, key=claim_key)
        c = claims_table

        def work(conn: Connection) -> int:
            now = self._now(conn)
            changed: list[Any] = []
            for chunk in chunks(ordered, self._dialect.batch):
                update = KeyedUpdate(
                    cols=CLAIM_KEY,
                    keys=[claim_key(o) for o in chunk],
                    where={"node": self.node_id, "status": ClaimStatus.CLAIMED.value},
                    values={"status": ClaimStatus.SENT.value, "sent_at": now},
                    increment=("attempts",),
                    returning=(*KEY_COLUMNS, c.c.task_id),
                    expected=[(o.schedule, o.at, o.task_id) for o in chunk],
                )
                changed.extend(self._dialect.update_by_keys(conn, update))
            per: dict[str, dict[str, Any]] = {}
            for schedule, at, task_id in changed:
                state = per.setdefault(
                    schedule,
                    {"name": schedule, "sent": 0, "last_task_id": task_id, "last_sent_at": now,
                     "last_sent_occurrence": at},
                )
                state["sent"] += 1
                if at > state["last_sent_occurrence"]:
                    state["last_sent_occurrence"] = at
                    state["last_task_id"] = task_id
            # The last run only moves forward: a late (re)send of an older occurrence
            # must not make the overlap guard watch that older run.
            self._upsert_schedules(conn, list(per.values()), now=now, add=("sent",),
                                   forward=("last_sent_occurrence", ("last_task_id", "last_sent_at")))
            return len(changed)

        return self._run(work)

    @_database_errors
    def fail_claimed(self, failed: Sequence[tuple[Occurrence, str]]) -> list[Occurrence]:
        """Give up for good on claimed occurrences, each with its own reason (``failed``), in one
        transaction: :meth:`mark_failed` with *final* for many, for occurrences that cannot be sent
        at all (a schedule that cannot be planned, a stored row refused). One round of statements
        however many there are, so a few hundred refused rows due at once cannot hold the scheduling
        loop (and its lease). Returns those this node still held; the rest are another node's to
        record."""
        reasons = {claim_key(o): clip(str(e)) for o, e in failed}
        ordered = sorted(_unique(o for o, _ in failed), key=claim_key)
        if not ordered:
            return []
        c = claims_table

        def work(conn: Connection) -> list[Any]:
            now = self._now(conn)
            changed: list[Any] = []
            for chunk in chunks(ordered, self._dialect.batch):
                changed.extend(self._dialect.update_by_keys(conn, KeyedUpdate(
                    cols=CLAIM_KEY,
                    keys=[claim_key(o) for o in chunk],
                    where={"node": self.node_id, "status": ClaimStatus.CLAIMED.value},
                    values={"status": ClaimStatus.FAILED.value},
                    increment=("attempts",),
                    returning=KEY_COLUMNS,
                    expected=[claim_key(o) for o in chunk],
                )))
            mine = [(r[0], r[1]) for r in changed]
            if mine:  # each row's own reason: one executemany over the rows just failed
                conn.execute(
                    sa.update(c).where(c.c.schedule == sa.bindparam("k_schedule"),
                                       c.c.scheduled_at == sa.bindparam("k_at"), c.c.node == self.node_id)
                    .values(reason=sa.bindparam("k_reason")),
                    [{"k_schedule": s, "k_at": at, "k_reason": reasons[(s, at)]} for s, at in mine])
            per: dict[str, dict[str, Any]] = {}
            for s, at in mine:
                state = per.setdefault(s, {"name": s, "failed": 0, "last_error": reasons[(s, at)],
                                           "last_error_at": now})
                state["failed"] += 1
            self._upsert_schedules(conn, list(per.values()), now=now, add=("failed",),
                                   assign=("last_error", "last_error_at"))
            return mine

        kept = set(self._run(work))
        return [o for o in ordered if claim_key(o) in kept]

    @_database_errors
    def mark_failed(self, occurrence: Occurrence, error: str, *, final: bool = False) -> bool:
        """Record a failed publish attempt.

        The row stays ``claimed`` so it is retried (by this node, or by a
        sweeper if this node dies) unless *final*, which gives up on it
        (``failed``). Returns False when this node no longer owns the
        claimed row (nothing recorded then).
        """
        error = clip(str(error))
        c = claims_table

        def work(conn: Connection) -> bool:
            now = self._now(conn)
            values: dict[str, Any] = {"reason": error, "attempts": c.c.attempts + 1}
            if final:
                values["status"] = ClaimStatus.FAILED.value
            else:  # still ours and being retried: keep the row from looking abandoned to sweepers
                values["claimed_at"] = now
            result = conn.execute(
                sa.update(c)
                .where(
                    c.c.schedule == occurrence.schedule,
                    c.c.scheduled_at == occurrence.at,
                    c.c.node == self.node_id,
                    c.c.status == ClaimStatus.CLAIMED.value,
                )
                .values(**values)
            )
            if result.rowcount != 1:
                return False
            state = {"name": occurrence.schedule, "last_error": error, "last_error_at": now, "failed": int(final)}
            self._upsert_schedules(conn, [state], now=now, add=("failed",), assign=("last_error", "last_error_at"))
            return True

        return self._run(work)
