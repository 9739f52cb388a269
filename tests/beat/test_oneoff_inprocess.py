"""One-offs and bounds with a real Scheduler driven as beat drives it (``tick()``, sleep what it
says), a real claim database (SQLite, PostgreSQL) and the Redis broker: an ``at()`` entry and a
stored one-off are each sent once, the stored row ends (next_at NULL, ended_at set) and is never
loaded again, also by a scheduler started afterwards; a one-off whose instant passed while no
scheduler ran follows its catch-up policy (sent late, or recorded missed); ``max_runs=2`` sends
exactly two; ``end_at`` stops a schedule."""
from __future__ import annotations

import json
import time
import uuid
from datetime import datetime, timedelta, timezone
from typing import Callable, List

import pytest
import redis
from celery import Celery

from celery_cluster_beat import at, every
from celery_cluster_beat.beat.scheduler import Scheduler
from celery_cluster_beat.dynamic import StoredSchedules
from celery_cluster_beat.store import ClaimStore

UTC = timezone.utc


def _app(made, db, broker, schedule=None) -> Celery:
    name = "ccb_once_" + uuid.uuid4().hex[:8]
    app = Celery(name, broker=broker, set_as_current=False)
    app.conf.update(task_default_queue="q_" + name, cluster_beat_db_url=db, cluster_beat_redis_url="",
                    cluster_beat_claim_grace=30.0, cluster_beat_node_id="node-" + name[-8:],
                    beat_schedule=schedule or {})
    made.append(app)
    return app


def _sent(app: Celery, name: str) -> List[datetime]:
    """Instants of the messages of schedule *name* in the app's queue, oldest first."""
    client = redis.Redis.from_url(app.conf.broker_url)
    try:
        raw = client.lrange(app.conf.task_default_queue, 0, -1)
    finally:
        client.close()
    out = []
    for item in reversed(raw):
        h = json.loads(item)["headers"]
        if h["cluster_beat_schedule"] == name:
            out.append(datetime.fromisoformat(h["cluster_beat_scheduled_at"].replace("Z", "+00:00")))
    return out


def _run(sched: Scheduler, seconds: float, until: Callable[[], bool] = lambda: False) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end and not until():
        time.sleep(max(0.0, min(sched.tick(), 0.05, end - time.monotonic())))


def _scheduler(made, app) -> Scheduler:
    sched = Scheduler(app, lazy=False)
    made.append(sched)
    return sched


def _ops(made, db) -> ClaimStore:
    store = ClaimStore(db, node_id="ops")
    store.open()
    made.append(store)
    return store


@pytest.mark.timeout(60)
def test_a_config_one_off_and_a_stored_one_off_are_each_sent_once_and_the_row_ends(made, db, broker):
    ops = _ops(made, db)
    when = ops.db_now().replace(microsecond=0) + timedelta(seconds=5)
    app = _app(made, db, broker, {"once": {"task": "t.once", "schedule": at(when)}})
    api = StoredSchedules(app)
    made.append(api)
    api.add("stored-once", "t.once", at(when.isoformat()), args=[1])
    sched = _scheduler(made, app)
    _run(sched, 20, until=lambda: len(_sent(app, "once")) + len(_sent(app, "stored-once")) >= 2)
    _run(sched, 1.5)  # anything more would come now
    assert _sent(app, "once") == [when] and _sent(app, "stored-once") == [when]
    row = api.get("stored-once")
    assert row.next_at is None and row.ended_at is not None and row.schedule == f"at {when:%Y-%m-%dT%H:%M:%S}Z"
    assert "once" not in sched._queue and "stored-once" not in sched._queue
    assert "stored-once" not in sched._node.entries
    assert [(c.scheduled_at, c.status) for c in ops.claims("stored-once")] == [(when, "sent")]
    # A restart (a new leader) sends neither again and does not load the ended row.
    sched.close()
    again = _scheduler(made, app)
    _run(again, 2.0)
    assert "stored-once" not in again._node.entries and "once" not in again._queue
    assert len(_sent(app, "once")) == len(_sent(app, "stored-once")) == 1


