"""How a notice reaches whoever waits for it: pub/sub on one Redis, sharded pub/sub on a Redis Cluster.

Both notices we send (the lease's release notice, the stored-schedule change notice)
are hints that save a wait; the truth is the lease key, or the change counter in the
claim database. So a subscription that breaks is simply made again.

* **One Redis** (plain, TLS, Sentinel): ``PUBLISH`` / ``SUBSCRIBE``.
* **Redis Cluster, Redis 7 or later**: sharded pub/sub, ``SPUBLISH`` / ``SSUBSCRIBE``. A
  channel then lives on the shard that serves its hash slot, the slot of the lease keys
  (same hash tag), so the release script publishes atomically with its ``DEL`` on the
  one master it runs on, and no message is broadcast over the cluster bus. The
  subscriber connects to that slot's master. When the master fails, or the slot moves
  (a failover that keeps the old master as a replica, a resharding), the subscription
  ends: a connection error, or a ``SUNSUBSCRIBE`` the server pushes
  (:class:`SubscriptionLost`); the caller subscribes again and finds the new master.
* **Redis Cluster without sharded pub/sub** (before 7.0, or ``SSUBSCRIBE`` disabled):
  no notices (:attr:`NoticeTransport.POLL`). The lease's standby then looks at the
  lease key a few times a second, and the leader reads the change counter every second.
"""
from __future__ import annotations

import time
from enum import Enum
from typing import Any, Optional

import redis
from redis.exceptions import ResponseError

from .clusterconn import is_cluster

__all__ = ["NoticeTransport", "Subscription", "SubscriptionLost", "publish"]


class NoticeTransport(str, Enum):
    PUBSUB = "pubsub"  # one Redis: PUBLISH / SUBSCRIBE
    SHARDED = "sharded"  # Redis Cluster 7+: SPUBLISH / SSUBSCRIBE on the slot's master
    POLL = "poll"  # Redis Cluster without sharded pub/sub: nothing to hear, look yourself

    def __str__(self) -> str:
        return self.value


class SubscriptionLost(redis.ConnectionError):
    """The server ended the subscription (its slot moved to another node): subscribe again."""


def publish(client: Any, channel: str, message: str) -> None:
    """Send *message* on *channel* the way :class:`Subscription` listens on this *client*."""
    if is_cluster(client):
        client.spublish(channel, message)
    else:
        client.publish(channel, message)


def _unknown_command(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, ResponseError) and "unknown command" in text


class Subscription:
    """One channel, subscribed where its notices are published.

    Not thread-safe: one thread opens, reads and closes it. Redis errors raise out
    of :meth:`open`, :meth:`wait` and :meth:`drain`; the caller then closes it and
    opens a new one later.
    """

    def __init__(self, client: Any, channel: str) -> None:
        self.client = client
        self.channel = channel
        #: How notices arrive; None until :meth:`open` succeeded.
        self.transport: Optional[NoticeTransport] = None
        self._pubsub: Any = None

    def open(self, timeout: float) -> NoticeTransport:
        """Subscribe and wait up to *timeout* s for the server's confirmation, so that a
        notice published from now on is heard (``redis.TimeoutError`` without one)."""
        if not is_cluster(self.client):
            self._pubsub = self.client.pubsub()
            self._pubsub.subscribe(self.channel)
            self._confirm("subscribe", timeout)
            self.transport = NoticeTransport.PUBSUB
            return self.transport
        # A keyed command on the channel's name is routed to its slot and follows MOVED, so the
        # client's slot map names the slot's current master before we subscribe there.
        self.client.exists(self.channel)
        node = self.client.get_node_from_key(self.channel)
        self._pubsub = self.client.get_redis_connection(node).pubsub()
        try:
            self._pubsub.ssubscribe(self.channel)
            self._confirm("ssubscribe", timeout)
        except ResponseError as exc:
            if not _unknown_command(exc):
                raise
            self.close()
            self.transport = NoticeTransport.POLL
            return self.transport
        self.transport = NoticeTransport.SHARDED
        return self.transport

    def _confirm(self, kind: str, timeout: float) -> None:
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            message = self._pubsub.get_message(timeout=max(0.0, deadline - time.monotonic()))
            if message is not None and message.get("type") == kind:
                return
            if time.monotonic() >= deadline:
                raise redis.TimeoutError(f"no {kind.upper()} confirmation for {self.channel}")

    def _next(self, timeout: float) -> Optional[bool]:
        """True: a notice; False: nothing within *timeout*; None: something else (a PONG)."""
        message = self._pubsub.get_message(timeout=timeout)
        if message is None:
            return False
        kind = message.get("type")
        if kind in ("message", "smessage"):
            return True
        if kind in ("unsubscribe", "sunsubscribe"):
            raise SubscriptionLost(f"the server ended the subscription to {self.channel} (its slot moved)")
        return None

    def wait(self, timeout: float) -> bool:
        """Block up to *timeout* s for a notice; True when one came."""
        if self._pubsub is None:
            return False
        deadline = time.monotonic() + max(0.0, timeout)
        while True:
            got = self._next(max(0.0, deadline - time.monotonic()))
            if got:
                return True
            if time.monotonic() >= deadline:
                return False

    def drain(self) -> bool:
        """Read what has arrived, without blocking; True if it held a notice."""
        heard = False
        while self._pubsub is not None:
            got = self._next(0.0)
            if got is False:
                break
            heard = heard or bool(got)
        return heard

    def close(self) -> None:
        pubsub, self._pubsub = self._pubsub, None
        if pubsub is not None:
            try:
                pubsub.close()
            except Exception:  # closing a broken connection
                pass
