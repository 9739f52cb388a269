"""The status page's reads: the first schedules by relevance, never every stored schedule.

A store may hold 100,000 stored schedules and the page is built on a thread of the
beat process, which shares its interpreter with the scheduling loop. So the page
reads what it shows, not what exists: the database ranks the stored schedules
(problems first, then the next to fire) and returns the first few with the totals
(one ``ORDER BY ... LIMIT`` with window counts); the config's entries, which beat
holds in memory anyway, are ranked by the caller from :meth:`PageQueries.schedule_marks`,
read by name. What the page then shows of each is read by name too (a few hundred at most).

The filter ignores the case of ASCII letters and of nothing else, the same in every database and
in Python (:func:`fold`, :func:`name_filter`): each database's own ``lower()`` folds differently
(SQLite ASCII only, PostgreSQL by its locale, MySQL by the character set), and a config entry and
a stored schedule of the same spelling must both match or both not.

Mixed into :class:`~.claims.ClaimStore`; rows come back as the dataclasses below.
"""
from __future__ import annotations

import string
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Callable, Collection, Dict, Iterable, List, Optional, Tuple

import sqlalchemy as sa

from ..base import StrEnum
from .dialects.base import chunks
from .errors import database_errors
from .schema import ClaimStatus, RunState, claims_table, controls_table, schedules_table, stored_schedules_table

if TYPE_CHECKING:  # pragma: no cover
    from sqlalchemy.engine import Connection


class Attention(StrEnum):
    """Why a schedule comes first on the status page (most pressing first)."""

    #: Its last occurrence failed (not sent, or its run failed: the worker's ledger) or was missed,
    #: or is still unsent past the claim grace.
    FAILING = "failing"
    #: An operator paused it.
    PAUSED = "paused"
    #: Its next occurrence after the last recorded one is long past: nobody is sending it.
    OVERDUE = "overdue"


#: Attention in the order the page shows it; a schedule that needs none comes after these.
RANKS: Tuple[Attention, ...] = (Attention.FAILING, Attention.PAUSED, Attention.OVERDUE)


def rank(attention: Optional[Attention]) -> int:
    """0 for the most pressing attention ... len(RANKS) for none."""
    return RANKS.index(attention) if attention is not None else len(RANKS)


class StateFilter(StrEnum):
    """The dashboard's ``?state=``: the schedules to show of those whose name matches."""

    FAILING = "failing"
    PAUSED = "paused"
    OVERDUE = "overdue"
    #: The last occurrence's run is running now (the worker's ledger says so).
    RUNNING = "running"
    #: Needs no attention (neither failing, paused nor overdue).
    OK = "ok"


class PageOrder(StrEnum):
    """The dashboard's ``?sort=``; every order ends with the name, so pages are stable."""

    #: Failing, paused, overdue, then the rest; each by next fire (the default).
    ATTENTION = "attention"
    NAME = "name"
    #: Next fire, soonest first (none last).
    NEXT = "next"
    #: Last recorded occurrence, newest first (none last).
    LAST = "last"


#: At most this many failures are counted by :meth:`PageQueries.failures_since` (then "10,000 or more").
FAILURES_COUNTED = 10_000


@dataclass(frozen=True)
class PageEntry:
    """One stored schedule's place on the page."""

    name: str
    attention: Optional[Attention]
    #: Its next occurrence as the table keeps it: exact while the leader does not hold the
    #: schedule, the instant it was loaded for while it does (due within the leader's horizon).
    next_at: Optional[datetime]
    #: Its last recorded occurrence.
    last: Optional[datetime] = None


@dataclass(frozen=True)
class StoredPage:
    """The first live stored schedules by relevance, and how many there are in all."""

    now: datetime  #: the database's clock
    total: int  #: live stored schedules matching the filter
    counts: Dict[Attention, int]  #: of those, how many need each attention
    entries: Tuple[PageEntry, ...]  #: the first ``limit``: by attention, next occurrence, name
    #: Of those matching the filter, how many have their last occurrence's run running.
    running: int = 0
    #: How many match the filter and the state asked for (``total`` when no state was asked).
    matching: Optional[int] = None


@dataclass(frozen=True)
class ScheduleMark:
    """What ranking a schedule by name needs besides its rule (config entries)."""

    failing: bool
    paused: bool
    #: Its latest recorded occurrence, or when a scheduling node first saw it.
    last: Optional[datetime]
    #: Its latest occurrence's run is running (the worker's ledger).
    running: bool = False


def _failing(now: datetime, grace: float) -> Any:
    """The last occurrence's claim row (``claims_table`` joined on it) says something went wrong."""
    c = claims_table
    return sa.or_(c.c.status.in_([ClaimStatus.FAILED.value, ClaimStatus.MISSED.value]),
                  c.c.run_state == RunState.FAILED.value,
                  sa.and_(c.c.status == ClaimStatus.CLAIMED.value, c.c.claimed_at < now - timedelta(seconds=grace)))


