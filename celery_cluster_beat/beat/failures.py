"""``pause_after_failures=N``: the leader pauses a schedule whose last N runs failed.

**Where failures come from.** From the worker-side ledger (``LedgerTask``): ``run_state`` on the
claim rows. Without the ledger, from the result backend, where the overlap guard reads task states
(its reader is reused: :attr:`~.guard.OverlapGuard.states`).

**When it is looked at.** Off the hot path: in the housekeeping of the node holding the lease
(every ``claim_grace / 3``, beside its heartbeat; never more often than :data:`CHECK_EVERY`
seconds), so a tick with nothing due still issues no SQL. Ledger: one indexed SELECT of the runs recorded ``failed``
since the previous pass (:meth:`~..store.failures.FailureQueries.failed_since`); when it finds
none, that is all, whatever the number of schedules. Only a schedule with a new failure and the
setting is judged, by one more read of its last N ended runs. Result backend: the runs this node
sent of schedules with the setting whose task does not use the ledger wait in memory until their
state is known, read in one batch (one MGET on Redis) per pass, only while some wait.

**What "consecutive" means.** The last N runs *that ended*, in the order of their scheduled
instants (a late finisher does not reorder them), all failed. Only runs count: an occurrence
skipped by the overlap guard, recorded missed, refused, never delivered, or still running (or
retried by Celery, or lost with its process) neither extends nor breaks the streak; one success
resets it. Runs that ended before the schedule's last resume do not count (a resume restarts the
streak). With the result backend the leader counts in memory the runs it sent, in the order it
sent them: a new leader starts its count afresh.

**What happens.** The schedule is paused through the operators' control (``by cluster-beat``,
with a note such as ``paused after 3 consecutive failed runs (last: ValueError: ...)``), which
every leader honours; :data:`~..signals.paused_after_failures` fires and the metric
``cluster_beat_paused_after_failures_total`` counts it. ``resume`` clears it and the streak
starts again from then.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from datetime import datetime, timedelta
from typing import Any, Callable, Deque, Dict, Iterable, List, NamedTuple, Optional, Set, Tuple

from celery import states as celery_states

from .. import signals
from ..base import clip
from ..config import Entry
from ..config.celeryconf import has_result_backend
from ..config.observing import ignores_results
from ..config.values import printable
from ..schedules.occurrence import Occurrence
from ..store import StoreUnavailable
from ..store.controls import MAX_NOTE_LENGTH
from ..store.schema import RunState
from .state import NodeState

logger = logging.getLogger("celery_cluster_beat")

#: Seconds between two passes.
CHECK_EVERY = 2.0
#: How far back a node that starts scheduling looks for failed runs.
LOOKBACK = timedelta(hours=1)
#: A run's finish time is the database's when its statement ran, before its commit: each pass reads
#: this much before the previous one again (runs already judged are skipped).
REREAD = timedelta(seconds=30)
#: Failed runs read per pass (more: the next pass goes on from the last one read).
READ_AT_ONCE = 500
#: Who the pause is by.
PAUSED_BY = "cluster-beat"
#: Result backend: schedules whose runs are watched in memory at most (the longest unsent-to is
#: forgotten first), and those the "cannot be watched" warning remembers having named.
MAX_WATCHED = 10000


class _Pause(NamedTuple):
    """A pause this node wrote, and what its signal says."""

    count: int
    last_error: Optional[str]
    task_ids: List[str]
    note: str


class _Watched(NamedTuple):
    """What the result-backend path keeps of a schedule, captured when a run of it went out: it
    may not be held in memory when the run ends (a stored schedule due later)."""

    count: int  # pause_after_failures
    give_up: float  # seconds after which a run whose state never shows is let go (its max_run_time)


def unobservable(app: Any, guard: Any, entries: Iterable[Entry]) -> List[str]:
    """Names of *entries* with ``pause_after_failures`` whose runs nothing can observe: the task does
    not use the ledger, and the app has no result backend or the task ignores its results."""
    backend = has_result_backend(app)
    return sorted(e.name for e in entries if e.pause_after_failures and not guard.uses_ledger(e)
                  and (not backend or ignores_results(app, e)))


def warn_unobservable(app: Any, guard: Any, entries: Iterable[Entry]) -> None:
    """The start-up warning (once, naming them) for entries whose ``pause_after_failures`` cannot work."""
    names = unobservable(app, guard, entries)
    if names:
        shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
        logger.warning("cluster-beat: pause_after_failures cannot work for %s: the task does not use the ledger "
                       "and %s, so nothing says a run failed. Use base=celery_cluster_beat.LedgerTask for the "
                       "task, or configure result_backend (and keep its results).", shown,
                       "the app has no result backend" if not has_result_backend(app) else "it ignores its results")


def pause_note(count: int, last_error: Optional[str]) -> str:
    """The note of a pause after *count* failed runs."""
    last = f" (last: {printable(last_error)})" if last_error else ""
    return clip(f"paused after {count} consecutive failed run{'s' if count != 1 else ''}{last}", MAX_NOTE_LENGTH)


class FailureWatch:
    """The failure streaks of schedules with ``pause_after_failures``, judged by the scheduling node.

    :param paused: the names paused (the controls' set): they are not judged.
    :param resolve: entries of stored schedules not held in memory, by name.
    :param forget: drop what was kept about schedules that are not held.
    :param paused_now: apply a pause this node just wrote (the controls' own path).
    """

    def __init__(self, node: NodeState, *, paused: Set[str], resolve: Callable[[List[str]], Dict[str, Entry]],
                 forget: Callable[[List[str]], None], paused_now: Callable[[str], None]) -> None:
        self.node = node
        self._paused = paused
        self._resolve = resolve
        self._forget = forget
        self._paused_now = paused_now
        self.next_check = 0.0
        #: Passes made (tests wait for one).
        self.passes = 0
        self.reset()

    def reset(self) -> None:
        """This node starts scheduling: look back :data:`LOOKBACK`; nothing of before is kept."""
        self._since: Optional[datetime] = None
        #: (finished_at, schedule, instant) of the last row of a full page: the next pass reads on from it.
        self._page: Optional[Tuple[datetime, str, datetime]] = None
        self._seen: Dict[Tuple[str, datetime], datetime] = {}
        #: Result backend: name -> (task id, monotonic time sent) of runs sent, their end not known yet.
        self._waiting: Dict[str, Deque[Tuple[str, float]]] = {}
        #: Result backend: name -> task ids of the failed runs in a row (the last N at most).
        self._streaks: Dict[str, List[str]] = {}
        #: Result backend: name -> its setting and give-up time, as of its last run sent (most recent last).
        self._watched: "OrderedDict[str, _Watched]" = OrderedDict()
        #: Names the "cannot be watched" warning named (each once; bounded).
        self._warned: Set[str] = set()
        #: Pauses written whose outcome is not known yet (their reply was lost): name -> what the
        #: signal says. The note identifies the pause: seen paused with it, the signal fires then, once.
        self._unconfirmed: Dict[str, _Pause] = {}

    def due(self, mono: float) -> bool:
        return mono >= self.next_check

    def resumed(self, name: str) -> None:
        """*name* was resumed: its streak restarts."""
        self._drop(name)

    def _drop(self, name: str) -> None:
        self._streaks.pop(name, None)
        self._waiting.pop(name, None)
        self._watched.pop(name, None)

    # -- the result-backend path ------------------------------------------------------
    def sent(self, entry: Entry, occ: Occurrence) -> None:
        """A run of *entry* went out (the send pipeline's hook: one attribute read for most entries)."""
        guard = self.node.guard
        if entry.pause_after_failures is None or guard is None or guard.uses_ledger(entry):
            return
        name = entry.name
        if unobservable(self.node.app, guard, [entry]):  # nothing would ever say how it ended
            if name not in self._warned and name not in self.node.static and len(self._warned) < MAX_WATCHED:
                self._warned.add(name)
                warn_unobservable(self.node.app, guard, [entry])
            return
        self._watched[name] = _Watched(int(entry.pause_after_failures), guard.max_run_time(entry))
        self._watched.move_to_end(name)
        while len(self._watched) > MAX_WATCHED:  # memory stays bounded: the longest idle goes first
            self._drop(next(iter(self._watched)))
        waiting = self._waiting.setdefault(name, deque())
        waiting.append((occ.task_id, time.monotonic()))
        while len(waiting) > 4 * entry.pause_after_failures + 16:  # never known: forgotten, oldest first
            waiting.popleft()

    def _backend_pass(self) -> None:
        node = self.node
        ids = [task_id for waiting in self._waiting.values() for task_id, _ in waiting]
        if not ids or node.guard is None:
            return
        states = node.guard.states(ids)
        mono = time.monotonic()
        for name in list(self._waiting):
            waiting = self._waiting[name]
            # What was captured when its runs went out: a stored schedule may not be held now.
            watched = self._watched.get(name)
            if watched is None:
                del self._waiting[name]
                continue
            # A run whose result never shows (expired, ignored) past max_run_time is let go, unknown:
            # it neither extends nor breaks the streak, and no longer holds up the runs after it.
            while waiting and (states.get(waiting[0][0]) in celery_states.READY_STATES
                               or mono - waiting[0][1] > watched.give_up):
                task_id, _ = waiting.popleft()
                state = states.get(task_id)
                if state == celery_states.SUCCESS:
                    self._streaks.pop(name, None)
                elif state == celery_states.FAILURE:
                    streak = self._streaks.setdefault(name, [])
                    streak.append(task_id)
                    del streak[:-watched.count]  # the last N are all a pause needs
            if not waiting:
                del self._waiting[name]
            streak = self._streaks.get(name)
            if streak and len(streak) >= watched.count and name not in self._paused:
                self._pause(name, len(streak), f"task {streak[-1]} ended FAILURE", list(streak))

    # -- the pass -----------------------------------------------------------------------
    def check(self) -> None:
        """One pass (raises StoreUnavailable: the next pass reads the same window again)."""
        node = self.node
        self.next_check = time.monotonic() + CHECK_EVERY
        now = node.clock.now()
        since = self._since if self._since is not None else now - LOOKBACK
        page = self._page
        rows = node.store.failed_since(since - REREAD, limit=READ_AT_ONCE, after=page)
        if len(rows) == READ_AT_ONCE:  # more to read: on from this row, ties of its finish time included
            self._page = (rows[-1][2], rows[-1][0], rows[-1][1])
        else:
            self._page, self._since = None, max(since, now)
        floor = since - REREAD
        self._seen = {k: v for k, v in self._seen.items() if v > floor}
        names: List[str] = []
        new: List[Tuple[str, datetime]] = []
        for name, at, finished in rows:
            if (name, at) not in self._seen:
                self._seen[(name, at)] = finished
                new.append((name, at))
                if name not in names and name not in self._paused:
                    names.append(name)
        if names:
            try:
                self._judge(names)
            except StoreUnavailable:  # judged again on the next pass
                self._since, self._page = since, page
                for key in new:
                    self._seen.pop(key, None)
                raise
        if self._waiting:
            self._backend_pass()
        self.passes += 1

    def _judge(self, names: List[str]) -> None:
        node = self.node
        entries = {n: node.entries[n] for n in names if n in node.entries}
        absent = [n for n in names if n not in entries]
        if absent:
            entries.update(self._resolve(absent))
        try:
            watched = {n: e for n, e in entries.items() if e.pause_after_failures and e.enabled}
            if not watched:
                return
            resumed = {c.name: c.resumed_at for c in node.store.controls(list(watched))}
            # A stored schedule's streak starts at its definition's last change (database clock): runs
            # of an earlier schedule of that name (removed and added again, or changed) do not count.
            stored = [n for n in watched if n not in node.static]
            changed = {r.name: r.changed_at for r in node.store.stored_get(stored)} if stored else {}
            for name, entry in watched.items():
                count = int(entry.pause_after_failures or 0)
                after = max((t for t in (resumed.get(name), changed.get(name)) if t is not None), default=None)
                runs = node.store.last_ended_runs(name, count, after=after)
                if len(runs) == count and all(r.run_state == RunState.FAILED for r in runs):
                    self._pause(name, count, runs[0].run_error, [r.task_id for r in runs],
                                resumed_at=resumed.get(name))
        finally:
            if absent:
                self._forget(absent)

    def _pause(self, name: str, count: int, last_error: Optional[str], task_ids: List[str],
               resumed_at: Any = ...) -> None:
        node = self.node
        note = pause_note(count, last_error)
        # Kept until the outcome is known: a commit whose reply was lost shows later as this very
        # pause (by cluster-beat, this note), and its signal and metric fire then (confirm()).
        self._unconfirmed[name] = _Pause(count, last_error, list(task_ids), note)
        # With *resumed_at*: only if not resumed since the runs were read (one transaction, serialised
        # with every control change by the change counter's row lock).
        _, changed = node.store.set_paused(name, True, by=PAUSED_BY, note=note, replace_note=False,
                                           resumed_at=resumed_at)
        self._drop(name)
        if not changed:  # an operator paused (theirs stands) or resumed it meanwhile; or ours, reply lost
            for row in node.store.controls([name]):
                self.confirm(row)
            self._unconfirmed.pop(name, None)
            return
        pause = self._unconfirmed.pop(name, None) or _Pause(count, last_error, list(task_ids), note)
        self._paused_now(name)  # its confirm() finds nothing pending: the signal fires here, once
        self._fire(name, pause)

    def confirm(self, row: Any) -> None:
        """A control row read paused: if it is a pause of this node's whose outcome it did not learn
        (the commit's reply was lost), its signal and metric fire now, once."""
        pending = self._unconfirmed.get(row.name)
        if pending is None or not row.paused or row.paused_by != PAUSED_BY or row.paused_note != pending.note:
            return
        del self._unconfirmed[row.name]
        self._fire(row.name, pending)

    def _fire(self, name: str, pause: _Pause) -> None:
        logger.warning("cluster-beat: %s %s", printable(name), pause.note)
        signals.paused_after_failures.send(sender=self.node.sender, schedule=name, failures=pause.count,
                                           last_error=pause.last_error, note=pause.note, task_ids=pause.task_ids)
