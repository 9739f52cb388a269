"""Leadership: which replica schedules, and how we talk to Redis.

Owns the Redis lease with its fencing term (:mod:`.lease`), the notice that
stored schedules changed (:mod:`.notices`), the redis-py
client factory for every URL form a Celery user has: plain, TLS, Unix socket,
Sentinel (:mod:`.redisconn`), and masking of passwords in URLs before anything
is logged (:mod:`.urls`).

May import: redis-py, :mod:`celery_cluster_beat.errors`. Nothing from store,
config or beat: the fencing term crosses into the store as a plain integer.
"""
from .lease import LeaseEvent, RedisLease, lease_keys
from .redisconn import redis_client_from_url
from .urls import mask_url

__all__ = ["LeaseEvent", "RedisLease", "lease_keys", "redis_client_from_url", "mask_url"]
