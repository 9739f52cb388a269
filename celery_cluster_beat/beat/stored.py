"""Stored schedules on the scheduling node: following their changes, and the horizon.

Schedules made at run time (:mod:`..dynamic`) live in SQL and may number far more
than a node should hold. So memory holds only those due before the *horizon*
(:data:`HORIZON` ahead, read a window at a time), plus the config's entries; the
rest wait in SQL with their exact next occurrence, and a schedule whose next fire
moves past the horizon is handed back (its next_at written first). Changes are read
from the store's change feed, counter first, only when a Redis notice says something
changed (or, without notices, on a timer), so following costs no SQL while nothing
changes. The same counter carries operators' controls, applied by :class:`~.controls.Controls`.

This is apart from the due pass because it is the one place that decides what is held
in memory, and from leadership because a new leader only resets it (:meth:`StoredFollower.reset`).
"""
from __future__ import annotations

import logging
import time
from datetime import datetime, timedelta
from typing import Dict, List, Optional, Set, Tuple

from ..config import Entry
from ..dynamic import entry_from_row
from ..errors import ConfigError
from ..schedules.instants import TINY
from ..store import ClaimStatus, StoreUnavailable
from .controls import Controls
from .state import NodeState

logger = logging.getLogger("celery_cluster_beat")

#: Stored schedules due within this many seconds are held in memory; the rest wait in SQL
#: with their next occurrence, read a window at a time (every HORIZON / 2).
HORIZON = 120.0
#: Without Redis notices the stored schedules' change counter is read this often (seconds) ...
CHANGE_READ_MIN = 1.0
#: ... while notices are heard, at once after one (at most this often, for a storm of changes) ...
CHANGE_READ_NOTICED = 0.1
#: ... and without a notice only this often (a notice lost while Redis reconnected).
CHANGE_READ_FALLBACK = 5.0
#: How often the leader looks for a notice (a socket read, no SQL) when nothing else wakes it.
NOTICE_POLL = 0.5
#: Changed rows applied per read of the change feed (a bigger backlog takes several reads).
CHANGE_BATCH = 1000


