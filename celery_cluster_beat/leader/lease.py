"""The Redis leader lease: one beat replica schedules, the others stand by.

Model: redis-py's ``redis.lock.Lock`` (a random token per holding; release and
extend are Lua scripts that act only while the key still holds *our* token), plus
what a scheduler needs on top of a lock:

* **A term (fencing token).** Every acquisition takes a number from a Redis
  counter (``INCR``) in the same Lua script that sets the key, so terms strictly
  increase across holdings. The SQL claim store refuses writes carrying a term
  lower than one it has seen; :meth:`RedisLease.step_down` is the reaction.
* **A local deadline.** ``valid_until`` is the time the acquire/renew command was
  *sent* plus ``ttl - safety_margin``; the key cannot expire in Redis before
  ``sent + ttl``, so a leader that stops acting at ``valid_until`` never overlaps
  with the next one, whether or not Redis answers. :attr:`RedisLease.is_leader`
  reads the clock, it never waits for Redis.
* **Fast handover.** :meth:`RedisLease.release` deletes the key and publishes a
  notice in one script; a standby blocked in :meth:`RedisLease.wait_for_release`
  wakes at once. When the holder dies instead, the standby's wait ends when the
  holder's key is due to expire, so failover takes at most ``ttl`` after the last
  renewal (plus one round trip).
* **No exceptions from Redis trouble.** Connection errors and time-outs are
  logged (once per outage), reported as events, and turned into return values.

Keys (one Redis Cluster slot thanks to the ``{name}`` hash tag)::

    cluster_beat:{<name>}:lease      "<token>:<term>:<node_id>", PX ttl
    cluster_beat:{<name>}:term       the term counter (never expires)
    cluster_beat:{<name>}:released   pub/sub channel of release notices
    cluster_beat:{<name>}:cluster    the cluster id of the claim store the lease serves;
                                     refreshed by every acquisition, expires 30 days after the last

On a Redis Cluster (``redis+cluster://``) the scripts run unchanged on the master
that serves that slot; the release notice is then a sharded ``SPUBLISH`` from the
release script, heard with ``SSUBSCRIBE`` on that master (:mod:`.channels`). A
failover of that master loses the lease at worst for one ttl: the holder cannot renew
while no master serves the slot, stops at ``valid_until``, and whoever acquires next
(the same node or another) takes a higher term. A replica promoted before it received
the last ``INCR`` may hand out a term again, as a Redis restarted without data does:
the claim store's fence refuses an equal term from another node, and the node then
steps down and acquires above the term it was shown (``step_down(observed_term=...)``).

A lease is named after the cluster (``cluster_beat_cluster_name``), never after
a URL: a key must not publish anything derived from a password. Two claim
databases behind one lease would keep two histories, so the acquire script
refuses a node whose store's cluster id differs from the one recorded.

Thread safety: the methods that talk to Redis serialise on an internal lock, so
``release()``/``close()`` may be called from a signal handler or another thread
while the scheduling loop is in ``maintain()``; :attr:`is_leader`, :attr:`term`
and :attr:`valid_until` never block.
"""
from __future__ import annotations

import logging
import random
import secrets
import threading
import time
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable, Optional

import redis
from redis.exceptions import RedisClusterException, RedisError

from ..errors import ConfigError
from .channels import NoticeTransport, Subscription, SubscriptionLost
from .clusterconn import is_cluster
from .urls import mask_url

__all__ = ["LeaseEvent", "RedisLease", "lease_keys", "cluster_key", "ForeignClusterError"]

logger = logging.getLogger("celery_cluster_beat.lease")

#: Errors that mean "Redis did not do what we asked" (unreachable, timed out,
#: loading, read-only replica, script error, no Redis Cluster node reachable...).
#: Anything else is a bug and raises.
_REDIS_ERRORS = (RedisError, RedisClusterException, OSError)

#: Longest pause between attempts while Redis is down (seconds).
MAX_BACKOFF = 2.0
_FIRST_BACKOFF = 0.1


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


def lease_keys(name: str) -> "tuple[str, str, str]":
    """The lease key, the term counter key and the release channel of lease *name*."""
    base = f"cluster_beat:{{{name}}}"
    return base + ":lease", base + ":term", base + ":released"


def cluster_key(name: str) -> str:
    """The key naming the claim store (by its cluster id) that lease *name* belongs to."""
    return f"cluster_beat:{{{name}}}:cluster"


