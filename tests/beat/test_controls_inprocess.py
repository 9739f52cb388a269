"""The leader's side of operators' controls, with a real Scheduler driven like beat drives it, a
real claim database and the Redis broker: a paused schedule (config or stored) sends and records
nothing while paused and resumes from the moment it is resumed; run-now pressed twice while pending
gives one manual occurrence, recorded with reason ``manual``, sent at once whatever the entry's
jitter; a pause survives a new leader."""
from __future__ import annotations

import json
import time
import uuid
from datetime import datetime, timedelta, timezone
from typing import List

import pytest
import redis
from celery import Celery

from celery_cluster_beat import cron, every
from celery_cluster_beat.beat.scheduler import Scheduler
from celery_cluster_beat.dynamic import StoredSchedules
from celery_cluster_beat.store import ClaimStore









def _app(made, db, broker) -> Celery:
    name = "ccb_ctl_" + uuid.uuid4().hex[:8]
    app = Celery(name, broker=broker, set_as_current=False)
    app.conf.update(task_default_queue="q_" + name, cluster_beat_db_url=db, cluster_beat_redis_url="",
                    beat_schedule={"tick": {"task": "t.x", "schedule": every(1)}})
    made.append(app)
    return app


def _run(sched: Scheduler, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(max(0.0, min(sched.tick(), end - time.monotonic())))


def _rows(store: ClaimStore, name: str):
    return store.claims(name)


def test_a_paused_schedule_records_nothing_and_resumes_from_now(made, db, broker):
    app = _app(made, db, broker)
    api = StoredSchedules(app)
    made.append(api)
    api.add("stored", "t.y", every(1))
    sched = Scheduler(app, lazy=False)
    made.append(sched)
    ops = api.store
    _run(sched, 2.5)
    assert {r.schedule for r in ops.claims()} >= {"tick", "stored"}
    ops.set_paused("tick", True, by="alice")
    ops.set_paused("stored", True)
    _run(sched, 1.5)  # the pause is read within a second
    paused_at = ops.db_now()
    _run(sched, 3.0)
    resumed_at = ops.db_now()
    for name in ("tick", "stored"):
        inside = [r for r in ops.claims(name) if paused_at <= r.scheduled_at <= resumed_at]
        assert inside == [], (name, inside)
        assert name not in sched._queue
    ops.set_paused("tick", False)
    ops.set_paused("stored", False)
    _run(sched, 3.0)
    for name in ("tick", "stored"):
        after = [r for r in ops.claims(name) if r.scheduled_at > resumed_at]
        assert len(after) >= 1, name
        # No catch-up of the paused seconds: nothing recorded between the pause and the resume.
        assert not [r for r in ops.claims(name) if paused_at <= r.scheduled_at <= resumed_at]


def test_run_now_pressed_twice_gives_one_manual_occurrence(made, db, broker):
    app = _app(made, db, broker)
    app.conf.beat_schedule = {"rare": {"task": "t.x", "schedule": every(3600)}}
    sched = Scheduler(app, lazy=False)
    made.append(sched)
    ops = ClaimStore(db, node_id="ops")
    ops.open()
    made.append(ops)
    _run(sched, 0.5)
    _, first, at, joined = ops.request_run("rare", by="alice")
    _, second, _, joined2 = ops.request_run("rare", by="bob")
    assert not joined and joined2 and first == second
    _run(sched, 2.0)
    manual = [r for r in ops.claims("rare") if r.reason == "manual"]
    assert [(r.scheduled_at, r.status) for r in manual] == [(at, "sent")]
    assert ops.controls(active_only=True) == []  # the request is handled
    # A new leader does not run it again.
    sched.close()
    again = Scheduler(app, lazy=False)
    made.append(again)
    _run(again, 1.5)
    assert len([r for r in ops.claims("rare") if r.reason == "manual"]) == 1


def test_a_pause_survives_a_new_leader(made, db, broker):
    app = _app(made, db, broker)
    ops = ClaimStore(db, node_id="ops")
    ops.open()
    made.append(ops)
    ops.set_paused("tick", True)
    sched = Scheduler(app, lazy=False)
    made.append(sched)
    start = ops.db_now()
    _run(sched, 2.5)
    assert [r for r in ops.claims("tick") if r.scheduled_at >= start - timedelta(seconds=1)] == []
    assert "tick" not in sched._queue


def test_a_resumed_schedule_does_not_catch_up_its_paused_time_after_a_leader_change(made, db, broker):
    """Paused, resumed, and the leader changes before the first fire after the resume: the new
    leader starts from the resume, so nothing of the paused time is sent or recorded missed
    (config and stored schedules alike)."""
    app = _app(made, db, broker)
    app.conf.cluster_beat_catchup = "all"
    api = StoredSchedules(app)
    made.append(api)
    api.add("stored", "t.y", every(1))
    ops = api.store
    first = Scheduler(app, lazy=False)
    _run(first, 1.5)
    ops.set_paused("tick", True)
    ops.set_paused("stored", True)
    _run(first, 1.5)
    first.close()  # the leader goes away while they are paused
    paused_at = ops.db_now()
    time.sleep(2.5)
    ops.set_paused("tick", False)
    ops.set_paused("stored", False)
    resumed_at = ops.db_now()
    again = Scheduler(app, lazy=False)  # a new leader, after the resume
    made.append(again)
    _run(again, 2.5)
    for name in ("tick", "stored"):
        inside = [(r.scheduled_at, r.status) for r in ops.claims(name) if paused_at < r.scheduled_at < resumed_at]
        assert inside == [], (name, inside)
        assert [r for r in ops.claims(name) if r.scheduled_at > resumed_at], name


def _far(now: datetime):
    """A yearly cron at least a day away: with a big jitter its cap is the jitter itself."""
    for expr in ("0 0 29 2 *", "0 12 1 7 *"):
        rule = cron(expr, tz="UTC")
        if rule.next_fire(now) - now > timedelta(days=1):
            return rule
    raise AssertionError("no far-away schedule found")  # pragma: no cover


def _messages(app: Celery, name: str) -> List[dict]:
    """Headers of the messages of schedule *name* in the app's queue."""
    client = redis.Redis.from_url(app.conf.broker_url)
    try:
        raw = client.lrange(app.conf.task_default_queue, 0, -1)
    finally:
        client.close()
    return [h for h in (json.loads(item)["headers"] for item in raw) if h.get("cluster_beat_schedule") == name]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["config", "stored"])