class StoredFollower:
    """Which stored schedules are held, up to which change, and the horizon."""

    def __init__(self, node: NodeState) -> None:
        self.node = node
        self.controls = Controls(node, drop=self.drop, horizon=lambda: self.horizon, resolve=self.resolve,
                                 forget=self.forget_held)
        self.version = 0  # the change counter's value this node has applied
        #: Within version ``version``, the last name read, while more rows of it remain (one
        #: change can write many rows: add_many).
        self.after: Optional[str] = None
        #: Held stored schedules whose previous runs the overlap guard has yet to load (the store failed).
        self.states_owed: Set[str] = set()
        self.horizon: Optional[datetime] = None  # stored schedules due before this are in memory
        self.read_at = float("-inf")  # monotonic time the change counter was last read
        self.changes_wanted = False
        #: (name, version, next fire) of stored schedules to hand back to SQL once their next_at is written.
        self.evict_retry: List[Tuple[str, int, Optional[datetime]]] = []
        self.evict_retry_at = 0.0

    @staticmethod
    def window_end(now: datetime) -> datetime:
        """Where the horizon moves to when its window is read at *now*."""
        return now + timedelta(seconds=HORIZON)

    def reset(self, version: int, horizon: datetime) -> None:
        """This node starts scheduling, with every change up to *version* read and the stored
        schedules due before *horizon* about to be held."""
        self.version = version
        self.after = None
        self.states_owed = set()
        self.read_at = time.monotonic()
        self.changes_wanted = False
        self.horizon = horizon
        self.evict_retry = []
        self.trim()  # stored schedules are read afresh (new entries: their old templates are stale anyway)

    # -- holding and dropping ------------------------------------------------------
    def hold(self, rows, last: Optional[Dict[str, datetime]] = None) -> None:
        """Hold stored schedules in memory (rows due before the horizon, or just changed);
        *last*: their last recorded occurrences, when next_at may lag behind them."""
        node = self.node
        paused = self.controls.paused
        held = []
        ended: List[Tuple[str, int, Optional[datetime]]] = []
        for row in rows:
            if row.name in node.static:
                self._clash(row)
                continue
            current = node.entries.get(row.name)
            if current is not None and (current.stored_version or 0) >= row.version:
                continue  # already held at this version (or a newer one)
            if row.deleted or not row.enabled or row.next_at is None or row.name in paused:
                why = ("paused" if row.name in paused else "removed" if row.deleted
                       else "ended" if row.enabled and row.next_at is None else "disabled")
                self.drop(row.name, gone=why)
                continue
            try:
                entry = entry_from_row(row, app=node.app)
            except ConfigError as exc:  # written by another release, or by hand: never fire it half-read
                logger.error("cluster-beat: stored schedule %r cannot be scheduled: %s", row.name, exc)
                self.drop(row.name, gone="unreadable")
                continue
            if current is not None:
                self._guard_forget(row.name, "changed")  # a buffered run of the old definition
                self.controls.failures.resumed(row.name)  # a streak of the old definition ends with it
                self._forget_message(row.name)  # built from the old definition
            if row.next_at >= self.horizon:
                self.drop(row.name)  # its next_at in SQL is exact: the window that covers it loads it
                continue
            # On the schedule's own instants (the zone it is read in here decides), from next_at on.
            try:
                at = entry.schedule.next_fire(row.next_at - TINY)
                if at is not None and last and row.name in last:  # held (before the horizon in SQL), from where it is
                    after_last = entry.schedule.next_fire(last[row.name])
                    at = None if after_last is None else max(at, after_last)
            except Exception as exc:  # a row written by hand with bounds past year 9999: this row only
                # Queued at its next_at, where the due pass records it failed with the reason and drops it.
                logger.error("cluster-beat: stored schedule %r: its next occurrence cannot be computed (%s: %s)",
                             row.name, exc.__class__.__name__, exc)
                entry.refused = f"its next occurrence cannot be computed ({exc.__class__.__name__}: {exc})"
                at = row.next_at
            if at is None:  # its last occurrence was recorded already (the previous leader did not hand it back)
                if current is not None:
                    self.drop(row.name, gone="ended")  # an older definition held must not fire on
                ended.append((row.name, row.version, None))
                continue
            node.entries[row.name] = entry
            node.queue.set(row.name, at)
            held.append(row.name)
        # A one-off has no previous run for the overlap guard to know of: 20,000 one-offs entering
        # the horizon together cost no read of their (absent) states.
        held = [name for name in held if not node.entries[name].schedule.once]
        if held:
            self.states_owed.update(held)
            self._load_states()
        if ended:
            self.release(ended)

    def _load_states(self) -> None:
        """Give the overlap guard the previous runs of newly held stored schedules (kept owed when the
        store fails: retried on the next pass, the schedules stay held meanwhile)."""
        owed = sorted(self.states_owed)
        try:
            states = self.node.store.schedule_states(owed)
        except StoreUnavailable as exc:
            logger.warning("cluster-beat: cannot read the last runs of %d stored schedule(s) yet (%s)", len(owed), exc)
            self.node.backoff.trouble()
            return
        self.node.guard.load(states)
        self.states_owed.difference_update(owed)

    def _guard_forget(self, name: str, why: str) -> None:
        """A buffered (``buffer_one``) occurrence of a schedule that changed or went away is not sent:
        it is recorded skipped, with the reason."""
        pair = self.node.guard.forget(name)
        if pair is None:
            return
        try:
            self.node.store.record([pair[1]], status=ClaimStatus.SKIPPED, reason=f"buffered; the schedule was {why}",
                                   term=self.node.term())
        except StoreUnavailable as exc:
            logger.warning("cluster-beat: cannot record the buffered occurrence of %s as skipped (%s)", name, exc)

    def _clash(self, row) -> None:
        logger.error("cluster-beat: the stored schedule %r has the name of a beat_schedule entry; it is not "
                     "scheduled (remove it, or rename the entry)", row.name)

    def drop(self, name: str, gone: Optional[str] = None) -> None:
        """Stop holding stored schedule *name* in memory; *gone* (removed, disabled, paused ...) when
        it must not fire at all: its buffered occurrence and pending publish retries go too."""
        node = self.node
        if gone is not None:
            self._guard_forget(name, gone)
            self.controls.failures.resumed(name)  # removed (or paused ...): a streak kept in memory ends
            node.pipeline.forget(name, f"the schedule was {gone} before this occurrence was sent")
            node.schedule_gone(name)
        if name in node.static:
            if gone is not None:
                node.queue.remove(name)
            return
        node.entries.pop(name, None)
        node.queue.remove(name)
        self.forget_held([name])

    # -- memory follows what is held ------------------------------------------------
    def forget_held(self, names) -> None:
        """What this node keeps about stored schedules *names* besides their entry (their message
        template or refusal, the overlap guard's last run) goes with them when they are no longer
        held: otherwise every schedule ever fired stays in memory. Both come back when needed:
        the template is built again before the next fire, the last run is read from SQL when
        the schedule is held again (:meth:`_load_states`)."""
        node = self.node
        names = [n for n in names if n not in node.entries]
        if not names:
            return
        if node.guard is not None:
            node.guard.forget_runs(names)
        for name in names:
            self._forget_message(name)

    def _forget_message(self, name: str) -> None:
        pipeline = self.node.pipeline
        if pipeline is not None:
            pipeline.publisher.templates.forget(name)

    def trim(self) -> None:
        """Forget what is kept for schedules no longer held however it came to be kept (a publish
        retry, a resend or a run-now of a schedule that is not held builds its message and records
        its run); cheap enough for each move of the horizon's window."""
        node = self.node
        held = node.entries.__contains__
        if node.pipeline is not None:
            node.pipeline.publisher.templates.retain(held)
        if node.guard is not None:
            node.guard.retain_runs(held)

    # -- following -----------------------------------------------------------------
    def next_check_in(self, mono: float) -> float:
        """Seconds until the change counter (or, with notices, the notice socket) is due a look."""
        since = mono - self.read_at
        notices = self.node.notices
        if notices is None or notices.down:
            return max(0.0, CHANGE_READ_MIN - since)
        if self.changes_wanted:
            return max(0.0, CHANGE_READ_NOTICED - since)
        # A notice is only seen on a tick: look twice a second, which costs no SQL.
        return min(NOTICE_POLL, max(0.0, CHANGE_READ_FALLBACK - since))

    def follow(self) -> None:
        """Apply stored schedule changes and move the horizon on, reading SQL only when due."""
        node = self.node
        if not node.active or self.horizon is None:
            return
        store, notices, controls = node.store, node.notices, self.controls
        mono = time.monotonic()
        if notices is not None and notices.heard():
            self.changes_wanted = True
        since = mono - self.read_at
        if notices is None or notices.down:
            read = since >= CHANGE_READ_MIN
        elif self.changes_wanted:
            read = since >= CHANGE_READ_NOTICED
        else:
            read = since >= CHANGE_READ_FALLBACK
        if read:
            self.read_at = mono
            self.changes_wanted = False
            version = store.stored_version()
            while version > self.version or self.after is not None:
                rows = store.stored_changes(self.version, after_name=self.after, limit=CHANGE_BATCH)
                if rows:
                    self.hold(rows)
                    self.version, self.after = rows[-1].version, rows[-1].name
                    logger.info("cluster-beat: applied %d stored schedule change(s) (version %d)",
                                len(rows), self.version)
                if len(rows) < CHANGE_BATCH:
                    self.after = None  # every row up to the counter's value is read
                    break
            if self.after is None:
                self.version = max(self.version, version)
            if version > controls.version:  # a backfill request bumps the counter too
                controls.backfills.wanted = True
            while version > controls.version:
                changed = store.control_changes(controls.version, limit=CHANGE_BATCH)
                if changed:
                    controls.apply(changed)
                    controls.version = changed[-1].version
                if len(changed) < CHANGE_BATCH:
                    controls.version = max(controls.version, version)
                    break
        if self.states_owed:
            self._load_states()
        if controls.run_requests:
            controls.run_requested()
        now = node.clock.now()
        if (self.horizon - now).total_seconds() <= HORIZON / 2:
            horizon = self.window_end(now)
            rows = store.stored_due(horizon, since=self.horizon)
            self.horizon = horizon
            self.hold(rows)
            self.trim()
        if self.evict_retry and mono >= self.evict_retry_at:
            leaving, self.evict_retry = self.evict_retry, []
            # Only what is still that fire: a schedule that fired since was handed back anew.
            self.release([(n, v, at) for n, v, at in leaving if node.queue.get(n) == at])

    def release(self, leaving: List[Tuple[str, int, Optional[datetime]]]) -> None:
        """Hand stored schedules whose next fire is past the horizon back to SQL: record their
        next occurrence, then forget them. Until SQL has it they stay in memory. A next fire of
        None: the schedule has ended (``next_at`` NULL, ``ended_at`` set), it is no longer queued."""
        node = self.node
        try:
            node.store.stored_set_next(leaving, term=node.term())  # StaleTermError: fenced out, nothing written
        except StoreUnavailable as exc:
            logger.warning("cluster-beat: cannot record the next occurrence of %d stored schedule(s) yet (%s)",
                           len(leaving), exc)
            self.evict_retry.extend(leaving)
            self.evict_retry_at = time.monotonic() + CHANGE_READ_FALLBACK
            return
        for name, version, at in leaving:
            entry = node.entries.get(name)
            # Still that definition, still that fire, and still past the horizon (which may have
            # moved on meanwhile): a window read before this write could not have seen it.
            if at is None:
                if name not in node.queue:  # ended: nothing of it is kept (a change may have queued it again)
                    self.drop(name)
            elif (entry is not None and entry.stored_version == version and node.queue.get(name) == at
                    and self.horizon is not None and at >= self.horizon):
                self.drop(name)

    def resolve(self, names: List[str]) -> Dict[str, Entry]:
        """Entries of stored schedules not held in memory (a stale claim of one is resent)."""
        out = {}
        for row in self.node.store.stored_get(names):
            try:
                out[row.name] = entry_from_row(row, app=self.node.app)
            except ConfigError:
                continue
        return out
