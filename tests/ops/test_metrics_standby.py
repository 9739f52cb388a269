"""A standby's ``/metrics`` carries the lease's term (issue 21, item 7).

``cluster_beat_lease_term`` was set from this node's own holdings only, so every standby said
``0.0``: a dashboard could not tell a standby that follows the current leader from one that lost
track. Now it is the latest term the node knows of, which a standby reads from the lease (the
holder's term, seen at each acquire attempt, or a higher one the claim store reported).

Two real Schedulers in this process, one lease on the real Redis, one SQLite claim file, each
with its HTTP server on a free port; ``/metrics`` is fetched over HTTP and parsed with
prometheus-client's own parser. The term counter starts at 41 so that the term is not a number
a node could show by chance.
"""
from __future__ import annotations

import time
import urllib.request
import uuid

import pytest
import redis
from celery import Celery
from prometheus_client.parser import text_string_to_metric_families

from celery_cluster_beat import every
from celery_cluster_beat.beat.scheduler import Scheduler
from celery_cluster_beat.leader.lease import lease_keys


def metric(base: str, name: str) -> float:
    with urllib.request.urlopen(base + "metrics", timeout=10) as resp:
        text = resp.read().decode()
    values = [s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name]
    assert len(values) == 1, (name, values)
    return values[0]


@pytest.mark.timeout(120)
def test_a_standby_shows_the_leaders_term(tmp_path, redis_url):
    cluster = f"term-{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(redis_url)
    client.set(lease_keys(cluster)[1], 41)  # the term counter: the next holding is term 42

    def app(node: str) -> Celery:
        a = Celery(cluster, broker=redis_url, set_as_current=False)
        a.conf.update(cluster_beat_db_url=f"sqlite:///{tmp_path}/claims.sqlite3", cluster_beat_redis_url=redis_url,
                      cluster_beat_cluster_name=cluster, cluster_beat_node_id=node, cluster_beat_http_port=0,
                      cluster_beat_lock_ttl=3, task_default_queue=f"q_{cluster}",
                      beat_schedule={"tick": {"task": "t.x", "schedule": every(3600), "overlap": "allow"}})
        return a

    made = []
    try:
        leader = Scheduler(app("leader"), lazy=False)
        made.append(leader)
        deadline = time.monotonic() + 60
        while not (leader._node.lease is not None and leader._node.lease.is_leader):
            assert time.monotonic() < deadline, "the first scheduler never took the lease"
            time.sleep(min(0.2, leader.tick()))
        standby = Scheduler(app("standby"), lazy=False)
        made.append(standby)
        lead_url, standby_url = leader._ops.url, standby._ops.url

        def both_ticked(seconds: float) -> None:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                time.sleep(max(0.0, min(0.2, leader.tick(), standby.tick(), end - time.monotonic())))

        deadline = time.monotonic() + 60
        while standby._node.lease is None or standby._node.lease.holder != "leader":
            assert time.monotonic() < deadline, "the standby never saw the leader"
            both_ticked(0.3)
        assert metric(lead_url, "cluster_beat_leader") == 1 and metric(lead_url, "cluster_beat_lease_term") == 42
        assert metric(standby_url, "cluster_beat_leader") == 0
        assert metric(standby_url, "cluster_beat_lease_term") == 42  # used to be 0.0
    finally:
        for sched in reversed(made):
            sched.close()
        client.delete(*client.keys(f"cluster_beat:{{{cluster}}}:*"), f"q_{cluster}")
        client.close()
