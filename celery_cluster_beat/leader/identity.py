"""Which claim store a lease serves: the cluster id key, and the refusal of a node of another store.

A lease is named after the cluster (``cluster_beat_cluster_name``), never after a URL:
a key must not publish anything derived from a password. But two clusters can then
share a name by mistake, and two claim databases behind one lease would each keep a
history of their own and resend what the other sent. So the lease records, in a key
next to it, the id of the claim store its holders write to::

    cluster_beat:{<name>}:cluster    the claim store's cluster id; refreshed by every
                                     acquisition and renewal, expires 30 days after the last

The acquire script (:mod:`.scripts`) refuses a node whose store's id differs from the one
recorded, and only a node that takes the lease writes the id, so a refused node cannot
claim the name. At start-up beat asks first (:meth:`RedisLease.check_cluster`), so a
misconfigured node stops with a message saying what to change (:class:`ForeignClusterError`)
instead of standing by forever. Nothing here talks to Redis: the lease does, and hands over what it read.
"""
from __future__ import annotations

import logging
from typing import Any, Optional, Tuple

from ..errors import ConfigError
from .scripts import text as _text

__all__ = ["CLUSTER_KEY_TTL", "ClusterIdentity", "ForeignClusterError", "cluster_key"]

logger = logging.getLogger("celery_cluster_beat.lease")

#: How long the cluster id key outlives the last acquisition: a decommissioned cluster's
#: key goes away, a running one's is refreshed by every acquisition.
CLUSTER_KEY_TTL = 30 * 86400.0


def cluster_key(name: str) -> str:
    """The key naming the claim store (by its cluster id) that lease *name* belongs to."""
    return f"cluster_beat:{{{name}}}:cluster"


class ForeignClusterError(ConfigError):
    """The lease is used by nodes of another claim store: two histories behind one leader."""


class ClusterIdentity:
    """This node's claim store as the lease *name* sees it.

    :param cluster_id: the id of the claim store this node writes to; None (or ``''``)
        checks nothing and records nothing.
    """

    def __init__(self, *, name: str, node_id: str, cluster_id: Optional[str]) -> None:
        self.name = name
        self.node_id = node_id
        self.cluster_id = cluster_id
        self.key = cluster_key(name)
        #: The other cluster's id when the lease belongs to another claim store.
        self.foreign: Optional[str] = None

    def script_args(self) -> Tuple[str, int]:
        """Our cluster id (``''`` for none) and the key's time to live in ms, as the scripts take them."""
        return self.cluster_id or "", int(CLUSTER_KEY_TTL * 1000)

    def message(self, theirs: str) -> str:
        return (
            f"node {self.node_id} writes to claim store {self.cluster_id}, but the lease {self.name!r} "
            f"belongs to the nodes of claim store {theirs}: two claim databases behind one leader would "
            "each keep a history of their own and resend what the other sent. Point cluster_beat_db_url "
            "at the same database on every node of the cluster, or give this one its own "
            f"cluster_beat_cluster_name (Redis key {self.key} names the store in use)."
        )

    def refused(self, theirs: Any) -> None:
        """The acquire script refused us for store *theirs*: say so once per other store."""
        theirs = _text(theirs)
        if theirs != self.foreign:
            self.foreign = theirs
            logger.error("lease %r: %s", self.name, self.message(theirs))

    def accepted(self) -> None:
        """The acquire script accepted our store (we hold the lease, or another node of ours does)."""
        self.foreign = None

    def check(self, recorded: Any) -> None:
        """Raise :class:`ForeignClusterError` when *recorded* (the key's value, None if unset) is not ours."""
        if recorded is not None and _text(recorded) != self.cluster_id:
            raise ForeignClusterError(self.message(_text(recorded)))
