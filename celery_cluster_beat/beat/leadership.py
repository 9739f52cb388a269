"""Leadership: when this node schedules, and what taking over and giving up mean.

The states are few: standing by (with a Redis lease: waiting for it, blocked on its
release notice), scheduling, and stepping aside. What makes them delicate is what each
transition must do so that no occurrence is sent twice or lost between two leaders:

* taking over (:meth:`Leadership.activate`) hands over first what an earlier holding of
  this node left, refuses a lease term below the one recorded in the store (Redis lost
  its counter), and rebuilds the queue from the store, never from memory: each schedule
  resumes after its last recorded occurrence (or from when it was first seen), stored
  schedules are read afresh, operators' controls in force are applied, and the previous
  leader's in-flight runs are inherited by the overlap guard;
* giving up (:meth:`Leadership.deactivate`, on a lost lease, a newer term in the store,
  or a store this node cannot reach for ``lock_ttl``) hands every unsent claim over to
  the next leader, and records buffered runs, before the lease goes;
* a node that cannot use the store never takes the lease from one that can.

Without a lease every replica schedules and races on the claims.
"""
from __future__ import annotations

import logging
import time
from datetime import datetime
from typing import Dict, List, Optional

from .. import signals
from ..config import OverlapPolicy
from ..schedules.occurrence import Occurrence
from ..store import ClaimStatus, StaleTermError, StoreUnavailable
from .state import NodeState
from .stored import StoredFollower
from .timeline import Timeline
from .upkeep import Upkeep

logger = logging.getLogger("celery_cluster_beat")

#: Standbys try to take the lease at least this often (seconds).
STANDBY_POLL = 1.0


