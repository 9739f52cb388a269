"""Failover of real ``celery beat`` replicas whose broker is RabbitMQ.

As in test_failover.py, three replicas run ``celery beat -S celery_cluster_beat.Scheduler``
with an ``every(1)`` schedule and claims in PostgreSQL, but the messages go to a RabbitMQ
vhost of the test's own. The lease still lives in Redis: the broker URL is not a Redis
URL, so ``cluster_beat_redis_url`` is set explicitly. An :class:`amqp_capture.AmqpWatcher`
consumes the queue and records every message with the occurrence and sender from its
headers.

The leader is killed (SIGKILL) or stopped (SIGTERM) with catch-up ``all``: every
occurrence from the first to the last seen reaches RabbitMQ exactly once, and every claim
row of that span is ``sent``. The check waits past ``claim_grace`` and a stale-claim sweep
after the new leader's first send, so a late resend by the sweep would be seen.
"""
from __future__ import annotations

import signal
import time
from datetime import timedelta

import pytest

from amqp_capture import AmqpWatcher
from cluster import Cluster, claim_rows, duplicates, kill_after_its_next_mark, kill_env, timeline
from procs import write_app

pytestmark = pytest.mark.slow

SECOND = timedelta(seconds=1)
EVERY_SECOND = "{'tick': {'task': 't.record', 'schedule': every(1)}}"
DEFAULT_TTL = 5.0
GRACE = 3


@pytest.fixture
def amqp_cluster_factory(tmp_path, rabbitmq_vhost):
    """``make(app) -> Cluster`` watching a RabbitMQ queue; stopped before the vhost is deleted."""
    made = []

    def make(app):
        cluster = Cluster(app, tmp_path, AmqpWatcher(app).__enter__())
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        cluster.stop_all()
        cluster.watcher.__exit__(None, None, None)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_leader_lost_on_rabbitmq_every_occurrence_reaches_the_broker_exactly_once(
        tmp_path, rabbitmq_vhost, redis_url, pg_url, amqp_cluster_factory, how):
    app = write_app(tmp_path, broker=rabbitmq_vhost, db_url=pg_url, redis_url=redis_url, schedule=EVERY_SECOND,
                    conf=f"{{'cluster_beat_catchup': 'all', 'cluster_beat_claim_grace': {GRACE}}}")
    cluster = amqp_cluster_factory(app)
    cluster.start(3, env=kill_env(tmp_path))
    old = cluster.steady_leader(timeout=90)
    old_proc = cluster.proc(old)

    if how == signal.SIGKILL:  # at a named point: nothing in flight, whatever the load
        lost_at = kill_after_its_next_mark(tmp_path, old_proc)
    else:
        lost_at = time.time()
        old_proc.signal(how)
    first_new = cluster.watcher.wait_for(lambda m: m.node != old and m.seen > lost_at, DEFAULT_TTL + 20,
                                         "a standby's first send after the leader went")
    # Past the claim grace and one more sweep (every grace / 3) after the takeover, plus room: a
    # claim left behind and resent by a sweep would reach the queue by now.
    time.sleep(GRACE + GRACE / 3 + 2)
    msgs = cluster.watcher.messages()
    cluster.stop_all()

    assert not old_proc.alive()
    assert not duplicates(msgs), f"occurrences sent twice: {duplicates(msgs)}\n{timeline(msgs)}"
    instants = [m.at for m in msgs]
    expected = [instants[0] + i * SECOND for i in range(int((instants[-1] - instants[0]).total_seconds()) + 1)]
    assert instants == expected, "occurrences lost:\n" + timeline(msgs)
    assert len({m.task_id for m in msgs}) == len(msgs)
    last_old = max(m.at for m in msgs if m.node == old)
    assert first_new.at == last_old + SECOND, timeline(msgs)
    assert all(m.at > last_old for m in msgs if m.node != old), timeline(msgs)
    assert msgs[-1].at.timestamp() > lost_at + GRACE, "the run after the failover was too short to see a resend"
    rows = [r for r in claim_rows(pg_url) if instants[0] <= r.scheduled_at <= instants[-1]]
    assert [r.status for r in rows] == ["sent"] * len(instants), rows
    print(f"{signal.Signals(how).name} on RabbitMQ: first send by a standby {first_new.seen - lost_at:.2f}s "
          f"after the signal, {len(msgs)} occurrences, none lost or twice")
