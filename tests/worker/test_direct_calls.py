"""A ledger task called as a function is a plain call, inside a run too (worker/calls.py).

Only the call Celery's tracer makes for a delivery goes through the ledger. A task that
calls itself (recursion) or another ledger task directly inside its run used to be
judged a second delivery of its own occurrence: ``Ignore`` aborted the outer body and
the row said ``succeeded``. Here the outer body must complete, the inner calls must
run, and the row must record one run, succeeded, with no duplicate and no signal for
the inner calls: with a real worker (prefork and threads) and in this process.
"""
from __future__ import annotations

import json
import uuid
from datetime import datetime, timedelta, timezone
from typing import List

import pytest
import redis
from celery import Celery
from celery.app.trace import build_tracer

import procs
from known_schedules import known_schedule
from celery_cluster_beat import signals
from celery_cluster_beat.schedules.instants import utc_iso
from celery_cluster_beat.schedules.occurrence import Occurrence
from celery_cluster_beat.signals import RunOutcome
from celery_cluster_beat.store import ClaimStore
from celery_cluster_beat.worker import LedgerTask
from celery_cluster_beat.worker.calls import MARK

UTC = timezone.utc
AT = datetime(2021, 3, 4, 5, 6, tzinfo=UTC)  # in the past: the ledger refuses an instant ahead of the database's clock

TASKS = '''
import redis as _redis
from celery_cluster_beat import LedgerTask

_rec = _redis.Redis.from_url({redis_url!r})
RUNS_KEY = {runs_key!r}


@app.task(bind=True, base=LedgerTask, name="t.outer")
def outer(self, depth):
    _rec.rpush(RUNS_KEY, "outer:%d" % depth)
    if depth > 0:
        outer(depth - 1)  # itself, directly
    helper(depth)  # another ledger task, directly
    _rec.rpush(RUNS_KEY, "outer-done:%d" % depth)
    return depth


@app.task(bind=True, base=LedgerTask, name="t.helper")
def helper(self, depth):
    _rec.rpush(RUNS_KEY, "helper:%d" % depth)
'''

#: What the bodies record for outer(2): every level runs and completes, the helper at each.
EXPECTED = ["outer:2", "outer:1", "outer:0", "helper:0", "outer-done:0", "helper:1", "outer-done:1",
            "helper:2", "outer-done:2"]


def headers_for(o: Occurrence) -> dict:
    return {"cluster_beat_schedule": o.schedule, "cluster_beat_scheduled_at": utc_iso(o.at),
            "cluster_beat_node": "beat-under-test", "cluster_beat_catchup": False, "cluster_beat_attempt": 1,
            "cluster_beat_max_run_time": 600.0}


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_direct_calls_inside_a_delivered_run_are_plain_calls(tmp_path, redis_url, pg_url, pool):
    runs_key = "ccbtest:direct:" + uuid.uuid4().hex[:10]
    app = procs.write_app(tmp_path, broker=redis_url, db_url=pg_url, schedule="{}",
                          tasks=TASKS.format(redis_url=redis_url, runs_key=runs_key))
    rec = redis.Redis.from_url(redis_url)
    store = ClaimStore(pg_url, node_id="beat-under-test")
    store.open()
    producer = Celery("direct-producer", broker=redis_url, set_as_current=False)
    worker = procs.start_worker(app, tmp_path, "worker", "-P", pool, concurrency=2)
    try:
        procs.wait_for(lambda: "ready." in worker.log() or not worker.alive(), 60, what="the worker")
        assert worker.alive(), worker.log()[-3000:]
        o = Occurrence(f"direct-{pool}-{uuid.uuid4().hex[:6]}",
                       datetime.now(UTC).replace(microsecond=0) - timedelta(seconds=1))
        assert store.claim([o]) == [o] and store.mark_sent([o]) == 1
        known_schedule(pg_url, o.schedule, "t.outer")
        producer.send_task("t.outer", (2,), task_id=o.task_id, headers=headers_for(o), queue=app.queue)

        def row():
            [r] = [r for r in store.claims(o.schedule) if r.scheduled_at == o.at]
            return r

        try:
            procs.wait_for(lambda: row().run_state not in (None, "running"), 60, interval=0.2,
                           what="the run to end")
        except AssertionError:
            raise AssertionError(f"row {row()}\n{worker.log()[-4000:]}") from None
        r = row()
        ran = [x.decode() for x in rec.lrange(runs_key, 0, -1)]
        assert ran == EXPECTED, (ran, worker.log()[-4000:])
        assert (r.run_state, r.duplicates, r.run_error) == ("succeeded", None, None), r
        log = worker.log()
        assert "duplicate delivery" not in log and log.count("Task t.outer[") == 2, log[-4000:]  # received, succeeded
        assert f"Task t.outer[{o.task_id}] succeeded" in log
    finally:
        worker.stop(timeout=10)
        store.close()
        producer.close()
        rec.delete(runs_key, app.queue)
        rec.close()


