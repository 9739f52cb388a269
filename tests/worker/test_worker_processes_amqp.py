"""The ledger with a real ``celery worker`` on RabbitMQ: a real broker redelivery is not run again.

Same set-up as test_worker_processes.py (its :class:`Setup` and task module: each run of a
body pushes a record to a Redis list; the ledger is a real PostgreSQL), with the broker
swapped for a RabbitMQ vhost of the test's own. The task module also records every
delivery that reaches a task (``task_prerun``) with the broker's ``redelivered`` flag, so
"the broker delivered it twice" is observed, not assumed.

The redelivery is RabbitMQ's own: an ``acks_late`` task runs to its end while its worker's
main process is frozen (SIGSTOP), so the acknowledgement is never sent; the worker is then
killed, RabbitMQ puts the unacknowledged message back (``redelivered=True``), and a second
worker receives it. The body must not run again, the duplicate is counted on the row, and
the message is acknowledged (not left to loop).
"""
from __future__ import annotations

import json
import os
import signal
import time
import uuid
from typing import List

import pytest
import redis
from celery import Celery

import procs
from amqp_capture import Capture
from celery_cluster_beat.store import ClaimStore
from test_worker_processes import TASKS, Setup

pytestmark = pytest.mark.slow

DELIVERIES = '''
from celery import signals as _signals
DELIVERIES_KEY = __DELIVERIES_KEY__


@_signals.task_prerun.connect
def _delivered(task_id=None, task=None, **kw):
    info = task.request.delivery_info or {}
    _rec.rpush(DELIVERIES_KEY, _json.dumps(dict(id=task_id, pid=os.getpid(), redelivered=bool(info.get("redelivered")))))


@app.task(bind=True, base=LedgerTask, name="t.finish_late", acks_late=True)
def finish_late(self, seconds):
    _push(self)
    time.sleep(seconds)
    return seconds
'''


class AmqpSetup(Setup):
    """:class:`Setup` with the broker on RabbitMQ (records and the ledger as there)."""

    def __init__(self, tmp, broker: str, redis_url: str, db_url: str, conf: str = "{}") -> None:
        self.tmp = tmp
        self.db_url = db_url
        self.broker = broker
        self.runs_key = "ccbtest:ledger:" + uuid.uuid4().hex[:10]
        self.deliveries_key = self.runs_key + ":deliveries"
        self.redis = redis.Redis.from_url(redis_url)
        tasks = TASKS.format(redis_url=redis_url, runs_key=self.runs_key, marker=str(tmp / "marker"))
        tasks += DELIVERIES.replace("__DELIVERIES_KEY__", repr(self.deliveries_key))
        self.app = procs.write_app(tmp, broker=broker, db_url=db_url, schedule="{}", conf=conf, tasks=tasks)
        self.producer = Celery("ledger-producer", broker=broker, set_as_current=False)
        self.store = ClaimStore(db_url, node_id="beat-under-test")
        self.store.open()
        self.workers: List[procs.Proc] = []

    def deliveries(self, task_id: str) -> List[dict]:
        return [d for d in (json.loads(x) for x in self.redis.lrange(self.deliveries_key, 0, -1)) if d["id"] == task_id]

    def close(self) -> None:
        self.producer.close()
        self.redis.delete(self.deliveries_key)
        super().close()


