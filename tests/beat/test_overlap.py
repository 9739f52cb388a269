"""The overlap guard, end to end: real ``celery beat`` and ``celery worker``
processes, a real result backend (Redis, and PostgreSQL through Celery's
database backend), runs timed by the worker itself.

Every task run pushes ``start`` and ``end`` records (wall clock, pid, the
node that sent it) to a Redis list of the test's own; the beat process pushes
each ``occurrence_handled`` / ``watchdog_fired`` signal to another. The claim
table tells what the scheduler decided for every nominal instant.

Policies under test (``overlap`` per entry, ``cluster_beat_overlap`` globally):

* ``skip``       -- while the previous run is in flight, the occurrence is recorded
  as a ``skipped`` claim (reason ``overlap``) and nobody sends it;
* ``allow``      -- sent regardless;
* ``buffer_one`` -- one pending occurrence is kept and sent as soon as the run ends;
* ``replace``    -- the previous run is revoked (terminated) and the new one sent;
* watchdog       -- a run still in flight after ``max_run_time`` stops blocking.
"""
from __future__ import annotations

import json
import os
import signal
import statistics
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Dict, List, Optional

import pytest
import redis

import procs
from celery_cluster_beat.store import ClaimStore

UTC = timezone.utc

# The task every test runs, and the signal recorder the beat process loads with the app.
TASKS = '''
import json as _json
import redis as _redis
from celery_cluster_beat import signals as _ccb_signals

_rec = _redis.Redis.from_url({redis_url!r})
RUNS_KEY = {runs_key!r}
EVENTS_KEY = {events_key!r}


def _push(key, **item):
    _rec.rpush(key, _json.dumps(item))


@app.task(bind=True, name="t.work")
def work(self, seconds):
    req = self.request
    info = dict(id=req.id, schedule=req.get("cluster_beat_schedule"), node=req.get("cluster_beat_node"),
                at=req.get("cluster_beat_scheduled_at"), pid=os.getpid())
    _push(RUNS_KEY, ev="start", t=time.time(), **info)
    time.sleep(seconds)
    _push(RUNS_KEY, ev="end", t=time.time(), **info)
    return seconds


def _on_occurrence(sender, outcome=None, schedule=None, scheduled_at=None, task_id=None, reason=None, **kw):
    _push(EVENTS_KEY, kind="occurrence", outcome=outcome, schedule=schedule, at=scheduled_at.isoformat(),
          task_id=task_id, reason=reason, node=sender.settings.node_id, t=time.time())


def _on_watchdog(sender, schedule=None, task_id=None, age=None, **kw):
    _push(EVENTS_KEY, kind="watchdog", schedule=schedule, task_id=task_id, age=age, t=time.time())


_ccb_signals.occurrence_handled.connect(_on_occurrence, weak=False)
_ccb_signals.watchdog_fired.connect(_on_watchdog, weak=False)
'''


@dataclass
class Run:
    id: str
    schedule: str
    node: str
    at: str  # nominal instant from the message header
    pid: int
    start: float
    end: Optional[float]  # None: never finished (terminated, or still running)