def _last_claim() -> Any:
    """The join of ``schedules_table`` to the claim row of its last occurrence (while not pruned)."""
    c, t = claims_table, schedules_table
    return sa.and_(c.c.schedule == t.c.name, c.c.scheduled_at == t.c.last_occurrence)


_ASCII_LOWER = str.maketrans(string.ascii_uppercase, string.ascii_lowercase)


def fold(text: str) -> str:
    """*text* with its ASCII capitals made small and every other character as it is: how the filter
    compares, on both sides (``"É"`` stays ``"É"``; ``"İ".lower()`` would even make it two)."""
    return text.translate(_ASCII_LOWER)


def name_filter(column: Any, contains: Optional[str]) -> Any:
    """*column* holds *contains*, ignoring the case of ASCII letters only (:func:`fold`); ``%``,
    ``_``, ``\\`` and the escape character match themselves.

    Only the letters *contains* has are folded in the column (a nested ``replace`` each, portable
    and case-sensitive everywhere): a capital whose small letter the filter lacks matches nothing,
    folded or not."""
    if not contains:
        return sa.true()
    folded = fold(contains)
    expr: Any = column
    for letter in sorted({ch for ch in folded if ch in string.ascii_lowercase}):
        expr = sa.func.replace(expr, letter.upper(), letter, type_=sa.String())
    return expr.contains(folded, autoescape=True)


