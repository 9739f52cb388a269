"""A Redis pub/sub notice that stored schedules changed: sent by whoever changes one, heard by the leader.

Only a hint that makes a change visible at once: the version counter in the
claim database is the truth, and a leader that hears nothing (Redis down, a
notice lost while it reconnected) still reads the counter on its own, less
often. So nothing here raises; trouble only makes :attr:`ChangeNotices.down` true.
On a Redis Cluster the notice is sharded pub/sub on the slot of the lease keys
(:mod:`.channels`); a cluster without it (before Redis 7) leaves ``down`` true for good.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from .channels import NoticeTransport, Subscription, publish

logger = logging.getLogger("celery_cluster_beat.notices")


#: Longest wait (seconds) for a subscription's confirmation, in the leader's loop.
SUBSCRIBE_TIMEOUT = 1.0


def notices_channel(name: str) -> str:
    """The channel of cluster *name*'s schedule change notices (same hash tag as its lease keys)."""
    return f"cluster_beat:{{{name}}}:schedules"


class ChangeNotices:
    """Publish and hear "stored schedules changed" notices of one cluster."""

    def __init__(self, client_factory: Callable[[], Any], name: str) -> None:
        self._factory = client_factory
        self._client: Any = None
        self._pubsub: Optional[Subscription] = None
        self.channel = notices_channel(name)
        #: True after a Redis error, until a subscription works again: read the counter yourself.
        self.down = False

    def _get_client(self) -> Any:
        if self._client is None:
            self._client = self._factory()
        return self._client

    def publish(self, version: int) -> None:
        """Tell the leader that the counter reached *version* (never raises)."""
        try:
            publish(self._get_client(), self.channel, str(int(version)))
        except Exception as exc:  # the leader reads the counter on its own as well
            logger.debug("cluster-beat: schedule change notice not published: %r", exc)

    def heard(self) -> bool:
        """Whether a notice came since the last call, without blocking.

        Also True right after (re)subscribing: a notice sent while not subscribed is lost,
        so the caller should read the counter then.
        """
        try:
            fresh = False
            if self._pubsub is None:
                self._pubsub = Subscription(self._get_client(), self.channel)
                if self._pubsub.open(SUBSCRIBE_TIMEOUT) is NoticeTransport.POLL:
                    logger.info("cluster-beat: this Redis Cluster has no sharded pub/sub (Redis 7+): reading the "
                                "change counter every second instead of hearing schedule change notices")
                fresh = True
            if self._pubsub.transport is NoticeTransport.POLL:
                self.down = True  # for good: the leader reads the counter every second
                return fresh
            got = self._pubsub.drain()
            if self.down:
                logger.info("cluster-beat: schedule change notices are heard again")
            self.down = False
            return got or fresh
        except Exception as exc:
            if not self.down:
                logger.warning("cluster-beat: cannot hear schedule change notices (%r); reading the change "
                               "counter every second instead", exc)
            self.down = True
            self._drop()
            return False

    def _drop(self) -> None:
        subscription, self._pubsub = self._pubsub, None
        if subscription is not None:
            subscription.close()

    def close(self) -> None:
        self._drop()
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # pragma: no cover
                pass
