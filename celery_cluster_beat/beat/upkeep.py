"""Upkeep on a clock of its own: the heartbeat, the stale-claim sweep, failed runs and pruning.

None of this follows the schedules' instants, and all of it is I/O, so it runs on
timers apart from the due pass: the housekeeping every ``claim_grace / 3`` (heartbeat
with a clock sample, settling what the pipeline owes the store, and on the scheduling
node the sweep that resends what a stopped node left claimed, and the look for failed runs of
``pause_after_failures``, :mod:`.failures`), and pruning every
``prune_interval``, bounded per pass so that a backlog never holds up a tick for long.
Kept apart so that a tick with nothing due costs a timer check here and no I/O.
"""
from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Optional

from ..store import StoreUnavailable
from .state import NodeState

if TYPE_CHECKING:  # pragma: no cover
    from .failures import FailureWatch

logger = logging.getLogger("celery_cluster_beat")

#: Seconds one pruning pass may take; a backlog is pruned over several passes a second apart.
PRUNE_BUDGET = 2.0


class Upkeep:
    """The housekeeping and pruning timers, and what runs when each is due."""

    def __init__(self, node: NodeState) -> None:
        self.node = node
        #: Monotonic time of the next housekeeping pass (set once the store is open).
        self.next_housekeeping = 0.0
        #: Monotonic time of the next pruning pass (set when this node starts scheduling).
        self.next_prune = 0.0
        #: ``pause_after_failures`` (the controls' :class:`~.failures.FailureWatch`), or None.
        self.failures: Optional["FailureWatch"] = None

    def interval(self) -> float:
        return self.node.settings.claim_grace / 3

    def housekeeping_due(self, mono: float) -> bool:
        return mono >= self.next_housekeeping and mono >= self.node.backoff.until

    def housekeep(self) -> None:
        """Every ``claim_grace / 3``: heartbeat (and clock sample), settle, sweep stale claims, look
        for failed runs (never more often than :data:`~.failures.CHECK_EVERY`)."""
        node = self.node
        self.next_housekeeping = time.monotonic() + self.interval()
        try:
            node.clock.sample(lambda: node.store.heartbeat(scheduling=node.active, clock_offset=node.clock.offset))
            node.backoff.ok()
            node.pipeline.settle()
            if node.active:
                node.pipeline.sweep_stale()
                if self.failures is not None and self.failures.due(time.monotonic()):
                    self.failures.check()
        except StoreUnavailable as exc:
            logger.error("cluster-beat: claim store unavailable (%s); backing off", exc)
            node.backoff.trouble()

    def prune_soon(self) -> None:
        """This node starts scheduling: prune within a few seconds, then every ``prune_interval``."""
        self.next_prune = time.monotonic() + min(5.0, self.node.settings.prune_interval)

    def prune_due(self) -> bool:
        return time.monotonic() >= self.next_prune

    def prune(self) -> None:
        """Delete finished rows past their retention, in bounded batches for at most
        :data:`PRUNE_BUDGET` a pass; a backlog is worked off a pass a second."""
        node = self.node
        s = node.settings
        self.next_prune = time.monotonic() + s.prune_interval
        if not node.active:
            return
        try:
            n, done = node.store.prune_pass(node.clock.now() - timedelta(seconds=s.claim_retention),
                                            time_budget=PRUNE_BUDGET)
            if done:
                node.store.stored_prune_removed(node.clock.now() - timedelta(seconds=s.claim_retention))
        except StoreUnavailable as exc:
            logger.error("cluster-beat: pruning old claims failed: %s", exc)
            node.backoff.trouble()
            return
        if not done:
            self.next_prune = time.monotonic() + 1.0
        if n:
            logger.info("cluster-beat: pruned %d claim row(s) older than %gs%s", n, s.claim_retention,
                        "" if done else "; more to prune")

    def prune_now(self, older_than: float) -> int:
        """Delete claim rows whose occurrence is more than *older_than* seconds old (manual prune)."""
        return self.node.store.prune(self.node.clock.now() - timedelta(seconds=older_than), batch=1000)
