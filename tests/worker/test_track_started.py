"""``task_track_started=True`` and the ledger: a duplicate delivery never writes to the result backend.

Celery's tracer stores STARTED before the task is called, so a duplicate the ledger
refuses used to write STARTED over the real run's SUCCESS, FAILURE or RETRY (and over a
running run's own STARTED). The real-process tests deliver an occurrence, wait for its
result in a real Redis result backend, deliver it again, and once the ledger row has
counted the duplicate (the count is written after the point where the tracer used to
store STARTED) compare the backend's stored bytes: unchanged. The in-process tests pin
how the ``track_started`` setting is kept (worker/tracking.py).
"""
from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone
from typing import List

import pytest
import redis
from celery import Celery
from celery.app.task import Context

import procs
from known_schedules import known_schedule
from celery_cluster_beat.schedules.instants import utc_iso
from celery_cluster_beat.schedules.occurrence import Occurrence
from celery_cluster_beat.store import ClaimStore
from celery_cluster_beat.worker import LedgerTask
from celery_cluster_beat.worker.tracking import tracks_started

UTC = timezone.utc

TASKS = '''
from pathlib import Path as _Path
from celery_cluster_beat import LedgerTask

RELEASE = _Path({release!r})


@app.task(base=LedgerTask, name="t.ok")
def ok():
    return "ok"


@app.task(base=LedgerTask, name="t.bad")
def bad():
    raise ValueError("bad value")


@app.task(bind=True, base=LedgerTask, name="t.retrying", max_retries=1)
def retrying(self):
    raise self.retry(countdown=600, exc=KeyError("later"))  # RETRY stays in the backend for the test


@app.task(base=LedgerTask, name="t.running")
def running():
    deadline = time.monotonic() + 90
    while not RELEASE.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    return "released"
'''

#: Prior state -> (task, backend state the first delivery leaves before the duplicate comes).
CASES = {
    "success": ("t.ok", "SUCCESS"),
    "failure": ("t.bad", "FAILURE"),
    "retry": ("t.retrying", "RETRY"),
    "running": ("t.running", "STARTED"),
}


class Setup:
    def __init__(self, tmp, redis_url: str, db_url: str) -> None:
        self.tmp = tmp
        self.db_url = db_url
        tasks = TASKS.format(release=str(tmp / "release"))
        self.app = procs.write_app(tmp, broker=redis_url, backend=redis_url, db_url=db_url, schedule="{}",
                                   conf='{"task_track_started": True}', tasks=tasks)
        self.producer = Celery("track-producer", broker=redis_url, backend=redis_url, set_as_current=False)
        self.redis = redis.Redis.from_url(redis_url)
        self.store = ClaimStore(db_url, node_id="beat-under-test")
        self.store.open()
        self.worker = None
        self.ids: List[str] = []

    def start_worker(self) -> None:
        # prefork, two children: a duplicate of a running run lands in the other child (another pid).
        self.worker = procs.start_worker(self.app, self.tmp, "worker", concurrency=2)
        procs.wait_for(lambda: "ready." in self.worker.log() or not self.worker.alive(), 60, what="the worker")
        assert self.worker.alive(), self.worker.log()[-3000:]

    def occurrence(self, name: str) -> Occurrence:
        o = Occurrence(f"{name}-{uuid.uuid4().hex[:8]}", datetime.now(UTC).replace(microsecond=0) - timedelta(seconds=1))
        assert self.store.claim([o]) == [o] and self.store.mark_sent([o]) == 1
        self.ids.append(o.task_id)
        return o

    def publish(self, task: str, o: Occurrence) -> None:
        known_schedule(self.db_url, o.schedule, task)
        headers = {"cluster_beat_schedule": o.schedule, "cluster_beat_scheduled_at": utc_iso(o.at),
                   "cluster_beat_node": "beat-under-test", "cluster_beat_catchup": False,
                   "cluster_beat_attempt": 1, "cluster_beat_max_run_time": 600.0}
        self.producer.send_task(task, (), task_id=o.task_id, headers=headers, queue=self.app.queue)

    def stored(self, o: Occurrence) -> bytes:
        """The result backend's record of the task, as stored (bytes)."""
        return self.redis.get(f"celery-task-meta-{o.task_id}") or b""

    def state(self, o: Occurrence) -> str:
        return self.producer.AsyncResult(o.task_id).state

    def row(self, o: Occurrence):
        rows = [r for r in self.store.claims(o.schedule) if r.scheduled_at == o.at]
        return rows[0] if rows else None

    def wait(self, predicate, what: str, timeout: float = 60) -> None:
        try:
            procs.wait_for(predicate, timeout, interval=0.1, what=what)
        except AssertionError:
            raise AssertionError(f"{what}\n{self.worker.log()[-4000:] if self.worker else ''}") from None

    def close(self) -> None:
        (self.tmp / "release").write_text("x")
        if self.worker is not None:
            self.worker.stop(timeout=10)
        self.store.close()
        try:
            self.redis.delete(self.app.queue, *(f"celery-task-meta-{i}" for i in self.ids))
        finally:
            self.redis.close()
            self.producer.close()