#: How long the cluster id key outlives the last acquisition: a decommissioned cluster's
#: key goes away, a running one's is refreshed by every acquisition.
CLUSTER_KEY_TTL = 30 * 86400.0


class ForeignClusterError(ConfigError):
    """The lease is used by nodes of another claim store: two histories behind one leader."""


# Every script starts with this: is a lease value ours (does it carry our token, ARGV[1])?
_OURS = """
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
_ACQUIRE = _OURS + """
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
_RENEW = _OURS + """
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
_RELEASE = _OURS + """
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
_RELEASE_SHARDED = _OURS + """
local current = redis.call('get', KEYS[1])
if ours(current) then
    redis.call('del', KEYS[1])
    redis.pcall('spublish', ARGV[2], ARGV[3])
    return 1
end
return 0
"""

#: Seconds between looks at the lease key of a standby that cannot hear release notices.
POLL_INTERVAL = 0.2


def _text(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def _parse_value(value: Any) -> "tuple[Optional[int], Optional[str]]":
    """(term, node id) of a lease value ``token:term:node_id``; (None, None) if foreign."""
    parts = _text(value).split(":", 2)
    if len(parts) < 2:
        return None, None
    try:
        term = int(parts[1])
    except ValueError:
        return None, None
    return term, (parts[2] if len(parts) > 2 else "")


@dataclass
class _Holding:
    token: str
    term: int
    last_renewed: float  # send time of the last successful acquire/renew
    valid_until: float
    next_renew_at: float


class RedisLease:
    """A leader lease in Redis with terms, a safety margin and fast handover.

    :param client_factory: returns the ``redis.Redis`` to use; called lazily (the
        constructor does not connect), once, e.g.
        ``lambda: redis_client_from_url(url, transport_options=...)``.
    :param name: the lease name, e.g. the Celery app's ``main``.
    :param node_id: this replica's identity, stored in the key for operators.
    :param ttl: seconds the key lives without renewal; failover takes at most this
        long after a leader dies.
    :param safety_margin: seconds before the key's earliest possible expiry at
        which we stop considering ourselves leader; default ``min(1, max(0.05, ttl/10))``.
    :param on_event: ``on_event(event, info)``; called with the lease's internal
        lock held, so it must be quick and must not call back into the lease.
        Its exceptions are logged and swallowed.
    :param clock: monotonic clock (seconds).
    :param cluster_id: the id of the claim store this node writes to; the lease
        then refuses nodes of another store (see :meth:`check_cluster`).
    """

    def __init__(
        self,
        client_factory: Callable[[], redis.Redis],
        *,
        name: str,
        node_id: str,
        ttl: float = 5.0,
        safety_margin: Optional[float] = None,
        on_event: Optional[Callable[[LeaseEvent, dict], None]] = None,
        clock: Callable[[], float] = time.monotonic,
        cluster_id: Optional[str] = None,
    ) -> None:
        problems = []
        if not isinstance(name, str) or not name:
            problems.append(f"lease name must be a non-empty string, not {name!r}")
        if not isinstance(node_id, str) or not node_id:
            problems.append(f"lease node_id must be a non-empty string, not {node_id!r}")
        try:
            ttl = float(ttl)
        except (TypeError, ValueError):
            problems.append(f"lease ttl must be a number of seconds, not {ttl!r}")
            ttl = 5.0
        if not ttl >= 0.1:
            problems.append(f"lease ttl must be at least 0.1 s, not {ttl!r}")
        if safety_margin is None:
            safety_margin = min(1.0, max(0.05, ttl / 10.0))
        try:
            safety_margin = float(safety_margin)
        except (TypeError, ValueError):
            problems.append(f"lease safety_margin must be a number of seconds, not {safety_margin!r}")
            safety_margin = 0.0
        if not 0.0 <= safety_margin <= ttl / 2.0:
            problems.append(
                f"lease safety_margin must be between 0 and ttl/2 ({ttl / 2.0:g} s), not {safety_margin!r}"
            )
        if problems:
            raise ConfigError(problems)

        self._factory = client_factory
        self.name = name
        self.node_id = node_id
        self.ttl = ttl
        self.safety_margin = safety_margin
        self._ttl_ms = max(1, int(round(ttl * 1000)))
        self._on_event = on_event
        self._clock = clock
        self.lease_key, self.term_key, self.channel = lease_keys(name)
        self.cluster_key = cluster_key(name)
        self.cluster_id = cluster_id
        #: The other cluster's id when the lease belongs to another claim store.
        self.foreign_cluster: Optional[str] = None

        self._lock = threading.RLock()
        self._client: Optional[redis.Redis] = None
        self._scripts: Optional[tuple] = None
        self._pubsub: Optional[Subscription] = None
        self._closed = False
        self._holding: Optional[_Holding] = None
        # Token of an acquire attempt whose reply we never got: the key may be ours.
        self._pending_token: Optional[str] = None
        self._renew_retry = min(0.25, ttl / 10.0)
        # Highest term seen anywhere (our holdings, other holders, the claim
        # store): the counter is raised to it before the next INCR, so terms keep
        # increasing even if Redis lost the counter (restart without persistence).
        self._term_floor = 0
        # What the last failed try_acquire told us about the holder.
        self._holder: Optional[str] = None
        self._holder_expires_at: Optional[float] = None
        # Outage bookkeeping.
        self._down_since: Optional[float] = None
        self._failures = 0

    # ------------------------------------------------------------------ state

    @property
    def term(self) -> Optional[int]:
        """Term of the current holding; None when we hold nothing."""
        holding = self._holding
        return holding.term if holding is not None else None

    @property
    def valid_until(self) -> float:
        """Monotonic deadline of the current holding (0.0 when none)."""
        holding = self._holding
        return holding.valid_until if holding is not None else 0.0

    @property
    def is_leader(self) -> bool:
        """We hold the lease and its validity has not run out. Never blocks."""
        holding = self._holding
        return holding is not None and self._clock() < holding.valid_until

    @property
    def redis_down(self) -> bool:
        """The last Redis call failed."""
        return self._down_since is not None

    @property
    def holder(self) -> Optional[str]:
        """node_id of the leader as last seen by :meth:`try_acquire` (None if unknown)."""
        return self._holder

    def __repr__(self) -> str:
        state = f"leader term={self.term}" if self._holding is not None else "standby"
        return f"<RedisLease {self.name!r} node={self.node_id!r} {state}>"

    # --------------------------------------------------------------- plumbing

    def _get_client(self) -> redis.Redis:
        if self._client is None:
            self._client = self._factory()
        return self._client

    def _get_scripts(self, client: redis.Redis) -> tuple:
        if self._scripts is None:
            self._scripts = (
                client.register_script(_ACQUIRE),
                client.register_script(_RENEW),
                client.register_script(_RELEASE_SHARDED if is_cluster(client) else _RELEASE),
            )
        return self._scripts

    def _emit(self, event: LeaseEvent, **info: Any) -> None:
        if self._on_event is None:
            return
        info.setdefault("name", self.name)
        info.setdefault("node_id", self.node_id)
        try:
            self._on_event(event, info)
        except Exception:
            logger.exception("lease %r: on_event handler failed for %s", self.name, event)

    def _note_down(self, exc: BaseException, doing: str) -> None:
        self._failures += 1
        if self._down_since is None:
            self._down_since = self._clock()
            error = mask_url(f"{type(exc).__name__}: {exc}")
            logger.warning(
                "lease %r (node %s): Redis unavailable while trying to %s: %s; retrying with back-off",
                self.name, self.node_id, doing, error,
            )
            self._emit(LeaseEvent.REDIS_DOWN, error=error, doing=doing)
        else:
            logger.debug("lease %r: Redis still unavailable (%s): %s", self.name, doing, type(exc).__name__)

    def _note_up(self) -> None:
        self._failures = 0
        if self._down_since is not None:
            downtime = self._clock() - self._down_since
            self._down_since = None
            logger.info("lease %r (node %s): Redis reachable again after %.1f s", self.name, self.node_id, downtime)
            self._emit(LeaseEvent.REDIS_BACK, downtime=downtime)

    def _observe(self, term: Optional[int]) -> None:
        if term is not None and term > self._term_floor:
            self._term_floor = term

    # -------------------------------------------------------------- operations

    def try_acquire(self) -> bool:
        """One attempt to become leader; True if we are leader now. Never raises on Redis errors.

        When we already hold the lease this is :meth:`maintain`. After a failure
        (Redis down or the lease held elsewhere), wait :meth:`retry_after` seconds,
        or call :meth:`wait_for_release` with it.
        """
        with self._lock:
            if self._closed:
                return False
            if self._holding is not None:
                return self.maintain()
            token = self._pending_token or secrets.token_hex(16)
            try:
                client = self._get_client()
                acquire = self._get_scripts(client)[0]
                sent = self._clock()
                reply = acquire(
                    keys=[self.lease_key, self.term_key, self.cluster_key],
                    args=[token, self._ttl_ms, self.node_id, self._term_floor, self.cluster_id or "",
                          int(CLUSTER_KEY_TTL * 1000)],
                    client=client,
                )
            except _REDIS_ERRORS as exc:
                # The script may have run and only the reply been lost: try the
                # same token next time, which finds and keeps that holding.
                self._pending_token = token
                self._note_down(exc, "acquire the lease")
                return False
            received = self._clock()
            self._pending_token = None
            self._note_up()
            if int(reply[0]) == -1:
                theirs = _text(reply[1])
                if theirs != self.foreign_cluster:
                    self.foreign_cluster = theirs
                    logger.error("lease %r: %s", self.name, self._foreign_message(theirs))
                return False
            self.foreign_cluster = None
            if int(reply[0]) == 1:
                value = _text(reply[1])
                term, _ = _parse_value(value)
                if term is None:  # cannot happen with our script; be loud rather than wrong
                    logger.error("lease %r: unexpected lease value %r", self.name, value)
                    return False
                self._observe(term)
                self._holding = _Holding(
                    token=token,
                    term=term,
                    last_renewed=sent,
                    valid_until=sent + self.ttl - self.safety_margin,
                    next_renew_at=sent + self.ttl / 3.0,
                )
                self._holder, self._holder_expires_at = self.node_id, None
                logger.info(
                    "lease %r: node %s is now the leader (term %d, ttl %.3g s)",
                    self.name, self.node_id, term, self.ttl,
                )
                self._emit(LeaseEvent.ACQUIRED, term=term)
                return self.is_leader
            term, holder = _parse_value(reply[1])
            self._observe(term)
            pttl = int(reply[2]) if len(reply) > 2 else -1
            # (a key without expiry was not set by us: look again after a ttl)
            self._holder_expires_at = received + (pttl / 1000.0 + 0.001 if pttl >= 0 else self.ttl)
            if holder != self._holder:
                logger.info(
                    "lease %r: standing by, leader is %s (term %s)", self.name, holder or "?", term,
                )
                self._holder = holder
            return False

    def _foreign_message(self, theirs: str) -> str:
        return (
            f"node {self.node_id} writes to claim store {self.cluster_id}, but the lease {self.name!r} "
            f"belongs to the nodes of claim store {theirs}: two claim databases behind one leader would "
            "each keep a history of their own and resend what the other sent. Point cluster_beat_db_url "
            "at the same database on every node of the cluster, or give this one its own "
            f"cluster_beat_cluster_name (Redis key {self.cluster_key} names the store in use)."
        )

    def check_cluster(self) -> bool:
        """Refuse (ForeignClusterError) when the lease belongs to another claim store.

        Called at start-up, so a misconfigured node stops with a message that
        says what to change instead of standing by forever. Redis being down
        is not an error here: False (the outage is logged once, like any other
        Redis call's, and :meth:`retry_after` says when to ask again); True once
        Redis has answered (or there is no cluster id to check).
        """
        if not self.cluster_id:
            return True
        with self._lock:
            try:
                theirs = self._get_client().get(self.cluster_key)
            except _REDIS_ERRORS as exc:
                self._note_down(exc, "check which claim store the lease serves")
                return False
            self._note_up()
        if theirs is not None and _text(theirs) != self.cluster_id:
            raise ForeignClusterError(self._foreign_message(_text(theirs)))
        return True

    def renew(self) -> bool:
        """Extend our holding by ttl; False when we do not hold the lease (any more).

        * The key no longer holds our token (expired, taken over): LOST, False.
        * Redis unreachable: keep believing (True) until ``valid_until``, since we
          stop acting there anyway; at or after it: LOST, False.
        * Renewed more than 2/3 ttl after the previous renewal: RENEWED_LATE.
        """
        with self._lock:
            holding = self._holding
            if holding is None or self._closed:
                return False
            try:
                client = self._get_client()
                renew = self._get_scripts(client)[1]
                sent = self._clock()
                ok = renew(keys=[self.lease_key, self.cluster_key],
                           args=[holding.token, self._ttl_ms, self.cluster_id or "", int(CLUSTER_KEY_TTL * 1000)],
                           client=client)
            except _REDIS_ERRORS as exc:
                self._note_down(exc, "renew the lease")
                now = self._clock()
                if now >= holding.valid_until:
                    self._lose(
                        holding,
                        f"Redis unreachable and the lease's validity ended "
                        f"{now - holding.valid_until:.3f} s ago",
                        redis_down=True,
                    )
                    return False
                holding.next_renew_at = min(now + self._renew_retry, holding.valid_until)
                return True
            self._note_up()
            if not int(ok):
                self._lose(holding, "the lease key no longer holds our token (it expired or another node took it)")
                return False
            since = sent - holding.last_renewed
            holding.last_renewed = sent
            holding.valid_until = sent + self.ttl - self.safety_margin
            holding.next_renew_at = sent + self.ttl / 3.0
            if since > self.ttl * 2.0 / 3.0:
                logger.warning(
                    "lease %r: renewed late, %.3f s after the previous renewal (ttl %.3g s); "
                    "is the scheduler loop blocked?", self.name, since, self.ttl,
                )
                self._emit(LeaseEvent.RENEWED_LATE, term=holding.term, since_last=since)
            return True

    def _lose(self, holding: _Holding, reason: str, **info: Any) -> None:
        self._holding = None
        logger.warning("lease %r: node %s lost the leadership (term %d): %s", self.name, self.node_id, holding.term, reason)
        self._emit(LeaseEvent.LOST, term=holding.term, reason=reason, **info)

    def maintain(self) -> bool:
        """Renew when due (every ttl/3; sooner after a failed renewal); returns :attr:`is_leader`.

        Makes no Redis call unless a renewal is due; does nothing when not holding.
        """
        holding = self._holding
        if holding is None:
            return False
        now = self._clock()
        if now >= holding.next_renew_at or now >= holding.valid_until:
            self.renew()
        return self.is_leader

    def next_renew_in(self) -> float:
        """Seconds until :meth:`maintain` should run again (never negative).

        While holding: until the next renewal is due, or until ``valid_until`` if
        that comes first. Not holding: ``ttl / 3`` (maintain has nothing to do).
        """
        holding = self._holding
        if holding is None:
            return self.ttl / 3.0
        return max(0.0, min(holding.next_renew_at, holding.valid_until) - self._clock())

    def retry_after(self) -> float:
        """Seconds to wait before the next :meth:`try_acquire`.

        Redis down: exponential back-off, 0.1 s doubling up to 2 s (with jitter).
        Lease held elsewhere: until that holder's key is due to expire (at most ttl).
        Holding it ourselves: :meth:`next_renew_in`.
        """
        if self._down_since is not None or self._failures:
            delay = min(MAX_BACKOFF, _FIRST_BACKOFF * (2 ** max(0, self._failures - 1)))
            return delay * random.uniform(0.75, 1.0)
        if self._holding is not None:
            return self.next_renew_in()
        if self._holder_expires_at is not None:
            return min(self.ttl, max(0.0, self._holder_expires_at - self._clock()))
        return 0.0

    def _forget(self, event: LeaseEvent, reason: str) -> None:
        """Drop our holding locally and delete the key if (and only if) it still holds our token."""
        holding, self._holding = self._holding, None
        token = holding.token if holding is not None else self._pending_token
        self._pending_token = None
        if token is None:
            return
        deleted = False
        try:
            client = self._get_client()
            release = self._get_scripts(client)[2]
            notice = f"{holding.term if holding else ''}:{self.node_id}"
            deleted = bool(int(release(keys=[self.lease_key], args=[token, self.channel, notice], client=client)))
        except _REDIS_ERRORS as exc:
            self._note_down(exc, "release the lease")
            logger.warning(
                "lease %r: could not delete the lease key (%s); it expires within %.3g s",
                self.name, type(exc).__name__, self.ttl,
            )
        except Exception:  # never raise from release/step_down/close
            logger.exception("lease %r: unexpected error while releasing", self.name)
        else:
            self._note_up()
        if holding is None:
            return  # an unconfirmed acquisition: nothing to report
        if event is LeaseEvent.RELEASED:
            logger.info(
                "lease %r: node %s released the leadership (term %d)%s", self.name, self.node_id, holding.term,
                "" if deleted else "; the key was no longer ours",
            )
        else:
            logger.warning(
                "lease %r: node %s stepped down (term %d): %s", self.name, self.node_id, holding.term, reason,
            )
        self._emit(event, term=holding.term, reason=reason, deleted=deleted)

    def release(self) -> None:
        """Give the lease up: delete our key and notify the standbys. Idempotent, never raises."""
        with self._lock:
            self._forget(LeaseEvent.RELEASED, "released")

    def step_down(self, reason: str, *, observed_term: Optional[int] = None) -> None:
        """Stop being leader because the claim store saw a newer term (StaleTermError).

        The key is deleted only if it still holds our token. Pass the term the
        claim store reported as *observed_term*: the next acquisition (by this
        node) then takes a term above it even if Redis lost its counter.
        """
        with self._lock:
            if observed_term is not None:
                try:
                    self._observe(int(observed_term))
                except (TypeError, ValueError):
                    pass
            self._forget(LeaseEvent.STEPPED_DOWN, str(reason))

    # ----------------------------------------------------------------- standby

    def _drop_pubsub(self) -> None:
        subscription, self._pubsub = self._pubsub, None
        if subscription is not None:
            subscription.close()

    def _subscribe(self, deadline: float) -> bool:
        """Subscribe to the release channel; True if the lease turned out to be free."""
        client = self._get_client()
        subscription = Subscription(client, self.channel)
        self._pubsub = subscription
        # Wait for the confirmation so that a release from now on is seen...
        if subscription.open(max(deadline - self._clock(), 1.0)) is NoticeTransport.POLL:
            logger.info("lease %r: this Redis Cluster has no sharded pub/sub (Redis 7+); standbys look at the "
                        "lease key every %.1f s instead of hearing a release", self.name, POLL_INTERVAL)
        # ...and a release before it is not missed: is the lease free right now?
        return self._look()

    def _look(self) -> bool:
        """Read the lease key's time to live; True when nobody holds the lease."""
        pttl = int(self._get_client().pttl(self.lease_key))
        self._note_up()
        if pttl == -2:
            return True
        self._holder_expires_at = self._clock() + (pttl / 1000.0 + 0.001 if pttl >= 0 else self.ttl)
        return False

    def wait_for_release(self, timeout: float) -> bool:
        """Standby: block up to *timeout* s for a release notice; True when one came.

        Also True at once if, when the subscription is (re)established, nobody
        holds the lease. Returns False early when the current holder's key is due
        to expire (so that the caller's next :meth:`try_acquire` comes right at
        expiry), and after *timeout*. Never raises: on a Redis error it sleeps
        for the rest of the timeout (at most 2 s) and returns False; the
        subscription is re-established on the next call.
        """
        start = self._clock()
        deadline = start + max(0.0, float(timeout))
        if self._closed:
            return False
        expires_at = self._holder_expires_at
        try:
            if self._pubsub is None:
                with self._lock:
                    if self._pubsub is None and self._subscribe(deadline):
                        return True
                expires_at = self._holder_expires_at
            capped = expires_at is not None and expires_at < deadline
            if capped:
                deadline = max(start, expires_at)
            subscription = self._pubsub
            while subscription is not None:
                remaining = deadline - self._clock()
                if remaining <= 0:
                    if capped:
                        self._holder_expires_at = None  # used up; try_acquire learns the next one
                    return False
                if subscription.transport is NoticeTransport.POLL:
                    time.sleep(min(remaining, POLL_INTERVAL))
                    if self._closed:
                        return False
                    if self._look():
                        self._holder_expires_at = None
                        return True
                    continue
                if subscription.wait(remaining):
                    self._holder_expires_at = None
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
                self._drop_pubsub()
                if self._closed:
                    return False
                if isinstance(exc, SubscriptionLost):
                    # A Redis Cluster moved the channel's slot (a failover): not an outage. The
                    # next call subscribes on the slot's new master and looks at the key first.
                    logger.info("lease %r: %s; subscribing again", self.name, exc)
                    return False
                if isinstance(exc, _REDIS_ERRORS) or isinstance(exc, (ValueError, AttributeError)):
                    # ValueError/AttributeError: redis-py's pub/sub on a socket closed under it.
                    self._note_down(exc, "wait for a release notice")
                else:
                    logger.exception("lease %r: unexpected error while waiting for a release", self.name)
            remaining = deadline - self._clock()
            if remaining > 0:
                time.sleep(min(remaining, MAX_BACKOFF))
            return False

    # ----------------------------------------------------------------- closing

    def close(self) -> None:
        """Release if held, then close the subscription and the client. Idempotent, never raises."""
        with self._lock:
            if self._closed:
                return
            try:
                self._forget(LeaseEvent.RELEASED, "closed")
            finally:
                self._closed = True
                self._drop_pubsub()
                client, self._client = self._client, None
                self._scripts = None
                if client is not None:
                    try:
                        client.close()
                    except Exception:
                        pass

    def __enter__(self) -> "RedisLease":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