def parse_iso(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


class Cluster:
    """One generated app, its worker(s) and beat(s), and what they recorded."""

    def __init__(self, tmp: Path, redis_url: str, db_url: str, *, schedule: str, backend: Optional[str],
                 conf: str = "{}", lease: bool = False) -> None:
        self.tmp = tmp
        self.db_url = db_url
        prefix = "ccbtest:overlap:" + uuid.uuid4().hex[:10]
        self.runs_key, self.events_key = prefix + ":runs", prefix + ":events"
        self.redis = redis.Redis.from_url(redis_url)
        tasks = TASKS.format(redis_url=redis_url, runs_key=self.runs_key, events_key=self.events_key)
        self.app = procs.write_app(tmp, broker=redis_url, db_url=db_url, schedule=schedule, backend=backend,
                                   conf=conf, tasks=tasks, redis_url=redis_url if lease else "")
        self.procs: List[procs.Proc] = []
        self.workers: List[procs.Proc] = []

    # -- processes -------------------------------------------------------------------
    def worker(self, concurrency: int, wait: bool = True) -> procs.Proc:
        """A prefork worker on the app's queue, ready to take tasks (or, with ``wait=False``, still
        starting: call :meth:`ready` once the beats are started alongside)."""
        proc = procs.start_worker(self.app, self.tmp, "worker", concurrency=concurrency)
        self.procs.append(proc)
        self.workers.append(proc)
        if wait:
            self.ready(proc)
        return proc

    def ready(self, proc: procs.Proc) -> None:
        wait_until(lambda: "ready." in proc.log() or not proc.alive(), 45, "the worker to be ready", self)
        assert proc.alive(), proc.log()[-3000:]

    def beat(self, label: str = "beat", node: Optional[str] = None) -> procs.Proc:
        proc = procs.start_beat(self.app, self.tmp, label, env={"CCB_NODE": node} if node else None)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in reversed(self.procs):  # the beats first: nothing more is sent
            if proc in self.workers and proc.alive():
                # A worker and its pool: killed, not waiting for the runs in flight (the test is over).
                os.killpg(proc.pid, signal.SIGKILL)
            proc.stop(timeout=3)
        try:
            self.redis.delete(self.runs_key, self.events_key, self.app.queue)
        finally:
            self.redis.close()

    # -- what happened ---------------------------------------------------------------
    def runs(self, schedule: Optional[str] = None) -> List[Run]:
        by_id: Dict[str, Run] = {}
        for raw in self.redis.lrange(self.runs_key, 0, -1):
            rec = json.loads(raw)
            if rec["ev"] == "start":
                by_id[rec["id"]] = Run(rec["id"], rec["schedule"], rec["node"], rec["at"], rec["pid"], rec["t"], None)
            elif rec["id"] in by_id:
                by_id[rec["id"]].end = rec["t"]
        runs = sorted(by_id.values(), key=lambda r: r.start)
        return [r for r in runs if schedule is None or r.schedule == schedule]

    def events(self, kind: str = "occurrence", schedule: Optional[str] = None) -> List[dict]:
        out = [json.loads(raw) for raw in self.redis.lrange(self.events_key, 0, -1)]
        return [e for e in out if e["kind"] == kind and (schedule is None or e["schedule"] == schedule)]

    def claims(self, schedule: str):
        store = ClaimStore(self.db_url, node_id="test-reader")
        store.open()
        try:
            return store.claims(schedule)
        finally:
            store.close()

    def diagnostics(self) -> str:
        return "\n".join(f"--- {p.log_path.name}\n{p.log()[-3000:]}" for p in self.procs)


@pytest.fixture
def cluster(tmp_path, redis_url):
    made: List[Cluster] = []

    def make(**kwargs) -> Cluster:
        c = Cluster(tmp_path, redis_url, **kwargs)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def result_backend(kind: str, redis_url: str, db_url: str) -> str:
    """The Celery result backend URL of *kind*; the database one gets its tables up front
    (several processes racing on CREATE TABLE is not what these tests are about)."""
    if kind == "redis":
        return redis_url
    url = "db+" + db_url
    from celery import Celery

    probe = Celery("probe", backend=url)
    probe.backend.ResultSession().close()  # database_create_tables_at_setup: created on first use
    return url


def name(base: str) -> str:
    """A schedule name of this test run's own: task ids derive from (name, instant), so two
    suites on the same Redis at the same second must not share them."""
    return f"{base}-{uuid.uuid4().hex[:6]}"


def max_concurrency(runs: List[Run]) -> int:
    points = []
    for r in runs:
        points += [(r.start, 1), (r.end if r.end is not None else float("inf"), -1)]
    level = best = 0
    for _, delta in sorted(points, key=lambda p: (p[0], p[1])):  # an end before a start at the same instant
        level += delta
        best = max(best, level)
    return best


def assert_never_overlap(runs: List[Run], what: str) -> None:
    for prev, nxt in zip(runs, runs[1:]):
        assert prev.end is not None and nxt.start >= prev.end, (
            f"{what}: run {nxt.id} (nominal {nxt.at}) started at {nxt.start:.3f}, while run {prev.id} "
            f"(nominal {prev.at}, started {prev.start:.3f}) was still running (ended {prev.end})")


def wait_until(predicate, timeout: float, what: str, cluster: Cluster) -> None:
    try:
        procs.wait_for(predicate, timeout, interval=0.1, what=what)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{cluster.diagnostics()}") from None


# ------------------------------------------------------------------------------ skip / allow


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend_kind", ["redis", "postgresql"])
def test_skip_never_runs_twice_at_once_while_allow_does(backend_kind, cluster, redis_url, pg_url, tmp_path):
    """A 2.5 s task every second under ``skip``: one run at a time, about one fire in three sent,
    the others recorded as ``skipped`` (reason ``overlap``); a 3.5 s one under ``allow``: runs pile up."""
    guarded, free = name("guarded"), name("free")
    backend = result_backend(backend_kind, redis_url, pg_url)
    c = cluster(
        db_url=pg_url if backend_kind == "postgresql" else f"sqlite:///{tmp_path}/claims.sqlite3",
        backend=backend,
        schedule=f"""{{
            {guarded!r}: {{"task": "t.work", "schedule": every(1), "args": (2.5,), "overlap": "skip"}},
            {free!r}: {{"task": "t.work", "schedule": every(1), "args": (3.5,), "overlap": "allow"}},
        }}""",
        conf='{"task_track_started": True, "cluster_beat_max_run_time": 60}',
    )
    worker = c.worker(concurrency=7, wait=False)
    c.beat()  # alongside: its first send waits in the queue (PENDING, in flight) until the worker is ready
    c.ready(worker)
    # Four finished guarded runs: about 12 s of a steady state.
    wait_until(lambda: len([r for r in c.runs(guarded) if r.end is not None]) >= 4, 45,
               "four finished runs of the guarded schedule", c)
    c.procs[-1].stop()  # beat: nothing more is sent

    runs = [r for r in c.runs(guarded) if r.end is not None]
    assert_never_overlap(runs, "skip")
    for prev, nxt in zip(runs, runs[1:]):
        # ... and the guard frees the schedule promptly: the first fire after the end is sent (the
        # second one if the run ended just before a whole second, before its result was stored).
        # Read on the beat's side, from the next run's instant: not how soon a worker process got
        # round to starting it.
        held = parse_iso(nxt.at).timestamp() - prev.end
        assert held < 2.0, f"skip: next fire sent {held:.2f}s after the end of the run\n{c.diagnostics()}"

    rows = c.claims(guarded)
    sent_at = [i for i, row in enumerate(rows) if row.status == "sent"]
    assert len(sent_at) >= 4
    window = rows[sent_at[0]:sent_at[-1] + 1]
    assert {row.status for row in window} == {"sent", "skipped"}, [(r.scheduled_at, r.status) for r in window]
    assert all(row.reason == "overlap" for row in window if row.status == "skipped")
    # one claim row per nominal second: every fire was decided (sent or skipped), none lost
    instants = [row.scheduled_at for row in window]
    assert all(b - a == timedelta(seconds=1) for a, b in zip(instants, instants[1:])), instants
    # about one send in three: 2.5 s of run, then the next whole second. Never fewer fires apart
    # (the run is in flight for 2.5 s at least); a 4th (or later) when a worker started the run
    # late on a loaded machine, which the median absorbs. How soon the guard frees the schedule
    # after a run is checked above, free of the worker's delays.
    gaps = [b - a for a, b in zip(sent_at, sent_at[1:])]
    assert all(g >= 3 for g in gaps) and statistics.median(gaps) <= 4, f"fires between sends: {gaps}"
    share = (len(sent_at) - 1) / (len(window) - 1)  # sends per fire, counted send to send
    assert share <= 1 / 3, share
    # each decision was reported through occurrence_handled too
    skipped_events = {e["at"] for e in c.events(schedule=guarded) if e["outcome"] == "skipped-overlap"}
    assert {row.scheduled_at.isoformat() for row in window if row.status == "skipped"} <= skipped_events
    sent_events = {e["task_id"] for e in c.events(schedule=guarded) if e["outcome"] == "sent"}
    assert {r.id for r in runs} <= sent_events

    # allow: the same task on the same grid runs several at once, every fire sent
    loose = c.runs(free)
    assert max_concurrency(loose) >= 3, [(r.start, r.end) for r in loose]
    free_rows = c.claims(free)
    assert free_rows and all(row.status == "sent" for row in free_rows), [(r.scheduled_at, r.status) for r in free_rows]


# ------------------------------------------------------------------------------ buffer_one


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend_kind", ["redis", "sqlite"])
def test_buffer_one_sends_the_pending_occurrence_as_soon_as_the_run_ends(backend_kind, cluster, redis_url, tmp_path):
    """A 2 s task every second under ``buffer_one``: the first fire during a run is kept and
    sent as soon as the run ends (the beat looks at a buffered run's predecessor every 0.25 s);
    later ones are skipped."""
    sched = name("buffered")
    backend = redis_url if backend_kind == "redis" else result_backend(backend_kind, redis_url, f"sqlite:///{tmp_path}/results.sqlite3")
    c = cluster(
        db_url=f"sqlite:///{tmp_path}/claims.sqlite3",
        backend=backend,
        schedule=f'{{{sched!r}: {{"task": "t.work", "schedule": every(1), "args": (2.0,), "overlap": "buffer_one"}}}}',
        conf='{"task_track_started": True, "cluster_beat_max_run_time": 60}',
    )
    worker = c.worker(concurrency=2, wait=False)
    c.beat()  # alongside: its first send waits in the queue (PENDING, in flight) until the worker is ready
    c.ready(worker)
    wait_until(lambda: len([r for r in c.runs(sched) if r.end is not None]) >= 4, 45, "four finished runs", c)
    c.procs[-1].stop()

    runs = [r for r in c.runs(sched) if r.end is not None]
    assert_never_overlap(runs, "buffer_one")
    events = c.events(schedule=sched)
    buffered = {e["at"] for e in events if e["outcome"] == "buffered"}
    sent_t = {e["task_id"]: e["t"] for e in events if e["outcome"] == "sent"}
    for prev, nxt in zip(runs, runs[1:]):
        # Sent by the beat within a poll (0.25 s) of the run's end, plus room for a loaded machine:
        # on the beat's side, not when a worker process got round to starting it.
        assert nxt.id in sent_t, (nxt.id, events)
        late = sent_t[nxt.id] - prev.end
        assert late < 1.0, f"buffer_one: sent {late:.2f}s after the end of the previous run\n{c.diagnostics()}"
        # It is the *buffered* occurrence that runs: nominally due while the previous one ran,
        # and its message still says so.
        nominal = parse_iso(nxt.at)
        assert nominal.timestamp() < prev.end, (nxt.at, prev.end)
        assert nominal.isoformat() in buffered, (nxt.at, sorted(buffered))
    rows = c.claims(sched)
    first = next(i for i, r in enumerate(rows) if r.scheduled_at == parse_iso(runs[1].at))
    last = next(i for i, r in enumerate(rows) if r.scheduled_at == parse_iso(runs[-1].at))
    window = rows[first:last + 1]
    # At most one pending occurrence: between two sends, the others are skipped (reason overlap).
    assert {r.status for r in window} == {"sent", "skipped"}
    assert all(r.reason == "overlap" for r in window if r.status == "skipped")
    sent = [r.scheduled_at for r in window if r.status == "sent"]
    assert sent == [parse_iso(r.at) for r in runs[1:]], (sent, [r.at for r in runs])


# ------------------------------------------------------------------------------ watchdog


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_watchdog_lets_the_next_fire_through_after_max_run_time(cluster, redis_url, tmp_path):
    """A run that hangs (sleeps 60 s, STARTED all along) blocks its schedule for ``max_run_time``
    (2 s) only: then the next fire is sent, ``watchdog_fired`` names the hung run, once."""
    sched = name("hung")
    c = cluster(
        db_url=f"sqlite:///{tmp_path}/claims.sqlite3",
        backend=redis_url,
        schedule=f'{{{sched!r}: {{"task": "t.work", "schedule": every(1), "args": (60,), "max_run_time": 2}}}}',
        conf='{"task_track_started": True}',  # overlap: skip, the default with a result backend
    )
    c.worker(concurrency=4)
    beat = c.beat()
    wait_until(lambda: len(c.runs(sched)) >= 3 and len(c.events("watchdog", sched)) >= 2, 40,
               "three hung runs and two watchdog signals", c)
    beat.stop()

    runs = c.runs(sched)
    assert all(r.end is None for r in runs)  # all still hanging: only the watchdog let them start
    for prev, nxt in zip(runs, runs[1:]):
        # sent ~2 s after the previous one (the first whole second past max_run_time): never
        # sooner (by the instants in the messages, free of when a worker started them)
        assert (parse_iso(nxt.at) - parse_iso(prev.at)).total_seconds() >= 2, [(r.at, r.start) for r in runs]
    dogs = c.events("watchdog", sched)
    assert len({d["task_id"] for d in dogs}) == len(dogs), "the watchdog fires once per hung run"
    by_task = {d["task_id"]: d for d in dogs}
    for hung, nxt in zip(runs, runs[1:]):
        dog = by_task[hung.id]
        # the first fire once the hung run is max_run_time old goes through: fires come a second
        # apart, so it is less than a second past max_run_time (plus room for a late tick)
        assert 2 <= dog["age"] < 3.5, dog
        assert dog["t"] <= nxt.start  # signalled when the next fire went through
    assert f"watchdog: {sched}: previous run {runs[0].id} is still STARTED" in beat.log()
    rows = c.claims(sched)
    skipped = [r for r in rows if parse_iso(runs[0].at) < r.scheduled_at < parse_iso(runs[1].at)]
    assert skipped and all((r.status, r.reason) == ("skipped", "overlap") for r in skipped)
    c.procs[0].stop(timeout=0.5)  # the worker: its tasks hang, do not wait for them


# ------------------------------------------------------------------------------ replace


def _process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_replace_terminates_the_previous_run_and_sends_the_new_one(cluster, redis_url, tmp_path):
    """``replace`` with a 60 s task every 2 s: each fire revokes the running one (terminate) and
    sends itself; every fire runs, none finishes, the replaced ones end REVOKED."""
    sched = name("replaced")
    c = cluster(
        db_url=f"sqlite:///{tmp_path}/claims.sqlite3",
        backend=redis_url,
        schedule=f'{{{sched!r}: {{"task": "t.work", "schedule": every(2), "args": (60,), "overlap": "replace"}}}}',
        conf='{"task_track_started": True, "cluster_beat_max_run_time": 600}',
    )
    c.worker(concurrency=3)
    c.beat()
    wait_until(lambda: len(c.runs(sched)) >= 3, 40, "three runs", c)
    c.procs[-1].stop()
    runs = c.runs(sched)[:3]

    from celery import Celery

    results = Celery("probe", backend=redis_url)
    # Each previous run's worker process was terminated, and its result says REVOKED.
    wait_until(lambda: all(_process_gone(r.pid) for r in runs[:2]), 10, "replaced runs' processes to exit", c)
    wait_until(lambda: all(results.AsyncResult(r.id).state == "REVOKED" for r in runs[:2]), 10,
               "replaced runs to be REVOKED", c)
    assert all(r.end is None for r in runs)
    # every fire of the grid was sent: nothing skipped, one after the other
    nominal = [parse_iso(r.at) for r in runs]
    assert all(b - a == timedelta(seconds=2) for a, b in zip(nominal, nominal[1:])), nominal
    assert {r.status for r in c.claims(sched) if r.scheduled_at <= nominal[-1]} == {"sent"}
    replaced = {e["task_id"]: e for e in c.events(schedule=sched) if e["outcome"] == "replaced"}
    for old, new in zip(runs, runs[1:]):
        assert old.id in replaced[new.id]["reason"], replaced
    assert f"Terminating {runs[0].id}" in c.procs[0].log()


# ------------------------------------------------------------------------------ failover


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_new_leader_honours_the_guard_of_the_old_one(cluster, redis_url, pg_url):
    """Two replicas with a Redis lease. Leader A sends a 9 s run and is SIGKILLed during it.
    B takes over and, though it never sent anything itself, records the fires during the run as
    ``skipped``; it sends again only after the run has ended."""
    sched = name("handover")
    c = cluster(
        db_url=pg_url,
        backend=redis_url,
        schedule=f'{{{sched!r}: {{"task": "t.work", "schedule": every(1), "args": (9,), "overlap": "skip"}}}}',
        conf='{"task_track_started": True, "cluster_beat_max_run_time": 60, "cluster_beat_lock_ttl": 2,'
             ' "cluster_beat_node_id": os.environ.get("CCB_NODE")}',
        lease=True,
    )
    worker = c.worker(concurrency=2, wait=False)
    beats = {"A": c.beat("A", node="A"), "B": c.beat("B", node="B")}
    c.ready(worker)
    for beat in beats.values():  # both up before the first run, so the kill below comes early in it
        procs.wait_for_log(beat, "cluster-beat: node", 30)
    wait_until(lambda: len(c.runs(sched)) >= 1, 30, "the first run", c)
    first = c.runs(sched)[0]
    leader, standby = first.node, "B" if first.node == "A" else "A"
    time.sleep(max(0.0, first.start + 1.5 - time.time()))
    beats[leader].signal(signal.SIGKILL)
    killed_at = time.time()

    wait_until(lambda: any(r.end is not None for r in c.runs(sched)) and len(c.runs(sched)) >= 2, 40,
               "the first run to end and a second to start", c)
    beats[standby].stop()
    first, second = c.runs(sched)[:2]
    assert first.end - first.start >= 8.9  # the run really was in flight during the whole hand-over
    assert first.end > killed_at + 4
    assert second.node == standby, "the new leader sends once the run has ended"
    assert second.start >= first.end, "the new leader must not send while the old leader's run is in flight"
    # ... and resumes right after it: its next run is the first (or, if the run ended just before
    # a whole second, the second) fire after the end (by the instant in the message, free of
    # when a worker started it)
    assert parse_iso(second.at).timestamp() - first.end < 2.0, "... and resumes right after it"

    rows = c.claims(sched)
    by_standby = [r for r in rows if r.node == standby and r.scheduled_at < parse_iso(second.at)]
    skipped = [r for r in by_standby if r.status == "skipped"]
    assert skipped, [(r.scheduled_at, r.node, r.status) for r in rows]
    assert all(r.reason == "overlap" for r in skipped)
    assert all(r.status in ("skipped", "missed") for r in by_standby), \
        [(r.scheduled_at, r.node, r.status, r.reason) for r in by_standby]
    # the skips happened while the run was in flight, under the new leader
    for r in skipped:
        assert first.start < r.scheduled_at.timestamp() < first.end
    assert "skipped-overlap" in beats[standby].log()


# ------------------------------------------------------------------------------ result lookups


@pytest.mark.timeout(60)
def test_result_states_are_read_for_due_schedules_only_in_one_mget(redis_url, tmp_path):
    """The scheduler in-process (real Redis broker and result backend, SQLite claims): 200
    yearly entries, each with a previous run on record, stay idle while three every-second
    entries fall due together. Each due second reads the three previous runs' states in ONE
    MGET; the idle entries' runs are never looked up."""
    from celery import Celery

    from celery_cluster_beat import cron, every
    from celery_cluster_beat.schedules.occurrence import Occurrence
    from celery_cluster_beat.beat.scheduler import Scheduler

    db_url = f"sqlite:///{tmp_path}/claims.sqlite3"
    queue = "q_ccb_lookup_" + uuid.uuid4().hex[:8]
    due = [name(f"due{i}") for i in range(3)]
    idle = [name(f"idle{i}") for i in range(200)]
    schedule = {n: {"task": "t.nothing", "schedule": every(1)} for n in due}
    schedule.update({n: {"task": "t.nothing", "schedule": cron("0 0 1 1 *")} for n in idle})
    # The idle entries ran last New Year (as far as the store knows): the guard knows their task ids.
    new_year = datetime(datetime.now(UTC).year, 1, 1, tzinfo=UTC)
    seed = ClaimStore(db_url, node_id="seed")
    seed.open()
    seeded = seed.claim([Occurrence(n, new_year) for n in idle])
    seed.mark_sent(seeded)
    seed.close()
    idle_ids = {o.task_id for o in seeded}
    assert len(idle_ids) == 200

    app = Celery("lookups", broker=redis_url, backend=redis_url)
    app.conf.update(task_default_queue=queue, task_track_started=True, beat_schedule=schedule,
                    cluster_beat_db_url=db_url, cluster_beat_redis_url="")
    backend = app.backend
    prefix = backend.task_keyprefix.decode()
    calls: List[List[str]] = []
    real_mget, real_get = backend.mget, backend.get

    def mget(keys):
        calls.append([(k.decode() if isinstance(k, bytes) else k)[len(prefix):] for k in keys])
        return real_mget(keys)

    def get(key):  # pragma: no cover - must not happen
        calls.append(["single GET " + repr(key)])
        return real_get(key)

    backend.mget, backend.get = mget, get
    sched = Scheduler(app)
    try:
        deadline = time.monotonic() + 4.2
        while time.monotonic() < deadline:
            time.sleep(min(sched.tick(), 0.2))
    finally:
        sched.close()
        r = redis.Redis.from_url(redis_url)
        r.delete(queue)
        r.close()
        backend.mget, backend.get = real_mget, real_get
    store = ClaimStore(db_url, node_id="reader")
    store.open()
    try:
        due_ids = {row.task_id for n in due for row in store.claims(n) if row.status == "sent"}
        fires = []
        for n in due:  # nobody ran them, so every later fire met a PENDING (young) run: skipped
            statuses = [r.status for r in store.claims(n)]
            assert statuses[0] == "sent" and set(statuses[1:]) == {"skipped"}, statuses
            fires.append(len(statuses))
    finally:
        store.close()
    # The first second has no previous run to look up; each later one does, in one call (4 or
    # 5 due seconds fit in the 4.2 s, fewer if the loop was slow: counted from the claim rows).
    assert len(set(fires)) == 1 and fires[0] >= 3, fires
    assert len(calls) == fires[0] - 1, (fires, calls)
    for ids in calls:
        assert sorted(ids) == sorted(due_ids), ids
    assert not idle_ids & {i for ids in calls for i in ids}


def test_database_backend_states_are_read_in_one_query(pg_url):
    """Celery's database backend: one SELECT for all due schedules' previous runs; ids it has
    never seen read as PENDING."""
    import sqlalchemy as sa
    from celery import Celery, states

    from celery_cluster_beat.beat.guard import OverlapGuard
    from celery_cluster_beat.config.settings import load_settings

    app = Celery("dbstates", backend=result_backend("postgresql", "", pg_url))
    backend = app.backend
    ids = {str(uuid.uuid4()): state for state in (states.STARTED, states.SUCCESS, states.RETRY, states.FAILURE)}
    for tid, state in ids.items():
        backend.store_result(tid, None if state != states.FAILURE else ValueError("x"), state)
    unknown = str(uuid.uuid4())
    guard = OverlapGuard(app, load_settings(app.conf, has_result_backend=lambda: True))
    selects: List[str] = []
    listener = lambda conn, cursor, statement, *a: selects.append(statement)  # noqa: E731
    sa.event.listen(sa.engine.Engine, "before_cursor_execute", listener)  # every engine, this process
    try:
        got = guard.states(sorted(ids) + [unknown])
    finally:
        sa.event.remove(sa.engine.Engine, "before_cursor_execute", listener)
        for engine in getattr(backend.session_manager, "_engines", {}).values():
            engine.dispose()  # let the fixture drop the database
    assert got == {**ids, unknown: states.PENDING}
    assert len([s for s in selects if s.lstrip().upper().startswith("SELECT")]) == 1, selects


def test_other_key_value_backends_are_read_in_one_call_too():
    """Celery's cache backend (memory here, memcached in production) answers a multi-get
    with a mapping rather than a list: same states, one call."""
    from celery import Celery

    app = Celery("cache", backend="cache+memory://")
    guard = _guard_for(app, overlap="skip")
    backend = app.backend
    calls = []
    real = backend.mget
    backend.mget = lambda keys: calls.append(list(keys)) or real(keys)
    backend.store_result("run-1", None, "STARTED")
    backend.store_result("run-2", None, "SUCCESS")
    assert guard.states(["run-1", "run-2", "run-3"]) == {"run-1": "STARTED", "run-2": "SUCCESS", "run-3": "PENDING"}
    assert len(calls) == 1


# ------------------------------------------------------------------------------ what "in flight" means


def _guard_for(app, **settings):
    from celery_cluster_beat.beat.guard import OverlapGuard
    from celery_cluster_beat.config.settings import load_settings

    app.conf.update({f"cluster_beat_{k}": v for k, v in settings.items()})
    from celery_cluster_beat.config.celeryconf import has_result_backend

    return OverlapGuard(app, load_settings(app.conf, has_result_backend=lambda: has_result_backend(app)))


def _entry(name_: str, overlap: Optional[str] = None, max_run_time: Optional[float] = None):
    from celery_cluster_beat import every
    from celery_cluster_beat.config.entries import Entry

    return Entry(name=name_, task="t.work", schedule=every(60), overlap=overlap, max_run_time=max_run_time)


@dataclass
class _State:  # what ClaimStore.schedule_states() gives the guard
    name: str
    last_task_id: str
    last_sent_at: datetime


STATE_TABLE = [
    # (state of the previous run, its age in s, sent?, watchdog?)
    ("PENDING", 5, False, False),  # queued, or running without task_track_started
    ("RECEIVED", 5, False, False),
    ("STARTED", 5, False, False),
    ("RETRY", 5, False, False),
    ("PROGRESS", 5, False, False),  # a custom state set with update_state()
    ("SUCCESS", 5, True, False),
    ("FAILURE", 5, True, False),
    ("REVOKED", 5, True, False),
    (None, 5, False, False),  # never stored: reads PENDING
    (None, 700, True, False),  # unknown and old (result expired / never stored): frees quietly
    ("PENDING", 700, True, False),
    ("STARTED", 700, True, True),  # in flight past max_run_time: the watchdog
    ("RETRY", 700, True, True),
]


def test_which_states_of_the_previous_run_block_the_next_fire(redis_url):
    """``skip`` against each state of the previous run in a real Redis result backend, with
    ``max_run_time`` 600 s."""
    from celery import Celery

    from celery_cluster_beat import signals

    app = Celery("states", broker=redis_url, backend=redis_url)
    guard = _guard_for(app, overlap="skip", max_run_time=600)
    now = datetime.now(UTC)
    entries, expected = [], {}
    for i, (state, age, send, dog) in enumerate(STATE_TABLE):
        entry = _entry(name(f"{state}-{age}-{i}"))
        task_id = str(uuid.uuid4())
        if state is not None:
            app.backend.store_result(task_id, None, state)
        guard.load([_State(entry.name, task_id, now - timedelta(seconds=age))])
        entries.append(entry)
        expected[entry.name] = (send, dog)
    from celery_cluster_beat.schedules.occurrence import Occurrence

    dogs: List[str] = []
    receiver = lambda sender, schedule=None, **kw: dogs.append(schedule)  # noqa: E731
    signals.watchdog_fired.connect(receiver, weak=False)
    try:
        decision = guard.filter([(e, Occurrence(e.name, now)) for e in entries], now)
        again = guard.filter([(e, Occurrence(e.name, now + timedelta(seconds=1))) for e in entries], now)
    finally:
        signals.watchdog_fired.disconnect(receiver)
    got = {e.name: (True, e.name in dogs) for e, _ in decision.send}
    got.update({e.name: (False, e.name in dogs) for e, _ in decision.skipped})
    assert got == expected
    assert len(dogs) == sum(1 for *_, dog in STATE_TABLE if dog), "once per hung run, not per fire"
    assert {e.name for e, _ in again.send} == {e.name for e, _ in decision.send}


def test_catch_up_sends_only_the_first_of_a_burst_and_buffer_one_keeps_one(redis_url):
    """Several occurrences of one schedule due at once (catch-up ``all``): with a free
    schedule ``skip`` sends the first and skips the rest, ``buffer_one`` sends the first and
    keeps the second, ``replace`` revokes the running one for the first only, ``allow`` sends all."""
    from celery import Celery

    from celery_cluster_beat.schedules.occurrence import Occurrence

    app = Celery("burst", broker=redis_url, backend=redis_url)
    guard = _guard_for(app, max_run_time=600)
    now = datetime.now(UTC)
    running = str(uuid.uuid4())
    app.backend.store_result(running, None, "STARTED")
    out = {}
    for policy in ("skip", "buffer_one", "replace", "allow"):
        entry = _entry(name(policy), overlap=policy)
        if policy == "replace":
            guard.load([_State(entry.name, running, now - timedelta(seconds=5))])
        occs = [Occurrence(entry.name, now - timedelta(minutes=k)) for k in (3, 2, 1)]
        d = guard.filter([(entry, o) for o in occs], now)
        out[policy] = ([o.at for _, o in d.send], [o.at for _, o in d.buffered], [o.at for _, o in d.skipped],
                       {o.at: tid for o, tid in d.replaces.items()})
        first, second, third = (o.at for o in occs)
        expect = {
            "skip": ([first], [], [second, third], {}),
            "buffer_one": ([first], [second], [third], {}),
            "replace": ([first], [], [second, third], {first: running}),
            "allow": ([first, second, third], [], [], {}),
        }[policy]
        assert out[policy] == expect, (policy, out[policy])


def test_without_a_result_backend_a_guarded_run_blocks_for_max_run_time(redis_url):
    """No result backend: nothing can say a run ended, so ``skip`` holds the schedule for
    ``max_run_time`` after each send, quietly (the start-up warning has said so)."""
    from celery import Celery

    from celery_cluster_beat.schedules.occurrence import Occurrence

    app = Celery("nobackend", broker=redis_url)
    guard = _guard_for(app, overlap="skip", max_run_time=30)
    now = datetime.now(UTC)
    young, old = _entry(name("young")), _entry(name("old"))
    guard.load([_State(young.name, str(uuid.uuid4()), now - timedelta(seconds=29)),
                _State(old.name, str(uuid.uuid4()), now - timedelta(seconds=31))])
    d = guard.filter([(young, Occurrence(young.name, now)), (old, Occurrence(old.name, now))], now)
    assert [e.name for e, _ in d.skipped] == [young.name] and [e.name for e, _ in d.send] == [old.name]


def test_an_unreachable_result_backend_fails_open_with_a_warning(caplog):
    """The result backend does not answer: the guard cannot know, so it does not block (a
    schedule that never runs is worse than a rare overlap), and says so once."""
    from celery import Celery

    from celery_cluster_beat.schedules.occurrence import Occurrence

    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens here
    app = Celery("down", backend=f"redis://127.0.0.1:{port}/0")
    app.conf.redis_socket_connect_timeout = 0.5
    app.conf.result_backend_always_retry = False
    guard = _guard_for(app, overlap="skip", max_run_time=600)
    now = datetime.now(UTC)
    entry = _entry(name("down"))
    guard.load([_State(entry.name, str(uuid.uuid4()), now - timedelta(seconds=1))])
    with caplog.at_level("WARNING", logger="celery_cluster_beat.guard"):
        for k in range(2):
            d = guard.filter([(entry, Occurrence(entry.name, now + timedelta(seconds=k)))], now)
            assert [e.name for e, _ in d.send] == [entry.name]
    warnings = [r for r in caplog.records if "cannot read task states" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]


# ------------------------------------------------------------------------------ start-up warnings


NO_BACKEND = "overlap guard on {names} but the app has no result backend"
NOT_TRACKED = "overlap guard on {names} with task_track_started=False"


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_start_up_warnings_when_the_guard_cannot_see_runs(redis_url, tmp_path):
    """Real ``celery beat`` start-ups. A guard asked for explicitly where nothing can see a run end
    (no result backend, no ledger) refuses to start, naming the entry, the field and the fixes; a
    guard that sees only part of it (no task_track_started) warns, naming the entries; a
    configuration it can work with stays quiet."""
    cases = {
        # name: (backend, conf, schedule extras, expected warning, or ("error", text), or None)
        "skip-no-backend": (None, '{"cluster_beat_overlap": "skip"}', "", ("error", "overlap (cluster_beat_overlap='skip'): 'skip'")),
        "entry-buffer-no-backend": (None, "{}", ', "overlap": "buffer_one"', ("error", "overlap: 'buffer_one'")),
        "not-tracked": (redis_url, "{}", "", NOT_TRACKED),  # skip is the default with a backend
        "tracked": (redis_url, '{"task_track_started": True}', "", None),
        "allow-by-default": (None, "{}", "", None),  # no backend: the default policy is allow
    }
    started = {}
    try:
        for label, (backend, conf, extra, _) in cases.items():
            d = tmp_path / label
            d.mkdir()
            sched = f"{label}-entry"
            app = procs.write_app(d, broker=redis_url, db_url=f"sqlite:///{d}/claims.sqlite3", backend=backend,
                                  conf=conf, schedule=f'{{{sched!r}: {{"task": "t.record", "schedule": every(3600){extra}}}}}')
            started[label] = procs.start_beat(app, d, label)
        for label, proc in started.items():
            procs.wait_for(lambda: "cluster-beat: node" in proc.log() or not proc.alive(), 40,
                           what=f"beat {label} to start")
        for label, (_, _, _, expected) in cases.items():
            log = started[label].log()
            if isinstance(expected, tuple):  # refused at start-up: the entry, the field, how to fix it
                procs.wait_for(lambda: not started[label].alive(), 20, what=f"beat {label} to exit")
                log = started[label].log()
                assert "cluster-beat: node" not in log, log
                assert f"beat_schedule entry '{label}-entry': {expected[1]} cannot see when a run ends" in log, log
                assert "LedgerTask" in log and "overlap='allow'" in log, log
                continue
            assert "cluster-beat: node" in log, log
            warned = [line for line in log.splitlines() if "overlap guard on" in line]
            if expected is None:
                assert warned == [], warned
            else:
                text = expected.format(names=f"{label}-entry")
                assert len(warned) == 1 and text in warned[0] and "WARNING" in warned[0], (text, warned)
    finally:
        for proc in started.values():
            proc.stop(timeout=5)


# ------------------------------------------------------------------------------ no lease


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_replicas_without_a_lease_share_the_guard(cluster, redis_url, pg_url):
    """Two replicas and no lease: both race for every fire. Whichever wins, it must see the
    run the *other* one sent: a 2.5 s task every second still never runs twice at once."""
    sched = name("racing")
    c = cluster(
        db_url=pg_url,
        backend=redis_url,
        schedule=f'{{{sched!r}: {{"task": "t.work", "schedule": every(1), "args": (2.5,), "overlap": "skip"}}}}',
        conf='{"task_track_started": True, "cluster_beat_max_run_time": 60,'
             ' "cluster_beat_node_id": os.environ.get("CCB_NODE")}',
    )
    worker = c.worker(concurrency=3, wait=False)
    c.beat("A", node="A")  # alongside: a first send waits in the queue (PENDING, in flight) until the worker is ready
    c.beat("B", node="B")
    c.ready(worker)
    wait_until(lambda: len([r for r in c.runs(sched) if r.end is not None]) >= 4, 45, "four finished runs", c)
    for proc in c.procs[1:]:
        proc.stop()
    runs = [r for r in c.runs(sched) if r.end is not None]
    assert_never_overlap(runs, f"no lease (senders {[r.node for r in runs]})")
    rows = c.claims(sched)
    assert {r.node for r in rows} == {"A", "B"}, "both replicas took part"
    assert all(r.reason == "overlap" for r in rows if r.status == "skipped")
