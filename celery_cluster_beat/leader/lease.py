"""The Redis leader lease: one beat replica schedules, the others stand by.

This module is the lease's state machine, the part the scheduler drives: standby →
leader (:meth:`RedisLease.try_acquire`), renewals (:meth:`~RedisLease.maintain`), and
back to standby by losing it, releasing it or stepping down. Each rule it applies has
a module of its own, so that each can be read, and checked, on its own:

* the keys, the lease value and the tokened Lua scripts, modelled on redis-py's
  ``redis.lock.Lock`` (:mod:`.scripts`);
* the term (fencing token) and the local deadline ``valid_until``, which keep two
  leaders from acting at once (:mod:`.fencing`);
* the cluster id key that ties the lease to one claim store (:mod:`.identity`);
* the standby's wait for a release notice (pub/sub, sharded pub/sub or polling),
  which makes a handover fast (:mod:`.standby`);
* the events, and Redis trouble turned into return values with back-off, logged once
  per outage (:mod:`.events`).

On a Redis Cluster (``redis+cluster://``) a failover of the master serving the lease's
slot loses the lease at worst for one ttl: the holder cannot renew while no master
serves the slot, stops at ``valid_until``, and whoever acquires next (the same node or
another) takes a higher term. A replica promoted before it received the last ``INCR``
may hand out a term again, as a Redis restarted without data does: the claim store's
fence refuses an equal term from another node, and the node then steps down and
acquires above the term it was shown (``step_down(observed_term=...)``).

Thread safety: the methods that talk to Redis serialise on an internal lock, so
``release()``/``close()`` may be called from a signal handler or another thread
while the scheduling loop is in ``maintain()``; :attr:`is_leader`, :attr:`term`
and :attr:`valid_until` never block.
"""
from __future__ import annotations

import logging
import secrets
import threading
import time
from typing import Any, Callable, Optional

import redis

from ..errors import ConfigError
from .channels import NoticeTransport
from .events import REDIS_ERRORS, LeaseEvent, LeaseReporter
from .fencing import Holding, LeaseTiming, TermFloor
from .identity import ClusterIdentity, ForeignClusterError, cluster_key
from .scripts import AcquireStatus, LeaseScripts, lease_keys, parse_value
from .standby import ReleaseWaiter

__all__ = ["LeaseEvent", "RedisLease", "lease_keys", "cluster_key", "ForeignClusterError"]

#: The lease value's reader, under the name ``ops.report`` imports it by.
_parse_value = parse_value

