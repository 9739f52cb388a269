"""Bounds on any rule: ``start_at``, ``end_at`` and ``max_runs``.

Pure, like every rule. A bounded rule fires the instants of its rule that are at or after
``start_at``, at or before ``end_at``, and among the first ``max_runs`` at or after its
*start*: ``start_at`` when given, else the schedule's *origin* (a stored row's creation, a
config entry's first registration: both the database's clock, known to every replica). So
which occurrences exist never depends on counting claim rows, and every replica agrees: an
occurrence that ended skipped, missed or failed counts toward ``max_runs`` like a sent one.

The ``max_runs``-th instant is computed once per (rule, start, count) and kept, so a due pass
costs one comparison more, never a walk over the runs so far.
"""
from __future__ import annotations

from datetime import datetime, tzinfo
from functools import lru_cache
from typing import Any, Optional, Tuple

from .errors import ScheduleError
from .instants import TINY, require_aware
from .rules import EveryRule, ScheduleRule

__all__ = ["BoundedRule", "MAX_RUNS", "nth_fire", "runs_problem"]

#: Most runs ``max_runs`` may ask for: finding the last one walks the rule once (for rules
#: other than a plain ``every``), which must stay well under a second. For more, use ``end_at``.
MAX_RUNS = 100_000


def runs_problem(value: Any) -> Optional[str]:
    """Why *value* cannot be a ``max_runs``; None when it can."""
    if isinstance(value, bool) or not isinstance(value, int):
        return f"expected a whole number of runs of at least 1, got {value!r}"
    if value < 1:
        return f"{value} is less than 1 (leave max_runs out for no limit)"
    if value > MAX_RUNS:
        return f"{value} is more than the {MAX_RUNS} runs allowed (use end_at for a longer schedule)"
    return None


@lru_cache(maxsize=4096)
def _nth(key: Tuple, rule: ScheduleRule, after: datetime, n: int) -> Optional[datetime]:
    if isinstance(rule, EveryRule) and rule.baseline is None:  # the epoch grid: arithmetic
        first = rule.next_fire(after)
        return first + (n - 1) * rule.interval
    t: Optional[datetime] = after
    for _ in range(n):
        t = rule.next_fire(t)
        if t is None:
            return None
    return t


def nth_fire(rule: ScheduleRule, after: datetime, n: int) -> Optional[datetime]:
    """The *n*-th instant of *rule* strictly after *after* (None when it has fewer)."""
    return _nth(rule.fires_key(), rule, require_aware(after), n)


class BoundedRule(ScheduleRule):
    """*rule* limited to [start_at, end_at] and to its first *max_runs* instants from its start."""

    def __init__(self, rule: ScheduleRule, *, start_at: Optional[datetime] = None,
                 end_at: Optional[datetime] = None, max_runs: Optional[int] = None,
                 origin: Optional[datetime] = None) -> None:
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
        if self.max_runs is not None and start is not None:
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
                          origin=origin)

    def _key(self) -> Tuple:
        return (self.rule, self.start_at, self.end_at, self.max_runs,
                self.origin if self.max_runs is not None and self.start_at is None else None)

    def __repr__(self) -> str:
        parts = [repr(self.rule)]
        if self.start_at is not None:
            parts.append(f"start_at={self.start_at.isoformat()}")
        if self.end_at is not None:
            parts.append(f"end_at={self.end_at.isoformat()}")
        if self.max_runs is not None:
            parts.append(f"max_runs={self.max_runs}")
        return "<bounded " + " ".join(parts) + ">"
