"""The lease in Redis: its keys, its value, and the three tokened Lua scripts that change them.

Modelled on redis-py's ``redis.lock.Lock``: each holding has a random token, and every
change to the key (take it, extend it, delete it) is a Lua script that acts only while
the key still holds *our* token, so a node never extends or deletes a successor's lease
after its own ran out. As in ``Lock``, the script texts are constants and registered with
``register_script`` (redis-py then sends ``EVALSHA`` and loads the text on ``NOSCRIPT``).
Unlike ``Lock``, they are registered per client (:class:`LeaseScripts`), not on the class:
the release script differs on a Redis Cluster, and a lease may close its client and
make another. What a scheduler needs beyond a lock is in the scripts too: the acquire
script takes a term from the counter (:mod:`.fencing`) and checks the cluster id
(:mod:`.identity`) atomically with setting the key.

Keys (one Redis Cluster slot thanks to the ``{name}`` hash tag)::

    cluster_beat:{<name>}:lease      "<token>:<term>:<node_id>", PX ttl
    cluster_beat:{<name>}:term       the term counter (never expires)
    cluster_beat:{<name>}:released   pub/sub channel of release notices
    cluster_beat:{<name>}:cluster    the cluster id of the claim store (:mod:`.identity`)

On a Redis Cluster the scripts run unchanged on the master that serves that slot; the
release notice is then a sharded ``SPUBLISH`` from the release script, heard with
``SSUBSCRIBE`` on that master (:mod:`.channels`, :mod:`.standby`).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Optional, Tuple

from .clusterconn import is_cluster

__all__ = ["AcquireReply", "AcquireStatus", "LeaseScripts", "lease_keys", "parse_value", "text"]


def lease_keys(name: str) -> "tuple[str, str, str]":
    """The lease key, the term counter key and the release channel of lease *name*."""
    base = f"cluster_beat:{{{name}}}"
    return base + ":lease", base + ":term", base + ":released"


def text(value: Any) -> str:
    """A Redis reply (bytes without ``decode_responses``) as text."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def parse_value(value: Any) -> "tuple[Optional[int], Optional[str]]":
    """(term, node id) of a lease value ``token:term:node_id``; (None, None) if foreign."""
    parts = text(value).split(":", 2)
    if len(parts) < 2:
        return None, None
    try:
        term = int(parts[1])
    except ValueError:
        return None, None
    return term, (parts[2] if len(parts) > 2 else "")


# Every script starts with this: is a lease value ours (does it carry our token, ARGV[1])?
OURS = """
local function ours(value)
    return value and string.sub(value, 1, string.len(ARGV[1]) + 1) == ARGV[1] .. ':'
end
"""

# KEYS[1] lease key, KEYS[2] term counter, KEYS[3] cluster id key
# ARGV[1] token, ARGV[2] ttl in ms, ARGV[3] node id, ARGV[4] lowest term the counter may hold,
# ARGV[5] our cluster id ('' for none), ARGV[6] how long the cluster id key lives (ms)
# Returns {1, value} when we hold the lease now, {0, holder's value, holder's pttl} otherwise,
# {-1, their cluster id} when the lease belongs to another cluster (another claim store).
# Idempotent for one token: if a previous call with the same token set the key but
# its reply was lost, calling again returns that holding (and refreshes its ttl)
# instead of locking ourselves out until it expires.
ACQUIRE_SCRIPT = OURS + """
if ARGV[5] ~= '' then
    local cluster = redis.call('get', KEYS[3])
    if cluster and cluster ~= ARGV[5] then
        return {-1, cluster}
    end
end
local current = redis.call('get', KEYS[1])
if current then
    if ours(current) then
        redis.call('pexpire', KEYS[1], ARGV[2])
        if ARGV[5] ~= '' then
            redis.call('set', KEYS[3], ARGV[5], 'PX', ARGV[6])
        end
        return {1, current}
    end
    return {0, current, redis.call('pttl', KEYS[1])}
end
-- Only a node that takes the lease names the cluster: a refused one must not.
if ARGV[5] ~= '' then
    redis.call('set', KEYS[3], ARGV[5], 'PX', ARGV[6])
end
local floor = tonumber(ARGV[4]) or 0
local counter = tonumber(redis.call('get', KEYS[2]) or '0') or 0
if counter < floor then
    redis.call('set', KEYS[2], floor)
end
local term = redis.call('incr', KEYS[2])
local value = ARGV[1] .. ':' .. term .. ':' .. ARGV[3]
redis.call('set', KEYS[1], value, 'PX', ARGV[2])
return {1, value}
"""