class Leadership:
    """Takes over, stands by and gives up, for the node in *node*."""

    def __init__(self, node: NodeState, stored: StoredFollower, upkeep: Upkeep) -> None:
        self.node = node
        self.stored = stored
        self.upkeep = upkeep

    def on_lease_event(self, event, info: dict) -> None:
        value = getattr(event, "value", event)
        signals.lease_changed.send(sender=self.node.sender, event=value, node=self.node.settings.node_id,
                                   term=info.get("term"), info=info)

    def activate(self) -> None:
        """Become the node that schedules: rebuild the heap from what the store says was claimed."""
        node = self.node
        store, lease, guard, entries, static = node.store, node.lease, node.guard, node.entries, node.static
        now = node.clock.now()
        try:
            node.pipeline.settle()  # hand over what an earlier holding left, before claiming anew
            if node.pipeline.owes_release:
                raise StoreUnavailable("claims of an earlier holding are not handed over yet")
            if lease is not None:
                recorded = store.current_term()
                if (lease.term or 0) < recorded:
                    # Redis lost its counter (restart without data): take a term above the recorded one.
                    lease.step_down(f"term {lease.term} is below the recorded term {recorded}",
                                    observed_term=recorded)
                    return
            for name in [n for n in entries if n not in static]:
                del entries[name]  # stored schedules are read afresh: they may have changed meanwhile
            last = store.last_occurrences(static)
            new = [name for name, entry in entries.items() if entry.enabled and name not in last]
            if new:  # first seen now: a later leader catches up from here, never from before
                registered = store.register(new)
                last.update((name, registered) for name in new)
            self._bind_origins()
            # The counter first: a change committed while the rows are read is applied again, harmlessly.
            version = store.stored_version()
            controls = store.controls(active_only=True)
            backfills = bool(store.pending_backfills(limit=1))
            horizon = self.stored.window_end(now)
            stored = store.stored_due(horizon)
            # The previous leader did not write next_at back for schedules it held in memory: resume
            # those after their last recorded occurrence instead of catching up from a stale next_at.
            stored_last = store.last_occurrences([r.name for r in stored]) if stored else {}
            # Inherit the previous leader's in-flight runs, for the entries a guard watches.
            watched = [n for n in static if n in entries and guard.policy(entries[n]) != OverlapPolicy.ALLOW]
            if watched:
                guard.load(store.schedule_states(watched))
        except StoreUnavailable as exc:
            logger.error("cluster-beat: cannot read the claim store (%s); retrying", exc)
            node.backoff.trouble()
            if lease is not None and lease.term is not None:
                lease.release()  # a node that cannot use the store must not keep others from it
            return
        node.backoff.ok()
        self.stored.controls.reset(controls, version, backfills=backfills)
        paused = self.stored.controls.paused
        # A schedule resumed after its last occurrence restarts from the resume: the paused time
        # is never caught up, whichever leader starts it.
        stored_names = {r.name for r in stored}
        for c in controls:
            if c.resumed_at is None or c.paused:
                continue
            known = last if c.name in static else stored_last if c.name in stored_names else None
            if known is not None:
                known[c.name] = max(known.get(c.name, c.resumed_at), c.resumed_at)
        fires: Dict[str, datetime] = {}
        ended: List[str] = []
        known: Dict[tuple, Optional[datetime]] = {}  # thousands of entries share a few rules and instants
        for name, entry in entries.items():
            if not entry.enabled or name in paused:
                continue
            # Resume after the last recorded occurrence, or from when the schedule was first
            # seen: it does not catch up to before it existed.
            after = last.get(name, now)
            key = (entry.schedule.fires_key(), after)
            try:
                nxt = known[key] if key in known else known.setdefault(key, entry.schedule.next_fire(after))
            except Exception as exc:  # its bounds cannot be computed (past year 9999): this entry only
                logger.error("cluster-beat: beat_schedule entry %r is not scheduled: its next occurrence cannot "
                             "be computed (%s: %s)", name, exc.__class__.__name__, exc)
                continue
            if nxt is None:  # a one-off that fired, a bound passed: nothing more to schedule
                ended.append(name)
                continue
            fires[name] = nxt
        if ended:
            logger.info("cluster-beat: %d beat_schedule entr%s without a further occurrence (ended): %s",
                        len(ended), "y" if len(ended) == 1 else "ies", ", ".join(sorted(ended)[:10]))
            self._record_late_one_offs(ended, last)
            self._warn_bounds_ended(ended)
        node.queue = Timeline(fires)
        self._log_schedule(fires)
        self.stored.reset(version, horizon)
        self.stored.hold(stored, stored_last)
        node.active = True
        self.upkeep.prune_soon()
        node.pipeline.publisher.warm_up()
        self.upkeep.housekeep()  # heartbeat as the scheduling node, and resend what a stopped node left

    def _record_late_one_offs(self, ended: List[str], last: Dict[str, datetime]) -> None:
        """A config ``at()`` first seen after its instant (deployed late) never fires: its occurrence
        is recorded ``missed``, saying why, never dropped silently. Like any entry it does not catch up
        to before it existed. The claim key makes it one row whatever the replicas or restarts (an
        occurrence that was sent keeps its row: nothing is recorded over it)."""
        node = self.node
        late: List[Occurrence] = []
        for name in ended:
            fire_at = getattr(node.entries[name].schedule, "fire_at", None)
            if not callable(fire_at):
                continue
            try:
                instant = fire_at()
            except Exception:  # its wall time cannot be resolved: nothing to record
                continue
            if instant < last.get(name, instant):  # first seen (or resumed) after it: never claimed
                late.append(Occurrence(name, instant))
        if not late:
            return
        try:
            recorded = node.store.record(late, status=ClaimStatus.MISSED, term=node.term(),
                                         reason="at() instant passed before the entry was first registered")
        except (StoreUnavailable, StaleTermError) as exc:
            logger.warning("cluster-beat: cannot record %d late one-off(s) as missed yet (%s)", len(late), exc)
            return
        for occ in recorded:
            logger.warning("cluster-beat: beat_schedule entry %r: its at() instant %s passed before any node "
                           "registered it; recorded missed (never sent)", occ.schedule, occ.at.isoformat())

    def _warn_bounds_ended(self, ended: List[str]) -> None:
        """A WARNING for each config entry its bounds have ended, naming the field and when: adding
        ``max_runs`` to an entry that has run for long ends it at once (it counts from its first
        registration), which must not pass as a quiet INFO line."""
        for name in sorted(ended)[:100]:
            rule = self.node.entries[name].schedule
            try:
                last = rule.last_instant() if hasattr(rule, "last_instant") else None
            except Exception:
                continue
            if last is None:
                continue
            end_at, runs = getattr(rule, "end_at", None), getattr(rule, "max_runs", None)
            if runs is not None and (end_at is None or last < end_at):
                why = (f"max_runs={runs}, counted from {rule.start.isoformat()} "
                       f"({'start_at' if rule.start_at is not None else 'its first registration'})")
            elif end_at is not None:
                why = "end_at"
            else:
                continue
            logger.warning("cluster-beat: beat_schedule entry %r has ended by its bounds (%s): its last instant "
                           "was %s; it does not fire again", name, why, last.isoformat())

    def _bind_origins(self) -> None:
        """Give each config entry whose ``max_runs`` counts from its registration (no ``start_at``)
        that time: the first time any node saw it, by the database's clock, the same on every
        replica and after any restart (the row is never pruned). Read back from the store, never
        taken from this node's own registration: replicas racing without a lease register at
        different times, and only the first is kept. StoreUnavailable propagates."""
        node = self.node
        # (a disabled entry never fires: it needs none)
        waiting = [n for n in node.static if n in node.entries and node.entries[n].enabled
                   and getattr(node.entries[n].schedule, "needs_origin", False)]
        if not waiting:
            return
        origins = {s.name: s.registered_at for s in node.store.schedule_states(waiting)}
        for name in waiting:
            origin = origins.get(name)
            if origin is None:  # registered by a release before registration times were kept: from now on
                origin = node.clock.now()
            entry = node.entries[name]
            entry.schedule = entry.schedule.with_origin(origin)

    def _log_schedule(self, fires: Dict[str, datetime]) -> None:
        """At debug level (``-l debug``), as plain beat's "Current schedule": one line per schedule."""
        if not logger.isEnabledFor(logging.DEBUG):
            return
        node = self.node
        static, paused = node.static, self.stored.controls.paused
        logger.debug("cluster-beat: node %s schedules %d beat_schedule entr%s (next fires in UTC):",
                     node.settings.node_id, len(static), "y" if len(static) == 1 else "ies")
        for name in sorted(static):
            entry = node.entries.get(name)
            if entry is None:
                continue
            at = fires.get(name)
            nxt = at.isoformat() if at is not None else ("paused" if name in paused else "disabled")
            logger.debug("cluster-beat: schedule %r: %s %r, next fire %s", name, entry.task, entry.schedule, nxt)

    def deactivate(self, why: str) -> None:
        node = self.node
        if node.active:
            logger.warning("cluster-beat: node %s stops scheduling: %s", node.settings.node_id, why)
        node.active = False
        buffered = node.guard.drop_buffered() if node.guard is not None else []
        if node.pipeline is not None:
            node.pipeline.abandon(buffered)

    def standby(self, max_interval: float) -> float:
        """One standby step (a lease is set and this node does not hold it): how long to sleep."""
        lease = self.node.lease
        mono = time.monotonic()
        if mono < self.node.backoff.until:
            # This node cannot use the store: it must not take the lease from one that can.
            return min(self.node.backoff.until - mono, max_interval)
        if lease.try_acquire():
            self.activate()
            return 0.001
        if lease.wait_for_release(min(STANDBY_POLL, max(0.05, lease.retry_after()))) and lease.try_acquire():
            self.activate()
        return 0.001

    def still_leader(self) -> bool:
        """True while this node may send: the lease is held (renewed when due), or there is none."""
        lease = self.node.lease
        if lease is None:
            return True
        if lease.maintain():
            return True
        self.deactivate("the lease was lost or could not be renewed in time")
        return False

    def check(self) -> None:
        """On each tick while scheduling with a lease: keep it, or step aside when the store has been
        unreachable for a whole lease (another node may reach it)."""
        self.still_leader()
        down = self.node.backoff.down_for()
        if self.node.active and down >= self.node.settings.lock_ttl:
            self.step_aside(f"the claim database has been unreachable for {self.node.backoff.down_for():.1f} s")

    def step_aside(self, why: str) -> None:
        """Give the lease up for a node that can do the work (this one cannot reach the store)."""
        self.deactivate(why)
        self.node.lease.release()

    def fenced_out(self, exc: StaleTermError) -> None:
        self.deactivate("a newer leader holds the claim store")  # hand claims over before the lease goes
        self.node.lease.step_down(f"a newer leader term {exc.seen_term} is recorded", observed_term=exc.seen_term)