logger = logging.getLogger("celery_cluster_beat.lease")


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
    :param redis_url: where the lease is, named (masked) when this node is refused.
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
        redis_url: Optional[str] = None,
    ) -> None:
        problems = []
        if not isinstance(name, str) or not name:
            problems.append(f"lease name must be a non-empty string, not {name!r}")
        if not isinstance(node_id, str) or not node_id:
            problems.append(f"lease node_id must be a non-empty string, not {node_id!r}")
        timing = LeaseTiming.checked(ttl, safety_margin, problems)
        if problems:
            raise ConfigError(problems)

        self._factory = client_factory
        self.name = name
        self.node_id = node_id
        self._timing = timing
        self.ttl = timing.ttl
        self.safety_margin = timing.safety_margin
        self._clock = clock
        self.lease_key, self.term_key, self.channel = lease_keys(name)
        self.cluster_key = cluster_key(name)
        self.cluster_id = cluster_id
        self._identity = ClusterIdentity(name=name, node_id=node_id, cluster_id=cluster_id, redis_url=redis_url)

        self._lock = threading.RLock()
        self._client: Optional[redis.Redis] = None
        self._scripts: Optional[LeaseScripts] = None
        self._closed = False
        self._holding: Optional[Holding] = None
        # Token of an acquire attempt whose reply we never got: the key may be ours.
        self._pending_token: Optional[str] = None
        # Highest term seen anywhere (our holdings, other holders, the claim
        # store): the counter is raised to it before the next INCR, so terms keep
        # increasing even if Redis lost the counter (restart without persistence).
        self._term_floor = TermFloor()
        # node_id of the holder as the last failed try_acquire told us.
        self._holder: Optional[str] = None
        self._events = LeaseReporter(name=name, node_id=node_id, on_event=on_event, clock=clock)
        self._standby = ReleaseWaiter(
            name=name, lease_key=self.lease_key, channel=self.channel, ttl=self.ttl, get_client=self._get_client,
            reporter=self._events, lock=self._lock, clock=clock, closed=lambda: self._closed,
        )

    # ------------------------------------------------------------------ state

    @property
    def term(self) -> Optional[int]:
        """Term of the current holding; None when we hold nothing."""
        holding = self._holding
        return holding.term if holding is not None else None

    @property
    def known_term(self) -> int:
        """The latest term this node knows of (0: none yet): its own holding's, else the holder's it
        last saw, or a higher one the claim store reported. Never blocks (a standby's metrics read it)."""
        return self._term_floor.value

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
        return self._events.redis_down

    @property
    def holder(self) -> Optional[str]:
        """node_id of the leader as last seen by :meth:`try_acquire` (None if unknown)."""
        return self._holder

    @property
    def foreign_cluster(self) -> Optional[str]:
        """The other cluster's id when the lease belongs to another claim store."""
        return self._identity.foreign

    @property
    def notice_transport(self) -> Optional[NoticeTransport]:
        """How this standby hears a release (pub/sub, sharded, or polling); None until it first waited."""
        subscription = self._standby.subscription
        return subscription.transport if subscription is not None else None

    def __repr__(self) -> str:
        state = f"leader term={self.term}" if self._holding is not None else "standby"
        return f"<RedisLease {self.name!r} node={self.node_id!r} {state}>"

    # --------------------------------------------------------------- plumbing

    def _get_client(self) -> redis.Redis:
        if self._client is None:
            self._client = self._factory()
        return self._client

    def _get_scripts(self, client: redis.Redis) -> LeaseScripts:
        if self._scripts is None:
            self._scripts = LeaseScripts(client, lease_key=self.lease_key, term_key=self.term_key,
                                         channel=self.channel, cluster_key=self.cluster_key)
        return self._scripts

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
                scripts = self._get_scripts(client)
                sent = self._clock()
                reply = scripts.acquire(token, self._timing.ttl_ms, self.node_id, self._term_floor.value,
                                        self._identity.script_args())
            except REDIS_ERRORS as exc:
                # The script may have run and only the reply been lost: try the
                # same token next time, which finds and keeps that holding.
                self._pending_token = token
                self._events.down(exc, "acquire the lease")
                return False
            received = self._clock()
            self._pending_token = None
            self._events.up()
            if reply.status is AcquireStatus.FOREIGN:
                self._identity.refused(reply.value)
                return False
            self._identity.accepted()
            if reply.status is AcquireStatus.HELD:
                term, _ = parse_value(reply.value)
                if term is None:  # cannot happen with our script; be loud rather than wrong
                    logger.error("lease %r: unexpected lease value %r", self.name, reply.value)
                    return False
                self._term_floor.observe(term)
                self._holding = self._timing.hold(token, term, sent)
                self._holder, self._standby.holder_expires_at = self.node_id, None
                logger.info(
                    "lease %r: node %s is now the leader (term %d, ttl %.3g s)",
                    self.name, self.node_id, term, self.ttl,
                )
                self._events.emit(LeaseEvent.ACQUIRED, term=term)
                return self.is_leader
            term, holder = parse_value(reply.value)
            self._term_floor.observe(term)
            self._standby.saw_holder(reply.pttl, received)
            if holder != self._holder:
                logger.info(
                    "lease %r: standing by, leader is %s (term %s)", self.name, holder or "?", term,
                )
                self._holder = holder
            return False

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
            except REDIS_ERRORS as exc:
                self._events.down(exc, "check which claim store the lease serves")
                return False
            self._events.up()
        self._identity.check(theirs)
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
                scripts = self._get_scripts(client)
                sent = self._clock()
                ok = scripts.renew(holding.token, self._timing.ttl_ms, self._identity.script_args())
            except REDIS_ERRORS as exc:
                self._events.down(exc, "renew the lease")
                now = self._clock()
                if now >= holding.valid_until:
                    self._lose(
                        holding,
                        f"Redis unreachable and the lease's validity ended "
                        f"{now - holding.valid_until:.3f} s ago",
                        redis_down=True,
                    )
                    return False
                self._timing.retry_renewal(holding, now)
                return True
            self._events.up()
            if not ok:
                self._lose(holding, "the lease key no longer holds our token (it expired or another node took it)")
                return False
            since = self._timing.extend(holding, sent)
            if self._timing.is_late(since):
                logger.warning(
                    "lease %r: renewed late, %.3f s after the previous renewal (ttl %.3g s); "
                    "is the scheduler loop blocked?", self.name, since, self.ttl,
                )
                self._events.emit(LeaseEvent.RENEWED_LATE, term=holding.term, since_last=since)
            return True

    def _lose(self, holding: Holding, reason: str, **info: Any) -> None:
        self._holding = None
        logger.warning("lease %r: node %s lost the leadership (term %d): %s", self.name, self.node_id, holding.term, reason)
        self._events.emit(LeaseEvent.LOST, term=holding.term, reason=reason, **info)

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
        backoff = self._events.backoff()
        if backoff is not None:
            return backoff
        if self._holding is not None:
            return self.next_renew_in()
        expires_at = self._standby.holder_expires_at
        if expires_at is not None:
            return min(self.ttl, max(0.0, expires_at - self._clock()))
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
            scripts = self._get_scripts(client)
            deleted = scripts.release(token, f"{holding.term if holding else ''}:{self.node_id}")
        except REDIS_ERRORS as exc:
            self._events.down(exc, "release the lease")
            logger.warning(
                "lease %r: could not delete the lease key (%s); it expires within %.3g s",
                self.name, type(exc).__name__, self.ttl,
            )
        except Exception:  # never raise from release/step_down/close
            logger.exception("lease %r: unexpected error while releasing", self.name)
        else:
            self._events.up()
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
        self._events.emit(event, term=holding.term, reason=reason, deleted=deleted)

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
                    self._term_floor.observe(int(observed_term))
                except (TypeError, ValueError):
                    pass
            self._forget(LeaseEvent.STEPPED_DOWN, str(reason))

    # ----------------------------------------------------------------- standby

    def wait_for_release(self, timeout: float) -> bool:
        """Standby: block up to *timeout* s for a release notice; True when one came.

        Also True at once if, when the subscription is (re)established, nobody
        holds the lease. Returns False early when the current holder's key is due
        to expire (so that the caller's next :meth:`try_acquire` comes right at
        expiry), and after *timeout*. Never raises: on a Redis error it sleeps
        for the rest of the timeout (at most 2 s) and returns False; the
        subscription is re-established on the next call.
        """
        return self._standby.wait(timeout)

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
                self._standby.drop()
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