# KEYS[1] lease key, KEYS[2] cluster id key; ARGV[1] token, ARGV[2] ttl in ms,
# ARGV[3] our cluster id ('' for none), ARGV[4] the cluster id key's ttl in ms.
# 1 if renewed (and the cluster id kept alive with it), 0 if not ours.
RENEW_SCRIPT = OURS + """
local current = redis.call('get', KEYS[1])
if ours(current) then
    redis.call('pexpire', KEYS[1], ARGV[2])
    if ARGV[3] ~= '' then
        redis.call('set', KEYS[2], ARGV[3], 'PX', ARGV[4])
    end
    return 1
end
return 0
"""

# KEYS[1] lease key; ARGV[1] token, ARGV[2] channel, ARGV[3] notice.
# 1 if we deleted our key (and told the standbys), 0 if it was not ours.
RELEASE_SCRIPT = OURS + """
local current = redis.call('get', KEYS[1])
if ours(current) then
    redis.call('del', KEYS[1])
    redis.call('publish', ARGV[2], ARGV[3])
    return 1
end
return 0
"""

# The same on a Redis Cluster: a sharded notice on the slot of the keys (the channel has their
# hash tag). pcall: a server without SPUBLISH (before Redis 7) still deletes the key, and its
# standbys look at the key instead of listening (channels.NoticeTransport.POLL).
RELEASE_SHARDED_SCRIPT = OURS + """
local current = redis.call('get', KEYS[1])
if ours(current) then
    redis.call('del', KEYS[1])
    redis.pcall('spublish', ARGV[2], ARGV[3])
    return 1
end
return 0
"""


class AcquireStatus(IntEnum):
    """The first element of the acquire script's reply."""

    FOREIGN = -1  # the lease belongs to another claim store
    TAKEN = 0  # another node holds it
    HELD = 1  # we hold it now


@dataclass(frozen=True)
class AcquireReply:
    """The acquire script's reply, read."""

    status: AcquireStatus
    #: HELD, TAKEN: the lease value; FOREIGN: the other claim store's cluster id.
    value: str
    #: TAKEN: the holder's key's time to live in ms (-1: the key has none, so it was not set by us).
    pttl: int = -1

    @classmethod
    def read(cls, reply: Any) -> "AcquireReply":
        first = int(reply[0])
        if first == AcquireStatus.FOREIGN:
            return cls(AcquireStatus.FOREIGN, text(reply[1]))
        if first == AcquireStatus.HELD:
            return cls(AcquireStatus.HELD, text(reply[1]))
        return cls(AcquireStatus.TAKEN, text(reply[1]), int(reply[2]) if len(reply) > 2 else -1)


class LeaseScripts:
    """The three scripts registered on one client, bound to one lease's keys.

    Registering builds the client's connection where the client is lazy (a Redis
    Cluster reads its topology), so it may raise a Redis error like any call.
    """

    def __init__(self, client: Any, *, lease_key: str, term_key: str, channel: str, cluster_key: str) -> None:
        self.client = client
        self._lease_key = lease_key
        self._term_key = term_key
        self._channel = channel
        self._cluster_key = cluster_key
        self._acquire = client.register_script(ACQUIRE_SCRIPT)
        self._renew = client.register_script(RENEW_SCRIPT)
        self._release = client.register_script(RELEASE_SHARDED_SCRIPT if is_cluster(client) else RELEASE_SCRIPT)

    def acquire(self, token: str, ttl_ms: int, node_id: str, term_floor: int,
                cluster: Tuple[str, int]) -> AcquireReply:
        """Take the lease with *token* if free (a term above *term_floor*), or learn who holds it.

        *cluster* is ``(our cluster id or '', the cluster id key's ttl in ms)``.
        """
        reply = self._acquire(
            keys=[self._lease_key, self._term_key, self._cluster_key],
            args=[token, ttl_ms, node_id, term_floor, *cluster],
            client=self.client,
        )
        return AcquireReply.read(reply)

    def renew(self, token: str, ttl_ms: int, cluster: Tuple[str, int]) -> bool:
        """Extend the key by *ttl_ms* if it still holds *token* (and keep the cluster id alive)."""
        ok = self._renew(keys=[self._lease_key, self._cluster_key], args=[token, ttl_ms, *cluster],
                         client=self.client)
        return bool(int(ok))

    def release(self, token: str, notice: str) -> bool:
        """Delete the key if it still holds *token*, and publish *notice* on the release channel."""
        return bool(int(self._release(keys=[self._lease_key], args=[token, self._channel, notice],
                                      client=self.client)))
