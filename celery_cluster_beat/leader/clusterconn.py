"""The lease's client for a Redis Cluster: ``redis+cluster://`` URLs, built on first use.

URL form (the scheme names the cluster, as ``sentinel://`` names Sentinel)::

    redis+cluster://[[user]:password@]host[:port][?option=value...]
    rediss+cluster://...                                  (TLS)
    redis+cluster://host1:port1;redis+cluster://host2:port2   (several seed nodes)

One reachable seed is enough: the client reads the cluster's topology (``CLUSTER
SLOTS``) from it and follows ``MOVED`` redirections and failovers on its own. A
database number other than 0 is refused (Redis Cluster has only database 0).

The lease keys of one cluster name share a hash tag, so every script runs on the one
master that serves their slot. What differs from a single Redis, and why:

* **Built on first use.** redis-py's ``RedisCluster`` connects in its constructor;
  :class:`ClusterClient` defers that to the first command, so that validating the
  settings, or building the client at start-up while the cluster is down, never
  blocks nor fails (the lease then backs off as for any outage).
* **Bounded calls.** The same ``socket_timeout`` / ``socket_connect_timeout`` as the
  single client, and a cluster-level retry of **one**: a dropped connection, or a
  cluster that is failing over, is retried once after the topology has been read
  again (redis-py's default is 10 retries with back-off, which would hold the
  scheduling loop for many seconds). A time-out is not retried, as on the single
  client: the lease has its own back-off. A ``MOVED`` reply is followed at once
  (it costs one round trip, not a retry).
* **Seeds learnt are shared.** Every client of one URL in a process (the lease, the
  change notices, the status page) also tries the nodes any of them has discovered, so
  a client made after the URL's only seed died still finds the cluster. A process
  *started* while every seed of its URL is down cannot: name several nodes (``;``),
  or a DNS name that resolves to live nodes (a managed service's configuration
  endpoint).
* **Errors are Redis errors.** ``RedisClusterException`` (no reachable node) is not a
  ``RedisError`` in redis-py; the lease treats it as one (see ``events.REDIS_ERRORS``).
"""
from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional, Tuple

import redis
from redis import cluster as _rc
from redis import exceptions as _rex
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

__all__ = ["CLUSTER_SCHEMES", "CLUSTER_NODE_KEYS", "ClusterClient", "LeaseRedisCluster", "is_cluster",
           "is_cluster_url"]

#: URL schemes of a Redis Cluster, and whether each means TLS.
CLUSTER_SCHEMES = {"redis+cluster": False, "rediss+cluster": True}
CLUSTER_DEFAULT_PORT = 6379

#: The connection options redis-py passes on to each node's connections (it drops any other silently,
#: so the URL parser refuses them instead). No ``db``: Redis Cluster has database 0 only.
CLUSTER_NODE_KEYS = frozenset(getattr(_rc, "REDIS_ALLOWED_KEYS", ())) - {
    "db", "host", "port", "retry", "connection_class", "connection_pool", "connection_pool_class",
    "unix_socket_path", "redis_connect_func", "nodes_flag", "cache", "cache_config",
}


def is_cluster_url(url: Any) -> bool:
    """Whether *url* names a Redis Cluster (``redis+cluster://`` or ``rediss+cluster://``)."""
    return isinstance(url, str) and url.strip().split("://", 1)[0].lower() in CLUSTER_SCHEMES


def is_cluster(client: Any) -> bool:
    """Whether *client* talks to a Redis Cluster (our lazy client or redis-py's own)."""
    return isinstance(client, (ClusterClient, RedisCluster))


class LeaseRedisCluster(RedisCluster):
    """redis-py's cluster client, retrying what is worth retrying once and time-outs never.

    A time-out on the node that serves the lease's slot would most likely time out
    again; the lease gives up on this call and backs off instead of blocking the
    scheduling loop for another ``socket_timeout``.
    """

    ERRORS_ALLOW_RETRY = tuple({_rex.ConnectionError, _rex.ClusterDownError,
                                getattr(_rex, "SlotNotCoveredError", _rex.ClusterDownError)})


def _one_retry() -> Dict[str, Any]:
    """The constructor argument that makes the cluster retry a failed command once."""
    if int(redis.__version__.split(".")[0]) >= 6:
        return {"retry": Retry(NoBackoff(), 1)}  # redis-py 6+: the cluster-level retry
    return {"cluster_error_retry_attempts": 1}  # redis-py 4.5-5.x (there ``retry`` is per connection)


# Nodes discovered by any client of a seed list, in this process: (seeds) -> [(host, port), ...].
_DISCOVERED: Dict[Tuple[Tuple[str, int], ...], List[Tuple[str, int]]] = {}
_DISCOVERED_LOCK = threading.Lock()


def _remember(seeds: Tuple[Tuple[str, int], ...], cluster: RedisCluster) -> None:
    try:
        nodes = [(node.host, int(node.port)) for node in cluster.get_nodes()]
    except Exception:  # a client being torn down: nothing to learn
        return
    if nodes:
        with _DISCOVERED_LOCK:
            _DISCOVERED[seeds] = nodes


class ClusterClient:
    """A :class:`LeaseRedisCluster` made on first use; otherwise used like the client itself.

    Attribute access other than :meth:`close` builds the cluster client (reading the
    topology from a seed node); a failure raises redis-py's error, and the next
    access tries again.
    """

    def __init__(self, startup_nodes: List[Tuple[str, int]], kwargs: Dict[str, Any], where: str) -> None:
        self._startup_nodes = list(startup_nodes)
        self._kwargs = dict(kwargs)
        self._where = where  # the URL, password masked
        self._cluster: Optional[LeaseRedisCluster] = None
        self._build_lock = threading.Lock()

    @property
    def cluster(self) -> LeaseRedisCluster:
        """The redis-py client; connects to a seed node the first time."""
        cluster = self._cluster
        if cluster is None:
            with self._build_lock:
                cluster = self._cluster
                if cluster is None:
                    seeds = tuple(self._startup_nodes)
                    with _DISCOVERED_LOCK:
                        learnt = [n for n in _DISCOVERED.get(seeds, ()) if n not in seeds]
                    cluster = self._cluster = LeaseRedisCluster(
                        startup_nodes=[ClusterNode(host, port) for host, port in (*seeds, *learnt)],
                        require_full_coverage=False,  # our slot is enough: another shard's outage is not ours
                        **_one_retry(),
                        **self._kwargs,
                    )
                    _remember(seeds, cluster)
        return cluster

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_cluster", "_kwargs", "_startup_nodes", "_where", "_build_lock"):
            raise AttributeError(name)
        return getattr(self.cluster, name)

    def close(self) -> None:
        with self._build_lock:
            cluster, self._cluster = self._cluster, None
        if cluster is not None:
            _remember(tuple(self._startup_nodes), cluster)
            cluster.close()

    def __repr__(self) -> str:
        state = "connected" if self._cluster is not None else "not connected yet"
        return f"<ClusterClient {self._where} ({state})>"
