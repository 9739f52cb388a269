"""The send pipeline: claim, publish, mark sent; retry failed publishes; resend what a stopped node left claimed.

One path, :meth:`SendPipeline.send`, publishes every message, whether it is a
first send, a retry after a failed publish or a resend of a stale claim, so
the bookkeeping a send implies (the row marked sent, the entry's
``last_run_at`` / ``total_run_count``, the overlap guard's last run, the
outcome report) is the same for all three.

The pipeline raises :class:`~celery_cluster_beat.store.StoreUnavailable` and
:class:`~celery_cluster_beat.store.StaleTermError` to the scheduler, which owns
the back-off and the stepping down; it only keeps messages already out that
the store has not yet recorded (:attr:`SendPipeline.unmarked`), so they are
never resent because of a lost mark.
"""
from __future__ import annotations

import heapq
import logging
import time
from datetime import datetime, timedelta
from typing import Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Tuple

from ..config import Entry, Settings
from ..schedules.occurrence import Occurrence
from ..store import ClaimStatus, ClaimStore, StoreUnavailable
from .guard import OverlapGuard
from .jitter import jitter_delay
from .outcomes import Outcome, Reporter
from .publisher import Dispatch, Publisher

logger = logging.getLogger("celery_cluster_beat")

#: Publish in slices this big, renewing the lease and marking rows sent between them.
SEND_SLICE = 2500
#: Publish attempts for one occurrence (retried 1, 2, 4, 8 s apart, capped at claim_grace/2)
#: before it is marked failed.
MAX_SEND_ATTEMPTS = 5
#: Below this many messages in a slice each one is logged at INFO, like Celery's beat.
LOG_EACH_UNDER = 20


class Pending(NamedTuple):
    """One claimed occurrence to publish, and how many attempts it has had."""

    entry: Entry
    occ: Occurrence
    attempt: int = 1
    resent: bool = False


