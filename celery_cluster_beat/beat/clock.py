"""The loop's "now": the local clock corrected by its measured offset from the database's clock.

Replicas on hosts whose clocks disagree would otherwise fire at different
instants (a leader 30 s fast fires 30 s early). Every time compared across
nodes is the database's (claims, heartbeats, takeovers); the loop's own
"is it due yet" uses the local clock shifted by the offset measured against
the database, so every replica fires on one clock.
"""
from __future__ import annotations

import logging
import time
from datetime import datetime, timedelta
from typing import Callable, List, Optional, Tuple

from ..schedules.instants import UTC, utcnow

logger = logging.getLogger("celery_cluster_beat")

#: An offset larger than this (seconds) is worth a warning: the host's clock is off.
WARN_OFFSET = 1.0
#: Offsets from the last few samples; the one with the shortest round trip is believed.
KEEP_SAMPLES = 5


class NodeClock:
    """Local time corrected by ``offset`` seconds (database clock minus local clock)."""

    def __init__(self, node_id: str, wall: Callable[[], float] = time.time) -> None:
        self.node_id = node_id
        self.offset = 0.0
        self._wall = wall
        self._samples: List[Tuple[float, float]] = []  # (round trip, offset)
        self._warned: Optional[float] = None

    def now(self) -> datetime:
        """The database's idea of now, without asking it."""
        if not self.offset:
            return utcnow()
        return utcnow() + timedelta(seconds=self.offset)

    def sample(self, read_db_now: Callable[[], datetime]) -> datetime:
        """Read the database's time once and learn the offset from it (round trip halved)."""
        t0 = self._wall()
        db = read_db_now()
        t1 = self._wall()
        offset = db.astimezone(UTC).timestamp() - (t0 + t1) / 2
        self._samples = (self._samples + [(t1 - t0, offset)])[-KEEP_SAMPLES:]
        self.offset = min(self._samples)[1]
        self._check()
        return db

    def measure(self, read_db_now: Callable[[], datetime], samples: int = 3) -> float:
        """A few samples in a row (start-up); returns the offset believed."""
        for _ in range(samples):
            self.sample(read_db_now)
        return self.offset

    def _check(self) -> None:
        off = self.offset
        if abs(off) > WARN_OFFSET:
            if self._warned is None or abs(off - self._warned) > WARN_OFFSET:
                self._warned = off
                logger.warning("cluster-beat: node %s: the local clock is %.3f s %s the claim database's; "
                               "scheduling on the database's clock (fix NTP on this host)",
                               self.node_id, abs(off), "behind" if off > 0 else "ahead of")
        elif self._warned is not None:
            self._warned = None
            logger.info("cluster-beat: node %s: the local clock agrees with the claim database's again "
                        "(offset %.3f s)", self.node_id, off)
