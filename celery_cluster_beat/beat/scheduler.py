"""The Celery glue: ``celery beat -S celery_cluster_beat.Scheduler``.

Beat calls :meth:`Scheduler.tick` in a loop and sleeps for what it returns.
Each tick here costs a heap peek when nothing is due: no I/O, no walk over the
schedule. When occurrences fall due they are claimed in the SQL store in one
statement (only rows this node inserted are sent), published in one transport
batch, and marked sent in one statement. With a Redis lease only the leader
does this; standbys block on the lease's release notice.
"""
from __future__ import annotations

import hashlib
import heapq
import logging
import time
from datetime import datetime, timedelta, timezone
from typing import Dict, List, Optional, Sequence, Tuple

from celery import beat
from celery.schedules import crontab
from sqlalchemy.exc import SQLAlchemyError

from .. import signals
from ..config import Entry, Settings, build_entries, load_settings
from ..config.celeryconf import has_result_backend
from ..errors import ConfigError
from ..leader.urls import mask_url
from ..schedules.occurrence import Occurrence
from ..store import ClaimStore, StaleTermError
from .catchup import ON_TIME, plan_catchup
from .guard import OverlapGuard
from .jitter import jitter_delay
from .publisher import Dispatch, Publisher

logger = logging.getLogger("celery_cluster_beat")

UTC = timezone.utc
_TINY = timedelta(microseconds=1)
#: Publish in slices this big, renewing the lease and marking rows sent between them.
SEND_SLICE = 2500
#: Publish attempts for one occurrence (retried 1, 2, 4, 8 s apart, capped at claim_grace/2)
#: before it is marked failed.
MAX_SEND_ATTEMPTS = 5
#: Standbys try to take the lease at least this often (seconds).
STANDBY_POLL = 1.0
#: Below this many messages in a burst each one is logged at INFO, like Celery's beat.
LOG_EACH_UNDER = 20


def _utcnow() -> datetime:
    return datetime.now(UTC)


