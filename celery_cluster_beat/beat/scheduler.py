"""The Celery glue: ``celery beat -S celery_cluster_beat.Scheduler``.

Beat calls :meth:`Scheduler.tick` in a loop and sleeps for what it returns.
Each tick here costs a heap peek when nothing is due: no walk over the
schedule, and no I/O but the housekeeping every ``claim_grace / 3`` (heartbeat,
clock sample, stale-claim sweep). When occurrences fall due the
:class:`~.pipeline.SendPipeline` claims them in the SQL store in one statement
(only rows this node inserted are sent) and publishes them in chunks, each
marked sent in one statement. With a Redis lease only the leader does this;
standbys block on the lease's release notice.

This module is only the wiring: what Celery calls (the constructor's validation,
``setup_schedule``, ``tick``, ``close``), the order of one tick, and how long to
sleep. The work is in rooms that share one :class:`~.state.NodeState` and each own
their state: bringing the node up (:mod:`.bringup`), leadership
(:mod:`.leadership`), the due pass with claim-ahead and catch-up (:mod:`.duepass`),
stored schedules and the horizon (:mod:`.stored`), operators' controls
(:mod:`.controls`), housekeeping and pruning (:mod:`.upkeep`) and building messages
ahead (:mod:`.prepare`). Their tunables are re-exported here, where they always were.
"""
from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Dict, List, Optional

from celery import beat

from ..config import Entry, Settings, build_entries, default_entries, load_settings
from ..config.celeryconf import has_result_backend
from ..config.options import trusted_option_warnings
from ..config.settings import unknown_settings
from ..errors import ConfigError
from ..leader.urls import mask_url
from ..store import StaleTermError, StoreUnavailable
from . import startup
from .bringup import Bringup
from .clock import NodeClock
from .duepass import CLAIM_AHEAD, DuePass
from .leadership import STANDBY_POLL, Leadership
from .outcomes import Reporter
from .prepare import PREPARE_AHEAD, PREPARE_BUDGET, PREPARE_EVERY, PREPARE_MARGIN, MessagePrep
from .state import NodeState
from .stored import (CHANGE_BATCH, CHANGE_READ_FALLBACK, CHANGE_READ_MIN, CHANGE_READ_NOTICED, HORIZON,
                     NOTICE_POLL, StoredFollower)
from .upkeep import PRUNE_BUDGET, Upkeep

__all__ = ["Scheduler", "STANDBY_POLL", "PRUNE_BUDGET", "HORIZON", "CHANGE_READ_MIN", "CHANGE_READ_NOTICED",
           "CHANGE_READ_FALLBACK", "NOTICE_POLL", "CLAIM_AHEAD", "PREPARE_AHEAD", "PREPARE_BUDGET",
           "PREPARE_MARGIN", "PREPARE_EVERY", "CHANGE_BATCH"]

logger = logging.getLogger("celery_cluster_beat")


