"""Operators' controls as the scheduling node applies them: pause, resume and run-now.

``celery ... cluster-beat pause / resume / run-now`` write rows in the store (see
:mod:`..store.controls`) and bump the same change counter as stored schedules, so the
leader reads them with the stored-schedule changes (:mod:`.stored` calls :meth:`Controls.apply`).
What they mean for scheduling lives here, apart from how changes are read, because each
has a rule of its own that every leader must apply alike: a paused schedule never fires
and its paused time is never caught up after a resume (whichever leader resumes it), and
a run-now request is sent once, for the request's instant and at once (never delayed by the
entry's jitter), by whichever node holds the lease when it is read (a request not handled yet
is kept and tried again).
"""
from __future__ import annotations

import logging
from dataclasses import replace
from datetime import datetime
from typing import Callable, Dict, List, Optional, Set, Tuple

from ..config import Entry
from ..dynamic import entry_from_row
from ..errors import ConfigError
from ..schedules.occurrence import Occurrence
from .backfills import Backfills
from .failures import FailureWatch
from .state import NodeState

logger = logging.getLogger("celery_cluster_beat")


class Controls:
    """Paused names, run-now requests not handled yet, and the control changes applied.

    :param drop: stop holding a schedule, with why it must not fire (the stored-schedule follower's).
    :param horizon: stored schedules due before this instant are held in memory (None: not scheduling).
    :param resolve: entries of stored schedules not held in memory, by name.
    :param forget: drop what a send kept about schedules that are not held (their message, last run).
    """

    def __init__(self, node: NodeState, *, drop: Callable[[str, str], None],
                 horizon: Callable[[], Optional[datetime]],
                 resolve: Callable[[List[str]], Dict[str, Entry]],
                 forget: Callable[[List[str]], None] = lambda names: None) -> None:
        self.node = node
        self._drop = drop
        self._horizon = horizon
        self._resolve = resolve
        self._forget = forget
        #: Names an operator paused. Changed in place only: the send pipeline holds this very set.
        self.paused: Set[str] = set()
        #: The change counter's value up to which control changes are applied.
        self.version = 0
        #: Run-now requests not handled yet: name -> (request id, the instant to run for).
        self.run_requests: Dict[str, Tuple[str, datetime]] = {}
        #: Backfill requests (:mod:`.backfills`): read when the change counter moves.
        self.backfills = Backfills(node, resolve=resolve, forget=forget)
        #: ``pause_after_failures`` (:mod:`.failures`): pauses through :meth:`apply` like an operator's.
        self.failures = FailureWatch(node, paused=self.paused, resolve=resolve, forget=forget,
                                     paused_now=lambda name: self.apply(node.store.controls([name])))

    def reset(self, rows, version: int, *, backfills: bool = False) -> None:
        """This node starts scheduling: the controls in force (*rows*, read at counter *version*);
        *backfills*: backfill requests are pending (made while no node scheduled: served now)."""
        self.paused.clear()
        self.paused.update(c.name for c in rows if c.paused)
        self.run_requests = {c.name: (c.run_request, c.run_requested_at) for c in rows
                             if c.run_request and c.run_requested_at is not None}
        self.backfills.reset(backfills)
        self.failures.reset()
        self.version = version

    def apply(self, rows) -> None:
        """Pause, resume and run-now, as operators asked (see :mod:`..store.controls`)."""
        now = self.node.clock.now()
        for row in rows:
            if row.paused and row.name not in self.paused:
                self.paused.add(row.name)
                self._drop(row.name, "paused")
                self.failures.confirm(row)  # a pause of pause_after_failures whose reply was lost
                logger.info("cluster-beat: %s paused%s", row.name, f" by {row.paused_by}" if row.paused_by else "")
            elif not row.paused and row.name in self.paused:
                self._resume(row.name, now)  # raises on a store error: the control is read again
                self.paused.discard(row.name)
                self.failures.resumed(row.name)
            if row.run_request and row.run_requested_at is not None:
                self.run_requests[row.name] = (row.run_request, row.run_requested_at)

    def _resume(self, name: str, now: datetime) -> None:
        """Schedule a resumed schedule from now on: the time it was paused is not caught up."""
        node = self.node
        static = node.static
        entry = node.entries.get(name) if name in static else None
        if entry is None and name not in static:
            rows = node.store.stored_get([name])
            if not rows or not rows[0].enabled:
                logger.info("cluster-beat: %s resumed (it is not an enabled schedule)", name)
                return
            try:
                entry = entry_from_row(rows[0], app=node.app)
            except ConfigError as exc:
                logger.error("cluster-beat: stored schedule %r cannot be scheduled: %s", name, exc)
                return
            nxt = entry.schedule.next_fire(now)
            # SQL's next_at is from before the pause: replace it, held or not, so no reader of it
            # (this leader's horizon, or the next leader) catches the paused time up.
            node.store.stored_set_next([(name, rows[0].version, nxt)], term=node.term())
            horizon = self._horizon()
            if nxt is None or (horizon is not None and nxt >= horizon):
                logger.info("cluster-beat: %s resumed; next fire %s", name, nxt.isoformat() if nxt else "none (ended)")
                return
            node.entries[name] = entry
        if entry is None or not entry.enabled:
            return
        nxt = entry.schedule.next_fire(now)
        if nxt is None:  # ended while paused (a one-off whose instant passed, a bound reached)
            node.queue.remove(name)
            logger.info("cluster-beat: %s resumed; it has no further occurrence", name)
            return
        node.queue.set(name, nxt)
        logger.info("cluster-beat: %s resumed; next fire %s", name, nxt.isoformat())

    def run_requested(self) -> None:
        """Send one occurrence per run-now request, at once, with reason ``manual``.

        Its instant is the request's (its claim key and task id); the entry's jitter does not
        apply: jitter spreads the scheduled occurrences of many schedules over time, while an
        operator who presses run-now means now."""
        node = self.node
        requests, self.run_requests = self.run_requests, {}
        missing: List[str] = []
        try:
            known = {name: node.entries[name] for name in requests if name in node.entries}
            missing = [name for name in requests if name not in known]
            if missing:
                known.update(self._resolve(missing))
            for name, (request, at) in sorted(requests.items()):
                entry = known.get(name)
                if entry is None:
                    logger.error("cluster-beat: run-now of %r: no such schedule; request dropped", name)
                else:
                    self._send_now(entry, at)
                    if not node.active:  # lost the lease meanwhile: the next leader handles the request
                        return
                    logger.info("cluster-beat: %s: manual run for %s (request %s)", name, at.isoformat(), request)
                node.store.finish_run_request(name, request)
                del requests[name]
        finally:
            for name, req in requests.items():  # not handled (the store failed): try again next tick
                self.run_requests.setdefault(name, req)
            if missing:  # sent for schedules not held: keep nothing of them
                self._forget(missing)

    def _send_now(self, entry: Entry, at: datetime) -> None:
        """Claim and publish the manual occurrence of *entry* at *at*, without jitter.

        The send pipeline takes an entry's jitter from the entry, so it is given a copy with
        none, which shares the entry's task, args, kwargs and options (the very objects: its
        prebuilt message is used) and whose sends count on the entry itself."""
        node = self.node
        now_entry = replace(entry, jitter=0.0)
        try:
            node.pipeline.claim_and_send([(now_entry, Occurrence(entry.name, at))], node.clock.now(),
                                         guarded=False, reason="manual")
        finally:
            if now_entry.total_run_count != entry.total_run_count:
                entry.last_run_at, entry.total_run_count = now_entry.last_run_at, now_entry.total_run_count