@pytest.mark.timeout(60)
def test_a_one_off_whose_instant_passed_while_no_scheduler_ran_follows_its_catchup_policy(made, db, broker):
    ops = _ops(made, db)
    when = ops.db_now().replace(microsecond=0) + timedelta(seconds=8)
    app = _app(made, db, broker, {"cfg-latest": {"task": "t.once", "schedule": at(when)},
                                  "cfg-none": {"task": "t.once", "schedule": at(when), "catchup": "none"}})
    api = StoredSchedules(app)
    made.append(api)
    api.add("st-latest", "t.once", at(when))
    api.add("st-none", "t.once", at(when), catchup="none")
    api.add("st-window", "t.once", at(when), catchup_window=1)
    first = _scheduler(made, app)  # registers the config entries, then stops before their instant
    _run(first, 0.5)
    first.close()
    assert ops.db_now() < when - timedelta(seconds=1), "set-up: the first scheduler stopped before the instant"
    while ops.db_now() < when + timedelta(seconds=3):  # the instant passes with no scheduler running
        time.sleep(0.1)
    sched = _scheduler(made, app)
    names = ("cfg-latest", "cfg-none", "st-latest", "st-none", "st-window")
    _run(sched, 20, until=lambda: all(ops.claims(n) for n in names))
    _run(sched, 1.0)
    status = {n: [(c.scheduled_at, c.status, c.reason) for c in ops.claims(n)] for n in names}
    assert status["cfg-latest"] == [(when, "sent", None)] and status["st-latest"] == [(when, "sent", None)]
    for name in ("cfg-none", "st-none", "st-window"):
        assert status[name] == [(when, "missed", "catchup")], (name, status)
    assert _sent(app, "cfg-latest") == _sent(app, "st-latest") == [when]
    assert not _sent(app, "cfg-none") and not _sent(app, "st-none")
    assert all(api.get(n).ended_at is not None for n in ("st-latest", "st-none", "st-window"))


@pytest.mark.timeout(60)
def test_max_runs_two_sends_exactly_two_and_end_at_stops_a_schedule(made, db, broker):
    ops = _ops(made, db)
    now = ops.db_now()
    start = now.replace(microsecond=0) + timedelta(seconds=4)
    app = _app(made, db, broker, {
        "cfg-two": {"task": "t.x", "schedule": every(1), "max_runs": 2},  # counted from its registration
        "cfg-until": {"task": "t.x", "schedule": every(1), "start_at": start, "end_at": start + timedelta(seconds=2)},
    })
    api = StoredSchedules(app)
    made.append(api)
    api.add("st-two", "t.x", every(1), max_runs=2, start_at=start.isoformat())
    api.add("st-until", "t.x", every(1), end_at=start + timedelta(seconds=1))
    sched = _scheduler(made, app)
    _run(sched, 30, until=lambda: api.get("st-two").ended_at is not None and api.get("st-until").ended_at
         is not None and len(_sent(app, "cfg-two")) >= 2 and len(_sent(app, "cfg-until")) >= 3)
    _run(sched, 2.5)  # a third would be sent now
    assert _sent(app, "st-two") == [start, start + timedelta(seconds=1)]
    assert len(_sent(app, "cfg-two")) == 2
    assert _sent(app, "cfg-until") == [start + timedelta(seconds=s) for s in range(3)]
    assert _sent(app, "st-until")[-1] == start + timedelta(seconds=1)
    assert "st-two" not in sched._queue and "cfg-two" not in sched._queue
    # A new leader counts from the same start: nothing more.
    sched.close()
    again = _scheduler(made, app)
    _run(again, 2.0)
    assert len(_sent(app, "cfg-two")) == len(_sent(app, "st-two")) == 2


@pytest.mark.timeout(120)
def test_fired_one_offs_leave_memory_and_are_never_loaded_again(made, db, broker, monkeypatch):
    """2,000 stored one-offs, held only once within the (shortened) horizon, fire, end in SQL and
    leave nothing behind: no entry, no queue item, no message template, no overlap-guard last run.
    A new horizon window does not load them again (next_at is NULL)."""
    from celery_cluster_beat.beat import stored as stored_module

    monkeypatch.setattr(stored_module, "HORIZON", 6.0)
    ops = _ops(made, db)
    app = _app(made, db, broker, {"static": {"task": "t.x", "schedule": every(3600)}})
    api = StoredSchedules(app)
    made.append(api)
    # Most beyond the first window; room for the 2,000 adds on a loaded host (an instant already
    # passed when its row is written is refused).
    when = ops.db_now().replace(microsecond=0) + timedelta(seconds=15)
    n = 2000
    api.add_many({"name": f"o-{i:05d}", "task": "t.x", "schedule": at(when + timedelta(milliseconds=i))}
                 for i in range(n))
    sched = _scheduler(made, app)
    client = redis.Redis.from_url(app.conf.broker_url)
    made.append(client)
    _run(sched, 50, until=lambda: client.llen(app.conf.task_default_queue) >= n and len(sched.entries) == 1)
    _run(sched, 4.0)  # the window moves on at least once more
    assert client.llen(app.conf.task_default_queue) == n
    assert sorted(sched.entries) == ["static"] and sorted(name for _, name in sched._queue) == ["static"]
    assert sched._pipeline.publisher.templates.kept() == 0 and sched._guard.kept_runs() == 0
    assert ops.stored_due(ops.db_now() + timedelta(days=1)) == []
    assert sum(1 for r in ops.stored_list() if r.ended_at is not None and r.next_at is None) == n
