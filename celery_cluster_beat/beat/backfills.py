"""Backfill requests as the scheduling node serves them: slice by slice, claim, send, record.

``celery ... cluster-beat backfill`` records a request (:mod:`..store.backfill`) and bumps the
change counter; the leader reads pending requests when it takes the lease and whenever the
counter moved, so a request waits, recorded, while no leader runs. Only the claimant publishes:
the leader claims the range's occurrences in fenced transactions and sends what it won through
the one send pipeline (reason ``backfill``, header ``cluster_beat_backfill``, outcome
``backfilled``, no jitter), so retries, the stale-claim sweep, the ``sent`` marks and the
worker-side ledger treat them like any occurrence.

**Never at the expense of on-time sends.** A request is served in slices of at most
:data:`SLICE` occurrences (one claim statement, one publish chunk, claimed and sent together),
after the due pass of the loop's pass and within a time budget (:meth:`Backfills.run`: at most
:data:`BUDGET` seconds, less when a schedule falls due sooner), so a range of 10,000 occurrences
goes out over many passes while every other schedule fires on time. After each slice the
request records its progress (the last instant served and the totals so far), so a new leader
goes on from there instead of starting over.

**Nothing of the row is trusted.** Before its first slice the leader checks the request again
(limit, range, ``--to`` not after the database's clock, ``--from`` within the claim retention),
and each slice's claim checks its instants against the database's clock in its transaction: a
row written by hand, or grown stale while it waited, is refused with the reason.

**The result says what happened.** ``sent`` counts the occurrences published and marked sent;
``failed`` those whose publish failed for good (with the reasons); ``retrying`` those still
claimed when their slice ended (a publish retry waits, or the next sender has them); ``not_sent``
those left as they were (:class:`~..store.backfill.NotSent`). A request the leader cannot go on
with ends ``failed`` with the error and these counts (what went out before stays counted).
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import replace
from datetime import timedelta
from typing import Callable, Dict, List, Optional

from ..config import Entry
from ..config.values import printable
from ..schedules.instants import TINY
from ..schedules.occurrence import Occurrence
from ..store import ClaimStatus, StaleTermError, StoreUnavailable
from ..store.backfill import MAX_LIMIT, BackfillRefused, BackfillRequest, backfill_problem, fires_between
from ..store.schema import BackfillState
from .state import NodeState

logger = logging.getLogger("celery_cluster_beat")

#: Requests read per look: a backlog is served one request after the other.
READ_AT_ONCE = 5
#: Most occurrences one slice claims and sends together.
SLICE = 100
#: Seconds of one pass of the loop spent serving backfills at most (less when a schedule falls due sooner).
BUDGET = 0.5
#: Once the range is served, occurrences whose publish is being retried are looked at this often
#: (seconds), for at most SETTLE_FOR seconds, so the result says how they ended.
SETTLE_EVERY = 1.0
SETTLE_FOR = 30.0
#: A pass serves backfills only with this many seconds left before a schedule falls due (and keeps
#: that much spare): a slice never runs into an on-time send.
MIN_ROOM = 0.1


class _Serving:
    """A request being served, with its totals so far (as last recorded in its row)."""

    def __init__(self, request: BackfillRequest) -> None:
        self.request = request
        self.checked = False
        self.done_to = request.done_to
        self.sent = request.sent or 0
        self.not_sent: Counter = Counter(request.not_sent)
        self.failed: Counter = Counter(request.failed)
        self.retrying = request.retrying or 0
        #: Claimed by this node's slices, not yet published: publish retries (how they end is counted).
        self.unsettled: List[Occurrence] = []
        #: Monotonic time before which the request is not looked at again (0: now), and when it stops waiting.
        self.idle_until = 0.0
        self.settle_by: Optional[float] = None

    def totals(self) -> dict:
        return dict(sent=self.sent, not_sent=dict(self.not_sent), failed=dict(self.failed),
                    retrying=self.retrying + len(self.unsettled), done_to=self.done_to)


class Backfills:
    """Pending backfill requests, served by the node holding the lease.

    :param resolve: entries of stored schedules not held in memory, by name.
    :param forget: drop what a send kept about schedules that are not held.
    """

    def __init__(self, node: NodeState, *, resolve: Callable[[List[str]], Dict[str, Entry]],
                 forget: Callable[[List[str]], None]) -> None:
        self.node = node
        self._resolve = resolve
        self._forget = forget
        #: Look for pending requests on the next pass (the counter moved, or this node took the lease).
        self.wanted = True
        self._queue: List[_Serving] = []
        #: How long before an instant the due pass claims it (the scheduler sets it).
        self.claim_ahead = timedelta(0)

    def reset(self, wanted: bool) -> None:
        """This node starts scheduling: requests are read afresh (with the progress they recorded)."""
        self.wanted = wanted
        self._queue = []

    @property
    def busy(self) -> bool:
        """A request is to be served now, or pending ones are to be read (the loop comes back soon)."""
        return self.wanted or bool(self._queue) and self._queue[0].idle_until <= time.monotonic()

    def room(self) -> float:
        """Seconds this pass may spend on backfills: :data:`BUDGET`, less when a schedule falls due sooner."""
        node = self.node
        if not node.queue:
            return BUDGET
        ahead = (node.queue.peek()[0] - self.claim_ahead - node.clock.now()).total_seconds()
        return min(BUDGET, ahead - MIN_ROOM)

    def ready(self) -> bool:
        """Something to serve, and room for it in this pass (no SQL: the loop asks on every pass)."""
        return self.busy and self.room() >= MIN_ROOM

    def serve(self) -> None:
        """The loop's call, after the due pass: serve within the room this pass has."""
        room = self.room()
        if room >= MIN_ROOM:
            self.run(room)

    def run(self, budget: float = BUDGET) -> None:
        """Serve pending requests for about *budget* seconds at most (each slice is whole; raises
        StoreUnavailable: they are served on from their recorded progress)."""
        node = self.node
        deadline = time.monotonic() + budget
        if not self._queue:
            if not self.wanted:
                return
            self.wanted = False
            try:
                self._queue = [_Serving(r) for r in node.store.pending_backfills(limit=READ_AT_ONCE)]
            except StoreUnavailable:
                self.wanted = True
                raise
            if len(self._queue) == READ_AT_ONCE:
                self.wanted = True  # more may wait: read once these are served
        while self._queue and node.active and time.monotonic() < deadline:
            serving = self._queue[0]
            if serving.idle_until > time.monotonic():
                break  # waiting for its publish retries (see _settle)
            if self._step(serving):
                self._queue.pop(0)
                if not self._queue:
                    self.wanted = True  # one more look: a request made meanwhile (cheap, once)

    def _step(self, serving: _Serving) -> bool:
        """Serve one slice of *serving*; True when the request is finished (done, refused or failed)."""
        node, request = self.node, serving.request
        if serving.settle_by is not None:
            return self._settle(serving)
        name = request.schedule
        entry = node.entries.get(name)
        held = entry is not None
        try:
            if entry is None:
                entry = self._resolve([name]).get(name)
            if entry is None or not entry.enabled:
                return self._refuse(serving, "no such schedule" if entry is None else "the schedule is disabled")
            if not serving.checked:
                why = self._problem(entry, request)
                if why:
                    return self._refuse(serving, why)
                serving.checked = True
            start = serving.done_to + TINY if serving.done_to is not None else request.from_at
            instants = fires_between(entry.schedule, start, request.to_at, SLICE - 1)
            if not instants:
                return self._settle(serving)
            try:
                sent = self._slice(serving, entry, instants)
            except (StoreUnavailable, StaleTermError):
                raise
            except BackfillRefused as exc:  # the database's clock: nothing of the slice was claimed
                return self._end(serving, BackfillState.FAILED, error=str(exc))
            except Exception as exc:  # a request that cannot be served must not come back every pass
                logger.exception("cluster-beat: backfill %s of %s failed", request.id, printable(name))
                return self._end(serving, BackfillState.FAILED, error=f"{type(exc).__name__}: {exc}")
            if not sent:
                return False  # no longer the leader: the next one goes on from the recorded progress
            if not node.store.update_backfill(request.id, **serving.totals()):
                return True  # no longer pending (cleared, or ended by another leader)
            return self._settle(serving) if len(instants) < SLICE else False
        finally:
            if not held:
                self._forget([name])

    def _problem(self, entry: Entry, request: BackfillRequest) -> Optional[str]:
        """Why the leader refuses *request* as its row stands (the command checked it, but the row may
        have been written by hand, or waited past the claim retention); None when it serves it."""
        if not isinstance(request.max_count, int) or not 1 <= request.max_count <= MAX_LIMIT:
            return f"the request's limit must be from 1 to {MAX_LIMIT}, got {request.max_count!r}"
        now = self.node.store.db_now()
        why = backfill_problem(request.from_at, request.to_at, now, request.max_count,
                               self.node.settings.claim_retention)
        if why:
            return why
        if len(fires_between(entry.schedule, request.from_at, request.to_at, request.max_count)) > request.max_count:
            return f"the range holds more than {request.max_count} occurrences (the request's limit)"
        return None

    def _slice(self, serving: _Serving, entry: Entry, instants: list) -> bool:
        """Claim and send one slice; add what came of it to *serving*'s totals. False: not the leader."""
        node, name = self.node, serving.request.schedule
        # A copy without jitter: a backfill is sent at once. It shares the entry's task, args and
        # options; what a send counts on it (last run, run count) stays on the copy.
        claimed = node.pipeline.backfill(replace(entry, jitter=0.0), [Occurrence(name, at) for at in instants],
                                         retention=node.settings.claim_retention)
        if claimed is None:
            return False
        claim, items, confirmed_at = claimed
        error: Optional[BaseException] = None
        try:
            if items:
                node.pipeline.send(items, confirmed_at)
        except (StoreUnavailable, StaleTermError):
            raise
        except Exception as exc:  # counted below: what went out before it stays counted
            error = exc
        serving.not_sent.update(str(reason.value) for reason in claim.left.values())
        if claim.won:
            self._count(serving, claim.won)
        serving.done_to = instants[-1]
        if error is not None:
            raise error
        return True

    def _count(self, serving: _Serving, won: List[Occurrence]) -> None:
        """What became of the occurrences a slice claimed, read back from their rows (published but
        not yet marked counts as sent); those still claimed are looked at again (:meth:`_settle`)."""
        node = self.node
        unmarked = set(node.pipeline.unmarked)
        rows = node.store.backfill_outcomes(serving.request.schedule, [o.at for o in won])
        for occ in won:
            status, reason = rows.get(occ.at, (None, None))
            if status == ClaimStatus.SENT.value or occ in unmarked:
                serving.sent += 1
            elif status == ClaimStatus.FAILED.value:
                serving.failed[reason or "publish failed"] += 1
            else:  # still claimed: a publish retry waits, or the next sender has it
                serving.unsettled.append(occ)

    def _settle(self, serving: _Serving) -> bool:
        """The range is served: end the request once the publish retries of its occurrences ended
        (or :data:`SETTLE_FOR` passed: those left count as still being sent)."""
        if serving.unsettled:
            mono = time.monotonic()
            if serving.settle_by is None:
                serving.settle_by = mono + SETTLE_FOR
            waiting, serving.unsettled = serving.unsettled, []
            self._count(serving, waiting)
            if serving.unsettled and mono < serving.settle_by:
                serving.idle_until = mono + SETTLE_EVERY
                return False
        return self._end(serving, BackfillState.DONE)

    def _refuse(self, serving: _Serving, why: str) -> bool:
        request = serving.request
        logger.error("cluster-beat: backfill %s of %s refused: %s", request.id, printable(request.schedule), why)
        return self._end(serving, BackfillState.REFUSED, error=why)

    def _end(self, serving: _Serving, state: BackfillState, error: Optional[str] = None) -> bool:
        request = serving.request
        self.node.store.update_backfill(request.id, state, error=error, **serving.totals())
        if state is BackfillState.REFUSED:
            return True
        extra = [f"{n} {r}" for r, n in sorted(serving.not_sent.items())]
        extra += [f"{n} failed ({r})" for r, n in sorted(serving.failed.items())]
        if serving.retrying:
            extra.append(f"{serving.retrying} still being sent")
        (logger.error if error else logger.info)(
            "cluster-beat: backfill %s of %s from %s to %s %s: %d sent%s%s", request.id, printable(request.schedule),
            request.from_at.isoformat(), request.to_at.isoformat(), state.value, serving.sent,
            f"; {', '.join(extra)}" if extra else "", f"; {error}" if error else "")
        return True
