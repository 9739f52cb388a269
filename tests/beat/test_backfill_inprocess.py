"""The leader's side of a backfill, with a real Scheduler driven like beat drives it, a real claim
database and the Redis broker: each past occurrence of the range is sent once, at once, with the
``cluster_beat_backfill`` header and reason ``backfill``; a second backfill of the range sends
nothing; missed rows are sent and sent ones are not; a request made while no leader runs waits
for the next one."""
from __future__ import annotations

import json
import time
import uuid
from datetime import timedelta
from typing import Any, Callable, List

import redis
from prometheus_client.parser import text_string_to_metric_families
from celery import Celery

from celery_cluster_beat import every
from celery_cluster_beat.beat.scheduler import Scheduler
from celery_cluster_beat.ops.metrics import ClusterBeatMetrics
from celery_cluster_beat.schedules.instants import utc_iso
from celery_cluster_beat.schedules.occurrence import Occurrence
from celery_cluster_beat.store import ClaimStore
from celery_cluster_beat.store.backfill import BackfillRequest


def _app(made, db, broker) -> Celery:
    name = "ccb_bf_" + uuid.uuid4().hex[:8]
    app = Celery(name, broker=broker, set_as_current=False)
    app.conf.update(task_default_queue="q_" + name, cluster_beat_db_url=db, cluster_beat_redis_url="",
                    beat_schedule={"minutely": {"task": "t.x", "schedule": every(60), "jitter": 30}})
    made.append(app)
    return app


