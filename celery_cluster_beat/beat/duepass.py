"""The due pass: what the scheduling node does when occurrences fall due.

It pops what is due from the queue (moving each schedule on to its next fire, never
building a backlog after a stall), decides per schedule what to send: the one
occurrence on time, or after downtime the catch-up plan (sent late, or recorded
missed, one warning a pass), and hands that to the send pipeline. An instant's
occurrences without an overlap guard are claimed up to :data:`CLAIM_AHEAD` before
it and published at it, so a burst's claim is off the time to its last message.
A store failure puts what was popped back into the queue, so the retry applies the
catch-up policy. Buffered runs (``buffer_one``) whose predecessor finished go out here too.

One schedule's trouble stays its own: when its next fire or its catch-up plan cannot be
computed, or its (stored) definition is refused (:attr:`Entry.refused`), its occurrence is
recorded ``failed`` with the reason, and every other schedule of the pass is planned and sent
as if it were not there.

Apart from the rest because this is the path every fire takes, where time matters:
it only reads the queue and the entries, and leaves what is held in memory to
:mod:`.stored` (it hands schedules that moved past the horizon to it).
"""
from __future__ import annotations

import logging
import time
from datetime import datetime, timedelta
from typing import Any, Callable, Dict, List, Optional, Tuple

from .. import faults
from ..config import Entry, OverlapPolicy
from ..schedules.instants import TINY
from ..schedules.occurrence import Occurrence
from ..store import ClaimStatus, StaleTermError, StoreUnavailable
from .catchup import ON_TIME, plan_catchup
from .catchup import RECORD_LIMIT as CATCHUP_RECORD_LIMIT
from .outcomes import Outcome
from .state import NodeState
from .stored import StoredFollower

logger = logging.getLogger("celery_cluster_beat")

#: The leader claims an instant's occurrences this long before it (policy ``allow`` only; at most
#: claim_grace / 8) and publishes them at the instant: a burst's claim is then off the time to its
#: last message.
CLAIM_AHEAD = timedelta(seconds=0.5)

Due = Tuple[Entry, datetime, bool]
#: A stored schedule handed back to SQL: (name, version, next fire; None when it has ended).
Leaving = Tuple[str, int, Optional[datetime]]
#: An occurrence that ends ``failed`` without being sent, and why.
Failed = Tuple[Entry, Occurrence, str]


