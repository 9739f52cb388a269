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
from known_schedules import known_schedule
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


@app.task(bind=True, base=LedgerTask, name="t.endless", max_retries=None)
def endless(self, retry_at):
    _push(self, retries=self.request.retries)
    if self.request.retries in retry_at:
        raise self.retry(countdown=0)
    return self.request.retries


def _slow(task, seconds):
    """The first run of an occurrence takes *seconds*; a re-run is quick."""
    _push(task)
    nth = _rec.incr(RUNS_KEY + ":n:" + task.request.id)
    _rec.expire(RUNS_KEY + ":n:" + task.request.id, 600)
    time.sleep(seconds if nth == 1 else 0.5)
    return nth


@app.task(bind=True, base=LedgerTask, name="t.slow", acks_late=True)
def slow(self, seconds):
    return _slow(self, seconds)


@app.task(bind=True, base=LedgerTask, name="t.slow_requeue", acks_late=True, reject_on_worker_lost=True)
def slow_requeue(self, seconds):
    return _slow(self, seconds)


@app.task(bind=True, base=LedgerTask, name="t.limited", time_limit=3)
def limited(self):
    _push(self)
    time.sleep(60)


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

    def publish(self, task: str, o: Occurrence, args=(), max_run_time: float = 600.0, retries: int = 0) -> None:
        known_schedule(self.db_url, o.schedule, task)
        headers = {"cluster_beat_schedule": o.schedule, "cluster_beat_scheduled_at": utc_iso(o.at),
                   "cluster_beat_node": "beat-under-test", "cluster_beat_catchup": False,
                   "cluster_beat_attempt": 1, "cluster_beat_max_run_time": max_run_time}
        self.producer.send_task(task, args, task_id=o.task_id, headers=headers, queue=self.app.queue,
                                retries=retries)

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


