"""Bringing a node up: the set-up that needs the claim database (and Redis), retried until it answers.

An outage at start-up is not an error: exiting would make a crash loop under
systemd or Kubernetes, and the services usually come back. So the set-up that needs
them is a step the loop repeats with back-off (logged once), while beat stays up and
its ``/healthz`` answers. What no retry can fix (a name clash between a
``beat_schedule`` entry and a stored schedule, a newer schema, another cluster's
lease, a missing driver) raises :class:`~celery_cluster_beat.errors.ConfigError` at
once. Once the store answers, this builds what works on it (the overlap guard, the
send pipeline, the lease and its change notices) and wires them to the rooms.
"""
from __future__ import annotations

import logging
import time
from typing import Optional

from ..errors import ConfigError
from ..store import ClaimStore, StoreUnavailable
from .failures import warn_unobservable
from .guard import OverlapGuard
from .leadership import Leadership
from .pipeline import SendPipeline
from .publisher import Publisher
from .state import NodeState
from .stored import StoredFollower
from .upkeep import Upkeep

logger = logging.getLogger("celery_cluster_beat")


class Bringup:
    """Where the set-up stands: still waiting for the store or Redis, or done."""

    def __init__(self, node: NodeState, leadership: Leadership, stored: StoredFollower, upkeep: Upkeep) -> None:
        self.node = node
        self.leadership = leadership
        self.stored = stored
        self.upkeep = upkeep
        #: Set-up waits for the claim database or Redis (unreachable at start-up): tick() goes on with it.
        self.pending = False
        self._retry_at = 0.0
        self._outage: Optional[float] = None  # when the start-up outage began (logged once)
        self._cluster_checked = False

    def lock_timeout(self) -> float:
        """How long a statement may wait for a row lock: well inside the lease, so a leader paused
        inside a claim transaction cannot hold up its successor past its own lease."""
        return max(0.25, min(2.0, self.node.settings.lock_ttl / 4))

    def create_store(self) -> ClaimStore:
        """The claim store, not opened yet (opening it needs the database: :meth:`step`)."""
        s = self.node.settings
        self.node.store = ClaimStore(s.db_url, node_id=s.node_id, lock_timeout=self.lock_timeout(),
                                      db_timeout=s.db_timeout)
        return self.node.store

    def _waits(self, what: str, exc: BaseException) -> None:
        if self._outage is None:
            self._outage = time.monotonic()
            logger.warning("cluster-beat: %s is unreachable at start-up (%s); retrying with back-off, beat stays "
                           "up and starts scheduling once it answers", what, exc)
        else:
            logger.debug("cluster-beat: %s still unreachable (%s)", what, exc)

    def step(self) -> float:
        """The set-up that needs the claim database (and Redis, for the cluster check).

        Done at once when both answer; otherwise tick() calls this again with back-off until
        it succeeds (see the module docstring). Returns how long to wait before the next try
        (0 when set up, and :attr:`pending` is then False); raises ConfigError for what no
        retry can fix.
        """
        node = self.node
        backoff = node.backoff
        if node.pipeline is None:
            mono = time.monotonic()
            if mono < backoff.until:
                return backoff.until - mono
            store = node.store
            try:
                store.open()
                store.check_names(node.entries)  # what the database cannot tell apart (a PAD SPACE collation)
                clash = store.stored_clashes(node.static)
                if clash:
                    raise ConfigError([f"beat_schedule entry {r.name!r} and the stored schedule {r.name!r}"
                                       f"{' of ' + repr(r.owner) if r.owner else ''} share a name: rename the entry "
                                       "or remove the stored schedule (StoredSchedules(app).remove(name))"
                                       for r in clash])
                node.clock.measure(store.db_now)
                store.heartbeat(scheduling=False, clock_offset=node.clock.offset, register=True)
            except StoreUnavailable as exc:
                self._waits("the claim store", exc)
                backoff.trouble()
                return max(0.0, backoff.until - time.monotonic())
            backoff.ok()
            if self._outage is not None:
                logger.info("cluster-beat: the claim store answers after %.1f s; start-up continues",
                            time.monotonic() - self._outage)
                self._outage = None
            self._store_users()
        if node.lease is not None and not self._cluster_checked:
            mono = time.monotonic()
            if mono < self._retry_at:
                return self._retry_at - mono
            if not node.lease.check_cluster():  # Redis did not answer (the lease logs an outage once)
                self._retry_at = time.monotonic() + max(0.1, node.lease.retry_after())
                return self._retry_at - time.monotonic()
            self._cluster_checked = True
        self.pending = False
        return 0.0

    def _store_users(self) -> None:
        """What works on the open store: the guard, the send pipeline, the lease."""
        node = self.node
        s = node.settings
        self.upkeep.next_housekeeping = time.monotonic() + self.upkeep.interval()
        node.guard = OverlapGuard(node.app, s, now=node.clock.now, ledger=node.store.run_states)
        node.guard.warn_about_configuration(node.entries.values())
        warn_unobservable(node.app, node.guard, node.entries.values())  # pause_after_failures that cannot work
        node.pipeline = SendPipeline(
            store=node.store, publisher=Publisher(node.app, s.node_id), guard=node.guard, settings=s,
            entries=node.entries, report=node.report, still_leader=self.leadership.still_leader, term=node.term,
            on_store_trouble=node.backoff.trouble,
        )
        node.pipeline.resolve = self.stored.resolve
        node.pipeline.paused = self.stored.controls.paused
        node.pipeline.on_sent = self.stored.controls.failures.sent
        if s.redis is not None:
            from ..leader.lease import RedisLease

            # (the cluster check, refusing two claim stores behind one lease, follows in step())
            node.lease = RedisLease(s.redis.client, name=s.cluster_name, node_id=s.node_id, ttl=s.lock_ttl,
                                    on_event=self.leadership.on_lease_event, cluster_id=node.store.cluster_id,
                                    redis_url=s.redis_url)
            from ..leader.notices import ChangeNotices

            node.notices = ChangeNotices(s.redis.client, s.cluster_name)
