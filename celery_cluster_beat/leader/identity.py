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
instead of standing by forever. Nothing here talks to Redis but :func:`adopt`: the lease does, and hands
over what it read.

**A rebuilt claim store.** A claim database rebuilt from scratch (restored empty, recreated, moved)
gets a new cluster id, and the key still names the old one for up to 30 days: every beat of the
cluster refuses to start. The refusal says so, and ``celery -A proj cluster-beat adopt-store``
(:mod:`celery_cluster_beat.ops.adopt`) moves the key to the current store with :func:`adopt`: one
script that changes it only while nobody holds the lease (a live holder serves the old store:
two stores sent from would each resend what the other sent) and only from the id the operator
was shown (a compare-and-set). A node of the old store that comes back afterwards is refused
like any node of another store.
"""
from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Optional, Sequence, Tuple

from ..errors import ConfigError
from .scripts import text as _text
from .urls import mask_url

__all__ = ["CLUSTER_KEY_TTL", "ClusterIdentity", "ForeignClusterError", "cluster_key", "adopt", "AdoptStatus",
           "AdoptReply", "adopt_command"]

logger = logging.getLogger("celery_cluster_beat.lease")

#: How long the cluster id key outlives the last acquisition: a decommissioned cluster's
#: key goes away, a running one's is refreshed by every acquisition.
CLUSTER_KEY_TTL = 30 * 86400.0


def cluster_key(name: str) -> str:
    """The key naming the claim store (by its cluster id) that lease *name* belongs to."""
    return f"cluster_beat:{{{name}}}:cluster"


class ForeignClusterError(ConfigError):
    """The lease is used by nodes of another claim store: two histories behind one leader."""


def adopt_command(argv: Optional[Sequence[str]] = None) -> str:
    """``celery -A <app> cluster-beat adopt-store`` with the ``-A`` this process was started with
    (``celery -A proj beat``: ``proj``), else a placeholder for it."""
    argv = list(sys.argv if argv is None else argv)
    app = None
    for i, arg in enumerate(argv):
        if arg in ("-A", "--app") and i + 1 < len(argv):
            app = argv[i + 1]
        elif arg.startswith("--app="):
            app = arg[len("--app="):]
        elif arg.startswith("-A") and len(arg) > 2:
            app = arg[2:]
    return f"celery -A {app or '<app>'} cluster-beat adopt-store"


class ClusterIdentity:
    """This node's claim store as the lease *name* sees it.

    :param cluster_id: the id of the claim store this node writes to; None (or ``''``)
        checks nothing and records nothing.
    """

    def __init__(self, *, name: str, node_id: str, cluster_id: Optional[str], redis_url: Optional[str] = None) -> None:
        self.name = name
        self.node_id = node_id
        self.cluster_id = cluster_id
        self.key = cluster_key(name)
        #: Where the key is (shown masked in the refusal); None: not said.
        self.redis_url = redis_url
        #: The other cluster's id when the lease belongs to another claim store.
        self.foreign: Optional[str] = None

    def script_args(self) -> Tuple[str, int]:
        """Our cluster id (``''`` for none) and the key's time to live in ms, as the scripts take them."""
        return self.cluster_id or "", int(CLUSTER_KEY_TTL * 1000)

    def message(self, theirs: str) -> str:
        """One line: the key and where it is, the store it names and ours, and what to do."""
        where = f" on {mask_url(self.redis_url)}" if self.redis_url else ""
        return (
            f"the lease {self.name!r} serves claim store {theirs} (Redis key {self.key}{where}), but this "
            f"node's claim store is {self.cluster_id}. If the claim database was rebuilt, stop the beats "
            f"still running on the old one and run `{adopt_command()}`; otherwise point cluster_beat_db_url "
            "at the cluster's database, or give this node a cluster_beat_cluster_name of its own"
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


# KEYS[1] lease key, KEYS[2] cluster id key; ARGV[1] the id the operator was shown ('' for none),
# ARGV[2] the id to record, ARGV[3] how long the cluster id key lives (ms).
# {1, previous id} when recorded; {0, holder's lease value, its pttl} while the lease is held
# (the old store is live); {-1, current id} when the key no longer names ARGV[1].
ADOPT_SCRIPT = """
local holder = redis.call('get', KEYS[1])
if holder then
    return {0, holder, redis.call('pttl', KEYS[1])}
end
local current = redis.call('get', KEYS[2]) or ''
if current ~= ARGV[1] then
    return {-1, current}
end
redis.call('set', KEYS[2], ARGV[2], 'PX', ARGV[3])
return {1, current}
"""


class AdoptStatus(IntEnum):
    """The first element of the adopt script's reply."""

    CHANGED = -1  # the key names another store than the one expected: nothing written
    HELD = 0  # somebody holds the lease: nothing written
    DONE = 1  # the key names the new store now


@dataclass(frozen=True)
class AdoptReply:
    status: AdoptStatus
    #: DONE: the id replaced ('' for none); CHANGED: the id the key names now; HELD: the lease value.
    value: str
    #: HELD: the holder's key's time to live in ms.
    pttl: int = -1


def adopt(client: Any, name: str, *, expected: Optional[str], new: str) -> AdoptReply:
    """Make the lease *name* serve claim store *new*, atomically: only while nobody holds the lease
    and while its cluster id key still names *expected* (None: no key). Redis errors raise."""
    from .scripts import lease_keys

    reply = client.eval(ADOPT_SCRIPT, 2, lease_keys(name)[0], cluster_key(name), expected or "", new,
                        int(CLUSTER_KEY_TTL * 1000))
    status = AdoptStatus(int(reply[0]))
    return AdoptReply(status, _text(reply[1]), int(reply[2]) if len(reply) > 2 else -1)