@pytest.fixture
def setup(tmp_path, redis_url, pg_url):
    s = Setup(tmp_path, redis_url, pg_url)
    yield s
    s.close()


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("prior", list(CASES))
def test_a_duplicate_delivery_leaves_the_result_backend_as_it_was(setup, prior):
    task, state = CASES[prior]
    s = setup
    s.start_worker()
    o = s.occurrence(prior)
    s.publish(task, o)
    s.wait(lambda: s.state(o) == state, f"the first delivery to leave {state} in the result backend")
    before = s.stored(o)
    assert before, "nothing stored"
    s.publish(task, o)
    s.wait(lambda: (s.row(o).duplicates or 0) >= 1, "the ledger to count the second delivery as a duplicate")
    after = s.stored(o)
    assert after == before, (prior, before, after)
    assert s.state(o) == state
    assert "duplicate delivery" in s.worker.log()
    if prior == "running":
        # A delivery without beat's headers is tracked too (the ledger task stores its STARTED).
        plain_id = str(uuid.uuid4())
        s.ids.append(plain_id)
        s.producer.send_task(task, (), task_id=plain_id, queue=s.app.queue)
        s.wait(lambda: s.producer.AsyncResult(plain_id).state == "STARTED", "the plain delivery to be STARTED")
        # The run itself still stores its outcome over its own STARTED.
        (s.tmp / "release").write_text("x")
        s.wait(lambda: s.state(o) == "SUCCESS", "the released run to store SUCCESS")
        assert s.producer.AsyncResult(o.task_id).result == "released"


# -- the setting, in this process ----------------------------------------------------------------

def _request(task, **extra) -> Context:
    return Context({"id": "x", "task": task.name, "is_eager": False, **extra})


def test_track_started_is_kept_by_the_ledger_task_and_hidden_from_the_tracer():
    app = Celery("track-inproc", set_as_current=False)
    app.conf.task_annotations = {"t.annotated": {"track_started": True}}

    @app.task(shared=False, base=LedgerTask, name="t.option", track_started=True)
    def option():
        pass

    @app.task(shared=False, base=LedgerTask, name="t.plain")
    def plain():
        pass

    @app.task(shared=False, base=LedgerTask, name="t.annotated")
    def annotated():
        pass

    class Declared(LedgerTask):
        track_started = True

    @app.task(shared=False, base=Declared, name="t.declared", ignore_result=True)
    def declared():
        pass

    option, plain, annotated, declared = (app.tasks[f"t.{n}"] for n in ("option", "plain", "annotated", "declared"))
    for t in (option, plain, annotated, declared):  # Celery's tracer stores no STARTED itself
        assert t.track_started is False and type(t).track_started is False, t.name
    assert tracks_started(option, _request(option))
    assert tracks_started(annotated, _request(annotated))
    assert not tracks_started(plain, _request(plain))  # the app's task_track_started: False
    assert not tracks_started(declared, _request(declared))  # ignore_result: nothing is stored
    assert not tracks_started(option, _request(option, is_eager=True))
    app.conf.task_track_started = True
    assert tracks_started(plain, _request(plain))
    plain.track_started = False  # an assignment is the task's own setting
    assert plain.ledger_track_started is False and not tracks_started(plain, _request(plain))
    type(declared).track_started = "yes"  # on the class, after binding: still the setting
    assert declared.track_started is False and declared.ledger_track_started == "yes"
