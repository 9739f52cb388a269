"""Real ``celery beat`` replicas whose leader lease is on a Redis Cluster (``redis+cluster://``).

The replicas run an ``every(1)`` schedule with claims in PostgreSQL; the broker (where the
watcher reads what was sent) is the plain Redis, the lease is on a six-node Redis Cluster
(``tests/redis_cluster.py``, one per module). The leader is stopped (SIGTERM), killed
(SIGKILL), and the cluster master serving the lease's slot is killed under the running
replicas: each time a replica leads again within the bound, and no occurrence reaches the
broker twice.
"""
from __future__ import annotations

import signal
import time

import pytest

from celery_cluster_beat.leader.lease import lease_keys
from cluster import duplicates, kill_after_its_next_mark, kill_env, timeline
from procs import write_app

pytestmark = pytest.mark.slow

EVERY_SECOND = "{'tick': {'task': 't.record', 'schedule': every(1)}}"
TTL = 5.0  # the default cluster_beat_lock_ttl


@pytest.mark.timeout(180)
def test_beats_on_a_cluster_lease_hand_over_on_sigterm_and_fail_over_on_sigkill_nothing_twice(
        tmp_path, redis_url, pg_url, cluster_factory, redis_cluster):
    app = write_app(tmp_path, broker=redis_url, db_url=pg_url, redis_url=redis_cluster.url, schedule=EVERY_SECOND)
    cluster = cluster_factory(app)
    cluster.start(3, env=kill_env(tmp_path))
    first = cluster.steady_leader()

    # SIGTERM: the leader releases the lease (a sharded notice on the slot's master) and a standby
    # sends the next occurrence.
    termed_at = time.time()
    cluster.proc(first).signal(signal.SIGTERM)
    after_term = cluster.watcher.wait_for(lambda m: m.node != first and m.seen > termed_at, 20,
                                          "a standby's first send after SIGTERM of the leader")
    assert cluster.proc(first).popen.wait(15) == 0
    second = cluster.steady_leader()

    # SIGKILL: nobody releases; the last standby takes over when the dead leader's key expires.
    killed_at = kill_after_its_next_mark(tmp_path, cluster.proc(second))  # nothing in flight
    after_kill = cluster.watcher.wait_for(lambda m: m.node not in (first, second) and m.seen > killed_at, TTL + 20,
                                          "the last standby's first send after SIGKILL of the leader")
    time.sleep(2.5)  # a late duplicate would show up now
    msgs = cluster.watcher.messages()
    logs = cluster.logs()
    cluster.stop_all()

    print(f"cluster lease: SIGTERM handover {after_term.seen - termed_at:.2f} s, "
          f"SIGKILL failover {after_kill.seen - killed_at:.2f} s")
    assert not duplicates(msgs), f"occurrences sent twice: {duplicates(msgs)}\n{timeline(msgs)}"
    # handover: the next due second (plus room for a loaded machine), not a lease ttl
    assert after_term.seen - termed_at < 2.5, timeline(msgs)
    # failover: the key expires at most ttl after the dead leader's last renewal
    assert after_kill.seen - killed_at <= TTL + 1.5, timeline(msgs)
    assert "Traceback" not in logs, logs


@pytest.mark.timeout(180)
def test_beats_survive_the_death_of_the_master_that_serves_the_lease_slot(
        tmp_path, redis_url, pg_url, cluster_factory, redis_cluster):
    app = write_app(tmp_path, broker=redis_url, db_url=pg_url, redis_url=redis_cluster.url, schedule=EVERY_SECOND)
    cluster = cluster_factory(app)
    cluster.start(2)
    cluster.steady_leader()

    master = redis_cluster.master_of(lease_keys(app.module)[0])
    killed_at = time.time()
    redis_cluster.kill(master)
    promoted = None
    deadline = time.monotonic() + 30
    while promoted in (None, master):
        assert time.monotonic() < deadline, "no replica was promoted"
        time.sleep(0.1)
        try:
            promoted = redis_cluster.master_of(lease_keys(app.module)[0])
        except Exception:
            promoted = None
    promoted_at = time.time()
    # A replica leads again on the new master: occurrences keep reaching the broker. (The leader
    # may keep sending throughout: its claims are in PostgreSQL, and it stops only when its lease's
    # validity runs out without a renewal.)
    cluster.watcher.wait_for(lambda m: m.seen > promoted_at + TTL, TTL + 25,
                             "sends after the lease's master was replaced")
    leader = cluster.steady_leader(runs=3, timeout=30)
    msgs = cluster.watcher.messages()
    logs = cluster.logs()
    alive = [p.alive() for p in cluster.procs]
    cluster.stop_all()

    print(f"lease master {master} killed; replica {promoted} promoted {promoted_at - killed_at:.2f} s later; "
          f"leader {leader}")
    assert all(alive), f"a beat died with the Redis master:\n{logs}"
    assert not duplicates(msgs), f"occurrences sent twice: {duplicates(msgs)}\n{timeline(msgs)}"
    # at worst the lease was lost for one ttl after the master died (plus the promotion, and room):
    # no second without a send longer than that
    after = sorted({m.at for m in msgs if m.seen > killed_at - 1})
    gaps = [(b - a).total_seconds() for a, b in zip(after, after[1:])]
    assert max(gaps, default=0) <= TTL + (promoted_at - killed_at) + 2, timeline(msgs)
    assert "Traceback" not in logs, logs
