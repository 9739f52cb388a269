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
from .schema import ClaimStatus, claims_table, controls_table, schedules_table, stored_schedules_table

if TYPE_CHECKING:  # pragma: no cover
    from sqlalchemy.engine import Connection


class Attention(StrEnum):
    """Why a schedule comes first on the status page (most pressing first)."""

    #: Its last occurrence failed or was missed, or is still unsent past the claim grace.
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


@dataclass(frozen=True)
class PageEntry:
    """One stored schedule's place on the page."""

    name: str
    attention: Optional[Attention]
    #: Its next occurrence as the table keeps it: exact while the leader does not hold the
    #: schedule, the instant it was loaded for while it does (due within the leader's horizon).
    next_at: Optional[datetime]


@dataclass(frozen=True)
class StoredPage:
    """The first live stored schedules by relevance, and how many there are in all."""

    now: datetime  #: the database's clock
    total: int  #: live stored schedules matching the filter
    counts: Dict[Attention, int]  #: of those, how many need each attention
    entries: Tuple[PageEntry, ...]  #: the first ``limit``: by attention, next occurrence, name


@dataclass(frozen=True)
class ScheduleMark:
    """What ranking a schedule by name needs besides its rule (config entries)."""

    failing: bool
    paused: bool
    #: Its latest recorded occurrence, or when a scheduling node first saw it.
    last: Optional[datetime]


def _failing(now: datetime, grace: float) -> Any:
    """The last occurrence's claim row (``claims_table`` joined on it) says something went wrong."""
    c = claims_table
    return sa.or_(c.c.status.in_([ClaimStatus.FAILED.value, ClaimStatus.MISSED.value]),
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
                    exclude: Collection[str] = ()) -> StoredPage:
        """The first *limit* live stored schedules (whose name contains *contains*, if given): failing,
        then paused, then overdue (next occurrence more than *overdue* seconds past, none recorded
        since), then the rest; each group by next occurrence, then name. One statement: the
        database ranks every row, only *limit* rows come back.

        *exclude*: names whose stored rows are left out of the rows and the counts alike (the
        config's entries: beat schedules the entry, not a stored row named like it). Those that
        exist are found first, by name, 500 at a time; usually none does."""
        if limit < 1:
            raise ValueError(f"limit must be positive, got {limit!r}")
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
            inner = (sa.select(s.c.name, s.c.next_at, ranked)
                     .select_from(s.outerjoin(k, k.c.name == s.c.name).outerjoin(t, t.c.name == s.c.name)
                                  .outerjoin(c, _last_claim()))
                     .where(s.c.deleted == sa.false(), name_filter(s.c.name, contains),
                            s.c.name.not_in(shadowed) if shadowed else sa.true())).subquery()
            per_rank = [sa.func.sum(sa.case((inner.c.rank == i, 1), else_=0)).over() for i in range(len(RANKS))]
            stmt = (sa.select(inner.c.name, inner.c.next_at, inner.c.rank, sa.func.count().over(), *per_rank)
                    .order_by(inner.c.rank, sa.case((inner.c.next_at.is_(None), 1), else_=0), inner.c.next_at,
                              inner.c.name)
                    .limit(limit))
            rows = conn.execute(stmt).all()
            if not rows:  # nothing matches (the window counts come with the rows)
                return StoredPage(now=now, total=0, counts={a: 0 for a in RANKS}, entries=())
            first = rows[0]
            return StoredPage(
                now=now, total=int(first[3]), counts={a: int(first[4 + i] or 0) for i, a in enumerate(RANKS)},
                entries=tuple(PageEntry(r.name, RANKS[r.rank] if r.rank < len(RANKS) else None, r.next_at)
                              for r in rows))

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
            found: Dict[str, Tuple[bool, Optional[datetime]]] = {}
            paused = set()
            for part in chunks(wanted, 500):
                stmt = (sa.select(t.c.name, failing, sa.func.coalesce(t.c.last_occurrence, t.c.registered_at))
                        .select_from(t.outerjoin(c, _last_claim())).where(t.c.name.in_(list(part))))
                found.update((name, (bool(bad), last)) for name, bad, last in conn.execute(stmt))
                paused.update(conn.execute(sa.select(k.c.name).where(k.c.name.in_(list(part)),
                                                                    k.c.paused == sa.true())).scalars())
            return {name: ScheduleMark(failing=found.get(name, (False, None))[0], paused=name in paused,
                                       last=found.get(name, (False, None))[1])
                    for name in set(found) | paused}

        return self._run(read, write=False) if wanted else {}