class PageQueries:
    """Mixed into :class:`~.claims.ClaimStore`: it provides ``_run`` and ``_now``."""

    if TYPE_CHECKING:  # pragma: no cover
        def _run(self, work: Callable[["Connection"], Any], *, write: bool = True) -> Any: ...

        def _now(self, conn: "Connection") -> datetime: ...

    @database_errors
    def stored_page(self, *, limit: int, grace: float, overdue: float, contains: Optional[str] = None,
                    exclude: Collection[str] = (), state: Optional[StateFilter] = None,
                    order: PageOrder = PageOrder.ATTENTION) -> StoredPage:
        """The first *limit* live stored schedules (whose name contains *contains*, if given): failing,
        then paused, then overdue (next occurrence more than *overdue* seconds past, none recorded
        since), then the rest; each group by next occurrence, then name (*order* another order). One
        statement: the database ranks every row, only *limit* rows come back.

        *state*: only those in that state (:class:`StateFilter`); the totals and counts stay those of
        the name filter, ``matching`` says how many are in the state.

        *exclude*: names whose stored rows are left out of the rows and the counts alike (the
        config's entries: beat schedules the entry, not a stored row named like it). Those that
        exist are found first, by name, 500 at a time; usually none does."""
        if limit < 1:
            raise ValueError(f"limit must be positive, got {limit!r}")
        state = StateFilter(state) if state is not None else None
        order = PageOrder(order)
        s, k, t, c = stored_schedules_table, controls_table, schedules_table, claims_table

        def read(conn: "Connection") -> StoredPage:
            now = self._now(conn)
            shadowed: List[str] = []
            for part in chunks(sorted(set(exclude)), 500):
                shadowed += conn.execute(sa.select(s.c.name).where(s.c.name.in_(list(part)),
                                                                   s.c.deleted == sa.false())).scalars()
            late = sa.and_(s.c.enabled == sa.true(), s.c.next_at < now - timedelta(seconds=overdue),
                           sa.or_(t.c.last_occurrence.is_(None), t.c.last_occurrence < s.c.next_at))
            ranked = sa.case((_failing(now, grace), 0), (k.c.paused == sa.true(), 1), (late, 2),
                             else_=len(RANKS)).label("rank")
            running = sa.case((c.c.run_state == RunState.RUNNING.value, 1), else_=0).label("running")
            inner = (sa.select(s.c.name, s.c.next_at, ranked, running, t.c.last_occurrence.label("last"))
                     .select_from(s.outerjoin(k, k.c.name == s.c.name).outerjoin(t, t.c.name == s.c.name)
                                  .outerjoin(c, _last_claim()))
                     .where(s.c.deleted == sa.false(), name_filter(s.c.name, contains),
                            s.c.name.not_in(shadowed) if shadowed else sa.true())).subquery()
            # The totals of the name filter are counted before the state filter (a window in a
            # subquery), the number in the state after it (a window of the outer statement).
            per_rank = [sa.func.sum(sa.case((inner.c.rank == i, 1), else_=0)).over().label(f"n{i}")
                        for i in range(len(RANKS))]
            counted = sa.select(inner, sa.func.count().over().label("total"), *per_rank,
                                sa.func.sum(inner.c.running).over().label("n_running")).subquery()
            stmt = (sa.select(counted.c.name, counted.c.next_at, counted.c.rank, counted.c.total,
                              *(counted.c[f"n{i}"] for i in range(len(RANKS))), counted.c.n_running,
                              sa.func.count().over().label("matching"), counted.c.last)
                    .where(_state_condition(counted, state))
                    .order_by(*_order_by(counted, order)).limit(limit))
            rows = conn.execute(stmt).all()
            if not rows and state is None:  # nothing matches (the window counts come with the rows)
                return StoredPage(now=now, total=0, counts={a: 0 for a in RANKS}, entries=(), matching=0)
            if not rows:  # none in that state: the name filter's counts alone
                first = conn.execute(sa.select(counted.c.total, *(counted.c[f"n{i}"] for i in range(len(RANKS))),
                                               counted.c.n_running).limit(1)).first()
                if first is None:
                    return StoredPage(now=now, total=0, counts={a: 0 for a in RANKS}, entries=(), matching=0)
                return StoredPage(now=now, total=int(first[0]),
                                  counts={a: int(first[1 + i] or 0) for i, a in enumerate(RANKS)}, entries=(),
                                  running=int(first[-1] or 0), matching=0)
            first = rows[0]
            return StoredPage(
                now=now, total=int(first[3]), counts={a: int(first[4 + i] or 0) for i, a in enumerate(RANKS)},
                entries=tuple(PageEntry(r.name, RANKS[r.rank] if r.rank < len(RANKS) else None, r.next_at, r.last)
                              for r in rows),
                running=int(first.n_running or 0), matching=int(first.matching))

        return self._run(read, write=False)

    @database_errors
    def schedule_marks(self, names: Iterable[str], *, grace: float) -> Dict[str, ScheduleMark]:
        """Per schedule of *names* that has any record (state or control): whether its last
        occurrence failed (as :meth:`stored_page` judges it), whether it is paused, and its last
        occurrence. One statement of each kind per 500 names; plain tuples, nothing else read."""
        wanted = sorted(set(names))
        t, c, k = schedules_table, claims_table, controls_table

        def read(conn: "Connection") -> Dict[str, ScheduleMark]:
            now = self._now(conn)
            failing = sa.case((_failing(now, grace), 1), else_=0)
            running = sa.case((c.c.run_state == RunState.RUNNING.value, 1), else_=0)
            found: Dict[str, Tuple[bool, Optional[datetime], bool]] = {}
            paused = set()
            for part in chunks(wanted, 500):
                stmt = (sa.select(t.c.name, failing, sa.func.coalesce(t.c.last_occurrence, t.c.registered_at),
                                  running)
                        .select_from(t.outerjoin(c, _last_claim())).where(t.c.name.in_(list(part))))
                found.update((name, (bool(bad), last, bool(run))) for name, bad, last, run in conn.execute(stmt))
                paused.update(conn.execute(sa.select(k.c.name).where(k.c.name.in_(list(part)),
                                                                    k.c.paused == sa.true())).scalars())
            none: Tuple[bool, Optional[datetime], bool] = (False, None, False)
            return {name: ScheduleMark(failing=found.get(name, none)[0], paused=name in paused,
                                       last=found.get(name, none)[1], running=found.get(name, none)[2])
                    for name in set(found) | paused}

        return self._run(read, write=False) if wanted else {}

    @database_errors
    def failures_since(self, seconds: float, *, cap: int = FAILURES_COUNTED) -> int:
        """How many occurrences scheduled within the last *seconds* (database clock) went wrong: their
        run failed (the worker's ledger), or they were not sent (failed, missed). Counted up to *cap*
        (a bounded subquery: at most *cap* + 1 rows are read, through the index on the instant), so
        a storm of failures costs no more than *cap* rows; *cap* + 1 means "more than *cap*"."""
        c = claims_table

        def read(conn: "Connection") -> int:
            since = self._now(conn) - timedelta(seconds=seconds)
            bad = (sa.select(c.c.schedule)
                   .where(c.c.scheduled_at >= since,
                          sa.or_(c.c.run_state == RunState.FAILED.value,
                                 c.c.status.in_([ClaimStatus.FAILED.value, ClaimStatus.MISSED.value])))
                   .limit(cap + 1).subquery())
            return int(conn.execute(sa.select(sa.func.count()).select_from(bad)).scalar_one())

        return self._run(read, write=False)


def _state_condition(rows: Any, state: Optional[StateFilter]) -> Any:
    """The rows of *rows* (a subquery with ``rank`` and ``running``) in *state* (None: all)."""
    if state is None:
        return sa.true()
    if state is StateFilter.RUNNING:
        return rows.c.running == 1
    if state is StateFilter.OK:
        return rows.c.rank == len(RANKS)
    return rows.c.rank == RANKS.index(Attention(state.value))


def _order_by(rows: Any, order: PageOrder) -> List[Any]:
    """ORDER BY of *rows* (``rank``, ``next_at``, ``last``, ``name``) for *order*; nulls last, the
    same in every database (a CASE, since MySQL has no NULLS LAST)."""
    nulls_last = lambda col: sa.case((col.is_(None), 1), else_=0)  # noqa: E731
    if order is PageOrder.NAME:
        return [rows.c.name]
    if order is PageOrder.NEXT:
        return [nulls_last(rows.c.next_at), rows.c.next_at, rows.c.name]
    if order is PageOrder.LAST:
        return [nulls_last(rows.c.last), rows.c.last.desc(), rows.c.name]
    return [rows.c.rank, nulls_last(rows.c.next_at), rows.c.next_at, rows.c.name]
