"""The ledger with real ``celery worker`` processes, a real Redis broker and a real PostgreSQL.

The test publishes beat's messages itself (``send_task`` with the occurrence's task id and
``cluster_beat_*`` headers), so it can deliver one occurrence twice on purpose. Every run
of a task body pushes a record (task id, pid, attempt, wall time) to a Redis list of the
test's own: "ran once" is counted there, after the ledger row says the second delivery
was handled (its ``duplicates`` counter), so the count cannot be read too early.
"""
from __future__ import annotations

import json
import os
import signal
import time
import uuid
from datetime import datetime, timedelta, timezone
from typing import List

import pytest
import redis
from celery import Celery

import procs
from celery_cluster_beat.schedules.instants import utc_iso
from celery_cluster_beat.schedules.occurrence import Occurrence
from celery_cluster_beat.store import ClaimStore

UTC = timezone.utc

TASKS = '''
import json as _json
import redis as _redis
from pathlib import Path as _Path
from celery_cluster_beat import LedgerTask

_rec = _redis.Redis.from_url({redis_url!r})
RUNS_KEY = {runs_key!r}
MARKER = _Path({marker!r})


def _push(task, **extra):
    occ = task.occurrence
    _rec.rpush(RUNS_KEY, _json.dumps(dict(id=task.request.id, pid=os.getpid(), t=time.time(),
                                          attempt=occ.attempt if occ else None,
                                          schedule=occ.schedule if occ else None, **extra)))


@app.task(bind=True, base=LedgerTask, name="t.once")
def once(self, seconds):
    _push(self)
    time.sleep(seconds)
    return seconds


@app.task(bind=True, base=LedgerTask, name="t.flaky", max_retries=3)
def flaky(self):
    _push(self)
    if self.request.retries == 0:
        raise self.retry(countdown=0.5)
    return "done"


@app.task(bind=True, base=LedgerTask, name="t.long", acks_late=True)
def long(self):
    _push(self)
    if not MARKER.exists():  # the first run hangs until its worker is killed
        MARKER.write_text("x")
        time.sleep(300)
    return "rerun"
'''


class Setup:
    def __init__(self, tmp, redis_url: str, db_url: str, conf: str = "{}") -> None:
        self.tmp = tmp
        self.db_url = db_url
        self.runs_key = "ccbtest:ledger:" + uuid.uuid4().hex[:10]
        self.redis = redis.Redis.from_url(redis_url)
        tasks = TASKS.format(redis_url=redis_url, runs_key=self.runs_key, marker=str(tmp / "marker"))
        self.app = procs.write_app(tmp, broker=redis_url, db_url=db_url, schedule="{}", conf=conf, tasks=tasks)
        self.producer = Celery("ledger-producer", broker=redis_url, set_as_current=False)
        self.store = ClaimStore(db_url, node_id="beat-under-test")
        self.store.open()
        self.workers: List[procs.Proc] = []

    def worker(self, *extra: str, concurrency: int = 4) -> procs.Proc:
        proc = procs.start_worker(self.app, self.tmp, f"worker{len(self.workers)}", *extra, concurrency=concurrency)
        self.workers.append(proc)
        procs.wait_for(lambda: "ready." in proc.log() or not proc.alive(), 60, what="the worker to be ready")
        assert proc.alive(), proc.log()[-3000:]
        return proc

    def occurrence(self, name: str, *, claim: bool = True) -> Occurrence:
        """An occurrence as beat would have claimed and sent it."""
        o = Occurrence(name, datetime.now(UTC).replace(microsecond=0) - timedelta(seconds=1))
        if claim:
            assert self.store.claim([o]) == [o]
            assert self.store.mark_sent([o]) == 1
        return o

    def publish(self, task: str, o: Occurrence, args=(), max_run_time: float = 600.0) -> None:
        headers = {"cluster_beat_schedule": o.schedule, "cluster_beat_scheduled_at": utc_iso(o.at),
                   "cluster_beat_node": "beat-under-test", "cluster_beat_catchup": False,
                   "cluster_beat_attempt": 1, "cluster_beat_max_run_time": max_run_time}
        self.producer.send_task(task, args, task_id=o.task_id, headers=headers, queue=self.app.queue)

    def row(self, o: Occurrence):
        rows = [r for r in self.store.claims(o.schedule) if r.scheduled_at == o.at]
        return rows[0] if rows else None

    def wait_row(self, o: Occurrence, predicate, timeout: float, what: str):
        found = []

        def check() -> bool:
            r = self.row(o)
            if r is not None and predicate(r):
                found[:] = [r]
                return True
            return False

        try:
            procs.wait_for(check, timeout, interval=0.2, what=what)
        except AssertionError:
            raise AssertionError(f"{what}; row {self.row(o)}\n{self.logs()}") from None
        return found[0]

    def runs(self, task_id: str) -> List[dict]:
        return [r for r in (json.loads(x) for x in self.redis.lrange(self.runs_key, 0, -1)) if r["id"] == task_id]

    def logs(self) -> str:
        return "\n".join(f"--- {p.log_path.name}\n{p.log()[-3000:]}" for p in self.workers)

    def close(self) -> None:
        for p in self.workers:
            p.stop(timeout=5)
        self.store.close()
        try:
            self.redis.delete(self.runs_key, self.app.queue)
        finally:
            self.redis.close()


