"""A standby's wait for the lease: a release notice, the holder's expiry, or a look at the key.

Failover speed is decided here. A leader that hands over (SIGTERM, ``release()``)
deletes the key and publishes a notice in one script (:mod:`.scripts`); a standby
blocked in :meth:`ReleaseWaiter.wait` wakes at once and tries to acquire. A leader that
dies publishes nothing, so the wait also ends when the holder's key is due to expire
(learnt from its ``PTTL``): failover then takes at most ``ttl`` after the last renewal,
plus one round trip. How the notice travels depends on the server (:mod:`.channels`):

* one Redis: ``SUBSCRIBE`` to the release channel;
* a Redis Cluster 7+: ``SSUBSCRIBE`` on the master of the lease's slot. A failover or a
  resharding ends the subscription (:class:`SubscriptionLost`); the next wait subscribes on
  the slot's new master, which is not an outage;
* a Redis Cluster without sharded pub/sub: nothing to hear, so the standby looks at the
  lease key every :data:`POLL_INTERVAL` seconds instead.

A notice published before the subscription is confirmed would be missed, so after each
(re)subscription the standby looks at the key once: a lease already free ends the wait.
The notice is only a hint; the key is the truth, and the caller always acquires after.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Optional

from .channels import NoticeTransport, Subscription, SubscriptionLost
from .events import MAX_BACKOFF, REDIS_ERRORS, LeaseReporter

__all__ = ["POLL_INTERVAL", "ReleaseWaiter"]

logger = logging.getLogger("celery_cluster_beat.lease")

#: Seconds between looks at the lease key of a standby that cannot hear release notices.
POLL_INTERVAL = 0.2


class ReleaseWaiter:
    """The release channel of one lease, and what the lease last learnt of the holder's expiry.

    :param get_client: the lease's client (made on first use).
    :param lock: the lease's lock: subscribing and tearing down hold it, so that ``close()``
        from a signal handler or another thread never races them; the blocking wait does not.
    :param closed: whether the lease was closed meanwhile (then the wait ends).
    """

    def __init__(self, *, name: str, lease_key: str, channel: str, ttl: float, get_client: Callable[[], Any],
                 reporter: LeaseReporter, lock: threading.RLock, clock: Callable[[], float],
                 closed: Callable[[], bool]) -> None:
        self.name = name
        self.lease_key = lease_key
        self.channel = channel
        self.ttl = ttl
        self._get_client = get_client
        self._reporter = reporter
        self._lock = lock
        self._clock = clock
        self._closed = closed
        #: The release channel, once subscribed (None until then, and after an error).
        self.subscription: Optional[Subscription] = None
        #: Monotonic time at which the holder's key is due to expire, as last learnt; None if unknown.
        self.holder_expires_at: Optional[float] = None

    def saw_holder(self, pttl_ms: int, at: float) -> None:
        """The holder's key had *pttl_ms* to live at *at* (a key without expiry was not set by us: a ttl)."""
        self.holder_expires_at = at + (pttl_ms / 1000.0 + 0.001 if pttl_ms >= 0 else self.ttl)

    def drop(self) -> None:
        """Close the subscription (the next wait makes a new one)."""
        subscription, self.subscription = self.subscription, None
        if subscription is not None:
            subscription.close()

    def _subscribe(self, deadline: float) -> bool:
        """Subscribe to the release channel; True if the lease turned out to be free."""
        client = self._get_client()
        subscription = Subscription(client, self.channel)
        self.subscription = subscription
        # Wait for the confirmation so that a release from now on is seen...
        if subscription.open(max(deadline - self._clock(), 1.0)) is NoticeTransport.POLL:
            logger.info("lease %r: this Redis Cluster has no sharded pub/sub (Redis 7+); standbys look at the "
                        "lease key every %.1f s instead of hearing a release", self.name, POLL_INTERVAL)
        # ...and a release before it is not missed: is the lease free right now?
        return self.look()

    def look(self) -> bool:
        """Read the lease key's time to live; True when nobody holds the lease."""
        pttl = int(self._get_client().pttl(self.lease_key))
        self._reporter.up()
        if pttl == -2:
            return True
        self.saw_holder(pttl, self._clock())
        return False

    def wait(self, timeout: float) -> bool:
        """Block up to *timeout* s for a release notice; True when one came.

        See :meth:`RedisLease.wait_for_release`, which is this.
        """
        start = self._clock()
        deadline = start + max(0.0, float(timeout))
        if self._closed():
            return False
        expires_at = self.holder_expires_at
        try:
            if self.subscription is None:
                with self._lock:
                    if self.subscription is None and self._subscribe(deadline):
                        return True
                expires_at = self.holder_expires_at
            capped = expires_at is not None and expires_at < deadline
            if capped:
                deadline = max(start, expires_at)
            subscription = self.subscription
            while subscription is not None:
                remaining = deadline - self._clock()
                if remaining <= 0:
                    if capped:
                        self.holder_expires_at = None  # used up; try_acquire learns the next one
                    return False
                if subscription.transport is NoticeTransport.POLL:
                    time.sleep(min(remaining, POLL_INTERVAL))
                    if self._closed():
                        return False
                    if self.look():
                        self.holder_expires_at = None
                        return True
                    continue
                if subscription.wait(remaining):
                    self.holder_expires_at = None
                    return True
            return False
        except Exception as exc:
            interrupted = exc.__context__
            while isinstance(interrupted, Exception):
                interrupted = interrupted.__context__
            if isinstance(interrupted, (SystemExit, KeyboardInterrupt)):
                # beat's SIGTERM/SIGINT handler closed us and raised while we blocked here; the
                # socket closed under redis-py turned its SystemExit into this error: let it through.
                raise interrupted
            with self._lock:
                self.drop()
                if self._closed():
                    return False
                if isinstance(exc, SubscriptionLost):
                    # A Redis Cluster moved the channel's slot (a failover): not an outage. The
                    # next call subscribes on the slot's new master and looks at the key first.
                    logger.info("lease %r: %s; subscribing again", self.name, exc)
                    return False
                if isinstance(exc, REDIS_ERRORS) or isinstance(exc, (ValueError, AttributeError)):
                    # ValueError/AttributeError: redis-py's pub/sub on a socket closed under it.
                    self._reporter.down(exc, "wait for a release notice")
                else:
                    logger.exception("lease %r: unexpected error while waiting for a release", self.name)
            remaining = deadline - self._clock()
            if remaining > 0:
                time.sleep(min(remaining, MAX_BACKOFF))
            return False
