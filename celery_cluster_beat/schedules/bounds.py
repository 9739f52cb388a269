"""Bounds on any rule: ``start_at``, ``end_at`` and ``max_runs``.

Pure, like every rule. A bounded rule fires the instants of its rule that are at or after
``start_at``, at or before ``end_at``, and among the first ``max_runs`` at or after its
*start*: ``start_at`` when given, else the schedule's *origin* (a stored row's creation, a
config entry's first registration: both the database's clock, known to every replica). So
which occurrences exist never depends on counting claim rows, and every replica agrees: an
occurrence that ended skipped, missed or failed counts toward ``max_runs`` like a sent one.

The ``max_runs``-th instant is computed once per (rule, start, count) and kept, so a due pass
costs one comparison more, never a walk over the runs so far. For a plain ``every`` it is
arithmetic; for other rules it is a walk of up to :data:`MAX_RUNS` instants, done once per
config entry when it becomes active. A stored schedule never walks on the scheduling node: the
API computes that instant once when the row is written and stores it (``runs_end_at``), and
the leader bounds the row by it (*runs_end*).
"""
from __future__ import annotations

from datetime import datetime, tzinfo
from functools import lru_cache
from typing import Any, Optional, Tuple

from .errors import ScheduleError
from .instants import TINY, require_aware
from .rules import EveryRule, ScheduleRule

__all__ = ["BoundedRule", "MAX_RUNS", "nth_fire", "runs_end", "runs_problem"]

#: Most runs ``max_runs`` may ask for: finding the last one walks the rule once (for rules
#: other than a plain ``every``), which must stay well under a second (10,000 steps of a
#: ``* * * * *`` cron: about 0.3 s). For more, use ``end_at``.
MAX_RUNS = 10_000


def runs_problem(value: Any) -> Optional[str]:
    """Why *value* cannot be a ``max_runs``; None when it can."""
    if isinstance(value, bool) or not isinstance(value, int):
        return f"expected a whole number of runs of at least 1, got {value!r}"
    if value < 1:
        return f"{value} is less than 1 (leave max_runs out for no limit)"
    if value > MAX_RUNS:
        return f"{value} is more than the {MAX_RUNS} runs allowed (use end_at for a longer schedule)"
    return None


def _beyond(n: int, after: datetime) -> ScheduleError:
    return ScheduleError(f"max_runs: the {n}th run from {(after + TINY).isoformat()} is later than the last date "
                         "a datetime can hold (year 9999): lower max_runs or start_at")


@lru_cache(maxsize=4096)
def _nth(key: Tuple, rule: ScheduleRule, after: datetime, n: int) -> Optional[datetime]:
    try:
        if isinstance(rule, EveryRule) and rule.baseline is None:  # the epoch grid: arithmetic
            first = rule.next_fire(after)
            return first + (n - 1) * rule.interval
        t: Optional[datetime] = after
        for _ in range(n):
            t = rule.next_fire(t)
            if t is None:
                return None
        return t
    except (OverflowError, ValueError, ScheduleError) as exc:  # past year 9999
        raise _beyond(n, after) from exc


def nth_fire(rule: ScheduleRule, after: datetime, n: int) -> Optional[datetime]:
    """The *n*-th instant of *rule* strictly after *after* (None when it has fewer); a
    :class:`ScheduleError` naming ``max_runs`` when it is past what a datetime holds."""
    return _nth(rule.fires_key(), rule, require_aware(after), n)


def runs_end(rule: ScheduleRule, start: datetime, max_runs: int, end_at: Optional[datetime] = None) -> datetime:
    """Where *max_runs* instants of *rule* from *start* end: the last instant it may fire at by its
    count (stored as a row's ``runs_end_at``). Walks at most *max_runs* instants, and stops at
    *end_at* (the count no longer matters past it); a rule with fewer instants ends at its last
    one (or at *start* when it has none). :class:`ScheduleError` naming ``max_runs`` when the
    count runs past year 9999."""
    start = require_aware(start)
    return _runs_end(rule.fires_key(), rule, start, max_runs, end_at)


@lru_cache(maxsize=1024)  # add_many: every row of one change has the same start
def _runs_end(key: Tuple, rule: ScheduleRule, start: datetime, max_runs: int,
              end_at: Optional[datetime]) -> datetime:
    after = start - TINY
    if isinstance(rule, EveryRule) and rule.baseline is None:
        nth = nth_fire(rule, after, max_runs)
        return start if nth is None else nth
    t: Optional[datetime] = after
    last = start
    try:
        for _ in range(max_runs):
            t = rule.next_fire(t)
            if t is None:
                return last
            last = t
            if end_at is not None and t > end_at:
                return t
    except (OverflowError, ValueError, ScheduleError) as exc:
        raise _beyond(max_runs, after) from exc
    return last