@pytest.fixture
def setup(tmp_path, redis_url, pg_url):
    made: List[Setup] = []

    def make(**kw) -> Setup:
        s = Setup(tmp_path, redis_url, pg_url, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("pool", ["prefork", "threads"])
def test_an_occurrence_published_twice_runs_once(setup, pool):
    s = setup()
    worker = s.worker("-P", pool, concurrency=4)
    o = s.occurrence(f"dup-{pool}")
    # Both copies at once: with 4 slots free, two processes (threads) race for the run.
    s.publish("t.once", o, (1.0,))
    s.publish("t.once", o, (1.0,))
    r = s.wait_row(o, lambda r: r.duplicates == 1 and r.run_state == "succeeded", 60,
                   "the run to succeed and the second delivery to be counted as a duplicate")
    runs = s.runs(o.task_id)
    assert len(runs) == 1, (runs, s.logs())
    assert runs[0]["schedule"] == o.schedule and runs[0]["attempt"] == 1
    assert r.worker and r.worker_pid and r.runtime >= 0.9 and r.finished_at >= r.started_at
    assert "duplicate delivery" in worker.log()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_celery_retry_continues_the_occurrence(setup):
    s = setup()
    s.worker(concurrency=2)
    o = s.occurrence("retrying")
    s.publish("t.flaky", o)
    r = s.wait_row(o, lambda r: r.run_state == "succeeded", 60, "the retried run to succeed")
    runs = s.runs(o.task_id)
    assert [(x["attempt"], x["schedule"]) for x in runs] == [(1, o.schedule), (2, o.schedule)], s.logs()
    assert r.duplicates is None and r.run_error is None
    # The original message delivered again later: the occurrence has run, it is not run again.
    s.publish("t.flaky", o)
    s.wait_row(o, lambda r: r.duplicates == 1, 60, "the late copy to be counted as a duplicate")
    assert len(s.runs(o.task_id)) == 2


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_acks_late_a_run_whose_worker_was_killed_runs_again_only_after_max_run_time(setup):
    """The worker is SIGKILLed mid-run; Redis hands the unacknowledged message out again
    after its visibility timeout (4 s), which is before max_run_time (10 s): that
    delivery is not run, but checks back, and the run happens once max_run_time has passed."""
    max_run_time = 10.0
    s = setup(conf='{"broker_transport_options": {"visibility_timeout": 4, "unacked_restore_interval": 1, "unacked_restore_throttle": 1}}')
    first_worker = s.worker(concurrency=1)
    o = s.occurrence("killed")
    s.publish("t.long", o, max_run_time=max_run_time)
    started = s.wait_row(o, lambda r: r.run_state == "running", 60, "the first run to start")
    os.killpg(first_worker.pid, signal.SIGKILL)
    first_worker.popen.wait(10)
    second_worker = s.worker(concurrency=2)
    r = s.wait_row(o, lambda r: r.run_state == "succeeded", 100, "the run to be re-run and succeed")
    runs = s.runs(o.task_id)
    assert len(runs) == 2, (runs, s.logs())
    gap = runs[1]["t"] - runs[0]["t"]
    assert gap >= max_run_time - 1.0, (gap, s.logs())  # by the database clock; one host: within a second
    assert (r.started_at - started.started_at).total_seconds() >= max_run_time
    assert r.worker != started.worker and runs[1]["pid"] != runs[0]["pid"]
    assert "duplicate delivery" in second_worker.log() or gap >= max_run_time, s.logs()