class Scheduler(beat.Scheduler):
    """Celery beat scheduler for several replicas: SQL tick claims plus an optional Redis lease."""

    #: Upper bound of one sleep; a tick with nothing due is a heap peek, so this is cheap.
    max_interval = 5.0

    def __init__(self, app, schedule=None, max_interval=None, Producer=None, lazy: bool = False,
                 sync_every_tasks=None, **kwargs) -> None:
        # Validate everything before anything is opened: one error lists every problem.
        problems: List[str] = []
        self.settings: Optional[Settings] = None
        self.entries: Dict[str, Entry] = {}
        try:
            self.settings = load_settings(app.conf, has_result_backend=lambda: has_result_backend(app))
        except ConfigError as exc:
            problems += exc.problems
        # Beat's banner instance (lazy) needs no entries; build them there only to report every problem.
        if not lazy or problems:
            try:
                self.entries = build_entries(app.conf.beat_schedule, app=app)
            except ConfigError as exc:
                problems += exc.problems
        if problems:
            raise ConfigError(problems)
        self._store = None
        self._lease = None
        self._publisher: Optional[Publisher] = None
        self._guard: Optional[OverlapGuard] = None
        self._active = False
        self._closed = False
        self._heap: List[Tuple[datetime, str]] = []
        self._next_at: Dict[str, datetime] = {}
        self._retries: List[Tuple[float, int, Occurrence]] = []
        self._unmarked: List[Occurrence] = []
        self._next_sweep = 0.0
        self._next_prune = 0.0
        self._db_backoff_until = 0.0
        self._db_failures = 0
        super().__init__(app, schedule=None, max_interval=max_interval, Producer=Producer, lazy=True,
                         sync_every_tasks=sync_every_tasks, **kwargs)
        if not lazy:
            self.setup_schedule()

    # -- set-up ----------------------------------------------------------------
    def _default_entries(self) -> None:
        """Celery's ``celery.backend_cleanup`` at 04:00, when Celery's beat would add it."""
        conf = self.app.conf
        if "celery.backend_cleanup" in self.entries or not conf.result_expires:
            return
        if not has_result_backend(self.app) or self.app.backend.supports_autoexpire:
            return
        self.entries.update(build_entries({
            "celery.backend_cleanup": {
                "task": "celery.backend_cleanup",
                "schedule": crontab("0", "4", "*"),
                "options": {"expires": 12 * 3600},
            }
        }, app=self.app))

    def _lease_name(self) -> str:
        # One lease per claim database: two clusters sharing a Redis never block each other.
        digest = hashlib.sha1(self.settings.db_url.encode()).hexdigest()[:10]
        return f"{self.app.main or 'celery'}:{digest}"

    def setup_schedule(self) -> None:
        s = self.settings
        self._default_entries()
        self._store = ClaimStore(s.db_url, node_id=s.node_id)
        self._store.open()
        self._publisher = Publisher(self.app, s.node_id)
        self._guard = OverlapGuard(self.app, s)
        self._guard.warn_about_configuration(self.entries.values())
        if s.redis_url:
            from ..leader.lease import RedisLease
            from ..leader.redisconn import redis_client_from_url

            url = s.redis_url
            same_as_broker = url == self.app.conf.broker_url
            options = dict(self.app.conf.broker_transport_options or {}) if same_as_broker else {}
            ssl = self.app.conf.broker_use_ssl if same_as_broker else None
            timeout = min(2.0, s.lock_ttl / 2)

            def client_factory():
                return redis_client_from_url(url, transport_options=options, ssl=ssl or None, socket_timeout=timeout)

            self._lease = RedisLease(client_factory, name=self._lease_name(), node_id=s.node_id,
                                     ttl=s.lock_ttl, on_event=self._on_lease_event)
        logger.info(
            "cluster-beat: node %s, %d entries, claims in %s, lease %s",
            s.node_id, len(self.entries), mask_url(s.db_url),
            f"{mask_url(s.redis_url)} (ttl {s.lock_ttl:g}s)" if s.redis_url else "off (replicas race on claims)",
        )
        if self._lease is None:
            # Replicas race for every fire: the guard must see the runs the other replicas sent.
            self._guard.refresh = self._store.schedule_states
            self._activate()

    def get_schedule(self) -> Dict[str, Entry]:
        return self.entries

    def set_schedule(self, schedule) -> None:  # beat's API; our schedule comes from the config
        raise NotImplementedError("celery-cluster-beat reads beat_schedule from the Celery config")

    schedule = property(get_schedule)

    @property
    def info(self) -> str:
        s = self.settings
        lease = f"{mask_url(s.redis_url)} (ttl {s.lock_ttl:g}s)" if s.redis_url else "off"
        return f"    . db -> {mask_url(s.db_url)}\n    . lease -> {lease}\n    . node -> {s.node_id}"

    # -- leadership --------------------------------------------------------------
    def _term(self) -> Optional[int]:
        return self._lease.term if self._lease is not None else None

    def _on_lease_event(self, event, info: dict) -> None:
        value = getattr(event, "value", event)
        signals.lease_changed.send(sender=self, event=value, node=self.settings.node_id,
                                   term=info.get("term"), info=info)

    def _activate(self) -> None:
        """Become the node that schedules: rebuild the heap from what the store says was claimed."""
        now = _utcnow()
        try:
            if self._lease is not None:
                recorded = self._store.current_term()
                if (self._lease.term or 0) < recorded:
                    # Redis lost its counter (restart without data): take a term above the recorded one.
                    self._lease.step_down(f"term {self._lease.term} is below the recorded term {recorded}",
                                          observed_term=recorded)
                    return
            last = self._store.last_occurrences()
            self._guard.load(self._store.schedule_states())  # inherit the previous leader's in-flight runs
        except SQLAlchemyError as exc:
            logger.error("cluster-beat: cannot read the claim store (%s); retrying", exc)
            self._db_trouble()
            return
        self._heap = []
        self._next_at = {}
        for name, entry in self.entries.items():
            if not entry.enabled:
                continue
            prev = last.get(name)
            # A schedule seen for the first time does not catch up to before it existed.
            at = entry.schedule.next_fire(prev if prev is not None else now)
            self._next_at[name] = at
            self._heap.append((at, name))
        heapq.heapify(self._heap)
        self._active = True
        self._next_sweep = 0.0
        self._next_prune = time.monotonic() + min(5.0, self.settings.prune_interval)
        self._publisher.warm_up()
        self._sweep_stale(now)

    def _deactivate(self, why: str) -> None:
        if self._active:
            logger.warning("cluster-beat: node %s stops scheduling: %s", self.settings.node_id, why)
        self._active = False
        self._retries = []
        if self._guard is not None:
            self._guard.drop_buffered()

    def _standby(self) -> float:
        lease = self._lease
        if lease.try_acquire():
            self._activate()
            return 0.001
        if lease.wait_for_release(min(STANDBY_POLL, max(0.05, lease.retry_after()))) and lease.try_acquire():
            self._activate()
        return 0.001

    def _still_leader(self) -> bool:
        if self._lease is None:
            return True
        if self._lease.maintain():
            return True
        self._deactivate("the lease was lost or could not be renewed in time")
        return False

    # -- the loop ----------------------------------------------------------------
    def tick(self, *args, **kwargs) -> float:
        """One pass of beat's loop; returns how long to sleep (always > 0). Never raises."""
        if self._closed:
            return self.max_interval
        try:
            return self._tick()
        except StaleTermError as exc:
            self._fenced_out(exc)
            return 0.001
        except Exception:  # a bug or an unexpected library error must not end beat (Celery's beat swallows too)
            logger.exception("cluster-beat: unexpected error in the scheduling loop; continuing in 1 s")
            return 1.0

    def _fenced_out(self, exc: StaleTermError) -> None:
        self._lease.step_down(f"a newer leader term {exc.seen_term} is recorded", observed_term=exc.seen_term)
        self._deactivate("a newer leader holds the claim store")

    def _tick(self) -> float:
        if self._lease is not None:
            if self._active:
                self._still_leader()
            if not self._active:
                return self._standby()
        elif not self._active:
            if time.monotonic() >= self._db_backoff_until:
                self._activate()
            return self._sleep_time()
        if self._heap and self._heap[0][0] <= _utcnow() and time.monotonic() >= self._db_backoff_until:
            self._run_due()
        if self._retries and self._retries[0][0] <= time.monotonic():
            self._run_retries()
        if self._guard.has_buffered() and time.monotonic() >= self._db_backoff_until:
            self._run_buffered()
        if time.monotonic() >= self._next_prune:
            self._prune()
        return self._sleep_time()

    def _sleep_time(self) -> float:
        mono = time.monotonic()
        wait = self.max_interval
        if self._heap:
            wait = min(wait, (self._heap[0][0] - _utcnow()).total_seconds())
        if self._retries:
            wait = min(wait, self._retries[0][0] - mono)
        if self._db_backoff_until > mono:
            wait = max(wait, self._db_backoff_until - mono)
        if self._active and self._lease is not None:
            wait = min(wait, self._lease.next_renew_in())
        check = self._guard.next_check_in() if self._guard is not None else None
        if check is not None:
            wait = min(wait, check)
        return max(wait, 0.001)  # never 0: beat would spin

    def _pop_due(self, now: datetime) -> List[Tuple[Entry, datetime, bool]]:
        """Due entries with their first due instant and whether that is the only one due."""
        due = []
        heap = self._heap
        while heap and heap[0][0] <= now:
            at, name = heapq.heappop(heap)
            entry = self.entries.get(name)
            if entry is None or self._next_at.get(name) != at:
                continue  # superseded heap item
            nxt = entry.schedule.next_fire(at)
            single = nxt > now
            if not single:
                nxt = entry.schedule.next_fire(now)  # forward from now: a stall never builds a backlog
            self._next_at[name] = nxt
            heapq.heappush(heap, (nxt, name))
            due.append((entry, at, single))
        return due

    def _run_due(self) -> None:
        now = _utcnow()
        due = self._pop_due(now)
        s = self.settings
        claim: List[Tuple[Entry, Occurrence]] = []
        missed: List[Occurrence] = []
        for entry, at, single in due:
            schedule = entry.schedule
            if single and now - at <= ON_TIME:
                claim.append((entry, Occurrence(entry.name, at)))  # the usual case: one occurrence, on time
                continue
            plan = plan_catchup(
                schedule, at - _TINY, now,
                policy=entry.catchup or s.catchup,
                window=entry.catchup_window if entry.catchup_window is not None else s.catchup_window,
                max_count=s.catchup_max,
            )
            claim.extend((entry, Occurrence(entry.name, t)) for t in plan.send)
            missed.extend(Occurrence(entry.name, t) for t in plan.missed)
            if plan.missed:
                logger.warning("cluster-beat: %s: %d%s occurrence(s) from %s missed (catch-up policy %s)",
                               entry.name, len(plan.missed), "+" if plan.missed_truncated else "",
                               plan.missed[0].isoformat(), entry.catchup or s.catchup)
        try:
            if missed:
                for occ in self._store.record(missed, status="missed", reason="catchup", term=self._term()):
                    self._outcome("missed", occ, "catchup")
            self._claim_and_send(claim, now)
        except SQLAlchemyError as exc:
            logger.error("cluster-beat: the claim store failed (%s); %d occurrence(s) will be retried",
                         exc.__class__.__name__ + ": " + str(exc).splitlines()[0], len(due))
            self._db_trouble()
            for entry, at, _ in due:  # put them back: the retry applies the catch-up policy
                self._next_at[entry.name] = at
                heapq.heappush(self._heap, (at, entry.name))
            return
        self._db_failures = 0
        if time.monotonic() >= self._next_sweep:
            self._sweep_stale(now)

    def _db_trouble(self) -> None:
        self._db_failures += 1
        self._db_backoff_until = time.monotonic() + min(30.0, 0.5 * 2 ** min(self._db_failures, 6))

    def _claim_and_send(self, claim: Sequence[Tuple[Entry, Occurrence]], now: datetime, *,
                        guarded: bool = True) -> None:
        """Guard, claim (one statement), send what this node won."""
        if not claim or not self._still_leader():
            return
        replaces: Dict[Occurrence, str] = {}
        if guarded:
            decision = self._guard.filter(claim, now)
            claim, replaces = decision.send, decision.replaces
        try:
            if guarded and decision.skipped:
                for occ in self._store.record([occ for _, occ in decision.skipped], status="skipped",
                                              reason="overlap", term=self._term()):
                    self._outcome("skipped-overlap", occ, "previous run still in flight")
            if guarded:
                for _, occ in decision.buffered:
                    self._outcome("buffered", occ, "previous run still in flight")
            if not claim:
                return
            won = self._store.claim([occ for _, occ in claim], term=self._term())
        except StaleTermError as exc:
            self._fenced_out(exc)
            return
        won_set = set(won)
        entry_of = {occ: entry for entry, occ in claim}
        for entry, occ in claim:
            if occ not in won_set:
                self._outcome("claim-lost", occ, "claimed by another node")
        for occ in won:
            if occ in replaces:
                self._guard.revoke(replaces[occ])
                self._outcome("replaced", occ, f"previous run {replaces[occ]} revoked")
        self._send([(entry_of[occ], occ) for occ in won], resent=False)

    def _run_buffered(self) -> None:
        """Send buffered occurrences (overlap ``buffer_one``) whose previous run has finished."""
        ready = self._guard.ready(_utcnow())
        if ready:
            try:
                self._claim_and_send(ready, _utcnow(), guarded=False)
            except SQLAlchemyError as exc:
                logger.error("cluster-beat: the claim store failed while sending buffered runs: %s", exc)
                self._db_trouble()

    def _dispatch_for(self, entry: Entry, occ: Occurrence) -> Dispatch:
        s = self.settings
        options = entry.options
        jitter = entry.jitter if entry.jitter is not None else s.jitter
        if jitter:
            delay = jitter_delay(entry.name, occ.at, jitter, entry.schedule.next_fire(occ.at))
            if delay:
                options = dict(options, eta=occ.at + timedelta(seconds=delay))
        return Dispatch(occ, entry.task, entry.args, entry.kwargs, options)

    def _send(self, items: Sequence[Tuple[Entry, Occurrence]], *, resent: bool) -> None:
        """Publish claimed occurrences slice by slice, renewing the lease between slices."""
        for start in range(0, len(items), SEND_SLICE):
            part = items[start:start + SEND_SLICE]
            if start and not self._still_leader():
                logger.warning("cluster-beat: %d claimed occurrence(s) left for the next leader", len(items) - start)
                return
            dispatches = [self._dispatch_for(entry, occ) for entry, occ in part]
            errors = self._publisher.publish(dispatches)
            sent = [occ for (_, occ), err in zip(part, errors) if err is None]
            self._mark_sent(sent)
            outcome = "resent" if resent else "sent"
            log_each = len(part) < LOG_EACH_UNDER
            for (entry, occ), err in zip(part, errors):
                if err is None:
                    entry.last_run_at = occ.at
                    entry.total_run_count += 1
                    self._guard.sent(entry, occ)
                    self._outcome(outcome, occ, None, entry, log=log_each)
                else:
                    self._send_failed(occ, err, attempt=1)
            if not log_each:
                logger.info("cluster-beat: %s %d occurrence(s) (%d failed)", outcome, len(sent), len(part) - len(sent))

    def _mark_sent(self, sent: List[Occurrence]) -> None:
        """Record sends; if the store is down, keep them to record later.

        The messages are out: losing the 'sent' mark would make the stale-claim
        sweep resend them, so they are kept until the store takes them.
        """
        pending = self._unmarked + sent
        try:
            self._store.mark_sent(pending)
        except SQLAlchemyError as exc:
            self._unmarked = pending
            logger.error("cluster-beat: cannot mark %d sent occurrence(s) in the claim store (%s); will retry",
                         len(pending), exc.__class__.__name__)
            self._db_trouble()
        else:
            self._unmarked = []

    def _send_failed(self, occ: Occurrence, err: BaseException, attempt: int) -> None:
        final = attempt >= MAX_SEND_ATTEMPTS
        self._store.mark_failed(occ, f"{err.__class__.__name__}: {err}", final=final)
        if final:
            logger.error("cluster-beat: giving up on %s at %s after %d attempts: %r", occ.schedule, occ.at, attempt, err)
            self._outcome("failed", occ, repr(err))
        else:
            # Each failed attempt refreshes the claim; retrying within the grace keeps sweepers off it.
            delay = min(2 ** (attempt - 1), self.settings.claim_grace / 2)
            heapq.heappush(self._retries, (time.monotonic() + delay, attempt + 1, occ))

    def _run_retries(self) -> None:
        mono = time.monotonic()
        batch = []
        while self._retries and self._retries[0][0] <= mono:
            batch.append(heapq.heappop(self._retries))
        if not self._still_leader():
            return
        ready = [(self.entries[occ.schedule], occ, attempt) for _, attempt, occ in batch if occ.schedule in self.entries]
        try:
            errors = self._publisher.publish([self._dispatch_for(e, o) for e, o, _ in ready])
            self._mark_sent([o for (_, o, _), err in zip(ready, errors) if err is None])
            for (entry, occ, attempt), err in zip(ready, errors):
                if err is None:
                    self._guard.sent(entry, occ)  # the overlap guard must see retried sends too
                    self._outcome("sent", occ, f"after {attempt - 1} failed attempt(s)", entry)
                else:
                    self._send_failed(occ, err, attempt)
        except SQLAlchemyError as exc:
            logger.error("cluster-beat: the claim store failed while retrying sends: %s", exc)
            self._db_trouble()

    def _sweep_stale(self, now: datetime) -> None:
        """Send rows another node claimed and never marked sent (it died in between)."""
        grace = self.settings.claim_grace
        self._next_sweep = time.monotonic() + grace / 2
        if not self._still_leader():
            return
        if self._unmarked:  # our own sends must be recorded before we look for unsent claims
            self._mark_sent([])
            if self._unmarked:
                return
        try:
            rows = self._store.take_over_stale(now - timedelta(seconds=grace), term=self._term())
        except SQLAlchemyError as exc:
            logger.error("cluster-beat: stale-claim sweep failed: %s", exc)
            return
        except StaleTermError as exc:
            self._fenced_out(exc)
            return
        retrying = {occ for _, _, occ in self._retries}
        items = []
        for occ in rows:
            if occ in retrying:  # our own failed publish, already queued for a retry
                continue
            entry = self.entries.get(occ.schedule)
            if entry is None:
                self._store.mark_failed(occ, "entry no longer in beat_schedule", final=True)
                continue
            items.append((entry, occ))
        if items:
            logger.warning("cluster-beat: resending %d occurrence(s) left claimed by a node that stopped", len(items))
            self._send(items, resent=True)

    def _prune(self) -> None:
        s = self.settings
        self._next_prune = time.monotonic() + s.prune_interval
        if not self._active:
            return
        try:
            n = self._store.prune(_utcnow() - timedelta(seconds=s.claim_retention), batch=1000, max_batches=10)
        except SQLAlchemyError as exc:
            logger.error("cluster-beat: pruning old claims failed: %s", exc)
            return
        if n:
            logger.info("cluster-beat: pruned %d claim row(s) older than %gs", n, s.claim_retention)

    def prune(self, older_than: float) -> int:
        """Delete claim rows whose occurrence is more than *older_than* seconds old (manual prune)."""
        return self._store.prune(_utcnow() - timedelta(seconds=older_than), batch=1000)

    def _outcome(self, outcome: str, occ: Occurrence, reason: Optional[str], entry: Optional[Entry] = None,
                 log: bool = True) -> None:
        if log:
            if entry is not None and outcome in ("sent", "resent"):
                logger.info("Scheduler: Sending due task %s (%s) for %s%s", entry.name, entry.task,
                            occ.at.isoformat(), " (resent)" if outcome == "resent" else "")
            elif outcome == "claim-lost":
                logger.debug("cluster-beat: %s at %s was claimed by another node", occ.schedule, occ.at.isoformat())
            else:
                logger.info("cluster-beat: %s at %s: %s%s", occ.schedule, occ.at.isoformat(), outcome,
                            f" ({reason})" if reason else "")
        signals.occurrence_handled.send(sender=self, outcome=outcome, schedule=occ.schedule,
                                        scheduled_at=occ.at, task_id=occ.task_id, reason=reason)

    # -- beat's persistence hooks ------------------------------------------------
    def should_sync(self) -> bool:
        return False  # state is written to SQL as it happens

    def sync(self) -> None:
        pass

    def close(self) -> None:
        """Release the lease and the store; beat calls this twice on SIGTERM."""
        if self._closed:
            return
        self._closed = True
        self._active = False
        if self._lease is not None:
            try:
                self._lease.close()
            except Exception as exc:  # never let shutdown fail
                logger.warning("cluster-beat: releasing the lease failed: %r", exc)
        if self._store is not None:
            self._store.close()
