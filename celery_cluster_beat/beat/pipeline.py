"""The send pipeline: claim, publish, mark sent; retry failed publishes; resend what a stopped node left claimed.

One path, :meth:`SendPipeline.send`, publishes every message, whether it is a
first send, a retry after a failed publish or a resend of a stale claim, so
the bookkeeping a send implies (the row marked sent, the entry's
``last_run_at`` / ``total_run_count``, the overlap guard's last run, the
outcome report) is the same for all three.

Publishing goes in chunks of at most :data:`PUBLISH_CHUNK`. A message goes out
only while its row is known to be ours: claimed (or confirmed in one
conditional statement) less than ``claim_grace / 4`` ago, as measured before
that statement, since no row can be taken over before it is ``claim_grace``
old. This holds between the messages of a chunk too: a node held up while
publishing one (GC, a frozen VM, SIGSTOP) confirms the rest again before going
on and withholds what was taken over meanwhile (:class:`~.publisher.Ownership`),
so a row taken over by another node, or a node fenced out, is never published
here. After each chunk its rows are marked sent, and a burst stops
when a mark fails. A crash can therefore leave at most one chunk published but
not marked: those are resent with the same task id, which the worker-side
ledger turns into a skipped duplicate. A clean stop leaves none: beat's SIGTERM
handler is held from a chunk's publish until what went out is owed its mark
(:mod:`.stophold`), and ``close()`` records that before it hands anything over.

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
import uuid
from datetime import datetime, timedelta
from typing import Callable, Dict, List, Mapping, NamedTuple, Optional, Sequence, Set, Tuple

from .. import faults
from ..config import Entry, Settings
from ..schedules.instants import TINY
from ..schedules.occurrence import Occurrence
from ..store import ClaimStatus, ClaimStore, StoreUnavailable
from ..store.backfill import BackfillClaim
from .guard import OverlapGuard
from .jitter import jitter_delay
from .outcomes import Outcome, Reporter
from .publisher import Dispatch, Ownership, Publisher, Withheld
from .stophold import stop_held

logger = logging.getLogger("celery_cluster_beat")

#: At most this many messages are published between two store round trips: the most a
#: crash between a broker flush and its 'sent' mark can leave to be resent (same task id).
PUBLISH_CHUNK = 250
#: Publish attempts for one occurrence (retried 1, 2, 4, 8 s apart, capped at claim_grace/2)
#: before it is marked failed.
MAX_SEND_ATTEMPTS = 5
#: Below this many messages in a send each one is logged at INFO, like Celery's beat.
LOG_EACH_UNDER = 20
#: Rows a sweep takes over per statement; a sweep goes on until done or out of time.
SWEEP_CHUNK = 500
#: Seconds one sweep pass may take before it yields to the loop (it resumes on the next pass).
SWEEP_BUDGET = 2.0


class Pending(NamedTuple):
    """One claimed occurrence to publish, and how many attempts it has had."""

    entry: Entry
    occ: Occurrence
    attempt: int = 1
    resent: bool = False
    #: Sent as a catch-up after downtime (told to the worker in a header).
    catchup: bool = False
    #: Sent by an operator's backfill (header ``cluster_beat_backfill``, outcome ``backfilled``).
    backfill: bool = False


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
        #: A confirmation older than this (seconds of this process's time) is taken again before publishing.
        self.recheck_after = settings.claim_grace / 4
        #: (monotonic due time, tie-breaker, pending) of failed publishes waiting for their next attempt.
        self._retries: List[Tuple[float, int, Pending]] = []
        self._retry_seq = 0
        #: Occurrences published whose 'sent' mark the store has not taken yet.
        self.unmarked: List[Occurrence] = []
        #: The token of a claim whose outcome we never learnt (its reply was lost): reused by the next claim.
        self._claim_token: Optional[str] = None
        #: Our claimed rows must be handed over (release) once the store answers again.
        self._release_owed = False
        #: A chunk is being published: what went out is not yet in :attr:`unmarked` (see abandon()).
        self._publishing = False
        #: Entries of schedules not held in memory, by name (stored schedules due later): a stale
        #: claim of one is still resent. The scheduler sets it; without it such claims fail.
        self.resolve: Callable[[List[str]], Dict[str, Entry]] = lambda names: {}
        #: Names an operator paused (the scheduler's set): a stale claim of one is not resent.
        self.paused: Set[str] = set()
        #: Told of every run that went out (``pause_after_failures`` without the ledger watches them).
        self.on_sent: Callable[[Entry, Occurrence], None] = lambda entry, occ: None

    # -- the scheduler's view ------------------------------------------------------
    def next_retry_in(self) -> Optional[float]:
        """Seconds until the next retry is due (None when none waits)."""
        return self._retries[0][0] - time.monotonic() if self._retries else None

    def abandon(self, buffered: Sequence[Tuple[Entry, Occurrence]] = ()) -> None:
        """This node stops scheduling: forget retries and hand every claim it holds to the next sender.

        Messages already out are recorded first, so only rows that were never
        published are released; a store that does not answer gets them later.
        *buffered* (``buffer_one`` occurrences waiting for their predecessor) are
        recorded as skipped with the reason, not dropped unseen.
        """
        self._retries = []
        self._claim_token = None
        self._release_owed = True
        if buffered:
            try:
                self.store.record([occ for _, occ in buffered], status=ClaimStatus.SKIPPED,
                                  reason="buffered behind a run still in flight when this node stopped scheduling")
            except StoreUnavailable as exc:
                logger.warning("cluster-beat: cannot record %d buffered occurrence(s) as skipped (%s)",
                               len(buffered), exc)
        if self._publishing:
            # Given up from inside a publish (a re-confirmation found the lease lost): the messages
            # of this chunk that went out are not in `unmarked` yet, and released now they would be
            # resent at once. send() records them, then settles.
            return
        self.settle()

    @property
    def owes_release(self) -> bool:
        return self._release_owed

    def settle(self) -> None:
        """Record unmarked sends and release what is owed, if the store answers (never raises)."""
        try:
            if self.unmarked:
                self.store.mark_sent(self.unmarked)
                self.unmarked = []
            if self._release_owed:
                released = self.store.release()
                self._release_owed = False
                if released:
                    logger.info("cluster-beat: handed %d unsent claim(s) over to the next sender", released)
        except StoreUnavailable as exc:
            logger.warning("cluster-beat: cannot settle with the claim store yet (%s): %d sent occurrence(s) "
                           "unrecorded", exc, len(self.unmarked))

    # -- first sends ---------------------------------------------------------------
    def claim_and_send(self, claim: Sequence[Tuple[Entry, Occurrence]], now: datetime, *,
                       guarded: bool = True, catchup: frozenset = frozenset(), reason: Optional[str] = None) -> None:
        """Guard, claim (one statement), send what this node won. *catchup* holds the occurrences
        sent as catch-up after downtime (their messages say so)."""
        won = self.claim(claim, now, guarded=guarded, catchup=catchup, reason=reason)
        if won is not None:
            self.send(*won)

    def claim(self, claim: Sequence[Tuple[Entry, Occurrence]], now: datetime, *, guarded: bool = True,
              catchup: frozenset = frozenset(),
              reason: Optional[str] = None) -> Optional[Tuple[List[Pending], float]]:
        """Guard and claim (one statement); the occurrences won, to be passed to :meth:`send`
        with the monotonic time their claim was read as confirmed (None: nothing to send)."""
        if not claim or not self._still_leader():
            return None
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
            return None
        # A claim whose commit may have succeeded with its reply lost is retried with its token:
        # the rows it wrote then count as won instead of as "claimed by another node".
        resume = self._claim_token is not None
        token = self._claim_token = self._claim_token or uuid.uuid4().hex
        faults.hit("before-claim")
        # Read before the call: a pause after the commit but before the reply must count
        # against the confirmation, or the first chunk could go out after a takeover.
        confirmed_at = time.monotonic()
        won = self.store.claim([occ for _, occ in claim], term=self._term(), token=token, resume=resume,
                               reason=reason)
        self._claim_token = None
        won_set = set(won)
        entry_of = {occ: entry for entry, occ in claim}
        for _, occ in claim:
            if occ not in won_set:
                self.report(Outcome.CLAIM_LOST, occ, "claimed by another node")
        for occ in won:
            if occ in replaces:
                self.guard.revoke(replaces[occ])
                self.report(Outcome.REPLACED, occ, f"previous run {replaces[occ]} revoked")
        return [Pending(entry_of[occ], occ, catchup=occ in catchup) for occ in won], confirmed_at

    def backfill(self, entry: Entry, occurrences: Sequence[Occurrence], *, retention: Optional[float] = None
                 ) -> Optional[Tuple[BackfillClaim, List[Pending], float]]:
        """Claim what a backfill may send of *occurrences* (one schedule's; see :mod:`..store.backfill`):
        the claim, what this node won as sends marked backfill, and the monotonic time to pass to
        :meth:`send` with them; None when this node may not send. *entry* should carry no jitter."""
        if not occurrences or not self._still_leader():
            return None
        confirmed_at = time.monotonic()  # before the call: see claim()
        result = self.store.claim_backfill(occurrences, term=self._term(), retention=retention)
        return result, [Pending(entry, occ, backfill=True) for occ in result.won], confirmed_at

    # -- the one publishing path ----------------------------------------------------
    def send(self, items: Sequence[Pending], confirmed_at: Optional[float] = None) -> None:
        """Publish claimed occurrences chunk by chunk, each confirmed as ours just before.

        *confirmed_at* (monotonic, read before the claim or takeover statement) says every row
        was ours then. A row cannot be taken over before it is ``claim_grace`` old, so while
        less than ``recheck_after`` has passed since, a chunk needs no confirmation of its own.
        """
        log_each = len(items) < LOG_EACH_UNDER
        sent = failed = 0
        for start in range(0, len(items), PUBLISH_CHUNK):
            if not self._still_leader():
                logger.warning("cluster-beat: %d claimed occurrence(s) left for the next leader", len(items) - start)
                return
            confirmed = self._confirmed(list(items[start:start + PUBLISH_CHUNK]), confirmed_at, first=not start)
            if confirmed is None:
                logger.warning("cluster-beat: %d claimed occurrence(s) left for the next leader", len(items) - start)
                return
            part, part_confirmed_at = confirmed
            if not part:
                continue
            built = self._buildable(part)  # one schedule's broken definition never costs the chunk
            if not built:
                continue
            part = [p for p, _ in built]
            ownership = Ownership(part_confirmed_at, self.recheck_after, self._reconfirmer(part))
            with stop_held():  # a stop in the publish would hand over what went out (see .stophold)
                self._publishing = True
                try:
                    errors = self.publisher.publish([d for _, d in built], ownership)
                finally:
                    self._publishing = False
                faults.hit("published")
                # Out on the broker: owed a 'sent' mark from now on, even if the process is told to
                # stop before the mark below (close() settles what is owed).
                self.unmarked.extend(p.occ for p, err in zip(part, errors) if err is None)
            faults.hit("after-flush")
            self._mark_sent()
            faults.hit("after-mark")
            if self._release_owed and not self.unmarked:  # given up during the publish: hand over now
                self.settle()
            for p, err in zip(part, errors):  # what went out first: no store call can stop this
                if err is not None:
                    continue
                sent += 1
                p.entry.last_run_at = p.occ.at
                p.entry.total_run_count += 1
                self.guard.sent(p.entry, p.occ)  # the overlap guard must see every send, retries too
                self.on_sent(p.entry, p.occ)
                reason = f"after {p.attempt - 1} failed attempt(s)" if p.attempt > 1 else None
                outcome = Outcome.RESENT if p.resent else Outcome.BACKFILLED if p.backfill else Outcome.SENT
                self.report(outcome, p.occ, reason, p.entry, log=log_each or p.attempt > 1)
            for p, err in zip(part, errors):
                if err is not None and not isinstance(err, Withheld):  # withheld: no longer ours
                    failed += 1
                    self._send_failed(p, err)
            if ownership.error is not None:  # the store failed mid-chunk: what went out is recorded
                raise ownership.error
            if self.unmarked:
                # The store did not take the marks: publishing on would widen the window a crash
                # leaves to be resent. The rest stays claimed for whoever can record it.
                logger.warning("cluster-beat: %d claimed occurrence(s) left unsent until the claim store "
                               "records what went out", len(items) - start - len(part))
                break
        if not log_each:
            logger.info("cluster-beat: %s %d occurrence(s) (%d failed)",
                        "resent" if items[0].resent else "sent", sent, failed)

    def _buildable(self, part: List[Pending]) -> List[Tuple[Pending, Dispatch]]:
        """Each occurrence of *part* with its dispatch; one whose dispatch cannot be built (a
        refused stored definition, a schedule that raises) ends ``failed`` with the reason, alone."""
        built: List[Tuple[Pending, Dispatch]] = []
        for p in part:
            try:
                if p.entry.refused:
                    raise ValueError(p.entry.refused)
                built.append((p, self._dispatch(p.entry, p.occ, p)))
            except Exception as exc:  # building again would fail the same way: final at once
                self._send_failed(p, exc, final=True)
        return built

    def _reconfirmer(self, part: List[Pending]) -> Callable[[List[Occurrence]], Tuple[Set[Occurrence], float]]:
        """What the publisher calls when a chunk's confirmation grew too old before all of it went
        out: confirms the occurrences not yet out again (see :class:`~.publisher.Ownership`)."""
        of = {p.occ: p for p in part}

        def confirm(occurrences: List[Occurrence]) -> Tuple[Set[Occurrence], float]:
            logger.warning("cluster-beat: held up while publishing a chunk; confirming its %d unpublished "
                           "occurrence(s) again", len(occurrences))
            confirmed = self._confirmed([of[occ] for occ in occurrences], None)
            if confirmed is None:  # no longer the leader: nothing more goes out
                return set(), time.monotonic()
            return {p.occ for p in confirmed[0]}, confirmed[1]

        return confirm

    def _confirmed(self, part: List[Pending], confirmed_at: Optional[float], *,
                   first: bool = False) -> Optional[Tuple[List[Pending], float]]:
        """The rows of *part* still ours, confirmed within ``recheck_after``, and the monotonic time
        of that confirmation; None when this node may no longer send at all."""
        tries = 0
        if confirmed_at is not None and time.monotonic() - confirmed_at > self.recheck_after:
            if first:  # nothing was published since the claim: the process was held up in between
                logger.warning("cluster-beat: %.1f s passed between claiming and publishing %d occurrence(s); "
                               "confirming them first", time.monotonic() - confirmed_at, len(part))
            confirmed_at = None  # too long ago for this chunk: confirm it now
        while True:
            if confirmed_at is None:
                tries += 1
                if tries > 3:  # each confirmation outlasts its own validity: the store is too slow
                    raise StoreUnavailable(f"confirming {len(part)} claim(s) took longer than "
                                           f"{self.recheck_after:g} s three times")
                confirmed_at = time.monotonic()  # before the call: see claim_and_send
                mine = set(self.store.confirm([p.occ for p in part], term=self._term()))
                for p in part:
                    if p.occ not in mine:
                        self.report(Outcome.CLAIM_LOST, p.occ, "taken over by another node")
                part = [p for p in part if p.occ in mine]
            faults.hit("before-publish")
            if time.monotonic() - confirmed_at <= self.recheck_after:
                return part, confirmed_at
            # This process was paused since (GC, SIGSTOP, an overloaded host): look again.
            logger.warning("cluster-beat: paused %.1f s between confirming and publishing %d occurrence(s); "
                           "confirming again", time.monotonic() - confirmed_at, len(part))
            if not self._still_leader():
                return None
            confirmed_at = None

    def _dispatch(self, entry: Entry, occ: Occurrence, pending: Optional[Pending] = None) -> Dispatch:
        jitter = entry.jitter if entry.jitter is not None else self.settings.jitter
        eta = None
        # Jitter delays the schedule's own fire times only: a run-now (or its resend after a
        # crash) is sent at once.
        if jitter and entry.schedule.next_fire(occ.at - TINY) == occ.at:
            following = entry.schedule.next_fire(occ.at)  # None after a last occurrence: the jitter is the cap
            delay = jitter_delay(entry.name, occ.at, jitter,
                                 following if following is not None else occ.at + timedelta(seconds=2 * jitter))
            if delay:
                eta = occ.at + timedelta(seconds=delay)
        return Dispatch(occ, entry.task, entry.args, entry.kwargs, entry.options,
                        catchup=bool(pending and pending.catchup), attempt=pending.attempt if pending else 1,
                        backfill=bool(pending and pending.backfill),
                        max_run_time=self.guard.max_run_time(entry), eta=eta)

    def prepare(self, entry: Entry, at: datetime) -> None:
        """Build *entry*'s message ahead of its fire at *at* (see :mod:`.messages`); never raises."""
        if self.publisher.templates.has(entry.name):
            return
        try:
            self.publisher.prepare(self._dispatch(entry, Occurrence(entry.name, at)))
        except Exception:  # the send builds it again and reports what fails
            logger.debug("cluster-beat: preparing the message of %s failed", entry.name, exc_info=True)

    def _mark_sent(self) -> None:
        """Record what went out (:attr:`unmarked`); if the store is down, keep it to record later.

        The messages are out: losing the 'sent' mark would make the stale-claim
        sweep resend them, so they are kept until the store takes them.
        """
        pending = self.unmarked
        if not pending:
            return
        try:
            self.store.mark_sent(pending)
        except StoreUnavailable as exc:
            self.unmarked = pending
            logger.error("cluster-beat: cannot mark %d sent occurrence(s) in the claim store (%s); will retry",
                         len(pending), exc)
            self._store_trouble()
        else:
            self.unmarked = []

    def _send_failed(self, p: Pending, err: BaseException, *, final: bool = False) -> None:
        final = final or p.attempt >= MAX_SEND_ATTEMPTS
        try:
            owned = self.store.mark_failed(p.occ, f"{err.__class__.__name__}: {err}", final=final)
        except StoreUnavailable:
            owned, final = True, False  # unrecorded: retry anyway; the retry's confirmation decides
            self._store_trouble()
        if not owned:
            # The row is no longer ours (taken over meanwhile): its new owner sends it.
            self.report(Outcome.CLAIM_LOST, p.occ, "taken over by another node after a failed publish")
            return
        if final:
            logger.error("cluster-beat: giving up on %s at %s after %d attempts: %r",
                         p.occ.schedule, p.occ.at, p.attempt, err)
            self.report(Outcome.FAILED, p.occ, repr(err))
        else:
            # Each failed attempt refreshes the claim; retrying within the grace keeps sweepers off it.
            delay = min(2 ** (p.attempt - 1), self.settings.claim_grace / 2)
            self._retry_seq += 1
            heapq.heappush(self._retries, (time.monotonic() + delay, self._retry_seq, p._replace(attempt=p.attempt + 1)))

    def forget(self, name: str, reason: str) -> None:
        """Schedule *name* went away (removed, disabled, paused): its occurrences waiting for a
        publish retry are not sent; their rows end ``failed`` with *reason*."""
        mine = [p for _, _, p in self._retries if p.entry.name == name]
        if not mine:
            return
        self._retries = [r for r in self._retries if r[2].entry.name != name]
        heapq.heapify(self._retries)
        for p in mine:
            try:
                self.store.mark_failed(p.occ, reason, final=True)
            except StoreUnavailable:  # still claimed by us: a later sweep finds the schedule gone
                self._store_trouble()

    # -- retries and resends ----------------------------------------------------------
    def run_retries(self) -> None:
        """Publish again the failed occurrences whose back-off has passed."""
        mono = time.monotonic()
        batch: List[Pending] = []
        while self._retries and self._retries[0][0] <= mono:
            batch.append(heapq.heappop(self._retries)[2])
        if not batch or not self._still_leader():
            return
        try:
            self.send(batch)
        except StoreUnavailable:
            for p in batch:  # keep their attempt count; the next try confirms ownership first
                self._retry_seq += 1
                heapq.heappush(self._retries, (time.monotonic() + 1.0, self._retry_seq, p))
            raise

    def sweep_stale(self) -> None:
        """Resend rows whose claimant is gone (judged by the database's clock), in bounded chunks
        until none is left or the pass's time budget is spent."""
        if not self._still_leader():
            return
        if self.unmarked:  # our own sends must be recorded before we look for unsent claims
            self._mark_sent()
            if self.unmarked:
                return
        deadline = time.monotonic() + SWEEP_BUDGET
        while time.monotonic() < deadline and self._still_leader():
            confirmed_at = time.monotonic()  # before the call: see claim_and_send
            rows = self.store.take_over_stale(self.settings.claim_grace, term=self._term(), limit=SWEEP_CHUNK)
            retrying = {p.occ for _, _, p in self._retries}
            items = []
            absent = sorted({occ.schedule for occ in rows if occ.schedule not in self.entries})
            found = self.resolve(absent) if absent else {}
            backfilled = self.store.backfill_keys(rows) if rows else set()  # resent as backfill, paused or not
            for occ in rows:
                if occ in retrying:  # our own failed publish, already queued for a retry
                    continue
                entry = self.entries.get(occ.schedule) or found.get(occ.schedule)
                backfill = (occ.schedule, occ.at) in backfilled  # an operator asked for it: a pause does not stop it
                if entry is not None and occ.schedule in self.paused and not backfill:
                    self.store.mark_failed(occ, "the schedule was paused before this occurrence was sent",
                                           final=True)
                    continue
                if entry is None or not entry.enabled:
                    # Never sent, and its schedule is gone or disabled: it ends here, with the reason.
                    self.store.mark_failed(occ, "the schedule no longer exists (neither in beat_schedule nor "
                                                "stored)" if entry is None else
                                           "the schedule was disabled before this occurrence was sent", final=True)
                    continue
                items.append(Pending(entry, occ, resent=True, backfill=backfill))
            if items:
                logger.warning("cluster-beat: resending %d occurrence(s) left claimed by a node that stopped",
                               len(items))
                self.send(items, confirmed_at=confirmed_at)
            if len(rows) < SWEEP_CHUNK:
                return