def test_run_now_is_sent_at_once_whatever_the_entrys_jitter(made, db, broker, kind):
    """An entry with a jitter of 6 hours (config, or stored and not held in memory): run-now gives
    a message within a few seconds of the request, with no eta (or one within a few seconds of
    the request's instant), recorded ``manual`` and ``sent``. Jitter spreads scheduled
    occurrences; an operator's run-now means now.

    Fails if the manual occurrence gets the entry's jitter (its eta hours after the request)."""
    jitter = 6 * 3600.0
    app = _app(made, db, broker)
    rule = _far(datetime.now(timezone.utc))
    if kind == "config":
        app.conf.beat_schedule = {"rare": {"task": "t.x", "schedule": rule, "jitter": jitter}}
    else:
        app.conf.beat_schedule = {}
        api = StoredSchedules(app)
        made.append(api)
        api.add("rare", "t.x", rule, jitter=jitter)
    sched = Scheduler(app, lazy=False)
    made.append(sched)
    ops = ClaimStore(db, node_id="ops")
    ops.open()
    made.append(ops)
    _run(sched, 0.5)
    assert ("rare" in sched.entries) == (kind == "config"), "set-up: a stored one a year away is not held"
    _, _, at, _ = ops.request_run("rare", by="alice")
    pressed = time.monotonic()
    while not _messages(app, "rare") and time.monotonic() - pressed < 15:
        time.sleep(max(0.0, min(sched.tick(), 0.05)))
    waited = time.monotonic() - pressed
    sent = _messages(app, "rare")

    assert len(sent) == 1, f"no manual message {waited:.1f}s after run-now"
    eta = sent[0].get("eta")
    if eta is not None:
        delay = (datetime.fromisoformat(eta.replace("Z", "+00:00")) - at).total_seconds()
        assert delay <= 5, f"the manual run waits {delay:.0f}s for the entry's jitter (eta {eta})"
    assert [(r.scheduled_at, r.status, r.reason) for r in ops.claims("rare")] == [(at, "sent", "manual")]
