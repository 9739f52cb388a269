"""The overlap guard on the worker-side ledger, and a default guard that guards only what it sees.

In this process: which policy each entry gets, the start-up warning and errors, and the
guard's verdicts read from real ledger rows (every dialect). With real ``celery beat`` and
``celery worker`` processes: a ledger task is guarded with no result backend and with
``ignore_result=True``; a task that ignores its results and does not use the ledger is no
longer held back by the default guard.
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
from celery_cluster_beat import Scheduler, every, signals
from celery_cluster_beat.beat.guard import OverlapGuard, configuration_problems
from celery_cluster_beat.config import Entry, OverlapPolicy, load_settings
from celery_cluster_beat.config.celeryconf import has_result_backend
from celery_cluster_beat.errors import ConfigError
from celery_cluster_beat.schedules.occurrence import Occurrence
from celery_cluster_beat.store import ClaimStore
from celery_cluster_beat.store.schema import RunState
from celery_cluster_beat.worker import LedgerTask

UTC = timezone.utc
SKIP, ALLOW = OverlapPolicy.SKIP, OverlapPolicy.ALLOW


def make_app(backend=None, **conf) -> Celery:
    app = Celery("guard-ledger", backend=backend, set_as_current=False)
    app.conf.update(conf)

    @app.task(shared=False, name="t.plain")
    def plain():
        pass

    @app.task(shared=False, name="t.quiet", ignore_result=True)
    def quiet():
        pass

    @app.task(shared=False, name="t.ledger", base=LedgerTask)
    def ledger():
        pass

    @app.task(shared=False, name="t.ledger_quiet", base=LedgerTask, ignore_result=True)
    def ledger_quiet():
        pass

    return app


def guard_for(app, ledger=lambda keys: {}) -> OverlapGuard:
    settings = load_settings(app.conf, has_result_backend=lambda: has_result_backend(app))
    return OverlapGuard(app, settings, ledger=ledger)


def entry(task: str, overlap=None, name=None, **kw) -> Entry:
    return Entry(name=name or task, task=task, schedule=every(60), overlap=overlap and OverlapPolicy(overlap), **kw)


# ------------------------------------------------------------------------------ policies


def test_the_default_guards_what_it_can_observe_and_nothing_else():
    with_backend = guard_for(make_app("redis://127.0.0.1:6379/0"))
    got = {t: with_backend.policy(entry(t)) for t in ("t.plain", "t.quiet", "t.ledger", "t.ledger_quiet")}
    assert got == {"t.plain": SKIP, "t.quiet": ALLOW, "t.ledger": SKIP, "t.ledger_quiet": SKIP}
    assert with_backend.policy(entry("t.plain", options={"ignore_result": True})) == ALLOW
    # A task beat does not know: the app's task_ignore_result says, or its task_cls.
    assert with_backend.policy(entry("t.elsewhere")) == SKIP
    assert guard_for(make_app("redis://127.0.0.1:6379/0", task_ignore_result=True)).policy(entry("t.elsewhere")) == ALLOW
    wide = Celery("wide", backend=None, set_as_current=False, task_cls="celery_cluster_beat:LedgerTask")
    assert guard_for(wide).policy(entry("t.elsewhere")) == SKIP

    no_backend = guard_for(make_app(None))
    got = {t: no_backend.policy(entry(t)) for t in ("t.plain", "t.quiet", "t.ledger", "t.ledger_quiet")}
    assert got == {"t.plain": ALLOW, "t.quiet": ALLOW, "t.ledger": SKIP, "t.ledger_quiet": SKIP}
    # Explicit policies are used as written.
    assert no_backend.policy(entry("t.ledger", "allow")) == ALLOW
    assert with_backend.policy(entry("t.quiet", "buffer_one")) == OverlapPolicy.BUFFER_ONE


def test_an_unguarded_ignore_result_entry_is_named_in_a_start_up_warning(caplog):
    guard = guard_for(make_app("redis://127.0.0.1:6379/0", task_track_started=True))
    with caplog.at_level("WARNING", logger="celery_cluster_beat.guard"):
        guard.warn_about_configuration([entry("t.quiet", name="fire-and-forget"), entry("t.plain"),
                                        entry("t.ledger_quiet")])
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "overlap guard off for fire-and-forget:" in lines[0], lines
    assert "LedgerTask" in lines[0]


def test_an_explicit_guard_nobody_can_observe_is_a_start_up_error_saying_how_to_fix_it():
    app = make_app("redis://127.0.0.1:6379/0")
    settings = load_settings(app.conf, has_result_backend=lambda: True)
    problems = configuration_problems(app, settings, [
        entry("t.quiet", "skip", name="quiet-skip"), entry("t.quiet", "allow", name="quiet-allow"),
        entry("t.ledger_quiet", "skip", name="ledger-skip"), entry("t.plain", "skip", name="plain-skip"),
        entry("t.quiet", name="quiet-default"),
    ])
    assert problems == [
        "beat_schedule entry 'quiet-skip': overlap: 'skip' cannot see when a run ends (task 't.quiet' ignores "
        "its results); use base=celery_cluster_beat.LedgerTask for the task, or store its results, or set "
        "overlap='allow' on the entry"]
    bare = make_app(None, cluster_beat_overlap="buffer_one")
    problems = configuration_problems(bare, load_settings(bare.conf, has_result_backend=lambda: False),
                                      [entry("t.plain"), entry("t.ledger")])
    assert len(problems) == 1 and problems[0].startswith(
        "beat_schedule entry 't.plain': overlap (cluster_beat_overlap='buffer_one'): 'buffer_one' cannot see "
        "when a run ends (the app has no result backend)")


def test_the_scheduler_refuses_to_start_with_such_a_guard(tmp_path):
    app = make_app("redis://127.0.0.1:6379/0", cluster_beat_db_url=f"sqlite:///{tmp_path}/never.sqlite3",
                   beat_schedule={"quiet": {"task": "t.quiet", "schedule": every(5), "overlap": "skip"}})
    with pytest.raises(ConfigError) as info:
        Scheduler(app)
    assert "beat_schedule entry 'quiet': overlap:" in str(info.value)
    assert not (tmp_path / "never.sqlite3").exists()  # refused before anything opened


# ------------------------------------------------------------------------------ verdicts from the ledger


@pytest.fixture
def make_store(db_url):
    stores: List[ClaimStore] = []

    def make(node: str) -> ClaimStore:
        store = ClaimStore(db_url, node_id=node)
        store.open()
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()


def test_the_ledger_says_when_the_previous_run_is_in_flight(make_store):
    beat, worker = make_store("beat"), make_store("worker")
    app = make_app(None)  # no result backend at all
    guard = guard_for(app, ledger=beat.run_states)
    e = entry("t.ledger_quiet", max_run_time=30)
    base = beat.db_now().replace(microsecond=0)
    fired: List[dict] = []
    signals.watchdog_fired.connect(lambda sender=None, **kw: fired.append(kw), weak=False)

    def verdict(o: Occurrence, now: datetime) -> str:
        nxt = Occurrence(e.name, o.at + timedelta(seconds=60))
        d = guard.filter([(e, nxt)], now)
        return "send" if d.send else "skip"

    def sent(k: int) -> Occurrence:
        o = Occurrence(e.name, base - timedelta(minutes=10 - k))
        beat.claim([o])
        beat.mark_sent([o])
        guard.sent(e, o)
        return o

    o1 = sent(1)
    now = beat.db_now()
    assert verdict(o1, now) == "skip"  # sent, not started yet, young: queued
    assert verdict(o1, now + timedelta(seconds=31)) == "send"  # never started within max_run_time: lost
    run = worker.start_run(e.name, o1.at, task_id=o1.task_id, worker="w", pid=1)
    assert verdict(o1, now) == "skip"  # running
    started = {k[1]: s for k, s in beat.run_states([(e.name, o1.at)]).items()}[o1.at].started_at
    assert verdict(o1, started + timedelta(seconds=31)) == "send"  # running past max_run_time: the watchdog
    assert len(fired) == 1 and fired[0]["task_id"] == o1.task_id
    worker.finish_run(e.name, o1.at, run.token, RunState.RETRIED, 0.1)
    assert verdict(o1, now) == "skip"  # a retry is on its way
    retry = worker.start_run(e.name, o1.at, task_id=o1.task_id, worker="w", pid=1, retries=1)
    worker.finish_run(e.name, o1.at, retry.token, RunState.SUCCEEDED, 0.1)
    assert verdict(o1, now) == "send"  # finished

    o2 = sent(2)
    run = worker.start_run(e.name, o2.at, task_id=o2.task_id, worker="w", pid=1)
    worker.finish_run(e.name, o2.at, run.token, RunState.FAILED, 0.1, "E: x")
    assert verdict(o2, now) == "send"  # a failed run has ended too

    o3 = sent(3)
    beat.prune(base + timedelta(days=1))  # its row is gone: nothing says it runs
    assert beat.claims(e.name) == [] or all(r.scheduled_at != o3.at for r in beat.claims(e.name))
    assert verdict(o3, now) == "send"


# ------------------------------------------------------------------------------ real processes

TASKS = '''
import json as _json
import redis as _redis
from celery_cluster_beat import LedgerTask

_rec = _redis.Redis.from_url({redis_url!r})
RUNS_KEY = {runs_key!r}


def _run(task, seconds):
    info = dict(id=task.request.id, at=task.request.get("cluster_beat_scheduled_at"))
    _rec.rpush(RUNS_KEY, _json.dumps(dict(ev="start", t=time.time(), **info)))
    time.sleep(seconds)
    _rec.rpush(RUNS_KEY, _json.dumps(dict(ev="end", t=time.time(), **info)))


@app.task(bind=True, base=LedgerTask, name="t.ledger_slow")
def ledger_slow(self, seconds):
    _run(self, seconds)


@app.task(bind=True, base=LedgerTask, name="t.ledger_slow_quiet", ignore_result=True)
def ledger_slow_quiet(self, seconds):
    _run(self, seconds)


@app.task(bind=True, name="t.quiet", ignore_result=True)
def quiet(self, seconds):
    _run(self, seconds)
'''


class Live:
    def __init__(self, tmp, redis_url: str, db_url: str, *, schedule: str, backend) -> None:
        self.tmp, self.db_url = tmp, db_url
        self.runs_key = "ccbtest:guard-ledger:" + uuid.uuid4().hex[:10]
        self.redis = redis.Redis.from_url(redis_url)
        self.app = procs.write_app(tmp, broker=redis_url, db_url=db_url, backend=backend, schedule=schedule,
                                   conf='{"task_track_started": True}',
                                   tasks=TASKS.format(redis_url=redis_url, runs_key=self.runs_key))
        self.procs: List[procs.Proc] = []

    def start(self) -> None:
        # Two processes: enough for two runs at once if the guard let one through (with one, the
        # worker itself would serialise the runs and the guard's tests could not fail).
        worker = procs.start_worker(self.app, self.tmp, "worker", concurrency=2)
        self.procs.append(worker)
        # Beat starts alongside (its first sends wait in the queue until the worker is ready).
        self.procs.append(procs.start_beat(self.app, self.tmp, "beat"))
        procs.wait_for(lambda: "ready." in worker.log() or not worker.alive(), 60, what="the worker")
        assert worker.alive(), worker.log()[-3000:]

    def runs(self) -> List[tuple]:
        """(start, end or None) of each run, by start."""
        out = {}
        for raw in self.redis.lrange(self.runs_key, 0, -1):
            rec = json.loads(raw)
            span = out.setdefault(rec["id"], [None, None])
            span[0 if rec["ev"] == "start" else 1] = rec["t"]
        return sorted(tuple(v) for v in out.values() if v[0] is not None)

    def fires(self) -> List[str]:
        """The nominal instant (message header) of each run that started."""
        return [rec["at"] for rec in map(json.loads, self.redis.lrange(self.runs_key, 0, -1)) if rec["ev"] == "start"]

    def claims(self, schedule: str):
        store = ClaimStore(self.db_url, node_id="reader")
        store.open()
        try:
            return store.claims(schedule)
        finally:
            store.close()

    def logs(self) -> str:
        return "\n".join(f"--- {p.log_path.name}\n{p.log()[-3000:]}" for p in self.procs)

    def close(self) -> None:
        for p in reversed(self.procs):  # beat first: nothing more is sent
            if p is self.procs[0] and p.alive():
                # The worker and its pool: killed, not waiting for a run in flight (the test is over).
                os.killpg(p.pid, signal.SIGKILL)
            p.stop(timeout=5)
        try:
            self.redis.delete(self.runs_key, self.app.queue)
        finally:
            self.redis.close()


@pytest.fixture
def live(tmp_path, redis_url, pg_url):
    made: List[Live] = []

    def make(**kw) -> Live:
        c = Live(tmp_path, redis_url, pg_url, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("variant", ["no-backend", "ignore-result"])
def test_the_ledger_guard_skips_while_a_run_is_in_flight(live, redis_url, variant):
    """Every second a fire; each run takes 2.2 s (so at least one fire falls inside each run).
    The ledger says when a run is in flight, with no result backend at all, and with a backend
    the task does not write to."""
    task = "t.ledger_slow" if variant == "no-backend" else "t.ledger_slow_quiet"
    c = live(schedule=f'{{"slow": {{"task": {task!r}, "schedule": every(1), "args": (2.2,)}}}}',
             backend=None if variant == "no-backend" else redis_url)
    c.start()
    procs.wait_for(lambda: sum(1 for s, e in c.runs() if e is not None) >= 2, 60,
                   what="two runs to finish")
    runs = [r for r in c.runs() if r[1] is not None]
    for (s1, e1), (s2, _) in zip(runs, runs[1:]):
        assert s2 >= e1 - 0.05, (runs, c.logs())  # never two at once
    rows = c.claims("slow")
    skipped = [r for r in rows if r.status == "skipped"]
    assert skipped and all(r.reason == "overlap" for r in skipped), rows
    ran = [r for r in rows if r.run_state == "succeeded"]
    assert len(ran) >= 2 and all(r.runtime >= 2.1 for r in ran)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_default_guard_no_longer_holds_back_a_task_that_ignores_results(live, redis_url):
    """A result backend, a task with ignore_result=True, the default policy: it used to run once
    per max_run_time (600 s; its state stays PENDING); now it runs on every fire, with a warning."""
    c = live(schedule='{"quick": {"task": "t.quiet", "schedule": every(1), "args": (0.1,)}}', backend=redis_url)
    c.start()
    procs.wait_for(lambda: len(c.runs()) >= 5, 60, what="five runs of an every-1-s task")
    starts = [s for s, _ in c.runs()]
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert all(g <= 3.0 for g in gaps), (gaps, c.logs())  # never held back (room for a loaded worker)
    # One run per fire, fire after fire: the runs' nominal instants (from their messages) are all
    # different and, but for a second a loaded beat let pass, one second apart.
    fires = sorted(datetime.fromisoformat(at.replace("Z", "+00:00")) for at in c.fires())
    assert all(timedelta(seconds=1) <= b - a <= timedelta(seconds=3) for a, b in zip(fires, fires[1:])), \
        (fires, c.logs())
    rows = c.claims("quick")
    assert [r for r in rows if r.status == "skipped"] == []
    beat = c.procs[1]
    assert "overlap guard off for quick" in beat.log()