@pytest.fixture
def setup(tmp_path, rabbitmq_vhost, redis_url, pg_url):
    made: List[AmqpSetup] = []

    def make(**kw) -> AmqpSetup:
        s = AmqpSetup(tmp_path, rabbitmq_vhost, redis_url, pg_url, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


@pytest.mark.timeout(150)
def test_rabbitmq_redelivers_a_finished_unacked_run_and_the_body_does_not_run_again(setup):
    s = setup()
    first = s.worker(concurrency=1)
    o = s.occurrence("redelivered")
    s.publish("t.finish_late", o, (2.0,))
    s.wait_row(o, lambda r: r.run_state == "running", 60, "the run to start")
    first.signal(signal.SIGSTOP)  # the main process: it would send the ack once the pool child returns
    s.wait_row(o, lambda r: r.run_state == "succeeded", 30, "the pool child to finish the run")
    os.killpg(first.pid, signal.SIGKILL)  # the connection drops with the message unacknowledged
    first.popen.wait(10)

    second = s.worker(concurrency=2)
    r = s.wait_row(o, lambda r: r.duplicates == 1, 60, "the redelivery to be counted as a duplicate")
    procs.wait_for(lambda: len(s.deliveries(o.task_id)) == 2, 10, what="both deliveries recorded")
    deliveries = s.deliveries(o.task_id)
    assert [d["redelivered"] for d in deliveries] == [False, True], (deliveries, s.logs())
    assert deliveries[1]["pid"] != deliveries[0]["pid"]
    runs = s.runs(o.task_id)
    assert len(runs) == 1, (runs, s.logs())
    assert r.run_state == "succeeded" and r.runtime >= 1.9
    procs.wait_for(lambda: "duplicate delivery" in second.log(), 10, what="the duplicate logged")

    # The duplicate was acknowledged: stopped, the worker hands nothing back to the queue.
    assert second.stop() == 0, second.log()[-3000:]
    capture = Capture(s.broker)
    try:
        assert capture.get(s.app.queue) == []
    finally:
        capture.close()


@pytest.mark.timeout(120)
def test_an_occurrence_published_twice_to_rabbitmq_runs_once(setup):
    s = setup()
    worker = s.worker("-P", "prefork", concurrency=4)
    o = s.occurrence("dup-amqp")
    s.publish("t.once", o, (1.0,))
    s.publish("t.once", o, (1.0,))
    r = s.wait_row(o, lambda r: r.duplicates == 1 and r.run_state == "succeeded", 60,
                   "the run to succeed and the second delivery to be counted as a duplicate")
    runs = s.runs(o.task_id)
    assert len(runs) == 1, (runs, s.logs())
    assert [d["redelivered"] for d in s.deliveries(o.task_id)] == [False, False]
    assert r.worker and r.runtime >= 0.9
    assert "duplicate delivery" in worker.log()


@pytest.mark.timeout(150)
def test_acks_late_worker_killed_mid_run_rabbitmq_redelivery_runs_once_the_heartbeat_expired(setup):
    """The whole worker dies inside the body (nobody records it): RabbitMQ redelivers at once
    (``redelivered=True``). That delivery is not run while the dead process's heartbeat is younger
    than its grace (6 s); it leaves one copy that re-runs the occurrence once it is older."""
    grace = 6.0
    s = setup(conf='{"cluster_beat_db_timeout": 2, "cluster_beat_worker_grace": %s}' % grace)
    first = s.worker(concurrency=1)
    o = s.occurrence("killed-amqp")
    s.publish("t.long", o)
    started = s.wait_row(o, lambda r: r.run_state == "running", 60, "the first run to start")
    second = s.worker(concurrency=2)  # ready before the kill: the redelivery reaches it at once
    os.killpg(first.pid, signal.SIGKILL)
    killed_at = time.time()
    first.popen.wait(10)
    r = s.wait_row(o, lambda r: r.run_state == "succeeded", 90, "the occurrence to be re-run and succeed")

    deliveries = s.deliveries(o.task_id)
    runs = s.runs(o.task_id)
    assert len(runs) == 2, (runs, deliveries, s.logs())
    # first delivery (run, killed), RabbitMQ's redelivery (not run), the check copy (runs)
    assert [d["redelivered"] for d in deliveries] == [False, True, False], (deliveries, s.logs())
    assert runs[1]["t"] - killed_at >= 0.75 * grace - 0.5, (runs, killed_at, s.logs())
    assert r.duplicates == 1 and r.worker != started.worker, r
    assert "duplicate delivery" in second.log() and "checking again in" in second.log(), second.log()[-3000:]
    assert deliveries[1]["pid"] != runs[0]["pid"]  # received by the second worker


@pytest.mark.timeout(150)
@pytest.mark.parametrize("requeue", [True, False], ids=["reject_on_worker_lost", "default"])
def test_a_sigkilled_pool_child_is_recorded_by_its_worker_and_rerun_only_when_requeued(setup, requeue):
    """A long acks_late body; its pool child is SIGKILLed. The worker's main process records the
    end on the row: with task_reject_on_worker_lost RabbitMQ gets the message back and its
    redelivery runs the occurrence again at once (once); without, Celery acknowledges it and
    stores FAILURE: the row ends ``failed`` with the reason and nothing runs again."""
    grace = 5.5
    s = setup(conf='{"cluster_beat_db_timeout": 2, "cluster_beat_worker_grace": %s}' % grace)
    worker = s.worker(concurrency=2)
    o = s.occurrence(f"child-killed-{requeue}")
    s.publish("t.slow_requeue" if requeue else "t.slow", o, (120.0,))
    s.wait_row(o, lambda r: r.run_state == "running", 60, "the run to start")
    time.sleep(2)
    [first] = s.runs(o.task_id)
    os.kill(first["pid"], signal.SIGKILL)
    if requeue:
        r = s.wait_row(o, lambda r: r.run_state == "succeeded", 60, "the lost run to be re-run and succeed")
        assert r.run_process.split(":")[-2] != str(first["pid"])
        assert "lost; its redelivery runs it again" in worker.log(), s.logs()
    else:
        r = s.wait_row(o, lambda r: r.run_state == "failed", 60, "the lost run to be recorded failed")
        assert r.run_error.startswith("WorkerLostError") and "SIGKILL" in r.run_error, r
        assert r.finished_at is not None
    time.sleep(grace + 3)  # past the grace: nothing else runs it
    runs = s.runs(o.task_id)
    assert len(runs) == (2 if requeue else 1), (runs, s.deliveries(o.task_id), s.logs())
    assert s.row(o).run_state == ("succeeded" if requeue else "failed")
