"""Leadership: which replica schedules, and how we talk to Redis.

Owns the Redis lease with its fencing term: the state machine the scheduler drives
(:mod:`.lease`), its keys and tokened Lua scripts (:mod:`.scripts`), the term and the local
deadline (:mod:`.fencing`), the cluster id key tying it to one claim store (:mod:`.identity`),
the standby's wait for a release (:mod:`.standby`), its events and Redis outages
(:mod:`.events`); the notice that stored schedules changed (:mod:`.notices`), the redis-py
client factory for every URL form a Celery user has: plain, TLS, Unix socket,
Sentinel (:mod:`.redisconn`), and a Redis Cluster (``redis+cluster://``: the lazy,
bounded cluster client in :mod:`.clusterconn`), how notices travel (pub/sub, or
sharded pub/sub on a cluster: :mod:`.channels`), and masking of passwords in URLs
before anything is logged (:mod:`.urls`).

May import: redis-py, :mod:`celery_cluster_beat.errors`. Nothing from store,
config or beat: the fencing term crosses into the store as a plain integer.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..base import lazy_attributes
from .urls import mask_url

if TYPE_CHECKING:
    from .lease import LeaseEvent, RedisLease, lease_keys
    from .redisconn import redis_client_from_url

__all__ = ["LeaseEvent", "RedisLease", "lease_keys", "redis_client_from_url", "mask_url"]

#: Attributes imported on first use (PEP 562): redis-py loads only for a lease or a client,
#: not for :func:`mask_url`, which the ``cluster-beat`` plugin needs at every ``celery`` start.
_LAZY = {"LeaseEvent": ".lease", "RedisLease": ".lease", "lease_keys": ".lease",
         "redis_client_from_url": ".redisconn"}


__getattr__, __dir__ = lazy_attributes(__name__, _LAZY, __all__)