class BoundedRule(ScheduleRule):
    """*rule* limited to [start_at, end_at] and to its first *max_runs* instants from its start."""

    def __init__(self, rule: ScheduleRule, *, start_at: Optional[datetime] = None,
                 end_at: Optional[datetime] = None, max_runs: Optional[int] = None,
                 origin: Optional[datetime] = None, runs_end: Optional[datetime] = None) -> None:
        if isinstance(rule, BoundedRule):
            raise ScheduleError(f"{rule!r} has bounds already")
        self.rule = rule
        self.start_at = require_aware(start_at, "start_at") if start_at is not None else None
        self.end_at = require_aware(end_at, "end_at") if end_at is not None else None
        if self.start_at is not None and self.end_at is not None and self.end_at < self.start_at:
            raise ScheduleError(f"end_at {self.end_at.isoformat()} is before start_at {self.start_at.isoformat()}")
        reason = None if max_runs is None else runs_problem(max_runs)
        if reason:
            raise ScheduleError(f"max_runs: {reason}")
        self.max_runs = max_runs
        self.origin = require_aware(origin, "origin") if origin is not None else None
        #: The last instant by the count, computed when the row was written (a stored row's
        #: ``runs_end_at``): the count is then never walked here.
        self.runs_end = require_aware(runs_end, "runs_end_at") if runs_end is not None and max_runs else None

    # A bounded rule runs in its rule's zone, and reads like it for operators (list, the page).
    @property
    def tz_name(self) -> Optional[str]:  # type: ignore[override]
        return self.rule.tz_name

    def _zone(self) -> tzinfo:
        return self.rule._zone()

    def __getattr__(self, name: str) -> Any:
        if name in ("expr", "spec", "step_us", "baseline", "interval", "run_every", "instant", "wall", "fire_at"):
            rule = self.__dict__.get("rule")
            if rule is not None:
                return getattr(rule, name)
        raise AttributeError(name)

    @property
    def once(self) -> bool:  # type: ignore[override]
        return self.rule.once or self.max_runs == 1

    @property
    def start(self) -> Optional[datetime]:
        """Where ``max_runs`` counts from: ``start_at``, else the origin (None: not known here)."""
        return self.start_at if self.start_at is not None else self.origin

    @property
    def needs_origin(self) -> bool:
        """``max_runs`` counts from a start only the store knows (no ``start_at``, no origin yet)."""
        return self.max_runs is not None and self.start is None

    def last_instant(self) -> Optional[datetime]:
        """The last instant it may fire at (None: no end), computed once."""
        cached = self.__dict__.get("_last", TINY)
        if cached is not TINY:
            return cached
        last = self.end_at
        start = self.start
        if self.runs_end is not None:
            if last is None or self.runs_end < last:
                last = self.runs_end
        elif self.max_runs is not None and start is not None:
            nth = nth_fire(self.rule, start - TINY, self.max_runs)
            if nth is not None and (last is None or nth < last):
                last = nth
        self.__dict__["_last"] = last
        return last

    def next_fire(self, after: datetime) -> Optional[datetime]:
        after = require_aware(after)
        start = self.start_at if self.max_runs is None else self.start
        if start is not None and after < start:
            after = start - TINY
        nxt = self.rule.next_fire(after)
        if nxt is None:
            return None
        last = self.last_instant()
        return None if last is not None and nxt > last else nxt

    def with_origin(self, origin: Optional[datetime]) -> "BoundedRule":
        """The same bounds counted from *origin* (the schedule's registration or creation)."""
        return type(self)(self.rule, start_at=self.start_at, end_at=self.end_at, max_runs=self.max_runs,
                          origin=origin, runs_end=self.runs_end if origin == self.origin else None)

    def _key(self) -> Tuple:
        return (self.rule, self.start_at, self.end_at, self.max_runs,
                self.origin if self.max_runs is not None and self.start_at is None else None, self.runs_end)

    def __repr__(self) -> str:
        parts = [repr(self.rule)]
        if self.start_at is not None:
            parts.append(f"start_at={self.start_at.isoformat()}")
        if self.end_at is not None:
            parts.append(f"end_at={self.end_at.isoformat()}")
        if self.max_runs is not None:
            parts.append(f"max_runs={self.max_runs}")
        return "<bounded " + " ".join(parts) + ">"