def _run_until(sched: Scheduler, done: Callable[[], Any], seconds: float = 20.0) -> Any:
    """Tick *sched* as beat does until *done()* is truthy (bounded: fails after *seconds*)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        found = done()
        if found:
            return found
        time.sleep(max(0.0, min(sched.tick(), 0.2)))
    raise AssertionError(f"not done within {seconds} s")


def _finished(ops: ClaimStore, request: BackfillRequest) -> Callable[[], Any]:
    def check() -> Any:
        row = ops.backfill_request(request.id)
        return row if row.state != "pending" else None
    return check


def _headers(app: Celery) -> List[dict]:
    client = redis.Redis.from_url(app.conf.broker_url)
    try:
        return [json.loads(m)["headers"] for m in client.lrange(app.conf.task_default_queue, 0, -1)]
    finally:
        client.close()


def test_a_range_of_past_occurrences_is_sent_once_each_with_the_backfill_header(made, db, broker):
    app = _app(made, db, broker)
    ops = ClaimStore(db, node_id="ops")
    ops.open()
    made.append(ops)
    sched = Scheduler(app, lazy=False)
    made.append(sched)
    sched.tick()
    now = ops.db_now()
    start = now.replace(second=0, microsecond=0) - timedelta(minutes=10)
    end = start + timedelta(minutes=4)
    expected = [start + timedelta(minutes=i) for i in range(5)]
    # One of them was missed while beat was down, one was sent already.
    ops.record([Occurrence("minutely", expected[1])], status="missed", reason="catchup")
    ops.claim([Occurrence("minutely", expected[2])])
    ops.mark_sent([Occurrence("minutely", expected[2])])

    _, request = ops.request_backfill("minutely", start, end, limit=10, by="alice")
    done = _run_until(sched, _finished(ops, request))

    assert (done.state, done.sent, done.not_sent) == ("done", 4, {"already sent": 1})
    rows = {r.scheduled_at: r for r in ops.claims("minutely") if start <= r.scheduled_at <= end}
    assert sorted(rows) == expected
    backfilled = sorted(at for at, r in rows.items() if r.reason == "backfill")
    assert backfilled == [at for at in expected if at != expected[2]]
    assert all(rows[at].status == "sent" for at in expected)
    sent = [h for h in _headers(app) if h.get("cluster_beat_backfill") is True]
    assert sorted(h["cluster_beat_scheduled_at"] for h in sent) == [utc_iso(at) for at in backfilled]
    assert all(h.get("eta") is None for h in sent)  # at once: the entry's jitter does not apply
    assert len({h["id"] for h in sent}) == 4

    # The same range again: nothing is sent, each one is reported already sent.
    _, again = ops.request_backfill("minutely", start, end, limit=10)
    done = _run_until(sched, _finished(ops, again))
    assert (done.state, done.sent, done.not_sent) == ("done", 0, {"already sent": 5})
    assert len([h for h in _headers(app) if h.get("cluster_beat_backfill") is True]) == 4


def test_a_request_beyond_its_limit_or_for_no_schedule_is_refused(made, db, broker):
    app = _app(made, db, broker)
    ops = ClaimStore(db, node_id="ops")
    ops.open()
    made.append(ops)
    sched = Scheduler(app, lazy=False)
    made.append(sched)
    sched.tick()
    now = ops.db_now()
    _, big = ops.request_backfill("minutely", now - timedelta(hours=1), now, limit=3)
    _, nobody = ops.request_backfill("nobody", now - timedelta(hours=1), now)
    assert _run_until(sched, _finished(ops, big)).error.startswith("the range holds more than 3 occurrences")
    assert _run_until(sched, _finished(ops, nobody)).error == "no such schedule"
    assert [r for r in ops.claims("minutely") if r.reason == "backfill"] == []


def test_a_request_made_while_no_leader_runs_is_served_by_the_next_one(made, db, broker):
    app = _app(made, db, broker)
    ops = ClaimStore(db, node_id="ops")
    ops.open()
    made.append(ops)
    Scheduler(app, lazy=False).close()  # prepares the store, then no leader runs
    now = ops.db_now()
    start = now.replace(second=0, microsecond=0) - timedelta(minutes=5)
    _, request = ops.request_backfill("minutely", start, start + timedelta(minutes=2))
    time.sleep(0.5)
    assert ops.backfill_request(request.id).state == "pending"
    sched = Scheduler(app, lazy=False)
    made.append(sched)
    done = _run_until(sched, _finished(ops, request))
    assert (done.state, done.sent) == ("done", 3)


def test_a_backfill_left_claimed_by_a_node_that_died_is_resent_with_its_header(made, db, broker):
    """The claimant of a backfill dies before publishing: the leader's stale-claim sweep resends its
    rows (known gone by the database's clock: it never heartbeat), still marked as backfill."""
    app = _app(made, db, broker)
    app.conf.cluster_beat_claim_grace = 1.5
    ops = ClaimStore(db, node_id="ops")
    ops.open()
    made.append(ops)
    now = ops.db_now()
    start = now.replace(second=0, microsecond=0) - timedelta(minutes=20)
    dead = ClaimStore(db, node_id="dead-leader")
    dead.open()
    made.append(dead)
    won = dead.claim_backfill([Occurrence("minutely", start + timedelta(minutes=i)) for i in range(3)]).won
    assert len(won) == 3
    sched = Scheduler(app, lazy=False)
    made.append(sched)
    metrics = ClusterBeatMetrics(sender=sched).connect()
    made.append(metrics)

    def resent() -> bool:
        return all(r.status == "sent" for r in ops.claims("minutely") if r.scheduled_at <= start + timedelta(minutes=2))

    _run_until(sched, resent)
    sent = [h for h in _headers(app) if h.get("cluster_beat_backfill") is True]
    assert sorted(h["cluster_beat_scheduled_at"] for h in sent) == [utc_iso(o.at) for o in won]
    assert b'cluster_beat_occurrences_total{outcome="resent",schedule="minutely"} 3.0' in metrics.exposition()


def test_backfilled_sends_are_counted_as_such(made, db, broker):
    app = _app(made, db, broker)
    ops = ClaimStore(db, node_id="ops")
    ops.open()
    made.append(ops)
    sched = Scheduler(app, lazy=False)
    made.append(sched)
    metrics = ClusterBeatMetrics(sender=sched).connect()
    made.append(metrics)
    sched.tick()
    start = ops.db_now().replace(second=0, microsecond=0) - timedelta(minutes=7)
    _, request = ops.request_backfill("minutely", start, start + timedelta(minutes=1))
    assert _run_until(sched, _finished(ops, request)).sent == 2
    text = metrics.exposition()
    assert b'cluster_beat_occurrences_total{outcome="backfilled",schedule="minutely"} 2.0' in text
    samples = {(s.name, s.labels.get("outcome")): s.value for f in text_string_to_metric_families(text.decode())
               for s in f.samples if s.labels.get("schedule") == "minutely"}
    # Lateness counts the on-time sends only (the minute may have fired meanwhile), not backfills.
    assert samples.get(("cluster_beat_send_lateness_seconds_count", None), 0) == samples.get(
        ("cluster_beat_occurrences_total", "sent"), 0)


def test_the_schedule_page_marks_backfilled_runs(made, db, broker):
    from celery_cluster_beat.ops.pagehtml import render_schedule
    from celery_cluster_beat.ops.schedulepage import schedule_detail

    app = _app(made, db, broker)
    ops = ClaimStore(db, node_id="ops")
    ops.open()
    made.append(ops)
    sched = Scheduler(app, lazy=False)
    made.append(sched)
    sched.tick()
    start = ops.db_now().replace(second=0, microsecond=0) - timedelta(minutes=9)
    _, request = ops.request_backfill("minutely", start, start + timedelta(minutes=1))
    _run_until(sched, _finished(ops, request))
    detail = schedule_detail(app, ops, "minutely")
    html = render_schedule(title="t", node="n", detail=detail)
    assert html.count(">backfill<") == 2, html


def test_a_backfill_row_whose_reason_was_rewritten_is_still_resent_and_shown_as_backfill(made, db, broker):
    """A failed publish (mark_failed) and a release rewrite the reason of a backfill's rows: their origin
    stays, so the sweep's resend still carries the header and history still says backfill."""
    from celery_cluster_beat.ops.records import HistoryRow

    app = _app(made, db, broker)
    app.conf.cluster_beat_claim_grace = 1.5
    ops = ClaimStore(db, node_id="ops")
    ops.open()
    made.append(ops)
    start = ops.db_now().replace(second=0, microsecond=0) - timedelta(minutes=30)
    dead = ClaimStore(db, node_id="dead-leader")
    dead.open()
    made.append(dead)
    occurrences = [Occurrence("minutely", start + timedelta(minutes=i)) for i in range(3)]
    assert len(dead.claim_backfill(occurrences).won) == 3
    assert dead.mark_failed(occurrences[0], "ConnectionError: broker down")  # retried later: still claimed
    assert dead.mark_failed(occurrences[1], "ConnectionError: broker down", final=True)  # failed for good
    dead.release()  # the third (and the first) handed over, reason "released by dead-leader"
    rows = {r.scheduled_at: r for r in ops.claims("minutely")}
    assert {rows[o.at].reason for o in occurrences} != {"backfill"}  # the reasons were rewritten
    assert {rows[o.at].origin for o in occurrences} == {"backfill"}
    assert HistoryRow.from_claim(rows[occurrences[1].at]).backfill  # failed: history still says backfill
    sched = Scheduler(app, lazy=False)
    made.append(sched)

    def resent() -> bool:
        rows = {r.scheduled_at: r.status for r in ops.claims("minutely")}
        return rows[occurrences[0].at] == "sent" and rows[occurrences[2].at] == "sent"

    _run_until(sched, resent)
    sent = [h for h in _headers(app) if h.get("cluster_beat_backfill") is True]
    assert sorted(h["cluster_beat_scheduled_at"] for h in sent) == [utc_iso(o.at) for o in (occurrences[0],
                                                                                         occurrences[2])]


def test_a_paused_schedules_backfill_left_claimed_is_still_resent_by_the_sweep(made, db, broker):
    """The operator asked for it: a backfill of a paused schedule is sent, and so is its resend when
    its leader died before publishing (the schedule's own occurrences left claimed end failed)."""
    app = _app(made, db, broker)
    app.conf.cluster_beat_claim_grace = 1.5
    ops = ClaimStore(db, node_id="ops")
    ops.open()
    made.append(ops)
    ops.set_paused("minutely", True, by="alice")
    start = ops.db_now().replace(second=0, microsecond=0) - timedelta(minutes=40)
    dead = ClaimStore(db, node_id="dead-leader")
    dead.open()
    made.append(dead)
    backfill = [Occurrence("minutely", start + timedelta(minutes=i)) for i in range(2)]
    own = Occurrence("minutely", start + timedelta(minutes=5))
    assert len(dead.claim_backfill(backfill).won) == 2
    assert dead.claim([own]) == [own]
    sched = Scheduler(app, lazy=False)
    made.append(sched)

    def swept() -> bool:
        rows = {r.scheduled_at: r.status for r in ops.claims("minutely")}
        return all(rows[o.at] != "claimed" for o in backfill + [own])

    _run_until(sched, swept)
    rows = {r.scheduled_at: r for r in ops.claims("minutely")}
    assert [rows[o.at].status for o in backfill] == ["sent", "sent"]
    assert rows[own.at].status == "failed" and "paused" in rows[own.at].reason
    sent = [h for h in _headers(app) if h.get("cluster_beat_backfill") is True]
    assert sorted(h["cluster_beat_scheduled_at"] for h in sent) == [utc_iso(o.at) for o in backfill]
