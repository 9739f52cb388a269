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
from typing import Callable, Dict, List, Optional, Set, Tuple

from celery import beat

from .. import faults, signals
from ..config import Entry, OverlapPolicy, Settings, build_entries, default_entries, load_settings
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
from . import startup
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
#: The leader claims an instant's occurrences this long before it (policy ``allow`` only; at most
#: claim_grace / 8) and publishes them at the instant: a burst's claim is then off the time to its
#: last message.
CLAIM_AHEAD = timedelta(seconds=0.5)
#: Messages of entries due within this many seconds are built ahead of their fire (see .messages).
PREPARE_AHEAD = 60.0
#: Seconds one tick may spend building them; the rest is built on the next ticks.
PREPARE_BUDGET = 0.05
#: No building when the next fire is closer than this: sends come first.
PREPARE_MARGIN = 0.5
#: Seconds between two looks for entries due soon whose message is not built yet.
PREPARE_EVERY = 10.0

#: Changed rows applied per read of the change feed (a bigger backlog takes several reads).
CHANGE_BATCH = 1000


class Scheduler(beat.Scheduler):
    """Celery beat scheduler for several replicas: SQL tick claims plus an optional Redis lease."""

    #: Upper bound of one sleep; a tick with nothing due is a heap peek, so this is cheap.
    max_interval = 5.0

    def __init__(self, app, schedule=None, max_interval=None, Producer=None, lazy: bool = False,
                 sync_every_tasks=None, **kwargs) -> None:
        #: Who runs us (celery beat, a worker's -B child or thread; None: built directly). Under Celery's
        #: beat a configuration error ends the process with one message and status 1 (see .startup).
        self._host = startup.beat_host()
        # Validate everything before anything is opened: one error lists every problem.
        problems: List[str] = []
        self.settings: Optional[Settings] = None
        self.entries: Dict[str, Entry] = {}
        try:
            self.settings = load_settings(app.conf, has_result_backend=lambda: has_result_backend(app), app_name=app.main,
                                          schedule_filename=kwargs.get("schedule_filename"))
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
            startup.refuse(ConfigError(problems), self._host, logger)
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
        #: Within version _stored_version, the last name read, while more rows of it remain (one
        #: change can write many rows: add_many).
        self._stored_after: Optional[str] = None
        #: Held stored schedules whose previous runs the overlap guard has yet to load (the store failed).
        self._states_owed: Set[str] = set()
        self._horizon: Optional[datetime] = None  # stored schedules due before this are in memory
        self._version_read_at = float("-inf")
        self._changes_wanted = False
        self._notices = None
        #: (name, version, next fire) of stored schedules to hand back to SQL once their next_at is written.
        self._evict_retry: List[Tuple[str, int, datetime]] = []
        self._evict_retry_at = 0.0
        #: Operators' controls (``celery ... cluster-beat pause / resume / run-now``), read with the
        #: same change counter: paused names, and run-now requests not handled yet.
        self._paused: Set[str] = set()
        self._controls_version = 0
        self._run_requests: Dict[str, Tuple[str, datetime]] = {}
        self._next_prune = 0.0
        #: Entries due soon whose message is still to be built ahead (latest first), and when to look again.
        self._prepare_todo: List[Tuple[datetime, str]] = []
        self._next_prepare = 0.0
        self._next_housekeeping = 0.0
        self._db_backoff_until = 0.0
        self._db_failures = 0
        self._db_down_since: Optional[float] = None
        #: Set-up waits for the claim database or Redis (unreachable at start-up): tick() goes on with it.
        self._setup_pending = False
        self._setup_retry_at = 0.0
        self._setup_outage: Optional[float] = None  # when the start-up outage began (logged once)
        self._cluster_checked = False
        #: A configuration error found in tick(): close() raises SystemExit with this status (see .startup).
        self._exit_status = 0
        self._clock = NodeClock(self.settings.node_id)
        #: How long before an instant its occurrences are claimed: CLAIM_AHEAD, or less with a short
        #: claim_grace, so that a claim made ahead needs no second confirmation before its publish.
        self._claim_ahead = min(CLAIM_AHEAD, timedelta(seconds=self.settings.claim_grace / 8))
        #: tick() is running: a close() now comes from a signal handler interrupting it (see close()).
        self._in_tick = False
        self._ops = None  # the HTTP server (/metrics, /healthz, status page) when cluster_beat_http_port is set
        super().__init__(app, schedule=None, max_interval=max_interval, Producer=Producer, lazy=True,
                         sync_every_tasks=sync_every_tasks, **kwargs)
        if not lazy:
            try:
                self.setup_schedule()
            except ConfigError as exc:  # a name clash, a newer schema, another cluster's lease, no driver
                self.close()
                startup.refuse(exc, self._host, logger)

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
        self._static = frozenset(self.entries)
        if s.http_port is not None and self._ops is None:  # first: /healthz answers while the database is awaited
            from ..ops.http import start_beat_server  # prometheus-client is imported only when asked for

            self._ops = start_beat_server(self.app, s, sender=self, store=self._store, now=self._clock.now)
        self._setup_pending = True
        self._continue_setup()

    def _setup_step(self) -> float:
        """tick() while the set-up waits for the claim database or Redis: how long to sleep."""
        try:
            wait = self._continue_setup()
        except ConfigError as exc:
            self._config_error_later(exc)
        else:
            if not self._setup_pending:
                return 0.001  # set up: the next tick schedules (or stands by)
            return max(0.05, min(self.max_interval, wait))
        return self.max_interval

    def _setup_waits(self, what: str, exc: BaseException) -> None:
        if self._setup_outage is None:
            self._setup_outage = time.monotonic()
            logger.warning("cluster-beat: %s is unreachable at start-up (%s); retrying with back-off, beat stays "
                           "up and starts scheduling once it answers", what, exc)
        else:
            logger.debug("cluster-beat: %s still unreachable (%s)", what, exc)

    def _continue_setup(self) -> float:
        """The set-up that needs the claim database (and Redis, for the cluster check).

        Done at once when both answer. An outage at start-up is not an error (an exit would be a
        crash loop under systemd or Kubernetes): it is logged once, and tick() calls this again with
        back-off until it succeeds. Returns how long to wait before the next try (0 when set up);
        raises ConfigError for what no retry can fix (a name clash, a newer schema, another
        cluster's lease, a missing driver).
        """
        if self._pipeline is None:
            mono = time.monotonic()
            if mono < self._db_backoff_until:
                return self._db_backoff_until - mono
            try:
                self._store.open()
                self._store.check_names(self.entries)  # what the database cannot tell apart (a PAD SPACE collation)
                clash = self._store.stored_clashes(self._static)
                if clash:
                    raise ConfigError([f"beat_schedule entry {r.name!r} and the stored schedule {r.name!r}"
                                       f"{' of ' + repr(r.owner) if r.owner else ''} share a name: rename the entry "
                                       "or remove the stored schedule (StoredSchedules(app).remove(name))"
                                       for r in clash])
                self._clock.measure(self._store.db_now)
                self._store.heartbeat(scheduling=False, clock_offset=self._clock.offset, register=True)
            except StoreUnavailable as exc:
                self._setup_waits("the claim store", exc)
                self._db_trouble()
                return max(0.0, self._db_backoff_until - time.monotonic())
            self._db_ok()
            if self._setup_outage is not None:
                logger.info("cluster-beat: the claim store answers after %.1f s; start-up continues",
                            time.monotonic() - self._setup_outage)
                self._setup_outage = None
            self._setup_store_users()
        if self._lease is not None and not self._cluster_checked:
            mono = time.monotonic()
            if mono < self._setup_retry_at:
                return self._setup_retry_at - mono
            if not self._lease.check_cluster():  # Redis did not answer (the lease logs an outage once)
                self._setup_retry_at = time.monotonic() + max(0.1, self._lease.retry_after())
                return self._setup_retry_at - time.monotonic()
            self._cluster_checked = True
        self._setup_pending = False
        self._setup_done()
        return 0.0

    def _setup_store_users(self) -> None:
        """What works on the open store: the guard, the send pipeline, the lease."""
        s = self.settings
        self._next_housekeeping = time.monotonic() + self._housekeeping_interval()
        self._guard = OverlapGuard(self.app, s, now=self._clock.now, ledger=self._store.run_states)
        self._guard.warn_about_configuration(self.entries.values())
        self._pipeline = SendPipeline(
            store=self._store, publisher=Publisher(self.app, s.node_id), guard=self._guard, settings=s,
            entries=self.entries, report=self._report, still_leader=self._still_leader, term=self._term,
            on_store_trouble=self._db_trouble,
        )
        self._pipeline.resolve = self.resolve_stored
        self._pipeline.paused = self._paused
        if s.redis is not None:
            from ..leader.lease import RedisLease

            # (the cluster check, refusing two claim stores behind one lease, follows in _continue_setup)
            self._lease = RedisLease(s.redis.client, name=self._lease_name(), node_id=s.node_id,
                                     ttl=s.lock_ttl, on_event=self._on_lease_event, cluster_id=self._store.cluster_id)
            from ..leader.notices import ChangeNotices

            self._notices = ChangeNotices(s.redis.client, s.cluster_name)

    def _setup_done(self) -> None:
        s = self.settings
        try:
            stored = str(self._store.stored_count())
        except StoreUnavailable:  # gone again already: the loop's back-off deals with it
            stored = "?"
        logger.info(
            "cluster-beat: node %s, %d entries, %s stored schedule(s), claims in %s, lease %s",
            s.node_id, len(self.entries), stored, mask_url(s.db_url),
            f"{mask_url(s.redis_url)} (ttl {s.lock_ttl:g}s)" if s.redis_url else "off (replicas race on claims)",
        )
        if self._ops is not None:
            self._ops.attach(lease=self._lease, also_from=(self._guard,))
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
            controls = self._store.controls(active_only=True)
            horizon = now + timedelta(seconds=HORIZON)
            stored = self._store.stored_due(horizon)
            # The previous leader did not write next_at back for schedules it held in memory: resume
            # those after their last recorded occurrence instead of catching up from a stale next_at.
            stored_last = self._store.last_occurrences([r.name for r in stored]) if stored else {}
            # Inherit the previous leader's in-flight runs, for the entries a guard watches.
            watched = [n for n in self._static if n in self.entries and
                       self._guard.policy(self.entries[n]) != OverlapPolicy.ALLOW]
            if watched:
                self._guard.load(self._store.schedule_states(watched))
        except StoreUnavailable as exc:
            logger.error("cluster-beat: cannot read the claim store (%s); retrying", exc)
            self._db_trouble()
            if self._lease is not None and self._lease.term is not None:
                self._lease.release()  # a node that cannot use the store must not keep others from it
            return
        self._db_ok()
        self._paused.clear()
        self._paused.update(c.name for c in controls if c.paused)
        self._run_requests = {c.name: (c.run_request, c.run_requested_at) for c in controls
                              if c.run_request and c.run_requested_at is not None}
        self._controls_version = version
        # A schedule resumed after its last occurrence restarts from the resume: the paused time
        # is never caught up, whichever leader starts it.
        stored_names = {r.name for r in stored}
        for c in controls:
            if c.resumed_at is None or c.paused:
                continue
            known = last if c.name in self._static else stored_last if c.name in stored_names else None
            if known is not None:
                known[c.name] = max(known.get(c.name, c.resumed_at), c.resumed_at)
        fires: Dict[str, datetime] = {}
        known: Dict[tuple, datetime] = {}  # thousands of entries share a few rules and instants
        for name, entry in self.entries.items():
            if not entry.enabled or name in self._paused:
                continue
            # Resume after the last recorded occurrence, or from when the schedule was first
            # seen: it does not catch up to before it existed.
            after = last.get(name, now)
            key = (entry.schedule.fires_key(), after)
            nxt = known.get(key)
            if nxt is None:
                nxt = known[key] = entry.schedule.next_fire(after)
            fires[name] = nxt
        self._queue = Timeline(fires)
        self._log_schedule(fires)
        self._stored_version = version
        self._stored_after = None
        self._states_owed = set()
        self._version_read_at = time.monotonic()
        self._changes_wanted = False
        self._horizon = horizon
        self._evict_retry = []
        self._hold(stored, stored_last)
        self._active = True
        self._next_prune = time.monotonic() + min(5.0, self.settings.prune_interval)
        self._pipeline.publisher.warm_up()
        self._housekeep()  # heartbeat as the scheduling node, and resend what a stopped node left

    def _config_error_later(self, exc: ConfigError) -> None:
        """A configuration error found by the set-up tick() finished: stop scheduling for good.

        Under Celery's beat the process ends with status 1 and one message: SystemExit from here
        ends beat's loop (which would exit 0), and close(), which the loop calls last, raises it
        again with the status. Built directly, the scheduler logs it and stays closed."""
        if self._host is None:
            logger.error("cluster-beat: configuration error, the scheduler stops: %s", exc)
            self._shutdown()
            return
        startup.report(exc, self._host, logger)
        if self._host != startup.THREAD:  # beat's thread must end quietly: the worker waits for it
            self._exit_status = startup.EXIT_STATUS
        self._shutdown()
        raise SystemExit(startup.EXIT_STATUS)

    def _log_schedule(self, fires: Dict[str, datetime]) -> None:
        """At debug level (``-l debug``), as plain beat's "Current schedule": one line per schedule."""
        if not logger.isEnabledFor(logging.DEBUG):
            return
        logger.debug("cluster-beat: node %s schedules %d beat_schedule entr%s (next fires in UTC):",
                     self.settings.node_id, len(self._static), "y" if len(self._static) == 1 else "ies")
        for name in sorted(self._static):
            entry = self.entries.get(name)
            if entry is None:
                continue
            at = fires.get(name)
            nxt = at.isoformat() if at is not None else ("paused" if name in self._paused else "disabled")
            logger.debug("cluster-beat: schedule %r: %s %r, next fire %s", name, entry.task, entry.schedule, nxt)

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
        self._in_tick = True
        try:
            wait = self._tick()
        except StaleTermError as exc:
            self._fenced_out(exc)
            wait = 0.001
        except Exception:  # a bug or an unexpected library error must not end beat (Celery's beat swallows too)
            logger.exception("cluster-beat: unexpected error in the scheduling loop; continuing in 1 s")
            wait = 1.0
        finally:
            self._in_tick = False
        if self._ops is not None:
            self._ops.health.ticked(wait)  # /healthz: the loop ticked, and means to sleep this long
            if self._pipeline is not None:
                self._ops.health.problem = self._pipeline.publisher.watch.problem  # ...and sends go out
        return wait

    def _tick(self) -> float:
        if self._setup_pending:
            return self._setup_step()
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
        if store_ok and self._queue and self._queue.peek()[0] <= self._clock.now() + self._claim_ahead:
            self._run_due()
        store_ok = time.monotonic() >= self._db_backoff_until  # again: the due pass may have failed
        retry_in = self._pipeline.next_retry_in()
        if store_ok and retry_in is not None and retry_in <= 0:
            self._guarded_store_call(self._pipeline.run_retries, "retrying sends")
        if store_ok and self._guard.has_buffered():
            self._guarded_store_call(self._run_buffered, "sending buffered runs")
        if store_ok and time.monotonic() >= self._next_prune:
            self._prune()
        self._prepare_messages()
        return self._sleep_time()

    def _prepare_messages(self) -> None:
        """Build, a slice a tick, the messages of entries due within :data:`PREPARE_AHEAD`, while
        nothing is due for :data:`PREPARE_MARGIN`: a burst then only stamps them."""
        mono = time.monotonic()
        if not self._active or self._pipeline is None or not self._queue:
            return
        if not self._prepare_todo and mono < self._next_prepare:
            return
        now = self._clock.now()
        if (self._queue.peek()[0] - now).total_seconds() < PREPARE_MARGIN:
            return
        if not self._prepare_todo:
            self._next_prepare = mono + PREPARE_EVERY
            soon = self._queue.due_before(now + timedelta(seconds=PREPARE_AHEAD))
            have = self._pipeline.publisher.templates.has
            self._prepare_todo = sorted((item for item in soon if not have(item[1])), reverse=True)
        deadline = mono + PREPARE_BUDGET
        while self._prepare_todo and time.monotonic() < deadline:
            at, name = self._prepare_todo.pop()
            entry = self.entries.get(name)
            if entry is not None and entry.enabled:
                self._pipeline.prepare(entry, at)

    def _preparing(self) -> bool:
        """Messages are being built ahead and the next fire leaves time for more."""
        return bool(self._prepare_todo) and bool(self._queue) and \
            (self._queue.peek()[0] - self._clock.now()).total_seconds() >= PREPARE_MARGIN

    def _sleep_time(self) -> float:
        mono = time.monotonic()
        wait = min(self.max_interval, self._next_housekeeping - mono)
        if self._queue:
            ahead = self._claim_ahead if self._active else timedelta(0)
            wait = min(wait, (self._queue.peek()[0] - ahead - self._clock.now()).total_seconds())
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
        if self._active and self._preparing():
            wait = min(wait, 0.005)  # build the next slice soon (each tick spends PREPARE_BUDGET at most)
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
        head = self._queue.peek()[0]
        if head > now:  # up to CLAIM_AHEAD early: claim this instant's occurrences now, send them at it
            self._run_ahead(head)
            return
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
        self._claim_due(due, leaving, lambda: self._send_due(missed, claim, now, catchup))

    def _send_due(self, missed: List[Occurrence], claim: List[Tuple[Entry, Occurrence]], now: datetime,
                  catchup: set) -> None:
        if missed:
            for occ in self._store.record(missed, status=ClaimStatus.MISSED, reason="catchup", term=self._term()):
                self._report(Outcome.MISSED, occ, "catchup")
        self._pipeline.claim_and_send(claim, now, catchup=frozenset(catchup))

    def _run_ahead(self, instant: datetime) -> None:
        """Claim the occurrences due at *instant* (a moment away) now and publish them at it.

        Only entries without an overlap guard are claimed ahead: a guard must judge the previous
        run at the instant itself. The claim is a normal one (fenced, confirmed before each
        publish), made by the only thread of the loop, which then waits for the instant: no
        other change can come in between. A row claimed ahead and handed over on a stop is not
        taken over before its instant (ClaimStore.take_over_stale).
        """
        due, leaving = self._pop_due(instant)
        policy = self._guard.policy
        ahead = [(e, Occurrence(e.name, at)) for e, at, _ in due if policy(e) == OverlapPolicy.ALLOW]
        guarded = [d for d in due if policy(d[0]) != OverlapPolicy.ALLOW]
        todo = list(due)  # what a store failure puts back into the queue

        def send() -> None:
            won = self._pipeline.claim(ahead, instant)
            # Claimed and not yet out: a stop during the wait (beat's SIGTERM handler raises
            # SystemExit; close() waits for it, see close()) is held until they are out at
            # their instant. Handed over unsent instead, a node started later would resend an
            # instant that passed while none ran, whatever its catch-up policy.
            stop: Optional[BaseException] = None
            while True:
                try:
                    faults.hit("claimed-ahead")
                    self._wait_for(instant)
                    break
                except (SystemExit, KeyboardInterrupt) as exc:
                    stop = stop or exc  # never publish before the instant: finish the wait
            if won is not None:
                self._pipeline.send(*won)
            if stop is not None:
                raise stop
            todo[:] = guarded  # the rest is the pipeline's now (sent, retried or left to the sweep)
            self._pipeline.claim_and_send([(e, Occurrence(e.name, at)) for e, at, _ in guarded], self._clock.now())

        self._claim_due(todo, leaving, send)

    def _wait_for(self, instant: datetime) -> None:
        """Sleep until *instant* by the node's clock, which instants are compared with; a clock
        stepped back meanwhile (more than the wait could take) does not hold the loop and its lease."""
        give_up = time.monotonic() + 2 * self._claim_ahead.total_seconds()
        while time.monotonic() < give_up:
            wait = (instant - self._clock.now()).total_seconds()
            if wait <= 0:
                return
            time.sleep(max(0.0, min(wait, give_up - time.monotonic())))

    def _claim_due(self, due, leaving, send: Callable[[], None]) -> bool:
        """Run *send* for the popped *due* entries; on a store failure put them back (the retry
        applies the catch-up policy) and return False."""
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
            self._db_trouble()
            for entry, at, _ in due:  # put them back: the retry applies the catch-up policy
                if self.entries.get(entry.name) is entry:
                    self._queue.set(entry.name, at)
            return False
        if not self._pipeline.unmarked:
            self._db_ok()
        if leaving:
            self._release_stored(leaving)
        return True

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
            if row.deleted or not row.enabled or row.next_at is None or row.name in self._paused:
                why = ("paused" if row.name in self._paused else "removed" if row.deleted else "disabled")
                self._drop(row.name, gone=why)
                continue
            try:
                entry = entry_from_row(row, app=self.app)
            except ConfigError as exc:  # written by another release, or by hand: never fire it half-read
                logger.error("cluster-beat: stored schedule %r cannot be scheduled: %s", row.name, exc)
                self._drop(row.name, gone="unreadable")
                continue
            if current is not None:
                self._guard_forget(row.name, "changed")  # a buffered run of the old definition
            if row.next_at >= self._horizon:
                self._drop(row.name)  # its next_at in SQL is exact: the window that covers it loads it
                continue
            # On the schedule's own instants (the zone it is read in here decides), from next_at on.
            at = entry.schedule.next_fire(row.next_at - TINY)
            if last and row.name in last:  # held (it is before the horizon in SQL), from where it really is
                at = max(at, entry.schedule.next_fire(last[row.name]))
            self.entries[row.name] = entry
            self._queue.set(row.name, at)
            held.append(row.name)
        if held:
            self._states_owed.update(held)
            self._load_states()

    def _load_states(self) -> None:
        """Give the overlap guard the previous runs of newly held stored schedules (kept owed when the
        store fails: retried on the next pass, the schedules stay held meanwhile)."""
        owed = sorted(self._states_owed)
        try:
            states = self._store.schedule_states(owed)
        except StoreUnavailable as exc:
            logger.warning("cluster-beat: cannot read the last runs of %d stored schedule(s) yet (%s)", len(owed), exc)
            self._db_trouble()
            return
        self._guard.load(states)
        self._states_owed.difference_update(owed)

    def _guard_forget(self, name: str, why: str) -> None:
        """A buffered (``buffer_one``) occurrence of a schedule that changed or went away is not sent:
        it is recorded skipped, with the reason."""
        pair = self._guard.forget(name)
        if pair is None:
            return
        try:
            self._store.record([pair[1]], status=ClaimStatus.SKIPPED, reason=f"buffered; the schedule was {why}",
                               term=self._term())
        except StoreUnavailable as exc:
            logger.warning("cluster-beat: cannot record the buffered occurrence of %s as skipped (%s)", name, exc)

    def _clash(self, row) -> None:
        logger.error("cluster-beat: the stored schedule %r has the name of a beat_schedule entry; it is not "
                     "scheduled (remove it, or rename the entry)", row.name)

    def _drop(self, name: str, gone: Optional[str] = None) -> None:
        """Stop holding stored schedule *name* in memory; *gone* (removed, disabled, paused ...) when
        it must not fire at all: its buffered occurrence and pending publish retries go too."""
        if gone is not None:
            self._guard_forget(name, gone)
            self._pipeline.forget(name, f"the schedule was {gone} before this occurrence was sent")
        if name in self._static:
            if gone is not None:
                self._queue.remove(name)
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
            while version > self._stored_version or self._stored_after is not None:
                rows = self._store.stored_changes(self._stored_version, after_name=self._stored_after,
                                                  limit=CHANGE_BATCH)
                if rows:
                    self._hold(rows)
                    self._stored_version, self._stored_after = rows[-1].version, rows[-1].name
                    logger.info("cluster-beat: applied %d stored schedule change(s) (version %d)",
                                len(rows), self._stored_version)
                if len(rows) < CHANGE_BATCH:
                    self._stored_after = None  # every row up to the counter's value is read
                    break
            if self._stored_after is None:
                self._stored_version = max(self._stored_version, version)
            while version > self._controls_version:
                changed = self._store.control_changes(self._controls_version, limit=CHANGE_BATCH)
                if changed:
                    self._apply_controls(changed)
                    self._controls_version = changed[-1].version
                if len(changed) < CHANGE_BATCH:
                    self._controls_version = max(self._controls_version, version)
                    break
        if self._states_owed:
            self._load_states()
        if self._run_requests:
            self._run_manual()
        now = self._clock.now()
        if (self._horizon - now).total_seconds() <= HORIZON / 2:
            horizon = now + timedelta(seconds=HORIZON)
            rows = self._store.stored_due(horizon, since=self._horizon)
            self._horizon = horizon
            self._hold(rows)
        if self._evict_retry and mono >= self._evict_retry_at:
            leaving, self._evict_retry = self._evict_retry, []
            # Only what is still that fire: a schedule that fired since was handed back anew.
            self._release_stored([(n, v, at) for n, v, at in leaving if self._queue.get(n) == at])

    def _apply_controls(self, rows) -> None:
        """Pause, resume and run-now, as operators asked (see :mod:`..store.controls`)."""
        now = self._clock.now()
        for row in rows:
            if row.paused and row.name not in self._paused:
                self._paused.add(row.name)
                self._drop(row.name, gone="paused")
                logger.info("cluster-beat: %s paused%s", row.name, f" by {row.paused_by}" if row.paused_by else "")
            elif not row.paused and row.name in self._paused:
                self._resume(row.name, now)  # raises on a store error: the control is read again
                self._paused.discard(row.name)
            if row.run_request and row.run_requested_at is not None:
                self._run_requests[row.name] = (row.run_request, row.run_requested_at)

    def _resume(self, name: str, now: datetime) -> None:
        """Schedule a resumed schedule from now on: the time it was paused is not caught up."""
        entry = self.entries.get(name) if name in self._static else None
        if entry is None and name not in self._static:
            rows = self._store.stored_get([name])
            if not rows or not rows[0].enabled:
                logger.info("cluster-beat: %s resumed (it is not an enabled schedule)", name)
                return
            try:
                entry = entry_from_row(rows[0], app=self.app)
            except ConfigError as exc:
                logger.error("cluster-beat: stored schedule %r cannot be scheduled: %s", name, exc)
                return
            nxt = entry.schedule.next_fire(now)
            # SQL's next_at is from before the pause: replace it, held or not, so no reader of it
            # (this leader's horizon, or the next leader) catches the paused time up.
            self._store.stored_set_next([(name, rows[0].version, nxt)])
            if self._horizon is not None and nxt >= self._horizon:
                logger.info("cluster-beat: %s resumed; next fire %s", name, nxt.isoformat())
                return
            self.entries[name] = entry
        if entry is None or not entry.enabled:
            return
        nxt = entry.schedule.next_fire(now)
        self._queue.set(name, nxt)
        logger.info("cluster-beat: %s resumed; next fire %s", name, nxt.isoformat())

    def _run_manual(self) -> None:
        """Send one occurrence per run-now request, at the request's instant, with reason ``manual``."""
        requests, self._run_requests = self._run_requests, {}
        try:
            known = {name: self.entries[name] for name in requests if name in self.entries}
            missing = [name for name in requests if name not in known]
            if missing:
                known.update(self.resolve_stored(missing))
            for name, (request, at) in sorted(requests.items()):
                entry = known.get(name)
                if entry is None:
                    logger.error("cluster-beat: run-now of %r: no such schedule; request dropped", name)
                else:
                    self._pipeline.claim_and_send([(entry, Occurrence(name, at))], self._clock.now(),
                                                  guarded=False, reason="manual")
                    if not self._active:  # lost the lease meanwhile: the next leader handles the request
                        return
                    logger.info("cluster-beat: %s: manual run for %s (request %s)", name, at.isoformat(), request)
                self._store.finish_run_request(name, request)
                del requests[name]
        finally:
            for name, req in requests.items():  # not handled (the store failed): try again next tick
                self._run_requests.setdefault(name, req)

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
        """Release the lease and the store; beat calls this twice on SIGTERM.

        After a configuration error found in tick() under Celery's beat, the call that ends
        beat's loop raises SystemExit with the exit status (once; see :mod:`.startup`)."""
        if self._in_tick:
            # Beat's SIGTERM/SIGINT handler calls close() and then raises SystemExit, wherever
            # tick() happens to be: inside a claim store transaction, this node's own lock
            # would block the close (SQLite: "database is locked"), and marks owed by the
            # interrupted step would be lost. So close() waits: the SystemExit unwinds tick()
            # (what it interrupted rolls back; what went out stays owed in the pipeline) and
            # beat's loop calls close() again on its way out, outside tick().
            logger.info("cluster-beat: stopping once the current step has unwound")
            return
        self._shutdown()

    def _shutdown(self) -> None:
        """close(), now: never from inside tick() (see close())."""
        if self._closed:
            if self._exit_status:
                status, self._exit_status = self._exit_status, 0
                raise SystemExit(status)
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
        if self._ops is not None:  # last: its shutdown must not delay the handover
            self._ops.stop()
