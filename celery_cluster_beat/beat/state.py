"""What the scheduler's rooms share: one view of this node, and one back-off for its store.

Leadership, the due pass, stored-schedule following, operators' controls, upkeep and
message preparation all act on the same few things: one queue of next fires (rebuilt
whole when this node takes over), one ``entries`` dict that the send pipeline reads
too, the claim store, the lease, and one back-off that every store failure feeds
(whichever room met it, nothing that needs the store runs until it ends). Each room
holds this object rather than the :class:`~.scheduler.Scheduler`, so no room depends
on Celery's beat class, and what a room keeps for itself stays in the room.

The store, lease, guard and pipeline are None until the set-up has reached the claim
database: rooms read them here at use, never keep their own copies.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, Optional, TYPE_CHECKING

from ..config import Entry, Settings
from ..store import ClaimStore, StoreUnavailable
from .clock import NodeClock
from .outcomes import Reporter
from .timeline import Timeline

if TYPE_CHECKING:
    from .guard import OverlapGuard
    from .pipeline import SendPipeline

logger = logging.getLogger("celery_cluster_beat")


class StoreBackoff:
    """Exponential back-off after claim-store failures, and how long the store has been down.

    One for the node: a failure met by any room holds back every use of the store until the
    back-off ends, and a leader steps aside once the store has been down for ``lock_ttl``.
    """

    def __init__(self) -> None:
        #: Monotonic time before which nothing that needs the store runs.
        self.until = 0.0
        self.failures = 0
        self.down_since: Optional[float] = None

    def trouble(self) -> None:
        mono = time.monotonic()
        self.failures += 1
        if self.down_since is None:
            self.down_since = mono
        self.until = mono + min(30.0, 0.5 * 2 ** min(self.failures, 6))

    def ok(self) -> None:
        self.failures = 0
        self.down_since = None

    def down_for(self) -> float:
        return 0.0 if self.down_since is None else time.monotonic() - self.down_since

    def over(self) -> bool:
        """The back-off has ended: the store may be used again."""
        return time.monotonic() >= self.until

    def guarded(self, call: Callable[[], None], doing: str) -> None:
        """Run *call*; a store failure is logged and starts (or extends) the back-off."""
        try:
            call()
        except StoreUnavailable as exc:
            logger.error("cluster-beat: the claim store failed while %s: %s", doing, exc)
            self.trouble()


class NodeState:
    """This node as every room sees it (see the module docstring)."""

    def __init__(self, app: Any, settings: Settings, entries: Dict[str, Entry], clock: NodeClock,
                 report: Reporter, sender: Any) -> None:
        self.app = app
        self.settings = settings
        #: Every schedule held in memory by name: the config's and stored ones due soon. Changed in
        #: place only: the send pipeline holds this very dict.
        self.entries = entries
        #: Names of the config's entries (``beat_schedule`` and Celery's defaults): never stored ones.
        self.static: frozenset = frozenset()
        #: Next fire of every schedule held in memory; replaced whole when this node takes over.
        self.queue = Timeline()
        self.clock = clock
        self.report = report
        #: What signals name as their sender (the Scheduler Celery runs).
        self.sender = sender
        self.store: Optional[ClaimStore] = None
        self.lease = None  # RedisLease, when cluster_beat_redis_url is set
        self.notices = None  # ChangeNotices, with the lease
        self.guard: Optional["OverlapGuard"] = None
        self.pipeline: Optional["SendPipeline"] = None
        #: This node schedules (holds the lease, or runs without one and has read the store).
        self.active = False
        self.backoff = StoreBackoff()
        #: Told the name of a schedule that stops for good (removed, disabled, paused, unreadable): the
        #: metrics drop its series (beat's HTTP server sets it; nothing to tell otherwise).
        self.schedule_gone: Callable[[str], None] = lambda name: None

    def term(self) -> Optional[int]:
        """The fencing term claims are made with (None without a lease)."""
        return self.lease.term if self.lease is not None else None