class SendPipeline:
    """Claims and publishes occurrences for the scheduler; owns retries and the stale-claim sweep.

    :param still_leader: True while this node may send (renews the lease when due).
    :param term: the fencing term to claim with (None without a lease).
    :param on_store_trouble: called when the store failed in a way the pipeline absorbed.
    """

    def __init__(self, *, store: ClaimStore, publisher: Publisher, guard: OverlapGuard, settings: Settings,
                 entries: Mapping[str, Entry], report: Reporter, still_leader: Callable[[], bool],
                 term: Callable[[], Optional[int]], on_store_trouble: Callable[[], None]) -> None:
        self.store = store
        self.publisher = publisher
        self.guard = guard
        self.settings = settings
        self.entries = entries
        self.report = report
        self._still_leader = still_leader
        self._term = term
        self._store_trouble = on_store_trouble
        #: (monotonic due time, tie-breaker, pending) of failed publishes waiting for their next attempt.
        self._retries: List[Tuple[float, int, Pending]] = []
        self._retry_seq = 0
        #: Occurrences published whose 'sent' mark the store has not taken yet.
        self.unmarked: List[Occurrence] = []
        self.next_sweep = 0.0

    # -- the scheduler's view ------------------------------------------------------
    def next_retry_in(self) -> Optional[float]:
        """Seconds until the next retry is due (None when none waits)."""
        return self._retries[0][0] - time.monotonic() if self._retries else None

    def reset(self) -> None:
        """Forget pending retries: this node stopped scheduling, the next leader's sweep takes them."""
        self._retries = []

    # -- first sends ---------------------------------------------------------------
    def claim_and_send(self, claim: Sequence[Tuple[Entry, Occurrence]], now: datetime, *,
                       guarded: bool = True) -> None:
        """Guard, claim (one statement), send what this node won."""
        if not claim or not self._still_leader():
            return
        replaces: Dict[Occurrence, str] = {}
        if guarded:
            decision = self.guard.filter(claim, now)
            claim, replaces = decision.send, decision.replaces
            if decision.skipped:
                for occ in self.store.record([occ for _, occ in decision.skipped], status=ClaimStatus.SKIPPED,
                                             reason="overlap", term=self._term()):
                    self.report(Outcome.SKIPPED_OVERLAP, occ, "previous run still in flight")
            for _, occ in decision.buffered:
                self.report(Outcome.BUFFERED, occ, "previous run still in flight")
        if not claim:
            return
        won = self.store.claim([occ for _, occ in claim], term=self._term())
        won_set = set(won)
        entry_of = {occ: entry for entry, occ in claim}
        for _, occ in claim:
            if occ not in won_set:
                self.report(Outcome.CLAIM_LOST, occ, "claimed by another node")
        for occ in won:
            if occ in replaces:
                self.guard.revoke(replaces[occ])
                self.report(Outcome.REPLACED, occ, f"previous run {replaces[occ]} revoked")
        self.send([Pending(entry_of[occ], occ) for occ in won])

    # -- the one publishing path ----------------------------------------------------
    def send(self, items: Sequence[Pending]) -> None:
        """Publish claimed occurrences slice by slice, renewing the lease between slices."""
        for start in range(0, len(items), SEND_SLICE):
            part = items[start:start + SEND_SLICE]
            if start and not self._still_leader():
                logger.warning("cluster-beat: %d claimed occurrence(s) left for the next leader", len(items) - start)
                return
            errors = self.publisher.publish([self._dispatch(p.entry, p.occ) for p in part])
            self._mark_sent([p.occ for p, err in zip(part, errors) if err is None])
            log_each = len(part) < LOG_EACH_UNDER
            sent = 0
            for p, err in zip(part, errors):
                if err is not None:
                    self._send_failed(p, err)
                    continue
                sent += 1
                p.entry.last_run_at = p.occ.at
                p.entry.total_run_count += 1
                self.guard.sent(p.entry, p.occ)  # the overlap guard must see every send, retries too
                reason = f"after {p.attempt - 1} failed attempt(s)" if p.attempt > 1 else None
                self.report(Outcome.RESENT if p.resent else Outcome.SENT, p.occ, reason, p.entry,
                            log=log_each or p.attempt > 1)
            if not log_each:
                logger.info("cluster-beat: %s %d occurrence(s) (%d failed)",
                            "resent" if part[0].resent else "sent", sent, len(part) - sent)

    def _dispatch(self, entry: Entry, occ: Occurrence) -> Dispatch:
        options = entry.options
        jitter = entry.jitter if entry.jitter is not None else self.settings.jitter
        if jitter:
            delay = jitter_delay(entry.name, occ.at, jitter, entry.schedule.next_fire(occ.at))
            if delay:
                options = dict(options, eta=occ.at + timedelta(seconds=delay))
        return Dispatch(occ, entry.task, entry.args, entry.kwargs, options)

    def _mark_sent(self, sent: List[Occurrence]) -> None:
        """Record sends; if the store is down, keep them to record later.

        The messages are out: losing the 'sent' mark would make the stale-claim
        sweep resend them, so they are kept until the store takes them.
        """
        pending = self.unmarked + sent
        try:
            self.store.mark_sent(pending)
        except StoreUnavailable as exc:
            self.unmarked = pending
            logger.error("cluster-beat: cannot mark %d sent occurrence(s) in the claim store (%s); will retry",
                         len(pending), exc)
            self._store_trouble()
        else:
            self.unmarked = []

    def _send_failed(self, p: Pending, err: BaseException) -> None:
        final = p.attempt >= MAX_SEND_ATTEMPTS
        self.store.mark_failed(p.occ, f"{err.__class__.__name__}: {err}", final=final)
        if final:
            logger.error("cluster-beat: giving up on %s at %s after %d attempts: %r",
                         p.occ.schedule, p.occ.at, p.attempt, err)
            self.report(Outcome.FAILED, p.occ, repr(err))
        else:
            # Each failed attempt refreshes the claim; retrying within the grace keeps sweepers off it.
            delay = min(2 ** (p.attempt - 1), self.settings.claim_grace / 2)
            self._retry_seq += 1
            heapq.heappush(self._retries, (time.monotonic() + delay, self._retry_seq, p._replace(attempt=p.attempt + 1)))

    # -- retries and resends ----------------------------------------------------------
    def run_retries(self) -> None:
        """Publish again the failed occurrences whose back-off has passed."""
        mono = time.monotonic()
        batch: List[Pending] = []
        while self._retries and self._retries[0][0] <= mono:
            batch.append(heapq.heappop(self._retries)[2])
        if not batch or not self._still_leader():
            return
        self.send([p for p in batch if p.entry.name in self.entries])

    def sweep_stale(self, now: datetime) -> None:
        """Resend rows another node claimed and never marked sent (it stopped in between)."""
        grace = self.settings.claim_grace
        self.next_sweep = time.monotonic() + grace / 2
        if not self._still_leader():
            return
        if self.unmarked:  # our own sends must be recorded before we look for unsent claims
            self._mark_sent([])
            if self.unmarked:
                return
        try:
            rows = self.store.take_over_stale(now - timedelta(seconds=grace), term=self._term())
        except StoreUnavailable as exc:
            logger.error("cluster-beat: stale-claim sweep failed: %s", exc)
            return
        retrying = {p.occ for _, _, p in self._retries}
        items = []
        for occ in rows:
            if occ in retrying:  # our own failed publish, already queued for a retry
                continue
            entry = self.entries.get(occ.schedule)
            if entry is None:
                self.store.mark_failed(occ, "entry no longer in beat_schedule", final=True)
                continue
            items.append(Pending(entry, occ, resent=True))
        if items:
            logger.warning("cluster-beat: resending %d occurrence(s) left claimed by a node that stopped", len(items))
            self.send(items)
