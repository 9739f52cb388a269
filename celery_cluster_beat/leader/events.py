"""What the lease tells the world: its transitions, and Redis outages turned into back-off.

The scheduler must never crash because Redis is unreachable, yet an operator must learn
that it is, once, not once a second. So every Redis call of the lease goes through one
rule (:class:`LeaseReporter`): an error of :data:`REDIS_ERRORS` becomes a return value,
the first of an outage is logged as a WARNING and reported as
:attr:`LeaseEvent.REDIS_DOWN`, the first success after it as :attr:`LeaseEvent.REDIS_BACK`,
and while it lasts the lease retries with an exponential back-off (:meth:`LeaseReporter.backoff`).
Anything that is not a Redis error is a bug and raises.

Every transition reaches the owner's ``on_event(event, info)`` callback (beat turns it
into the ``lease_changed`` signal and the metrics); a failing callback is logged and
swallowed, so a bug in a handler cannot take the leadership down with it.
"""
from __future__ import annotations

import logging
import random
from enum import Enum
from typing import Any, Callable, Optional

from redis.exceptions import RedisClusterException, RedisError

from .urls import mask_url

__all__ = ["LeaseEvent", "LeaseReporter", "REDIS_ERRORS", "MAX_BACKOFF"]

logger = logging.getLogger("celery_cluster_beat.lease")

#: Errors that mean "Redis did not do what we asked" (unreachable, timed out,
#: loading, read-only replica, script error, no Redis Cluster node reachable...).
#: Anything else is a bug and raises.
REDIS_ERRORS = (RedisError, RedisClusterException, OSError)

#: Longest pause between attempts while Redis is down (seconds).
MAX_BACKOFF = 2.0
FIRST_BACKOFF = 0.1


class LeaseEvent(str, Enum):
    ACQUIRED = "acquired"  # we became leader (info: term)
    RENEWED_LATE = "renewed_late"  # a renewal came more than 2/3 ttl after the previous one
    LOST = "lost"  # the holding ended without our consent (expired, taken over, Redis gone past valid_until)
    RELEASED = "released"  # we gave the lease up (release()/close())
    STEPPED_DOWN = "stepped_down"  # we gave it up because the claim store saw a higher term
    REDIS_DOWN = "redis_down"  # first failed Redis call of an outage
    REDIS_BACK = "redis_back"  # first successful call after an outage

    def __str__(self) -> str:  # "acquired", not "LeaseEvent.ACQUIRED", in logs
        return self.value


class LeaseReporter:
    """One lease's events and outage bookkeeping.

    Not locked itself: the lease calls it with its own lock held (except :meth:`backoff`
    and :attr:`redis_down`, which only read).
    """

    def __init__(self, *, name: str, node_id: str, on_event: Optional[Callable[[LeaseEvent, dict], None]],
                 clock: Callable[[], float]) -> None:
        self.name = name
        self.node_id = node_id
        self._on_event = on_event
        self._clock = clock
        self._down_since: Optional[float] = None
        self._failures = 0

    @property
    def redis_down(self) -> bool:
        """The last Redis call failed."""
        return self._down_since is not None

    def emit(self, event: LeaseEvent, **info: Any) -> None:
        """Tell ``on_event``; its exceptions are logged, never raised."""
        if self._on_event is None:
            return
        info.setdefault("name", self.name)
        info.setdefault("node_id", self.node_id)
        try:
            self._on_event(event, info)
        except Exception:
            logger.exception("lease %r: on_event handler failed for %s", self.name, event)

    def down(self, exc: BaseException, doing: str) -> None:
        """A Redis call failed while *doing* something: log and report the first of an outage."""
        self._failures += 1
        if self._down_since is None:
            self._down_since = self._clock()
            error = mask_url(f"{type(exc).__name__}: {exc}")
            logger.warning(
                "lease %r (node %s): Redis unavailable while trying to %s: %s; retrying with back-off",
                self.name, self.node_id, doing, error,
            )
            self.emit(LeaseEvent.REDIS_DOWN, error=error, doing=doing)
        else:
            logger.debug("lease %r: Redis still unavailable (%s): %s", self.name, doing, type(exc).__name__)

    def up(self) -> None:
        """A Redis call succeeded: end the outage, if any."""
        self._failures = 0
        if self._down_since is not None:
            downtime = self._clock() - self._down_since
            self._down_since = None
            logger.info("lease %r (node %s): Redis reachable again after %.1f s", self.name, self.node_id, downtime)
            self.emit(LeaseEvent.REDIS_BACK, downtime=downtime)

    def backoff(self) -> Optional[float]:
        """Seconds to wait before trying Redis again; None when the last call did not fail.

        0.1 s doubling up to 2 s, with jitter so that the replicas of a cluster spread
        their retries over the moment Redis comes back.
        """
        if self._down_since is None and not self._failures:
            return None
        delay = min(MAX_BACKOFF, FIRST_BACKOFF * (2 ** max(0, self._failures - 1)))
        return delay * random.uniform(0.75, 1.0)
