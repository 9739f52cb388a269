"""The Celery glue: ``celery beat -S celery_cluster_beat.Scheduler``.

Beat calls :meth:`Scheduler.tick` in a loop and sleeps for what it returns.
Each tick here costs a heap peek when nothing is due: no walk over the
schedule, and no I/O but the housekeeping every ``claim_grace / 3`` (heartbeat,
clock sample, stale-claim sweep). When occurrences fall due the
:class:`~.pipeline.SendPipeline` claims them in the SQL store in one statement
(only rows this node inserted are sent) and publishes them in chunks, each
marked sent in one statement. With a Redis lease only the leader does this;
standbys block on the lease's release notice.

The scheduler owns what Celery calls and the loop's state (the heap of next
fires, leadership, the store back-off); the pipeline owns sending.
"""
from __future__ import annotations

import logging
import time
from datetime import datetime, timedelta
from typing import Dict, List, Optional, Tuple

from celery import beat

from .. import signals
from ..config import Entry, Settings, build_entries, default_entries, load_settings
from ..config.celeryconf import has_result_backend
from ..dynamic import entry_from_row
from ..errors import ConfigError
from ..leader.urls import mask_url
from ..schedules.instants import TINY
from ..schedules.occurrence import Occurrence
from ..store import ClaimStatus, ClaimStore, StaleTermError, StoreUnavailable
from .clock import NodeClock
from .catchup import ON_TIME, plan_catchup
from .catchup import RECORD_LIMIT as CATCHUP_RECORD_LIMIT
from .guard import OverlapGuard
from .outcomes import Outcome, Reporter
from .pipeline import SendPipeline
from .publisher import Publisher
from .timeline import Timeline

logger = logging.getLogger("celery_cluster_beat")