def counted(n: object, one: str, many: Optional[str] = None) -> str:
    """``1 entry``, ``2 entries``, ``0 stored schedules``: *n* (a number, or ``?`` when unknown)
    with the noun that agrees with it."""
    return f"{n} {one if n == 1 else many or one + 's'}"


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
        for line in trusted_option_warnings(self.entries.values()):  # trusted, but said once (config/options.py)
            logger.warning("cluster-beat: %s", line)
        ignored = unknown_settings(app.conf)  # a misspelt setting would leave its default in force unsaid
        if ignored:
            logger.warning("cluster-beat: %s", "; ".join(ignored))
        self._clock = NodeClock(self.settings.node_id)
        self._report = Reporter(self)
        #: What every room shares (the queue, the entries, the store, the lease, the back-off).
        self._node = node = NodeState(app, self.settings, self.entries, self._clock, self._report, sender=self)
        self._upkeep = Upkeep(node)
        self._stored = StoredFollower(node)  # it holds the operators' controls (read with the same counter)
        self._upkeep.failures = self._stored.controls.failures  # pause_after_failures, judged in housekeeping
        self._leadership = Leadership(node, self._stored, self._upkeep)
        self._due = DuePass(node, self._stored)
        self._stored.controls.backfills.claim_ahead = self._due.claim_ahead
        self._prep = MessagePrep(node)
        self._bringup = Bringup(node, self._leadership, self._stored, self._upkeep)
        self._closed = False
        #: A configuration error found in tick(): close() raises SystemExit with this status (see .startup).
        self._exit_status = 0
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

    # -- what the rooms hold, under the names tests and tools have always read ----
    @property
    def _queue(self):
        return self._node.queue

    @property
    def _active(self) -> bool:
        return self._node.active

    @property
    def _store(self):
        return self._node.store

    @property
    def _lease(self):
        return self._node.lease

    @property
    def _guard(self):
        return self._node.guard

    @property
    def _pipeline(self):
        return self._node.pipeline

    @property
    def _stored_version(self) -> int:
        return self._stored.version

    @property
    def _next_prune(self) -> float:
        return self._upkeep.next_prune

    @_next_prune.setter
    def _next_prune(self, value: float) -> None:
        self._upkeep.next_prune = value

    def _lease_name(self) -> str:
        return self.settings.cluster_name

    # -- set-up ----------------------------------------------------------------
    def setup_schedule(self) -> None:
        s = self.settings
        self.entries.update(build_entries(default_entries(self.app, self.entries), app=self.app))
        store = self._bringup.create_store()
        self._node.static = frozenset(self.entries)
        if s.http_port is not None and self._ops is None:  # first: /healthz answers while the database is awaited
            from ..ops.http import start_beat_server  # prometheus-client is imported only when asked for

            self._ops = start_beat_server(self.app, s, sender=self, store=store, now=self._clock.now)
        self._bringup.pending = True
        self._continue_setup()

    def _continue_setup(self) -> float:
        """One step of the set-up (see :mod:`.bringup`); once it is done, what follows it."""
        wait = self._bringup.step()
        if not self._bringup.pending:
            self._setup_done()
        return wait

    def _setup_step(self) -> float:
        """tick() while the set-up waits for the claim database or Redis: how long to sleep."""
        try:
            wait = self._continue_setup()
        except ConfigError as exc:
            self._config_error_later(exc)
        else:
            if not self._bringup.pending:
                return 0.001  # set up: the next tick schedules (or stands by)
            return max(0.05, min(self.max_interval, wait))
        return self.max_interval

    def _setup_done(self) -> None:
        s, node = self.settings, self._node
        try:
            stored: object = node.store.stored_count()
        except StoreUnavailable:  # gone again already: the loop's back-off deals with it
            stored = "?"
        logger.info(
            "cluster-beat: node %s, %s, %s, claims in %s, lease %s",
            s.node_id, counted(len(self.entries), "entry", "entries"), counted(stored, "stored schedule"),
            mask_url(s.db_url),
            f"{mask_url(s.redis_url)} (ttl {s.lock_ttl:g}s)" if s.redis_url else "off (replicas race on claims)",
        )
        if self._ops is not None:
            self._ops.attach(lease=node.lease, also_from=(node.guard,), config=node.static)
            node.schedule_gone = self._ops.metrics.schedule_gone
        if node.lease is None:
            # Replicas race for every fire: the guard must see the runs the other replicas sent.
            node.guard.refresh = node.store.schedule_states
            self._leadership.activate()

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

    def resolve_stored(self, names: List[str]) -> Dict[str, Entry]:
        """Entries of stored schedules not held in memory (a stale claim of one is resent)."""
        return self._stored.resolve(names)

    def prune(self, older_than: float) -> int:
        """Delete claim rows whose occurrence is more than *older_than* seconds old (manual prune)."""
        return self._upkeep.prune_now(older_than)

    # -- the loop ----------------------------------------------------------------
    def tick(self, *args, **kwargs) -> float:
        """One pass of beat's loop; returns how long to sleep (always > 0). Never raises."""
        if self._closed:
            return self.max_interval
        self._in_tick = True
        try:
            wait = self._tick()
        except StaleTermError as exc:
            self._leadership.fenced_out(exc)
            wait = 0.001
        except Exception:  # a bug or an unexpected library error must not end beat (Celery's beat swallows too)
            logger.exception("cluster-beat: unexpected error in the scheduling loop; continuing in 1 s")
            wait = 1.0
        finally:
            self._in_tick = False
        if self._ops is not None:
            self._ops.health.ticked(wait)  # /healthz: the loop ticked, and means to sleep this long
            if self._node.pipeline is not None:
                self._ops.health.problem = self._node.pipeline.publisher.watch.problem  # ...and sends go out
        return wait

    def _tick(self) -> float:
        if self._bringup.pending:
            return self._setup_step()
        node, backoff = self._node, self._node.backoff
        if self._upkeep.housekeeping_due(time.monotonic()):
            self._upkeep.housekeep()
        if node.lease is not None:
            if node.active:
                self._leadership.check()  # renew the lease; step aside after a long store outage
            if not node.active:
                return self._leadership.standby(self.max_interval)
        elif not node.active:
            if backoff.over():
                self._leadership.activate()
            return self._sleep_time()
        if backoff.over():
            backoff.guarded(self._stored.follow, "reading stored schedule changes")
        if backoff.over() and self._due.due():
            self._due.run()
            # The pass may have waited up to CLAIM_AHEAD for its instant: look for changes again
            # now (a socket read unless a notice came; SQL stays rate-limited by the follower), so
            # an every-second schedule does not leave notices unread for a second at a time.
            if backoff.over():
                backoff.guarded(self._stored.follow, "reading stored schedule changes")
        store_ok = backoff.over()  # again: the due pass may have failed
        retry_in = node.pipeline.next_retry_in()
        if store_ok and retry_in is not None and retry_in <= 0:
            backoff.guarded(node.pipeline.run_retries, "retrying sends")
        if store_ok and node.guard.has_buffered():
            backoff.guarded(self._due.run_buffered, "sending buffered runs")
        if self._stored.controls.backfills.ready() and backoff.over():  # after what is due, never before
            backoff.guarded(self._stored.controls.backfills.serve, "serving backfill requests")
        if store_ok and self._upkeep.prune_due():
            self._upkeep.prune()
        self._prep.run()
        return self._sleep_time()

    def _sleep_time(self) -> float:
        node = self._node
        mono = time.monotonic()
        wait = min(self.max_interval, self._upkeep.next_housekeeping - mono)
        if node.queue:
            ahead = self._due.claim_ahead if node.active else timedelta(0)
            wait = min(wait, (node.queue.peek()[0] - ahead - self._clock.now()).total_seconds())
        if node.active:
            wait = min(wait, self._stored.next_check_in(mono))
        retry_in = node.pipeline.next_retry_in() if node.pipeline is not None else None
        if retry_in is not None:
            wait = min(wait, retry_in)
        check = node.guard.next_check_in() if node.guard is not None else None
        if check is not None:
            wait = min(wait, check)
        if node.backoff.until > mono:
            # Nothing that needs the store may undercut the back-off (buffered runs, due fires).
            wait = max(wait, node.backoff.until - mono)
        if node.active and node.lease is not None:
            wait = min(wait, node.lease.next_renew_in())
        if node.active and self._stored.controls.backfills.ready():
            wait = min(wait, 0.005)  # the next slice soon (each pass spends a bounded time on it)
        if node.active and self._prep.preparing():
            wait = min(wait, 0.005)  # build the next slice soon (each tick spends PREPARE_BUDGET at most)
        return max(wait, 0.001)  # never 0: beat would spin

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
        node = self._node
        node.active = False
        if node.pipeline is not None:
            # Record what went out, hand the rest over before the lease goes. A buffered (buffer_one)
            # occurrence lives only in memory: recorded skipped here, as when the lease is lost, or it
            # would end without a claim row, and the next leader, finding the later instants recorded,
            # would never see it (a bounded schedule's row would even be ended after it).
            buffered = node.guard.drop_buffered() if node.guard is not None else []
            node.pipeline.abandon(buffered)
        if node.lease is not None:
            try:
                node.lease.close()
            except Exception as exc:  # never let shutdown fail
                logger.warning("cluster-beat: releasing the lease failed: %r", exc)
        if node.notices is not None:
            node.notices.close()
        if node.store is not None:
            try:  # operators read "stopped" (a deploy), not "gone" (a crash); claims are judged as ever
                node.store.node_stopped()
            except Exception as exc:  # never let shutdown fail
                logger.warning("cluster-beat: cannot record this node's clean stop: %r", exc)
            node.store.close()
        if self._ops is not None:  # last: its shutdown must not delay the handover
            self._ops.stop()