class DuePass:
    """Claims and sends due occurrences (on time, ahead or as catch-up) through the pipeline."""

    def __init__(self, node: NodeState, stored: StoredFollower) -> None:
        self.node = node
        self.stored = stored
        #: How long before an instant its occurrences are claimed: CLAIM_AHEAD, or less with a short
        #: claim_grace, so that a claim made ahead needs no second confirmation before its publish.
        self.claim_ahead = min(CLAIM_AHEAD, timedelta(seconds=node.settings.claim_grace / 8))
        #: Ends of stored schedules held back while their last occurrence is buffered (name -> leaving).
        self.ends_owed: Dict[str, Leaving] = {}

    def due(self) -> bool:
        """Something is due now, or within the claim-ahead."""
        queue = self.node.queue
        return bool(queue) and queue.peek()[0] <= self.node.clock.now() + self.claim_ahead

    def _pop_due(self, now: datetime) -> Tuple[List[Due], List[Leaving], List[Failed]]:
        """Due entries with their first due instant and whether that is the only one due; the
        stored schedules whose next fire is past the horizon, to hand back to SQL; and the
        occurrences of schedules whose next fire cannot be computed (they leave the queue)."""
        due = []
        leaving: List[Leaving] = []
        failed: List[Failed] = []
        queue = self.node.queue
        entries = self.node.entries
        horizon = self.stored.horizon
        while queue and queue.peek()[0] <= now:
            at, name = queue.peek()
            entry = entries[name]
            try:
                nxt = entry.schedule.next_fire(at)
                single = nxt is None or nxt > now
                if not single:
                    nxt = entry.schedule.next_fire(now)  # forward from now: a stall never builds a backlog
            except Exception as exc:  # its rule cannot go on (past what datetime holds): it stops here, said
                queue.remove(name)
                reason = f"its next occurrence cannot be computed ({exc.__class__.__name__}: {exc})"
                logger.error("cluster-beat: %s stops firing: %s", name, reason)
                failed.append((entry, Occurrence(entry.name, at), reason))
                continue
            if nxt is None:  # its last occurrence (a one-off, a bound reached): it leaves the queue for good
                queue.remove(name)
                if entry.stored_version is not None:  # ended in SQL too: no leader loads it again
                    leaving.append((name, entry.stored_version, None))
                else:
                    logger.info("cluster-beat: %s has no further occurrence after %s", name, at.isoformat())
            else:
                queue.set(name, nxt)
                if entry.stored_version is not None and horizon is not None and nxt >= horizon:
                    leaving.append((name, entry.stored_version, nxt))
            due.append((entry, at, single))
        return due, leaving, failed

    def _plan(self, entry: Entry, at: datetime, single: bool, now: datetime) -> Tuple[List[datetime], Any]:
        """The instants of *entry* to send from its first due instant *at*, and the catch-up plan
        they come from (None when on time). Raises what computing the plan raises."""
        if single and now - at <= ON_TIME:
            return [at], None  # the usual case: one occurrence, on time
        s = self.node.settings
        plan = plan_catchup(
            entry.schedule, at - TINY, now,
            policy=entry.catchup or s.catchup,
            window=entry.catchup_window if entry.catchup_window is not None else s.catchup_window,
            max_count=s.catchup_max,
        )
        return plan.send, plan

    def run(self) -> None:
        node = self.node
        now = node.clock.now()
        head = node.queue.peek()[0]
        if head > now:  # up to CLAIM_AHEAD early: claim this instant's occurrences now, send them at it
            self._run_ahead(head)
            return
        due, leaving, failed = self._pop_due(now)
        todo = due + [(entry, occ.at, True) for entry, occ, _ in failed]  # what a store failure puts back
        s = node.settings
        claim: List[Tuple[Entry, Occurrence]] = []
        missed: List[Occurrence] = []
        missed_by: Dict[str, int] = {}
        catchup: set = set()  # sent late, after a stop: the task can tell (its occurrence context)
        truncated = 0
        for entry, at, single in due:
            try:
                send, plan = self._plan(entry, at, single, now)
            except Exception as exc:  # this schedule's plan only: the others of the pass go on
                reason = f"catch-up planning failed ({exc.__class__.__name__}: {exc})"
                logger.error("cluster-beat: %s at %s: %s", entry.name, at.isoformat(), reason)
                failed.append((entry, Occurrence(entry.name, at), reason))
                continue
            if entry.refused:  # its instants are known, its definition is not to be sent
                failed.extend((entry, Occurrence(entry.name, t), entry.refused) for t in send)
                send = []
            if plan is None:
                claim.extend((entry, Occurrence(entry.name, t)) for t in send)
                continue
            policy = entry.catchup or s.catchup
            sent_late = [(entry, Occurrence(entry.name, t)) for t in send]
            claim.extend(sent_late)
            catchup.update(occ for _, occ in sent_late)
            missed.extend(Occurrence(entry.name, t) for t in plan.missed)
            if plan.missed:
                missed_by[entry.name] = len(plan.missed)
                truncated += plan.missed_truncated
                logger.debug("cluster-beat: %s: %d%s occurrence(s) from %s missed (catch-up policy %s)",
                             entry.name, len(plan.missed), "+" if plan.missed_truncated else "",
                             plan.missed[0].isoformat(), policy)
        if missed_by:
            # One line a pass: after a stop with thousands of entries, not thousands of lines.
            names = sorted(missed_by)
            logger.warning("cluster-beat: catch-up: %d occurrence(s) of %d schedule(s) missed (%s%s)%s; "
                           "details at debug level", sum(missed_by.values()), len(names), ", ".join(names[:5]),
                           ", ..." if len(names) > 5 else "",
                           f"; {truncated} schedule(s) missed more than the {CATCHUP_RECORD_LIMIT} recorded"
                           if truncated else "")
        self._claim_due(todo, leaving, lambda: self._send_due(missed, claim, now, catchup, failed))

    def _send_due(self, missed: List[Occurrence], claim: List[Tuple[Entry, Occurrence]], now: datetime,
                  catchup: set, failed: List[Failed]) -> None:
        node = self.node
        self._record_failed(failed)
        if missed:
            for occ in node.store.record(missed, status=ClaimStatus.MISSED, reason="catchup", term=node.term()):
                node.report(Outcome.MISSED, occ, "catchup")
        node.pipeline.claim_and_send(claim, now, catchup=frozenset(catchup))

    def _record_failed(self, failed: List[Failed]) -> None:
        """Record occurrences that end ``failed`` unsent, each with its reason, the way a publish
        that failed for good is recorded: claimed (fenced, so no other node sends it), then marked
        failed (the schedule's ``last_error`` and ``failed`` counter with it). A row another node
        holds is left to it; one this node claimed on an earlier try is marked now. All of them in
        two statements' transactions, however many (a few hundred refused rows falling due together
        must not hold the loop and its lease)."""
        if not failed:
            return
        node = self.node
        node.store.claim([occ for _, occ, _ in failed], term=node.term(), reason="cannot be sent")
        reasons = {(occ.schedule, occ.at): reason for _, occ, reason in failed}
        for occ in node.store.fail_claimed([(occ, reason) for _, occ, reason in failed]):
            node.report(Outcome.FAILED, occ, reasons[(occ.schedule, occ.at)])

    def _run_ahead(self, instant: datetime) -> None:
        """Claim the occurrences due at *instant* (a moment away) now and publish them at it.

        Only entries without an overlap guard are claimed ahead: a guard must judge the previous
        run at the instant itself. The claim is a normal one (fenced, confirmed before each
        publish), made by the only thread of the loop, which then waits for the instant: no
        other change can come in between. A row claimed ahead and handed over on a stop is not
        taken over before its instant (ClaimStore.take_over_stale).
        """
        node = self.node
        due, leaving, failed = self._pop_due(instant)
        todo = due + [(e, occ.at, True) for e, occ, _ in failed]  # what a store failure puts back into the queue
        failed.extend((e, Occurrence(e.name, at), e.refused) for e, at, _ in due if e.refused)
        due = [d for d in due if not d[0].refused]
        policy = node.guard.policy
        ahead = [(e, Occurrence(e.name, at)) for e, at, _ in due if policy(e) == OverlapPolicy.ALLOW]
        guarded = [d for d in due if policy(d[0]) != OverlapPolicy.ALLOW]

        def send() -> None:
            won = node.pipeline.claim(ahead, instant)
            # Claimed and not yet out: a stop during the wait (beat's SIGTERM handler raises
            # SystemExit; close() waits for it, see Scheduler.close()) is held until they are
            # out at their instant. Handed over unsent instead, a node started later would resend
            # an instant that passed while none ran, whatever its catch-up policy.
            stop: Optional[BaseException] = None
            while True:
                try:
                    faults.hit("claimed-ahead")
                    self._wait_for(instant)
                    break
                except (SystemExit, KeyboardInterrupt) as exc:
                    stop = stop or exc  # never publish before the instant: finish the wait
            if won is not None:
                node.pipeline.send(*won)
            if stop is not None:
                raise stop
            todo[:] = guarded + [(e, occ.at, True) for e, occ, _ in failed]  # the rest is the pipeline's now
            self._record_failed(failed)
            todo[:] = guarded
            node.pipeline.claim_and_send([(e, Occurrence(e.name, at)) for e, at, _ in guarded], node.clock.now())

        self._claim_due(todo, leaving, send)

    def _wait_for(self, instant: datetime) -> None:
        """Sleep until *instant* by the node's clock, which instants are compared with; a clock
        stepped back meanwhile (more than the wait could take) does not hold the loop and its lease."""
        give_up = time.monotonic() + 2 * self.claim_ahead.total_seconds()
        while time.monotonic() < give_up:
            wait = (instant - self.node.clock.now()).total_seconds()
            if wait <= 0:
                return
            time.sleep(max(0.0, min(wait, give_up - time.monotonic())))

    def _claim_due(self, due: List[Due], leaving: List[Leaving], send: Callable[[], None]) -> bool:
        """Run *send* for the popped *due* entries; on a store failure put them back (the retry
        applies the catch-up policy) and return False."""
        node = self.node
        try:
            send()
        except (StoreUnavailable, Exception) as exc:
            if isinstance(exc, StaleTermError):
                raise
            if isinstance(exc, StoreUnavailable):
                logger.error("cluster-beat: the claim store failed (%s); %d due occurrence(s) wait for it, then "
                             "go by the catch-up policy", exc, len(due))
            else:
                logger.exception("cluster-beat: unexpected error handling %d due occurrence(s); they wait for "
                                 "the next try", len(due))
            node.backoff.trouble()
            for entry, at, _ in due:  # put them back: the retry applies the catch-up policy
                if node.entries.get(entry.name) is entry:
                    node.queue.set(entry.name, at)
            return False
        if not node.pipeline.unmarked:
            node.backoff.ok()
        if leaving:
            self.stored.release(self._unless_buffered(leaving))
        return True

    def _unless_buffered(self, leaving: List[Leaving]) -> List[Leaving]:
        """*leaving* but the ends of stored schedules whose last occurrence waits in the buffer
        (``buffer_one``): only in memory, a crash would lose it with the row already ended. Their
        end is written once it is claimed (:meth:`run_buffered`); a stop records it skipped, and the
        next leader ends the row after it (:meth:`~.stored.StoredFollower.hold`)."""
        guard = self.node.guard
        if guard is None:
            return leaving
        out = []
        for item in leaving:
            if item[2] is None and guard.is_buffered(item[0]):
                self.ends_owed[item[0]] = item
            else:
                out.append(item)
        return out

    def run_buffered(self) -> None:
        """Send buffered occurrences (overlap ``buffer_one``) whose previous run has finished."""
        node = self.node
        ready = node.guard.ready(node.clock.now())
        if ready:
            try:
                node.pipeline.claim_and_send(ready, node.clock.now(), guarded=False)
            except Exception:
                node.guard.requeue(ready)  # not claimed: they wait (or are recorded on handover), not dropped
                raise
        owed = [name for name in self.ends_owed if not node.guard.is_buffered(name)]
        if owed:  # claimed now (or recorded skipped when forgotten): the row may end
            self.stored.release([self.ends_owed.pop(name) for name in owed])