#: Standbys try to take the lease at least this often (seconds).
STANDBY_POLL = 1.0
#: Seconds one pruning pass may take; a backlog is pruned over several passes a second apart.
PRUNE_BUDGET = 2.0
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
            self.settings = load_settings(app.conf, has_result_backend=lambda: has_result_backend(app), app_name=app.main)
        except ConfigError as exc:
            problems += exc.problems
        # Beat's banner instance (lazy) needs no entries; build them there only to report every problem.
        if not lazy or problems:
            try:
                self.entries = build_entries(app.conf.beat_schedule, app=app)
            except ConfigError as exc:
                problems += exc.problems
        if self.settings is not None and self.entries:
            from .guard import configuration_problems  # an explicit guard nothing can observe

            problems += configuration_problems(app, self.settings, self.entries.values())
        if problems:
            raise ConfigError(problems)
        self._store: Optional[ClaimStore] = None
        self._lease = None
        self._guard: Optional[OverlapGuard] = None
        self._pipeline: Optional[SendPipeline] = None
        self._report = Reporter(self)
        self._active = False
        self._closed = False
        #: Next fire of every schedule held in memory (the config's and stored ones due soon).
        self._queue = Timeline()
        #: Names of the config's entries (``beat_schedule`` and Celery's defaults): never stored ones.
        self._static: frozenset = frozenset()
        self._stored_version = 0  # the change counter's value this node has applied
        self._horizon: Optional[datetime] = None  # stored schedules due before this are in memory
        self._version_read_at = float("-inf")
        self._changes_wanted = False
        self._notices = None
        #: (name, version, next fire) of stored schedules to hand back to SQL once their next_at is written.
        self._evict_retry: List[Tuple[str, int, datetime]] = []
        self._evict_retry_at = 0.0
        self._next_prune = 0.0
        self._next_housekeeping = 0.0
        self._db_backoff_until = 0.0
        self._db_failures = 0
        self._db_down_since: Optional[float] = None
        self._clock = NodeClock(self.settings.node_id)
        super().__init__(app, schedule=None, max_interval=max_interval, Producer=Producer, lazy=True,
                         sync_every_tasks=sync_every_tasks, **kwargs)
        if not lazy:
            self.setup_schedule()

    # -- set-up ----------------------------------------------------------------
    def _lease_name(self) -> str:
        return self.settings.cluster_name

    def _lock_timeout(self) -> float:
        """How long a statement may wait for a row lock: well inside the lease, so a leader paused
        inside a claim transaction cannot hold up its successor past its own lease."""
        return max(0.25, min(2.0, self.settings.lock_ttl / 4))

    def _housekeeping_interval(self) -> float:
        return self.settings.claim_grace / 3

    def setup_schedule(self) -> None:
        s = self.settings
        self.entries.update(build_entries(default_entries(self.app, self.entries), app=self.app))
        self._store = ClaimStore(s.db_url, node_id=s.node_id, lock_timeout=self._lock_timeout())
        self._store.open()
        self._store.check_names(self.entries)  # what the database cannot tell apart (a PAD SPACE collation)
        self._static = frozenset(self.entries)
        clash = self._store.stored_get(sorted(self._static))
        if clash:
            raise ConfigError([f"beat_schedule entry {r.name!r} and the stored schedule {r.name!r}"
                               f"{' of ' + repr(r.owner) if r.owner else ''} share a name: rename the entry "
                               "or remove the stored schedule (StoredSchedules(app).remove(name))" for r in clash])
        self._clock.measure(self._store.db_now)
        self._store.heartbeat(scheduling=False, clock_offset=self._clock.offset, register=True)
        self._next_housekeeping = time.monotonic() + self._housekeeping_interval()
        self._guard = OverlapGuard(self.app, s, now=self._clock.now, ledger=self._store.run_states)
        self._guard.warn_about_configuration(self.entries.values())
        self._pipeline = SendPipeline(
            store=self._store, publisher=Publisher(self.app, s.node_id), guard=self._guard, settings=s,
            entries=self.entries, report=self._report, still_leader=self._still_leader, term=self._term,
            on_store_trouble=self._db_trouble,
        )
        self._pipeline.resolve = self.resolve_stored
        if s.redis is not None:
            from ..leader.lease import RedisLease

            self._lease = RedisLease(s.redis.client, name=self._lease_name(), node_id=s.node_id,
                                     ttl=s.lock_ttl, on_event=self._on_lease_event, cluster_id=self._store.cluster_id)
            self._lease.check_cluster()  # two claim stores behind one lease: refuse to start
            from ..leader.notices import ChangeNotices

            self._notices = ChangeNotices(s.redis.client, s.cluster_name)
        logger.info(
            "cluster-beat: node %s, %d entries, %d stored schedule(s), claims in %s, lease %s",
            s.node_id, len(self.entries), self._store.stored_count(), mask_url(s.db_url),
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
        now = self._clock.now()
        try:
            self._pipeline.settle()  # hand over what an earlier holding left, before claiming anew
            if self._pipeline.owes_release:
                raise StoreUnavailable("claims of an earlier holding are not handed over yet")
            if self._lease is not None:
                recorded = self._store.current_term()
                if (self._lease.term or 0) < recorded:
                    # Redis lost its counter (restart without data): take a term above the recorded one.
                    self._lease.step_down(f"term {self._lease.term} is below the recorded term {recorded}",
                                          observed_term=recorded)
                    return
            for name in [n for n in self.entries if n not in self._static]:
                del self.entries[name]  # stored schedules are read afresh: they may have changed meanwhile
            last = self._store.last_occurrences(self._static)
            new = [name for name, entry in self.entries.items() if entry.enabled and name not in last]
            if new:  # first seen now: a later leader catches up from here, never from before
                registered = self._store.register(new)
                last.update((name, registered) for name in new)
            # The counter first: a change committed while the rows are read is applied again, harmlessly.
            version = self._store.stored_version()
            horizon = now + timedelta(seconds=HORIZON)
            stored = self._store.stored_due(horizon)
            # The previous leader did not write next_at back for schedules it held in memory: resume
            # those after their last recorded occurrence instead of catching up from a stale next_at.
            stored_last = self._store.last_occurrences([r.name for r in stored]) if stored else {}
            self._guard.load(self._store.schedule_states(self._static))  # inherit the previous leader's in-flight runs
        except StoreUnavailable as exc:
            logger.error("cluster-beat: cannot read the claim store (%s); retrying", exc)
            self._db_trouble()
            if self._lease is not None and self._lease.term is not None:
                self._lease.release()  # a node that cannot use the store must not keep others from it
            return
        self._db_ok()
        fires: Dict[str, datetime] = {}
        for name, entry in self.entries.items():
            if not entry.enabled:
                continue
            # Resume after the last recorded occurrence, or from when the schedule was first
            # seen: it does not catch up to before it existed.
            fires[name] = entry.schedule.next_fire(last.get(name, now))
        self._queue = Timeline(fires)
        self._stored_version = version
        self._version_read_at = time.monotonic()
        self._changes_wanted = False
        self._horizon = horizon
        self._evict_retry = []
        self._hold(stored, stored_last)
        self._active = True
        self._next_prune = time.monotonic() + min(5.0, self.settings.prune_interval)
        self._pipeline.publisher.warm_up()
        self._housekeep()  # heartbeat as the scheduling node, and resend what a stopped node left

    def _deactivate(self, why: str) -> None:
        if self._active:
            logger.warning("cluster-beat: node %s stops scheduling: %s", self.settings.node_id, why)
        self._active = False
        buffered = self._guard.drop_buffered() if self._guard is not None else []
        if self._pipeline is not None:
            self._pipeline.abandon(buffered)

    def _standby(self) -> float:
        lease = self._lease
        mono = time.monotonic()
        if mono < self._db_backoff_until:
            # This node cannot use the store: it must not take the lease from one that can.
            return min(self._db_backoff_until - mono, self.max_interval)
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

    def _fenced_out(self, exc: StaleTermError) -> None:
        self._deactivate("a newer leader holds the claim store")  # hand claims over before the lease goes
        self._lease.step_down(f"a newer leader term {exc.seen_term} is recorded", observed_term=exc.seen_term)

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

    def _tick(self) -> float:
        mono = time.monotonic()
        if mono >= self._next_housekeeping and mono >= self._db_backoff_until:
            self._housekeep()
        if self._lease is not None:
            if self._active:
                self._still_leader()
                if self._active and self._db_down_for() >= self.settings.lock_ttl:
                    self._step_aside(f"the claim database has been unreachable for {self._db_down_for():.1f} s")
            if not self._active:
                return self._standby()
        elif not self._active:
            if time.monotonic() >= self._db_backoff_until:
                self._activate()
            return self._sleep_time()
        store_ok = time.monotonic() >= self._db_backoff_until
        if store_ok:
            self._guarded_store_call(self._follow_stored, "reading stored schedule changes")
        store_ok = time.monotonic() >= self._db_backoff_until
        if store_ok and self._queue and self._queue.peek()[0] <= self._clock.now():
            self._run_due()
        store_ok = time.monotonic() >= self._db_backoff_until  # again: the due pass may have failed
        retry_in = self._pipeline.next_retry_in()
        if store_ok and retry_in is not None and retry_in <= 0:
            self._guarded_store_call(self._pipeline.run_retries, "retrying sends")
        if store_ok and self._guard.has_buffered():
            self._guarded_store_call(self._run_buffered, "sending buffered runs")
        if store_ok and time.monotonic() >= self._next_prune:
            self._prune()
        return self._sleep_time()

    def _sleep_time(self) -> float:
        mono = time.monotonic()
        wait = min(self.max_interval, self._next_housekeeping - mono)
        if self._queue:
            wait = min(wait, (self._queue.peek()[0] - self._clock.now()).total_seconds())
        if self._active:
            wait = min(wait, self._next_change_check_in(mono))
        retry_in = self._pipeline.next_retry_in() if self._pipeline is not None else None
        if retry_in is not None:
            wait = min(wait, retry_in)
        check = self._guard.next_check_in() if self._guard is not None else None
        if check is not None:
            wait = min(wait, check)
        if self._db_backoff_until > mono:
            # Nothing that needs the store may undercut the back-off (buffered runs, due fires).
            wait = max(wait, self._db_backoff_until - mono)
        if self._active and self._lease is not None:
            wait = min(wait, self._lease.next_renew_in())
        return max(wait, 0.001)  # never 0: beat would spin

    def _pop_due(self, now: datetime) -> Tuple[List[Tuple[Entry, datetime, bool]], List[Tuple[str, int, datetime]]]:
        """Due entries with their first due instant and whether that is the only one due; and the
        stored schedules whose next fire is past the horizon, to hand back to SQL."""
        due = []
        leaving: List[Tuple[str, int, datetime]] = []
        queue = self._queue
        while queue and queue.peek()[0] <= now:
            at, name = queue.peek()
            entry = self.entries[name]
            nxt = entry.schedule.next_fire(at)
            single = nxt > now
            if not single:
                nxt = entry.schedule.next_fire(now)  # forward from now: a stall never builds a backlog
            queue.set(name, nxt)
            if entry.stored_version is not None and self._horizon is not None and nxt >= self._horizon:
                leaving.append((name, entry.stored_version, nxt))
            due.append((entry, at, single))
        return due, leaving

    def _run_due(self) -> None:
        now = self._clock.now()
        due, leaving = self._pop_due(now)
        s = self.settings
        claim: List[Tuple[Entry, Occurrence]] = []
        missed: List[Occurrence] = []
        missed_by: Dict[str, int] = {}
        catchup: set = set()  # sent late, after a stop: the task can tell (its occurrence context)
        truncated = 0
        for entry, at, single in due:
            if single and now - at <= ON_TIME:
                claim.append((entry, Occurrence(entry.name, at)))  # the usual case: one occurrence, on time
                continue
            policy = entry.catchup or s.catchup
            plan = plan_catchup(
                entry.schedule, at - TINY, now,
                policy=policy,
                window=entry.catchup_window if entry.catchup_window is not None else s.catchup_window,
                max_count=s.catchup_max,
            )
            sent_late = [(entry, Occurrence(entry.name, t)) for t in plan.send]
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
        try:
            if missed:
                for occ in self._store.record(missed, status=ClaimStatus.MISSED, reason="catchup", term=self._term()):
                    self._report(Outcome.MISSED, occ, "catchup")
            self._pipeline.claim_and_send(claim, now, catchup=frozenset(catchup))
        except (StoreUnavailable, Exception) as exc:
            if isinstance(exc, StaleTermError):
                raise
            if isinstance(exc, StoreUnavailable):
                logger.error("cluster-beat: the claim store failed (%s); %d due occurrence(s) wait for it, then "
                             "go by the catch-up policy", exc, len(due))
            else:
                logger.exception("cluster-beat: unexpected error handling %d due occurrence(s); they wait for "
                                 "the next try", len(due))
            self._db_trouble()
            for entry, at, _ in due:  # put them back: the retry applies the catch-up policy
                if self.entries.get(entry.name) is entry:
                    self._queue.set(entry.name, at)
            return
        if not self._pipeline.unmarked:
            self._db_ok()
        if leaving:
            self._release_stored(leaving)

    # -- stored schedules ----------------------------------------------------------
    def _hold(self, rows, last: Optional[Dict[str, datetime]] = None) -> None:
        """Hold stored schedules in memory (rows due before the horizon, or just changed);
        *last*: their last recorded occurrences, when next_at may lag behind them."""
        held = []
        for row in rows:
            if row.name in self._static:
                self._clash(row)
                continue
            current = self.entries.get(row.name)
            if current is not None and (current.stored_version or 0) >= row.version:
                continue  # already held at this version (or a newer one)
            if row.deleted or not row.enabled or row.next_at is None:
                self._drop(row.name)
                continue
            try:
                entry = entry_from_row(row, app=self.app)
            except ConfigError as exc:  # written by another release, or by hand: never fire it half-read
                logger.error("cluster-beat: stored schedule %r cannot be scheduled: %s", row.name, exc)
                self._drop(row.name)
                continue
            if row.next_at >= self._horizon:
                self._drop(row.name)  # its next_at in SQL is exact: the window that covers it loads it
                continue
            at = row.next_at
            if last and row.name in last:  # held (it is before the horizon in SQL), from where it really is
                at = max(at, entry.schedule.next_fire(last[row.name]))
            self.entries[row.name] = entry
            self._queue.set(row.name, at)
            held.append(row.name)
        if held:
            self._guard.load(self._store.schedule_states(held))

    def _clash(self, row) -> None:
        logger.error("cluster-beat: the stored schedule %r has the name of a beat_schedule entry; it is not "
                     "scheduled (remove it, or rename the entry)", row.name)

    def _drop(self, name: str) -> None:
        if name in self._static:
            return
        self.entries.pop(name, None)
        self._queue.remove(name)

    def _next_change_check_in(self, mono: float) -> float:
        since = mono - self._version_read_at
        if self._notices is None or self._notices.down:
            return max(0.0, CHANGE_READ_MIN - since)
        if self._changes_wanted:
            return max(0.0, CHANGE_READ_NOTICED - since)
        # A notice is only seen on a tick: look twice a second, which costs no SQL.
        return min(NOTICE_POLL, max(0.0, CHANGE_READ_FALLBACK - since))

    def _follow_stored(self) -> None:
        """Apply stored schedule changes and move the horizon on, reading SQL only when due."""
        if not self._active or self._horizon is None:
            return
        mono = time.monotonic()
        if self._notices is not None and self._notices.heard():
            self._changes_wanted = True
        since = mono - self._version_read_at
        if self._notices is None or self._notices.down:
            read = since >= CHANGE_READ_MIN
        elif self._changes_wanted:
            read = since >= CHANGE_READ_NOTICED
        else:
            read = since >= CHANGE_READ_FALLBACK
        if read:
            self._version_read_at = mono
            self._changes_wanted = False
            version = self._store.stored_version()
            while version > self._stored_version:
                rows = self._store.stored_changes(self._stored_version, limit=CHANGE_BATCH)
                if not rows:
                    break
                self._hold(rows)
                self._stored_version = rows[-1].version
                logger.info("cluster-beat: applied %d stored schedule change(s) (version %d)",
                            len(rows), self._stored_version)
                if len(rows) < CHANGE_BATCH:
                    break
        now = self._clock.now()
        if (self._horizon - now).total_seconds() <= HORIZON / 2:
            horizon = now + timedelta(seconds=HORIZON)
            rows = self._store.stored_due(horizon, since=self._horizon)
            self._horizon = horizon
            self._hold(rows)
        if self._evict_retry and mono >= self._evict_retry_at:
            leaving, self._evict_retry = self._evict_retry, []
            self._release_stored(leaving)

    def _release_stored(self, leaving: List[Tuple[str, int, datetime]]) -> None:
        """Hand stored schedules whose next fire is past the horizon back to SQL: record their
        next occurrence, then forget them. Until SQL has it they stay in memory."""
        try:
            self._store.stored_set_next(leaving)
        except StoreUnavailable as exc:
            logger.warning("cluster-beat: cannot record the next occurrence of %d stored schedule(s) yet (%s)",
                           len(leaving), exc)
            self._evict_retry.extend(leaving)
            self._evict_retry_at = time.monotonic() + CHANGE_READ_FALLBACK
            return
        for name, version, at in leaving:
            entry = self.entries.get(name)
            # Still that definition, still that fire, and still past the horizon (which may have
            # moved on meanwhile): a window read before this write could not have seen it.
            if (entry is not None and entry.stored_version == version and self._queue.get(name) == at
                    and self._horizon is not None and at >= self._horizon):
                self._drop(name)

    def resolve_stored(self, names: List[str]) -> Dict[str, Entry]:
        """Entries of stored schedules not held in memory (a stale claim of one is resent)."""
        out = {}
        for row in self._store.stored_get(names):
            try:
                out[row.name] = entry_from_row(row, app=self.app)
            except ConfigError:
                continue
        return out

    def _housekeep(self) -> None:
        """Every ``claim_grace / 3``: heartbeat (and clock sample), settle, sweep stale claims."""
        self._next_housekeeping = time.monotonic() + self._housekeeping_interval()
        try:
            self._clock.sample(lambda: self._store.heartbeat(scheduling=self._active, clock_offset=self._clock.offset))
            self._db_ok()
            self._pipeline.settle()
            if self._active:
                self._pipeline.sweep_stale()
        except StoreUnavailable as exc:
            logger.error("cluster-beat: claim store unavailable (%s); backing off", exc)
            self._db_trouble()

    def _db_trouble(self) -> None:
        mono = time.monotonic()
        self._db_failures += 1
        if self._db_down_since is None:
            self._db_down_since = mono
        self._db_backoff_until = mono + min(30.0, 0.5 * 2 ** min(self._db_failures, 6))

    def _db_ok(self) -> None:
        self._db_failures = 0
        self._db_down_since = None

    def _db_down_for(self) -> float:
        return 0.0 if self._db_down_since is None else time.monotonic() - self._db_down_since

    def _step_aside(self, why: str) -> None:
        """Give the lease up for a node that can do the work (this one cannot reach the store)."""
        self._deactivate(why)
        self._lease.release()

    def _guarded_store_call(self, call, doing: str) -> None:
        try:
            call()
        except StoreUnavailable as exc:
            logger.error("cluster-beat: the claim store failed while %s: %s", doing, exc)
            self._db_trouble()

    def _run_buffered(self) -> None:
        """Send buffered occurrences (overlap ``buffer_one``) whose previous run has finished."""
        ready = self._guard.ready(self._clock.now())
        if ready:
            try:
                self._pipeline.claim_and_send(ready, self._clock.now(), guarded=False)
            except Exception:
                self._guard.requeue(ready)  # not claimed: they wait (or are recorded on handover), not dropped
                raise

    def _prune(self) -> None:
        """Delete finished rows past their retention, in bounded batches for at most
        :data:`PRUNE_BUDGET` a pass; a backlog is worked off a pass a second."""
        s = self.settings
        self._next_prune = time.monotonic() + s.prune_interval
        if not self._active:
            return
        try:
            n, done = self._store.prune_pass(self._clock.now() - timedelta(seconds=s.claim_retention),
                                             time_budget=PRUNE_BUDGET)
            if done:
                self._store.stored_prune_removed(self._clock.now() - timedelta(seconds=s.claim_retention))
        except StoreUnavailable as exc:
            logger.error("cluster-beat: pruning old claims failed: %s", exc)
            self._db_trouble()
            return
        if not done:
            self._next_prune = time.monotonic() + 1.0
        if n:
            logger.info("cluster-beat: pruned %d claim row(s) older than %gs%s", n, s.claim_retention,
                        "" if done else "; more to prune")

    def prune(self, older_than: float) -> int:
        """Delete claim rows whose occurrence is more than *older_than* seconds old (manual prune)."""
        return self._store.prune(self._clock.now() - timedelta(seconds=older_than), batch=1000)

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
        if self._pipeline is not None:
            self._pipeline.abandon()  # record what went out, hand the rest over before the lease goes
        if self._lease is not None:
            try:
                self._lease.close()
            except Exception as exc:  # never let shutdown fail
                logger.warning("cluster-beat: releasing the lease failed: %r", exc)
        if self._notices is not None:
            self._notices.close()
        if self._store is not None:
            self._store.close()
