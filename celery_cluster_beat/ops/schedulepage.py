"""The status page's schedules: the first few by relevance, with a filter, at any number of schedules.

The page is built on a thread of the beat process, so what it costs is taken from the
scheduling loop (one interpreter lock). ``list`` may print every schedule; the page
must not read them: with 100,000 stored schedules that was 91 MB of HTML and 25 s of
the loop's time a load. So the page shows the first ``limit`` schedules (100 unless
asked, at most 500) in this order, and says how many there are in all:

1. failing: the last occurrence failed, was missed, or is still unsent past the claim grace;
2. paused by an operator;
3. overdue: the next occurrence after the last recorded one is more than
   :data:`OVERDUE_AFTER` seconds past (nobody sends it: no leader, or a stuck one);
4. the rest;

each group by next fire, soonest first, then by name (``sort``: by name, next fire or last
occurrence instead; ``state``: only the schedules in one state, :class:`StateFilter`). A filter (``query``) keeps the
names that contain it, ignoring the case of ASCII letters (and only theirs: ``É`` matches ``É``,
not ``é``), for config entries and stored schedules alike in every database
(:func:`~celery_cluster_beat.store.pagequeries.fold`). A stored row named like a config entry
is neither shown nor counted: beat schedules the entry.

The database ranks the stored schedules and returns the first ``limit``
(:meth:`~celery_cluster_beat.store.claims.ClaimStore.stored_page`); the config's entries,
held in memory anyway, are ranked here from one read by name of what ranking needs
(:meth:`~celery_cluster_beat.store.claims.ClaimStore.schedule_marks`) and their rules
(next fires are remembered between builds: :class:`NextFires`). What is shown of each
is then read for those names only (:class:`~.report.ScheduleReads`).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Dict, List, Optional, Tuple

from ..base import MAX_NAME_LENGTH
from ..config.entries import Entry
from ..config.settings import Settings
from ..errors import ScheduleError
from ..store import ClaimStore
from ..store.pagequeries import RANKS, Attention, PageOrder, ScheduleMark, StateFilter, fold, rank
from ..store.schema import ClaimRow
from .records import ScheduleInfo
from .report import Opened, ScheduleReads, config_entries, load_settings_of

__all__ = ["SchedulePage", "PageRow", "NextFires", "Attention", "StateFilter", "PageOrder", "schedule_page",
           "page_params", "view_params", "PAGE_LIMIT", "PAGE_LIMIT_MAX", "QUERY_MAX", "OVERDUE_AFTER",
           "ScheduleDetail", "schedule_detail", "UPCOMING", "RECENT_RUNS"]

#: Schedules the page shows unless asked for another number ...
PAGE_LIMIT = 100
#: ... and at most (``?limit=``).
PAGE_LIMIT_MAX = 500
#: Longest filter: a name is at most this long, so a longer filter matches nothing.
QUERY_MAX = MAX_NAME_LENGTH
#: A schedule whose next occurrence after its last recorded one is this many seconds past is overdue:
#: beyond a failover and its catch-up, and beyond the leader's two-minute horizon of stored schedules.
OVERDUE_AFTER = 300.0

_NEVER = datetime.max.replace(tzinfo=None)


@dataclass(frozen=True)
class PageRow:
    """One schedule on the page, and why it is near the top (None: nothing wrong)."""

    attention: Optional[Attention]
    schedule: ScheduleInfo
    #: The claim row of its last occurrence, with the worker's ledger columns (run state, runtime,
    #: error, worker): None when nothing was recorded or the row was pruned.
    last_run: Optional[ClaimRow] = None

    def as_dict(self) -> Dict[str, Any]:
        """The schedule's record (:meth:`ScheduleInfo.as_dict`, JSON-safe) with ``attention`` beside
        its fields: one flat object a row, as the page and a dashboard read it."""
        run = self.last_run
        return {"attention": self.attention.value if self.attention else None, **self.schedule.as_dict(),
                "last_runtime": run.runtime if run is not None else None,
                "last_run_error": run.run_error if run is not None else None}


@dataclass(frozen=True)
class SchedulePage:
    """The first ``limit`` schedules by relevance, of ``total`` matching ``query``."""

    rows: Tuple[PageRow, ...]
    total: int  #: schedules (config + stored) whose name matches the filter
    config_total: int
    stored_total: int
    counts: Dict[Attention, int]  #: of the matching ones, how many need each attention
    limit: int
    query: Optional[str]
    now: datetime  #: the database's clock
    state: Optional[StateFilter] = None
    order: PageOrder = PageOrder.ATTENTION
    running: int = 0  #: of the matching ones, how many have their last occurrence's run running
    matching: Optional[int] = None  #: of the matching ones, how many are in ``state`` (None: no state asked)

    @property
    def shown(self) -> int:
        """How many schedules the page shows: ``limit`` at most, fewer when fewer match (or a row was
        removed between the reads); "showing *shown* of *total*"."""
        return len(self.rows)

    def as_dict(self) -> Dict[str, Any]:
        """JSON-safe, like every report record."""
        return {"shown": self.shown, "total": self.total, "config_total": self.config_total,
                "stored_total": self.stored_total, "counts": {a.value: n for a, n in self.counts.items()},
                "limit": self.limit, "query": self.query, "now": self.now.isoformat(),
                "state": self.state.value if self.state else None, "sort": self.order.value,
                "running": self.running, "matching": self.matching,
                "schedules": [r.as_dict() for r in self.rows]}


def page_params(limit: Any = None, query: Any = None) -> Tuple[int, Optional[str]]:
    """(limit, query) checked: *limit* a whole number, capped to 1 .. PAGE_LIMIT_MAX (None: PAGE_LIMIT);
    *query* printable text of at most QUERY_MAX characters ('' or None: no filter). ValueError
    saying which and why otherwise."""
    if limit is None or limit == "":
        limit = PAGE_LIMIT
    elif isinstance(limit, str):
        if not limit.isascii() or not limit.isdigit() or len(limit) > 9:
            raise ValueError("limit: expected a whole number")
        limit = int(limit)
    elif isinstance(limit, bool) or not isinstance(limit, int):
        raise ValueError("limit: expected a whole number")
    limit = max(1, min(PAGE_LIMIT_MAX, limit))
    if query is not None and not isinstance(query, str):
        raise ValueError("q: expected text")
    if query:
        if len(query) > QUERY_MAX:
            raise ValueError(f"q: at most {QUERY_MAX} characters")
        if not query.isprintable():
            raise ValueError("q: printable characters only")
    return limit, (query or None)


def view_params(state: Any = None, sort: Any = None) -> Tuple[Optional[StateFilter], PageOrder]:
    """(state, order) checked: *state* one of :class:`StateFilter` ('' or None: every state), *sort*
    one of :class:`PageOrder` ('' or None: by attention). ValueError saying which and why otherwise."""
    try:
        chosen = StateFilter(state) if state else None
    except ValueError:
        raise ValueError(f"state: expected one of {', '.join(s.value for s in StateFilter)}") from None
    try:
        order = PageOrder(sort) if sort else PageOrder.ATTENTION
    except ValueError:
        raise ValueError(f"sort: expected one of {', '.join(o.value for o in PageOrder)}") from None
    return chosen, order


class NextFires:
    """Next fires of the config's entries, remembered between page builds: an entry's next fire
    after *now* changes only once *now* reaches it, so a build computes only those that did."""

    def __init__(self) -> None:
        self._after_now: Dict[str, Tuple[Any, datetime, Optional[datetime]]] = {}
        self._after_last: Dict[str, Tuple[Any, Optional[datetime], Optional[datetime]]] = {}

    @staticmethod
    def _next(rule: Any, after: datetime) -> Optional[datetime]:
        try:
            return rule.next_fire(after)
        except (ScheduleError, ValueError):
            return None

    def after_now(self, name: str, rule: Any, now: datetime) -> Optional[datetime]:
        """Entry *name*'s next fire after *now* by *rule* (None: it never fires again). Remembered
        with the *now* it was computed for: valid while *now* moves forward and stays before it, and
        while the entry keeps the same rule object (a changed config builds a new one)."""
        known = self._after_now.get(name)
        if known is not None and known[0] is rule and known[1] <= now and (known[2] is None or now < known[2]):
            return known[2]
        nf = self._next(rule, now)
        self._after_now[name] = (rule, now, nf)
        return nf

    def after(self, name: str, rule: Any, last: datetime) -> Optional[datetime]:
        """Entry *name*'s first fire after its last recorded occurrence *last* (whether the entry is
        overdue): remembered until *last* or the rule changes, since it depends on nothing else."""
        known = self._after_last.get(name)
        if known is not None and known[0] is rule and known[1] == last:
            return known[2]
        nf = self._next(rule, last)
        self._after_last[name] = (rule, last, nf)
        return nf

    def retain(self, names: Any) -> None:
        """Forget entries no longer in the config."""
        for memo in (self._after_now, self._after_last):
            for name in [n for n in memo if n not in names]:
                del memo[name]


def _config_attention(name: str, entry: Entry, mark: Optional[ScheduleMark], now: datetime,
                      fires: NextFires) -> Tuple[Optional[Attention], Optional[datetime]]:
    """(attention, next fire) of a config entry, judged as the store judges a stored schedule."""
    if mark is not None and mark.failing:
        attention: Optional[Attention] = Attention.FAILING
    elif mark is not None and mark.paused:
        return Attention.PAUSED, None
    else:
        attention = None
    if not entry.enabled:
        return attention, None
    if attention is None and mark is not None and mark.last is not None:
        due = fires.after(name, entry.schedule, mark.last)
        if due is not None and due < now - timedelta(seconds=OVERDUE_AFTER):
            attention = Attention.OVERDUE
    return attention, fires.after_now(name, entry.schedule, now)


def _naive(at: Optional[datetime]) -> datetime:
    return at.replace(tzinfo=None) if at is not None else _NEVER


def _key(order: PageOrder, attention: Optional[Attention], next_fire: Optional[datetime],
         last: Optional[datetime], name: str) -> Tuple[Any, ...]:
    """Sort key of the page in *order*, the name last (as the database orders stored schedules)."""
    if order is PageOrder.NAME:
        return (name,)
    if order is PageOrder.NEXT:
        return next_fire is None, _naive(next_fire), name
    if order is PageOrder.LAST:  # newest first: the distance before the far future sorts ascending
        return last is None, (_NEVER - _naive(last)) if last is not None else timedelta(0), name
    return rank(attention), next_fire is None, _naive(next_fire), name


def _in_state(state: Optional[StateFilter], attention: Optional[Attention], running: bool) -> bool:
    if state is None:
        return True
    if state is StateFilter.RUNNING:
        return running
    if state is StateFilter.OK:
        return attention is None
    return attention is not None and attention.value == state.value


def schedule_page(app: Any, store: Optional[ClaimStore] = None, *, limit: Any = None, query: Any = None,
                  settings: Optional[Settings] = None, entries: Optional[Dict[str, Entry]] = None,
                  fires: Optional[NextFires] = None, state: Any = None, sort: Any = None) -> SchedulePage:
    """The first *limit* schedules by relevance (see the module docstring), of those whose name
    contains *query* (and are in *state*, ordered by *sort*). *entries* (the config's, validated)
    and *fires* are what a caller building the page again and again keeps; they are built for the
    call otherwise. ValueError for a bad *limit*, *query*, *state* or *sort* (:func:`page_params`,
    :func:`view_params`); the store's errors are raised (StoreUnavailable)."""
    limit, query = page_params(limit, query)
    chosen_state, order = view_params(state, sort)
    settings = settings or load_settings_of(app)
    entries = config_entries(app) if entries is None else entries
    fires = fires or NextFires()
    folded = fold(query) if query else None
    names = sorted(n for n in entries if folded is None or folded in fold(n))
    with Opened(app, store, settings) as st:
        stored = st.stored_page(limit=limit, contains=query, grace=settings.claim_grace, overdue=OVERDUE_AFTER,
                                exclude=names, state=chosen_state, order=order)
        now = stored.now
        marks = st.schedule_marks(names, grace=settings.claim_grace)
        counts = dict(stored.counts)
        running = stored.running
        matching = stored.matching or 0
        keys: List[Tuple[Tuple[Any, ...], str, Optional[Attention]]] = []
        for name in names:
            mark = marks.get(name)
            attention, next_fire = _config_attention(name, entries[name], mark, now, fires)
            if attention is not None:
                counts[attention] = counts.get(attention, 0) + 1
            is_running = bool(mark is not None and mark.running)
            running += is_running
            if _in_state(chosen_state, attention, is_running):
                matching += 1
                keys.append((_key(order, attention, next_fire, mark.last if mark else None, name), name, attention))
        keys.extend((_key(order, e.attention, e.next_at, e.last, e.name), e.name, e.attention)
                    for e in stored.entries
                    if e.name not in entries)  # named like an entry since the read above: beat schedules the entry
        chosen = heapq.nsmallest(limit, keys)
        shown = [name for _, name, _ in chosen]
        rows = {r.name: r for r in st.stored_get([n for n in shown if n not in entries])}
        reads = ScheduleReads(app, st, shown, now=now)
    page_rows = []
    for _, name, attention in chosen:
        if name in entries:
            info = reads.config_info(name, entries[name])
        elif name in rows:
            info = reads.stored_info(rows[name])
        else:  # removed between the two reads
            continue
        page_rows.append(PageRow(attention, info, reads.latest.get(name)))
    fires.retain(entries)
    return SchedulePage(rows=tuple(page_rows), total=len(names) + stored.total, config_total=len(names),
                        stored_total=stored.total, counts={a: counts.get(a, 0) for a in RANKS}, limit=limit,
                        query=query, now=now, state=chosen_state, order=order, running=running,
                        matching=matching if chosen_state is not None else None)


# ----------------------------------------------------------------------------- one schedule

#: The schedule page lists this many of its next fires ...
UPCOMING = 10
#: ... and this many of its latest occurrences (claim rows with the worker's ledger columns).
RECENT_RUNS = 50


@dataclass(frozen=True)
class ScheduleDetail:
    """One schedule as its page shows it: what ``list`` says of it, why it needs attention, its
    next fires, and its latest occurrences newest first (``info`` None: a removed schedule whose
    occurrences are still recorded)."""

    name: str
    info: Optional[ScheduleInfo]
    attention: Optional[Attention]
    running: bool
    upcoming: Tuple[datetime, ...]
    recent: Tuple[ClaimRow, ...]
    now: datetime  #: the database's clock


def _upcoming(rule: Any, now: datetime, count: int) -> Tuple[datetime, ...]:
    out: List[datetime] = []
    at = now
    for _ in range(count):
        try:
            at = rule.next_fire(at)
        except (ScheduleError, ValueError):
            break
        if at is None:
            break
        out.append(at)
    return tuple(out)


def schedule_detail(app: Any, store: Optional[ClaimStore] = None, name: str = "", *,
                    settings: Optional[Settings] = None, entries: Optional[Dict[str, Entry]] = None,
                    recent: int = RECENT_RUNS, upcoming: int = UPCOMING) -> Optional[ScheduleDetail]:
    """Schedule *name*'s page (see :class:`ScheduleDetail`), or None when no schedule has that name
    and none had occurrences recorded. A bounded read: its row, its marks, and the last *recent*
    claim rows (``ORDER BY scheduled_at DESC LIMIT``)."""
    from ..dynamic.convert import entry_from_row

    if not isinstance(name, str) or not name or len(name) > QUERY_MAX:
        return None
    settings = settings or load_settings_of(app)
    entries = config_entries(app) if entries is None else entries
    with Opened(app, store, settings) as st:
        now = st.db_now()
        rows = [] if name in entries else st.stored_get([name])
        recent_rows = tuple(st.recent_claims(name, limit=max(1, min(recent, 500))))
        if name not in entries and not rows and not recent_rows:
            return None
        mark = st.schedule_marks([name], grace=settings.claim_grace).get(name)
        reads = ScheduleReads(app, st, [name], now=now)
    rule: Any = None
    info: Optional[ScheduleInfo] = None
    attention: Optional[Attention] = None
    if name in entries:
        info, rule = reads.config_info(name, entries[name]), reads.bound(name, entries[name].schedule)
        attention = _config_attention(name, entries[name], mark, now, NextFires())[0]
    elif rows:
        info = reads.stored_info(rows[0])
        try:
            rule = entry_from_row(rows[0], app=app).schedule
        except Exception:  # noqa: BLE001 - a row that does not validate: its problem is shown, no fires
            rule = None
        if mark is not None and mark.failing:
            attention = Attention.FAILING
        elif info.paused:
            attention = Attention.PAUSED
    fires = _upcoming(rule, now, upcoming) if rule is not None and info is not None and info.enabled else ()
    return ScheduleDetail(name=name, info=info, attention=attention, running=bool(mark and mark.running),
                          upcoming=fires, recent=recent_rows, now=now)
