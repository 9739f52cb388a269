"""What the leader keeps in memory follows what it holds: a stored schedule that leaves memory
(handed back to SQL after it fired, removed, or changed to fire beyond the horizon) takes its
message template and the overlap guard's record of its last run with it.

Counted in the caches themselves, not by RSS, so the test is exact and fast: a real
:class:`Scheduler` driven like beat drives it, on a real claim database and the Redis broker,
with the horizon shortened to 4 s (the same code paths as the real 120 s). Before, both caches
kept one item per schedule ever fired (about 160 MiB after 100,000 stored schedules fired once;
``benchmarks/bench_held_memory.py`` measures that RSS).
"""
from __future__ import annotations

import time
import uuid
from datetime import datetime, timedelta, timezone
from typing import Callable, List

import pytest
import redis
from celery import Celery

from celery_cluster_beat import cron, every
from celery_cluster_beat.beat import stored as stored_module
from celery_cluster_beat.beat.scheduler import Scheduler
from celery_cluster_beat.dynamic import StoredSchedules

UTC = timezone.utc
HORIZON = 4.0
N = 2000








def _far():
    """A yearly cron at least a day away (never due during the test)."""
    now = datetime.now(UTC)
    for expr in ("0 0 29 2 *", "0 12 1 7 *"):
        rule = cron(expr, tz="UTC")
        if rule.next_fire(now) - now > timedelta(days=1):
            return rule
    raise AssertionError("no far-away schedule found")  # pragma: no cover


def _every_first_in(lo: float, hi: float, steps) -> int:
    """A step n such that every(n) (on the epoch grid) first fires between *lo* and *hi* s from now."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        now = time.time()
        for n in steps:
            if lo <= n - now % n <= hi:
                return n
        time.sleep(0.05)
    raise AssertionError("no suitable every(n)")  # pragma: no cover


def _app(made, db: str, broker: str) -> Celery:
    name = "ccb_mem_" + uuid.uuid4().hex[:8]
    app = Celery(name, broker=broker, set_as_current=False)
    app.conf.update(task_default_queue="q_" + name, cluster_beat_db_url=db, cluster_beat_redis_url="",
                    cluster_beat_claim_grace=30.0, cluster_beat_prune_interval=3600.0,
                    beat_schedule={"static": {"task": "t.record", "schedule": _far()}})
    made.append(app)
    return app


def _queued(app: Celery) -> int:
    client = redis.Redis.from_url(app.conf.broker_url)
    try:
        return client.llen(app.conf.task_default_queue)
    finally:
        client.close()


def _run_until(sched: Scheduler, predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        wait = sched.tick()
        if predicate():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(min(wait, 0.05))


def _kept(sched: Scheduler):
    """(names with a template or refusal, names with a recorded last run) the leader keeps."""
    return sched._pipeline.publisher.templates.kept(), sched._guard.kept_runs()


@pytest.mark.timeout(180)
def test_stored_schedules_handed_back_to_sql_leave_no_template_and_no_guard_state(db, made, broker, monkeypatch):
    """2,000 stored ``every(n)`` schedules (n 30-60 s) first due 8-11 s after start are held, fire
    once together, and are handed back to SQL (their next fire is past the 12 s horizon). Then
    the leader holds only the config's entry, and keeps no template and no last run of any of
    them, although each was sent from a template and its run recorded by the guard.

    Fails if the template cache or the overlap guard's last runs keep a schedule that is no
    longer held (memory growing with every stored schedule ever fired)."""
    # A horizon of its own, wide enough that storing 2,000 rows on a loaded host still ends
    # before their first fire (8-11 s away), which the next (30+ s later) lies beyond. The window
    # is at most 12 s ahead of the pass that fires them, so the next fire is past it unless that pass
    # comes more than n - 12 s late: with n from 13 s, a pass 1-2 s late on a loaded machine (2,000
    # sends) kept them held, and they fired again every n s and were never handed back; n >= 30
    # leaves 18 s.
    monkeypatch.setattr(stored_module, "HORIZON", 12.0)
    app = _app(made, db, broker)
    api = StoredSchedules(app)
    made.append(api)
    n = _every_first_in(8.0, 11.0, range(30, 61))
    api.add_many([{"name": f"s-{i:05d}", "task": "t.record", "schedule": every(n)} for i in range(N)])
    first = api.store.stored_get(["s-00000"])[0].next_at
    sched = Scheduler(app, lazy=False)
    made.append(sched)
    assert len(sched.entries) == N + 1, "set-up: all of them are due within the horizon"
    publisher, guard = sched._pipeline.publisher, sched._guard
    recorded: List[str] = []  # every send the guard records (counted, not changed)
    record = guard.sent
    guard.sent = lambda entry, occ: (recorded.append(entry.name), record(entry, occ))[-1]

    _run_until(sched, lambda: _queued(app) >= N and len(sched.entries) == 1, 60, f"{N} sends and their hand-back")
    row = api.store.stored_get(["s-00000"])[0]

    assert sorted(sched.entries) == ["static"]
    assert row.next_at >= first + timedelta(seconds=n), "set-up: handed back to SQL with a later fire"
    assert len(set(recorded)) == N, "set-up: the guard recorded a last run of each"
    assert publisher.stamped >= N // 2, f"set-up: only {publisher.stamped} messages came from templates"
    assert _kept(sched) == (0, 0), "templates / last runs of schedules no longer held are kept"


@pytest.mark.timeout(120)
def test_a_removed_or_rescheduled_stored_schedule_takes_its_template_and_last_run_with_it(
        db, made, broker, monkeypatch):
    """Two stored every-second schedules fire while held (each then has a template and a last
    run); one is removed, the other changed to a yearly rule (beyond the horizon); once the
    changes are applied neither keeps anything in memory. A run-now of a stored schedule that
    is not held leaves nothing behind either. The config's entry, held throughout, keeps its own.

    Fails if a removal, a change or a manual run leaves the schedule's template or last run."""
    monkeypatch.setattr(stored_module, "HORIZON", HORIZON)
    app = _app(made, db, broker)
    app.conf.beat_schedule = {"static": {"task": "t.record", "schedule": every(1)}}
    api = StoredSchedules(app)
    made.append(api)
    api.add("gone", "t.record", every(1))
    api.add("moved", "t.record", every(1))
    api.add("far", "t.record", _far())
    sched = Scheduler(app, lazy=False)
    made.append(sched)
    templates = sched._pipeline.publisher.templates
    guard = sched._guard

    _run_until(sched, lambda: _queued(app) >= 9, 20, "the schedules firing a few times")
    assert _kept(sched) == (3, 3), "set-up: three held schedules fired, each kept a template and a last run"
    api.remove("gone")
    api.update("moved", schedule=_far())
    _run_until(sched, lambda: sorted(sched.entries) == ["static"], 10, "the changes applied")
    assert _kept(sched) == (1, 1) and templates.has("static"), "a removed or moved schedule kept its state"

    before = _queued(app)
    api.store.request_run("far")
    _run_until(sched, lambda: _queued(app) > before, 10, "the manual run of 'far'")
    assert "far" not in sched.entries
    assert not templates.has("far") and _kept(sched) == (1, 1), "a manual run of a schedule not held kept its state"
    assert guard.kept_runs() == 1