#: Redis hands an unacknowledged message out again after 5 s, to any worker, even while the
#: run is alive; worker processes count as alive for *grace* s after their last heartbeat. Database
#: calls are bounded at 2 s, so a grace from 5.4 s is allowed (2 x db_timeout + grace / 4).
SHORT_VISIBILITY = ('{"broker_transport_options": {"visibility_timeout": 5, "unacked_restore_interval": 1, '
                    '"unacked_restore_throttle": 1}, "cluster_beat_db_timeout": 2, "cluster_beat_worker_grace": %s}')


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_acks_late_a_run_whose_whole_worker_was_killed_runs_again_once_its_heartbeat_expired(setup):
    """The worker (main process and pool child) is SIGKILLed mid-run: nobody records the loss.
    Redis hands the unacknowledged message out again; the run is taken over only once the dead
    process's heartbeat is older than its grace (6 s) by the database's clock, and once."""
    grace = 6.0
    s = setup(conf=SHORT_VISIBILITY % grace)
    first_worker = s.worker(concurrency=1)
    o = s.occurrence("killed")
    s.publish("t.long", o)
    started = s.wait_row(o, lambda r: r.run_state == "running", 60, "the first run to start")
    second_worker = s.worker(concurrency=2)
    # Redis hands the message out again while the run is alive: a duplicate, which leaves one copy.
    s.wait_row(o, lambda r: (r.duplicates or 0) >= 1, 60, "a redelivery of the live run")
    procs.wait_for(lambda: "checking again in" in second_worker.log(), 15, what="the check copy logged")
    os.killpg(first_worker.pid, signal.SIGKILL)
    killed_at = time.time()
    first_worker.popen.wait(10)
    r = s.wait_row(o, lambda r: r.run_state == "succeeded", 100, "the run to be re-run and succeed")
    runs = s.runs(o.task_id)
    assert len(runs) == 2, (runs, s.logs())
    # Its last heartbeat was at most grace/4 before the kill: not re-run before 3/4 of the grace.
    assert runs[1]["t"] - killed_at >= 0.75 * grace - 0.5, (runs, killed_at, s.logs())
    assert r.worker != started.worker and runs[1]["pid"] != runs[0]["pid"]
    assert r.run_process != started.run_process
    time.sleep(grace + 3)  # any check copy still pending comes and goes: a duplicate
    assert len(s.runs(o.task_id)) == 2, s.logs()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_long_acks_late_run_starts_once_while_its_child_lives_and_reruns_once_after_sigkill(setup):
    """A 2-minute body, Redis visibility 5 s: the message is handed out again every few seconds
    while the run is alive; none of those deliveries runs (one "check later" copy at a time).
    The pool child is then SIGKILLed: its worker's main process records the run lost and Celery
    requeues it (task_reject_on_worker_lost): it runs again, once."""
    grace = 5.5
    s = setup(conf=SHORT_VISIBILITY % grace)
    worker = s.worker(concurrency=2)  # a free child handles the redeliveries meanwhile
    o = s.occurrence("long-body")
    s.publish("t.slow_requeue", o, (120.0,))
    s.wait_row(o, lambda r: r.run_state == "running", 60, "the run to start")
    # Several visibility timeouts and graces pass; the redeliveries are counted, never run.
    s.wait_row(o, lambda r: (r.duplicates or 0) >= 3, 90, "redeliveries of the live run counted as duplicates")
    time.sleep(10)
    runs = s.runs(o.task_id)
    assert len(runs) == 1, (runs, s.logs())
    live = s.row(o)
    assert live.run_state == "running" and live.run_process.split(":")[-2] == str(runs[0]["pid"])
    os.kill(runs[0]["pid"], signal.SIGKILL)
    r = s.wait_row(o, lambda r: r.run_state == "succeeded", 60, "the lost run to be re-run and succeed")
    assert r.run_process != live.run_process
    time.sleep(grace + 4)  # pending check copies and the requeued message come and go
    runs = s.runs(o.task_id)
    assert len(runs) == 2, (runs, s.logs())
    assert s.row(o).run_state == "succeeded"
    assert "lost; its redelivery runs it again" in worker.log(), s.logs()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_hard_time_limit_and_a_terminating_revoke_are_recorded_by_the_main_process(setup):
    """The pool child is killed by the worker (hard time limit) or by a revoke(terminate=True):
    it records nothing itself; the worker's main process ends the row ``failed`` with the reason,
    so the run does not read ``running`` and the guard is free."""
    s = setup(conf='{"cluster_beat_db_timeout": 2, "cluster_beat_worker_grace": 5.5}')
    s.worker(concurrency=2)
    timed, killed, termed = s.occurrence("time-limited"), s.occurrence("revoked-kill"), s.occurrence("revoked-term")
    s.publish("t.limited", timed)
    s.publish("t.slow", killed, (120.0,))
    s.wait_row(killed, lambda r: r.run_state == "running", 60, "the run to be revoked to start")
    # The row says running a moment before the body notes its run: revoked in between, the body
    # would never have run, and "ran once, never again" below could not be told from "never ran".
    procs.wait_for(lambda: len(s.runs(killed.task_id)) == 1, 60, interval=0.05, what="the body to start")
    # SIGKILL: the body records nothing; SIGTERM reaches it as SystemExit (it records 'lost', acks_late):
    # either way the main process's verdict stands, as Celery acknowledged the message.
    s.producer.control.revoke(killed.task_id, terminate=True, signal="SIGKILL")
    r = s.wait_row(timed, lambda r: r.run_state == "failed", 60, "the time limit to be recorded")
    assert r.run_error.startswith("TimeLimitExceeded") and r.finished_at is not None, r
    s.publish("t.slow", termed, (120.0,))
    s.wait_row(termed, lambda r: r.run_state == "running", 60, "the second run to be revoked to start")
    procs.wait_for(lambda: len(s.runs(termed.task_id)) == 1, 60, interval=0.05, what="the second body to start")
    s.producer.control.revoke(termed.task_id, terminate=True)
    for o in (killed, termed):
        r = s.wait_row(o, lambda r: r.run_state == "failed", 60, "the terminating revoke to be recorded")
        assert r.run_error.startswith("revoked (terminated)") and r.finished_at is not None, r
    time.sleep(6.5)  # past the grace: none runs again
    assert [len(s.runs(o.task_id)) for o in (timed, killed, termed)] == [1, 1, 1], s.logs()
    states = s.store.run_states([(o.schedule, o.at) for o in (timed, killed, termed)])
    assert {st.run_state for st in states.values()} == {"failed"}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_retry_ten_thousand_of_an_unbounded_task_runs_and_its_duplicate_does_not(setup):
    """``max_retries=None``: retries have no upper bound, so attempt 10,000 is an attempt like
    any other. The test publishes the message of retry 9,998 (as Celery would after 9,998
    retries); from there the worker's own ``self.retry`` publishes 9,999 and 10,000: each
    continues the run, and a copy of the retry-10,000 message is a duplicate."""
    s = setup()
    s.worker(concurrency=2)
    o = s.occurrence("ten-thousand")
    s.publish("t.endless", o, ([9998, 9999],), retries=9998)
    r = s.wait_row(o, lambda r: r.run_state == "succeeded", 60, "retry 10,000 to run and succeed")
    runs = s.runs(o.task_id)
    assert [(x["retries"], x["attempt"], x["schedule"]) for x in runs] == [
        (9998, 9999, o.schedule), (9999, 10000, o.schedule), (10000, 10001, o.schedule)], s.logs()
    assert r.duplicates is None and r.run_error is None
    # The retry-10,000 message delivered again: that attempt has run, it does not run again.
    s.publish("t.endless", o, ([9998, 9999],), retries=10000)
    s.wait_row(o, lambda r: r.duplicates == 1, 60, "the copy of retry 10,000 to be counted as a duplicate")
    assert len(s.runs(o.task_id)) == 3 and s.row(o).run_state == "succeeded", s.logs()
