"""Backfills: past occurrences of one schedule sent on an operator's request, each at most once.

``celery ... cluster-beat backfill NAME --from T1 --to T2`` records a request
(:meth:`BackfillQueries.request_backfill`, a row of ``cluster_beat_backfills``, with the change
counter bumped so the leader reads it with the other controls). The leader claims the range's
occurrences (:meth:`BackfillQueries.claim_backfill`) and sends what it won through the one send
pipeline; the claim key (schedule, instant) makes a second backfill of the same range a no-op.

Which occurrences a backfill sends (:func:`verdict` says it for one row, the dry run for all):

* **no row**: never claimed (beat was down and the catch-up policy recorded nothing, the
  schedule was paused, the rows were pruned): inserted ``claimed`` with reason ``backfill``;
* a row that ended **missed**, **skipped** or **failed** (publishing failed for good) and was
  **never run** (``run_state`` NULL): taken to ``claimed`` by this node, reason ``backfill``, by
  one conditional UPDATE (its WHERE repeats the status and the empty run), so a row that is
  ``sent``, ``claimed`` (by anyone, live or gone: a gone claimant's rows are the stale-claim
  sweep's to resend) or already run is never touched.

Everything else is left as it is, with the reason (:class:`NotSent`): ``already sent`` (the
run may have failed: a backfill is not a retry; ``run-now`` is), ``being sent`` (claimed) and
``already ran`` (a worker recorded a run on a row not marked sent).
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

import sqlalchemy as sa

from ..base import MAX_NAME_LENGTH, StrEnum, clip
from ..schedules.instants import TINY, require_aware
from ..schedules.occurrence import Occurrence
from .controls import bump_version
from .dialects.base import ClaimValues, chunks, claim_key, new_token
from .errors import database_errors
from .schema import BackfillState, ClaimStatus, backfills_table, claims_table

if TYPE_CHECKING:  # pragma: no cover
    from sqlalchemy.engine import Connection

#: The reason a backfill's claim rows carry (history, the schedule page).
BACKFILL_REASON = "backfill"
#: ``--limit``'s default, and the most one request may send: one command cannot flood the broker.
DEFAULT_LIMIT = 1000
MAX_LIMIT = 10000
#: Statuses a backfill takes over when the occurrence never ran.
REDOABLE = (ClaimStatus.MISSED.value, ClaimStatus.SKIPPED.value, ClaimStatus.FAILED.value)


class NotSent(StrEnum):
    """Why a backfill leaves an occurrence as it is."""

    ALREADY_SENT = "already sent"
    BEING_SENT = "being sent"  # claimed, not yet marked sent (its claimant, or the sweep, sends it)
    ALREADY_RAN = "already ran"  # a worker recorded a run of it


def verdict(status: Optional[str], run_state: Optional[str]) -> Optional[NotSent]:
    """None when a backfill sends the occurrence whose row has *status* and *run_state* (None,
    None: no row); else why not. The rule :meth:`BackfillQueries.claim_backfill` applies in SQL."""
    if status is None:
        return None
    if status == ClaimStatus.SENT.value:
        return NotSent.ALREADY_SENT
    if status == ClaimStatus.CLAIMED.value:
        return NotSent.BEING_SENT
    if run_state is not None:
        return NotSent.ALREADY_RAN
    return None


def fires_between(rule: Any, start: datetime, end: datetime, limit: int) -> List[datetime]:
    """The instants of *rule* (``next_fire``) in [*start*, *end*], at most *limit* + 1 of them (one
    more than allowed says the range holds too many, without walking a year of seconds). A rule
    that ends (a one-off, a bound) simply has fewer."""
    return list(rule.fires_between(start - TINY, end, limit + 1))


class BackfillRefused(ValueError):
    """A backfill (or a slice of one) the database's clock forbids: a range reaching into the future,
    or older than the claim retention."""


def retention_problem(start: datetime, now: datetime, retention: Optional[float]) -> Optional[str]:
    """Why *start* is too old for a backfill at the database's time *now*: rows older than
    ``cluster_beat_claim_retention`` may have been pruned, and a pruned ``sent`` row would read as
    never sent (its occurrence sent and run again). None when it is not."""
    if retention is None or retention <= 0:
        return None
    oldest = now - timedelta(seconds=retention)
    if start >= oldest:
        return None
    return (f"--from ({start.isoformat()}) is older than cluster_beat_claim_retention ({retention:g} s before "
            f"the claim database's time, {oldest.isoformat()}): rows pruned from there may have been sent "
            "already, so a backfill cannot tell; start at that instant or later")


def backfill_problem(start: datetime, end: datetime, now: datetime, limit: Any,
                     retention: Optional[float] = None) -> Optional[str]:
    """Why a backfill of [*start*, *end*] at the database's time *now* is refused (*retention*: the
    claim retention in seconds, see :func:`retention_problem`); None when it is not."""
    if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= MAX_LIMIT:
        return f"--limit must be a whole number from 1 to {MAX_LIMIT}, got {limit!r}"
    if start > end:
        return f"--from ({start.isoformat()}) is after --to ({end.isoformat()})"
    if end > now:
        return (f"--to ({end.isoformat()}) is in the future (the claim database's time is {now.isoformat()}): "
                "a backfill sends past occurrences only")
    return retention_problem(start, now, retention)


@dataclass(frozen=True)
class BackfillRequest:
    """One row of ``cluster_beat_backfills``."""

    id: str
    schedule: str
    from_at: datetime
    to_at: datetime
    max_count: int
    state: BackfillState
    requested_at: datetime
    requested_by: Optional[str]
    finished_at: Optional[datetime] = None
    node: Optional[str] = None
    #: Published (and marked sent) by this backfill.
    sent: Optional[int] = None
    #: Left as they were: reason -> count (:class:`NotSent`).
    not_sent: Dict[str, int] = field(default_factory=dict)
    error: Optional[str] = None
    #: The last instant served (progress: the leader goes on after it).
    done_to: Optional[datetime] = None
    #: Claimed, their publish failed for good: reason -> count.
    failed: Dict[str, int] = field(default_factory=dict)
    #: Claimed, not yet published when their slice ended (a publish retry waits, or the next sender has them).
    retrying: int = 0


@dataclass
class BackfillClaim:
    """What :meth:`BackfillQueries.claim_backfill` did: the occurrences this node won (to send), and
    those left as they were, with why."""

    won: List[Occurrence]
    left: Dict[Occurrence, NotSent]


_COLS = ("id", "schedule", "from_at", "to_at", "max_count", "state", "requested_at", "requested_by",
         "finished_at", "node", "sent", "not_sent", "error", "done_to", "failed", "retrying")


def _counts(text: Any) -> Dict[str, int]:
    """A JSON object of counts as written by :meth:`BackfillQueries.update_backfill`; {} for anything else
    (a row written by hand must not stop the leader)."""
    try:
        value = json.loads(text) if text else {}
    except (TypeError, ValueError):
        return {}
    if not isinstance(value, dict):
        return {}
    return {str(k): v for k, v in value.items() if isinstance(v, int) and not isinstance(v, bool)}


def _request(r: Any) -> BackfillRequest:
    values = dict(zip(_COLS, r))
    values["not_sent"], values["failed"] = _counts(values["not_sent"]), _counts(values["failed"])
    values["retrying"] = values["retrying"] or 0
    try:
        values["state"] = BackfillState(values["state"])
    except ValueError:  # written by hand or by a later release: not pending, so never served
        values["state"] = BackfillState.REFUSED
    return BackfillRequest(**values)


class BackfillQueries:
    """Mixed into :class:`~.claims.ClaimStore`: it provides ``_run``, ``_now``, ``_dialect``, ``_fence``
    and ``node_id``."""

    if TYPE_CHECKING:  # pragma: no cover
        node_id: str
        _dialect: Any

        def _run(self, work: Callable[["Connection"], Any], *, write: bool = True) -> Any: ...

        def _now(self, conn: "Connection") -> datetime: ...

        def _fence(self, conn: "Connection", term: Optional[int]) -> None: ...

    @database_errors
    def request_backfill(self, name: str, start: datetime, end: datetime, *, limit: int = DEFAULT_LIMIT,
                         by: Optional[str] = None, retention: Optional[float] = None) -> Tuple[int, BackfillRequest]:
        """Record a backfill of *name* over [*start*, *end*] for the leader; (the change counter's new
        value, the request). ValueError (nothing written) for a bad range or limit, *end* after the
        database's time or *start* older than *retention* seconds (the claim retention) included."""
        if not isinstance(name, str) or not name or len(name) > MAX_NAME_LENGTH:
            raise ValueError(f"schedule name must have 1 to {MAX_NAME_LENGTH} characters: {name!r}")
        self._dialect.check_name(name)
        start, end = require_aware(start, "--from"), require_aware(end, "--to")
        b = backfills_table

        def work(conn: "Connection") -> Tuple[int, BackfillRequest]:
            now = self._now(conn)
            problem = backfill_problem(start, end, now, limit, retention)
            if problem:
                raise BackfillRefused(problem)
            version = bump_version(conn)
            row = {"id": str(uuid.uuid4()), "schedule": name, "from_at": start, "to_at": end, "max_count": limit,
                   "state": BackfillState.PENDING.value, "requested_at": now,
                   "requested_by": clip(by, MAX_NAME_LENGTH) if by else None}
            conn.execute(sa.insert(b), [row])
            return version, BackfillRequest(**{**row, "state": BackfillState.PENDING})

        return self._run(work)

    @database_errors
    def pending_backfills(self, limit: int = 10) -> List[BackfillRequest]:
        """Requests no leader has handled yet, oldest first (one indexed SELECT)."""
        b = backfills_table
        stmt = (sa.select(*(b.c[k] for k in _COLS)).where(b.c.state == BackfillState.PENDING.value)
                .order_by(b.c.requested_at, b.c.id).limit(limit))
        return [_request(r) for r in self._run(lambda conn: conn.execute(stmt).all(), write=False)]

    @database_errors
    def backfill_request(self, request_id: str) -> Optional[BackfillRequest]:
        """The request *request_id* as it stands (None: no such request)."""
        b = backfills_table
        stmt = sa.select(*(b.c[k] for k in _COLS)).where(b.c.id == request_id)
        r = self._run(lambda conn: conn.execute(stmt).first(), write=False)
        return None if r is None else _request(r)

    def finish_backfill(self, request_id: str, state: BackfillState, *, sent: int = 0,
                        not_sent: Optional[Dict[str, int]] = None, error: Optional[str] = None,
                        failed: Optional[Dict[str, int]] = None, retrying: int = 0,
                        done_to: Optional[datetime] = None) -> bool:
        """The leader handled request *request_id*: record how (once: a finished request stays so)."""
        return self.update_backfill(request_id, state, sent=sent, not_sent=not_sent, error=error, failed=failed,
                                    retrying=retrying, done_to=done_to)

    @database_errors
    def update_backfill(self, request_id: str, state: BackfillState = BackfillState.PENDING, *, sent: int = 0,
                        not_sent: Optional[Dict[str, int]] = None, error: Optional[str] = None,
                        failed: Optional[Dict[str, int]] = None, retrying: int = 0,
                        done_to: Optional[datetime] = None) -> bool:
        """Record the progress of pending request *request_id* (the totals so far, and the last instant
        served), ending it unless *state* is pending; False when it is no longer pending."""
        b = backfills_table
        state = BackfillState(state)

        def work(conn: "Connection") -> bool:
            values: Dict[str, Any] = dict(node=self.node_id, sent=sent, error=clip(error) if error else None,
                                          not_sent=json.dumps(not_sent or {}, sort_keys=True),
                                          failed=json.dumps(failed or {}, sort_keys=True), retrying=retrying,
                                          done_to=done_to)
            if state is not BackfillState.PENDING:
                values.update(state=state.value, finished_at=self._now(conn))
            return conn.execute(sa.update(b).where(b.c.id == request_id, b.c.state == BackfillState.PENDING.value)
                                .values(**values)).rowcount == 1

        return bool(self._run(work))

    @database_errors
    def backfill_rows(self, name: str, instants: Sequence[datetime]) -> Dict[datetime, Tuple[str, Optional[str]]]:
        """(status, run_state) of the rows of *name* at *instants* that have one (the dry run's read)."""
        c = claims_table
        wanted = sorted({require_aware(at, "instant") for at in instants})

        def read(conn: "Connection") -> Dict[datetime, Tuple[str, Optional[str]]]:
            out: Dict[datetime, Tuple[str, Optional[str]]] = {}
            for part in chunks(wanted, 500):
                for at, status, run_state in conn.execute(sa.select(c.c.scheduled_at, c.c.status, c.c.run_state)
                                                          .where(c.c.schedule == name,
                                                                 c.c.scheduled_at.in_(list(part)))):
                    out[at] = (status, run_state)
            return out

        return self._run(read, write=False)

    @database_errors
    def backfill_outcomes(self, name: str, instants: Sequence[datetime]) -> Dict[datetime, Tuple[str, Optional[str]]]:
        """(status, reason) of the rows of *name* at *instants* (what a backfill's slice came to)."""
        c = claims_table
        wanted = sorted(set(instants))

        def read(conn: "Connection") -> Dict[datetime, Tuple[str, Optional[str]]]:
            out: Dict[datetime, Tuple[str, Optional[str]]] = {}
            for part in chunks(wanted, 500):
                for at, status, reason in conn.execute(sa.select(c.c.scheduled_at, c.c.status, c.c.reason).where(
                        c.c.schedule == name, c.c.scheduled_at.in_(list(part)))):
                    out[at] = (status, reason)
            return out

        return self._run(read, write=False) if wanted else {}

    @database_errors
    def backfill_keys(self, occurrences: Sequence[Occurrence]) -> set:
        """The (schedule, instant) keys among *occurrences* whose rows a backfill claimed (origin
        ``backfill``, whatever their reason says now): the stale-claim sweep resends those with the
        backfill header too."""
        c = claims_table
        keys = sorted({claim_key(o) for o in occurrences})

        def read(conn: "Connection") -> set:
            out: set = set()
            for part in chunks(keys, 200):
                cond = sa.or_(*(sa.and_(c.c.schedule == s, c.c.scheduled_at == at) for s, at in part))
                out.update((s, at) for s, at in conn.execute(
                    sa.select(c.c.schedule, c.c.scheduled_at).where(cond, c.c.origin == BACKFILL_REASON)))
            return out

        return self._run(read, write=False) if keys else set()

    @database_errors
    def claim_backfill(self, occurrences: Sequence[Occurrence], *, term: Optional[int] = None,
                       retention: Optional[float] = None) -> BackfillClaim:
        """Claim the occurrences of one schedule a backfill may send (the module docstring's rule), in
        one fenced transaction: insert-if-absent, then one conditional UPDATE of the rows that ended
        missed, skipped or failed without a run. Only the returned ``won`` may be sent by this node.
        :class:`BackfillRefused` (nothing claimed) when an occurrence is after the database's time, or
        older than *retention* seconds before it (the claim retention: its row may have been pruned)."""
        ordered = sorted({claim_key(o): o for o in occurrences}.values(), key=claim_key)
        if not ordered:
            return BackfillClaim([], {})
        names = {o.schedule for o in ordered}
        if len(names) != 1:
            raise ValueError("claim_backfill() claims occurrences of one schedule")
        name = names.pop()
        token = new_token()
        c = claims_table

        def work(conn: "Connection") -> Tuple[set, Dict[datetime, Tuple[str, Optional[str]]]]:
            self._fence(conn, term)
            now = self._now(conn)
            if ordered[-1].at > now + TINY:  # never a future instant, whatever the request said
                raise BackfillRefused(f"{ordered[-1].at.isoformat()} is after the claim database's time "
                                      f"({now.isoformat()}): a backfill sends past occurrences only")
            problem = retention_problem(ordered[0].at, now, retention)
            if problem:
                raise BackfillRefused(problem)
            shared = ClaimValues(claimed_at=now, node=self.node_id, term=term, status=ClaimStatus.CLAIMED.value,
                                 reason=BACKFILL_REASON, token=token)
            won = self._dialect.insert_claims(conn, ordered, shared)
            first = set(won)
            rest = [o for o in ordered if claim_key(o) not in won]
            for part in chunks(rest, 500):
                conn.execute(sa.update(c).where(
                    c.c.schedule == name, c.c.scheduled_at.in_([o.at for o in part]),
                    c.c.status.in_(REDOABLE), c.c.run_state.is_(None),
                ).values(status=ClaimStatus.CLAIMED.value, node=self.node_id, term=term, claimed_at=now,
                         reason=BACKFILL_REASON, origin=BACKFILL_REASON, op_token=token, sent_at=None))
            if rest:
                won |= self._dialect.keys_written(conn, token, rest)
            inserted = [o for o in ordered if claim_key(o) in first]
            for part in chunks(inserted, 500):  # the origin outlives the reason (a failed publish rewrites it)
                conn.execute(sa.update(c).where(c.c.schedule == name, c.c.scheduled_at.in_([o.at for o in part]),
                                                c.c.op_token == token).values(origin=BACKFILL_REASON))
            left = [o for o in ordered if claim_key(o) not in won]
            found: Dict[datetime, Tuple[str, Optional[str]]] = {}
            for part in chunks(left, 500):
                for at, status, run_state in conn.execute(sa.select(c.c.scheduled_at, c.c.status, c.c.run_state)
                                                          .where(c.c.schedule == name,
                                                                 c.c.scheduled_at.in_([o.at for o in part]))):
                    found[at] = (status, run_state)
            return won, found

        won, found = self._run(work)
        left: Dict[Occurrence, NotSent] = {}
        for o in ordered:
            if claim_key(o) in won:
                continue
            status, run_state = found.get(o.at, (ClaimStatus.CLAIMED.value, None))  # gone meanwhile: not ours
            left[o] = verdict(status, run_state) or NotSent.BEING_SENT
        return BackfillClaim([o for o in ordered if claim_key(o) in won], left)

__all__ = ["BACKFILL_REASON", "BackfillClaim", "BackfillQueries", "BackfillRefused", "BackfillRequest",
           "DEFAULT_LIMIT", "MAX_LIMIT", "NotSent", "backfill_problem", "fires_between", "retention_problem",
           "verdict"]