# -- in this process: Celery's tracer through apply(), a SQLite ledger --------------------------

@pytest.fixture
def inproc(tmp_path):
    url = f"sqlite:///{tmp_path}/ledger.sqlite3"
    app = Celery("direct-inproc", set_as_current=False)
    app.conf.cluster_beat_db_url = url
    app.conf.beat_schedule = {name: {"task": "t.outer", "schedule": 60} for name in ("inproc", "forged")}
    ran: List[str] = []

    @app.task(shared=False, base=LedgerTask, bind=True, name="t.outer")
    def outer(self, depth):
        ran.append(f"outer:{depth}")
        if depth > 0:
            outer(depth - 1)
        helper(depth)
        ran.append(f"outer-done:{depth}")
        return depth

    @app.task(shared=False, base=LedgerTask, bind=True, name="t.helper")
    def helper(self, depth):
        ran.append(f"helper:{depth}")
        return depth

    reported: List[dict] = []

    def receiver(sender=None, **kw):
        reported.append(kw)

    signals.run_handled.connect(receiver, weak=False)
    store = ClaimStore(url, node_id="reader")
    store.open()
    yield outer, helper, ran, reported, store
    store.close()
    signals.run_handled.disconnect(receiver)


def test_direct_calls_outside_any_worker_are_plain_calls(inproc):
    outer, helper, ran, reported, store = inproc
    assert outer(2) == 2 and helper(5) == 5
    assert ran == EXPECTED + ["helper:5"]
    assert store.claims() == [] and reported == []


def test_direct_calls_inside_a_run_are_plain_calls_and_the_run_is_recorded_once(inproc):
    outer, helper, ran, reported, store = inproc
    o = Occurrence("inproc", AT)
    store.claim([o])
    result = outer.apply((2,), task_id=o.task_id, headers=headers_for(o))
    assert (result.state, result.result) == ("SUCCESS", 2)
    assert ran == EXPECTED
    [r] = store.claims("inproc")
    assert (r.run_state, r.duplicates) == ("succeeded", None)
    assert [e["outcome"] for e in reported] == [RunOutcome.STARTED, RunOutcome.SUCCEEDED]
    # The delivery itself is still judged: a second one of the occurrence is not run.
    assert outer.apply((2,), task_id=o.task_id, headers=headers_for(o)).state == "IGNORED"
    assert ran == EXPECTED and store.claims("inproc")[0].duplicates == 1


def test_a_header_cannot_pass_a_delivery_off_as_a_call_inside_a_run(inproc):
    """A worker turns message headers into request attributes; one named like the mark changes nothing."""
    outer, helper, ran, reported, store = inproc
    task = outer._get_current_object()
    o = Occurrence("forged", AT)
    store.claim([o])
    trace = build_tracer(task.name, task, eager=True, app=task.app)
    request = {"id": o.task_id, "task": task.name, "is_eager": True, **headers_for(o), MARK: True}
    trace(o.task_id, (0,), {}, dict(request))
    trace(o.task_id, (0,), {}, dict(request))
    assert ran == ["outer:0", "helper:0", "outer-done:0"]
    [r] = store.claims("forged")
    assert (r.run_state, r.duplicates) == ("succeeded", 1)
