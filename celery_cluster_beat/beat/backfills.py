"""Backfill requests as the scheduling node serves them: claim, send, record the result.

``celery ... cluster-beat backfill`` records a request (:mod:`..store.backfill`) and bumps the
change counter; the leader reads pending requests when it takes the lease and whenever the
counter moved (:meth:`~.stored.StoredFollower.follow`), so a request waits, recorded, while no
leader runs, and the next leader serves one a leader died in the middle of. Only the claimant
publishes: the leader claims the range's occurrences in one fenced transaction and sends what it
won through the one send pipeline (reason ``backfill``, header ``cluster_beat_backfill``, outcome
``backfilled``, no jitter), so retries, the stale-claim sweep, the ``sent`` marks and the
worker-side ledger treat them like any occurrence.
"""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import replace
from typing import Callable, Dict, List

from ..config import Entry
from ..config.values import printable
from ..schedules.occurrence import Occurrence
from ..store import StaleTermError, StoreUnavailable
from ..store.backfill import BackfillRequest, fires_between
from ..store.schema import BackfillState
from .state import NodeState

logger = logging.getLogger("celery_cluster_beat")

#: Requests read per look: a backlog is served over several ticks.
READ_AT_ONCE = 5


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

    def run(self) -> None:
        """Serve the pending requests (raises StoreUnavailable: they are looked for again)."""
        node = self.node
        self.wanted = False
        try:
            requests = node.store.pending_backfills(limit=READ_AT_ONCE)
            for request in requests:
                if not node.active:
                    return
                try:
                    self._serve(request)
                except (StoreUnavailable, StaleTermError):
                    raise
                except Exception as exc:  # a request that cannot be served must not come back every pass
                    logger.exception("cluster-beat: backfill %s of %s failed", request.id,
                                     printable(request.schedule))
                    node.store.finish_backfill(request.id, BackfillState.REFUSED,
                                               error=f"{type(exc).__name__}: {exc}")
        except StoreUnavailable:
            self.wanted = True
            raise
        if len(requests) == READ_AT_ONCE:
            self.wanted = True  # more may wait: the next pass reads them

    def _serve(self, request: BackfillRequest) -> None:
        node, name = self.node, request.schedule
        entry = node.entries.get(name)
        held = entry is not None
        if entry is None:
            entry = self._resolve([name]).get(name)
        try:
            if entry is None or not entry.enabled:
                why = "no such schedule" if entry is None else "the schedule is disabled"
                node.store.finish_backfill(request.id, BackfillState.REFUSED, error=why)
                logger.error("cluster-beat: backfill %s of %s refused: %s", request.id, printable(name), why)
                return
            instants = fires_between(entry.schedule, request.from_at, request.to_at, request.max_count)
            if len(instants) > request.max_count:
                why = f"the range holds more than {request.max_count} occurrences (the request's limit)"
                node.store.finish_backfill(request.id, BackfillState.REFUSED, error=why)
                logger.error("cluster-beat: backfill %s of %s refused: %s", request.id, printable(name), why)
                return
            # A copy without jitter: a backfill is sent at once. It shares the entry's task, args and
            # options; what a send counts on it (last run, run count) stays on the copy.
            result = node.pipeline.backfill(replace(entry, jitter=0.0), [Occurrence(name, at) for at in instants])
            if result is None:  # no longer the leader: the next one serves the request
                return
            left = Counter(str(reason.value) for reason in result.left.values())
            node.store.finish_backfill(request.id, BackfillState.DONE, sent=len(result.won), not_sent=dict(left))
            logger.info("cluster-beat: backfill %s of %s from %s to %s: %d sent, %d left as they were%s",
                        request.id, printable(name), request.from_at.isoformat(), request.to_at.isoformat(),
                        len(result.won), len(result.left),
                        f" ({', '.join(f'{n} {r}' for r, n in sorted(left.items()))})" if left else "")
        finally:
            if not held:
                self._forget([name])
