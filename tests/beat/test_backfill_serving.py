"""How the leader serves a backfill: in slices within a time budget per pass, after the due pass,
so an every-second schedule keeps every occurrence on time while thousands of another's are
backfilled; the request records its progress; the leader checks the request row again (a row
written by hand is refused, never walked); the result counts what was published, what failed and
what is still being sent."""
from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any

import pytest
import sqlalchemy as sa
from celery import Celery

from celery_cluster_beat import every
from celery_cluster_beat.beat.scheduler import Scheduler
from celery_cluster_beat.store import ClaimStore
from celery_cluster_beat.store.schema import BackfillState, backfills_table

from test_backfill_inprocess import _finished, _run_until  # the same ticking and waiting


def _app(made, db, broker, **schedule) -> Celery:
    name = "ccb_bfs_" + uuid.uuid4().hex[:8]
    app = Celery(name, broker=broker, set_as_current=False)
    app.conf.update(task_default_queue="q_" + name, cluster_beat_db_url=db, cluster_beat_redis_url="",
                    beat_schedule={k: {"task": "t.x", "schedule": v} for k, v in schedule.items()})
    made.append(app)
    return app




def _open(made, db) -> ClaimStore:
    ops = ClaimStore(db, node_id="ops")
    ops.open()
    made.append(ops)
    return ops


@pytest.mark.parametrize("db", ["postgresql"], indirect=True)
def test_a_large_backfill_never_delays_an_every_second_schedule(made, db, broker):
    app = _app(made, db, broker, fast=every(1), bulk=every(1))
    ops = _open(made, db)
    sched = Scheduler(app, lazy=False)
    made.append(sched)
    _run_until(sched, lambda: any(r.status == "sent" for r in ops.claims("fast")), 20)
    now = ops.db_now().replace(microsecond=0)
    start, end = now - timedelta(seconds=4100), now - timedelta(seconds=100)  # 4,001 occurrences
    _, request = ops.request_backfill("bulk", start, end, limit=5000)
    began = ops.db_now()
    progressed = []

    def done() -> Any:
        row = ops.backfill_request(request.id)
        if row.state == BackfillState.PENDING and row.done_to is not None:
            progressed.append(row.done_to)
        return row if row.state != BackfillState.PENDING else None

    found = _run_until(sched, done, 120)
    ended = ops.db_now()
    # Every occurrence of the every-second schedule while the backfill was served went out, none missed.
    fast = [r for r in ops.claims("fast") if began <= r.scheduled_at <= ended - timedelta(seconds=1)]
    assert [r for r in fast if r.status != "sent"] == []
    assert len(fast) >= (ended - began).total_seconds() - 2
    ats = [r.scheduled_at for r in fast]
    assert all(b - a == timedelta(seconds=1) for a, b in zip(ats, ats[1:]))
    assert (found.state, found.sent, found.not_sent, found.failed, found.retrying) == (
        BackfillState.DONE, 4001, {}, {}, 0)
    assert found.done_to == end
    assert len(set(progressed)) > 1  # served over several passes, the progress recorded each time
    bulk = [r for r in ops.claims("bulk") if start <= r.scheduled_at <= end]
    assert len(bulk) == 4001 and {(r.status, r.reason) for r in bulk} == {("sent", "backfill")}


def _hand_written(db: str, name: str, start, end, *, limit: int = 10, state: str = "pending",
                  not_sent: Any = None) -> str:
    """A request row written directly (not by the command): the leader must not trust it."""
    engine = sa.create_engine(db)
    request_id = str(uuid.uuid4())
    try:
        with engine.begin() as conn:
            conn.execute(sa.insert(backfills_table), [{
                "id": request_id, "schedule": name, "from_at": start, "to_at": end, "max_count": limit,
                "state": state, "requested_at": end, "requested_by": "by hand", "not_sent": not_sent}])
    finally:
        engine.dispose()
    return request_id


@pytest.mark.parametrize("db", ["postgresql"], indirect=True)
def test_the_leader_refuses_a_request_row_it_cannot_trust(made, db, broker):
    app = _app(made, db, broker, minutely=every(60), fast=every(1))
    app.conf.cluster_beat_claim_retention = 3 * 3600
    ops = _open(made, db)
    Scheduler(app, lazy=False).close()  # prepares the store; the rows are read by the next leader
    now = ops.db_now().replace(microsecond=0)
    hour = timedelta(hours=1)
    refused = {
        # limit beyond the cap, over a range of hundreds of thousands of occurrences: never walked
        _hand_written(db, "fast", now - 2 * hour, now, limit=1_000_000): "the request's limit must be from 1 to 10000",
        _hand_written(db, "minutely", now - hour, now - 2 * hour): "is after --to",
        _hand_written(db, "fast", now - hour, now + hour, limit=10000): "is in the future",
        _hand_written(db, "minutely", now - 4 * hour, now - 3.5 * hour, limit=100): "cluster_beat_claim_retention",
        _hand_written(db, "minutely", now - hour, now, limit=5): "the range holds more than 5 occurrences",
    }
    minute = now.replace(second=0)
    served = _hand_written(db, "minutely", minute - timedelta(minutes=10), minute - timedelta(minutes=9),
                           not_sent="{not json")
    strange = _hand_written(db, "minutely", now - hour, now, state="whatever")
    sched = Scheduler(app, lazy=False)
    made.append(sched)
    for request_id in refused:
        _run_until(sched, lambda: ops.backfill_request(request_id).state != BackfillState.PENDING, 20)
    _run_until(sched, lambda: ops.backfill_request(served).state != BackfillState.PENDING, 20)
    for request_id, why in refused.items():
        found = ops.backfill_request(request_id)
        assert found.state == BackfillState.REFUSED and why in found.error, (found, why)
    assert "\n" not in ops.backfill_request(next(iter(refused))).error
    done = ops.backfill_request(served)
    assert (done.state, done.sent) == (BackfillState.DONE, 2)
    assert ops.backfill_request(strange).state == BackfillState.REFUSED  # unknown: read as ended, never served
    backfilled = [r.scheduled_at for n in ("fast", "minutely") for r in ops.claims(n) if r.reason == "backfill"]
    assert sorted(backfilled) == [minute - timedelta(minutes=10), minute - timedelta(minutes=9)]


def test_a_range_older_than_the_claim_retention_is_refused_by_the_command(made, db, broker):
    from celery_cluster_beat.store.backfill import BackfillRefused

    ops = _open(made, db)
    _app(made, db, broker, minutely=every(60))
    Scheduler(made[-1], lazy=False).close()  # prepares the store
    now = ops.db_now()
    with pytest.raises(BackfillRefused, match="older than cluster_beat_claim_retention"):
        ops.request_backfill("minutely", now - timedelta(hours=2), now - timedelta(hours=1), retention=3600)
    assert ops.pending_backfills() == []
    _, request = ops.request_backfill("minutely", now - timedelta(minutes=30), now, retention=3600)
    assert request.state is BackfillState.PENDING and ops.backfill_request(request.id).state is BackfillState.PENDING


def test_the_result_counts_what_was_published_and_what_failed_with_the_reason(made, db, broker):
    """The broker refuses two of a backfill's messages (the publisher patched: a broker failure): the
    result counts the published ones as sent and the others, once their retries gave up, as failed
    with the broker's error; the command's summary says so."""
    from celery_cluster_beat.ops.cliviews import backfill_result

    app = _app(made, db, broker, minutely=every(60))
    app.conf.cluster_beat_claim_grace = 2.0  # publish retries 1 s apart: the last one within seconds
    ops = _open(made, db)
    sched = Scheduler(app, lazy=False)
    made.append(sched)
    sched.tick()
    start = ops.db_now().replace(second=0, microsecond=0) - timedelta(minutes=20)
    refused = {start + timedelta(minutes=1), start + timedelta(minutes=3)}
    publisher = sched._node.pipeline.publisher
    real = publisher.publish

    def publish(dispatches, ownership=None):
        errors = list(real([d for d in dispatches if d.occurrence.at not in refused], ownership))
        out = []
        for d in dispatches:
            out.append(ConnectionError("broker refused") if d.occurrence.at in refused else errors.pop(0))
        return out

    publisher.publish = publish
    _, request = ops.request_backfill("minutely", start, start + timedelta(minutes=5))
    found = _run_until(sched, _finished(ops, request), 60)
    assert (found.state, found.sent, found.failed, found.retrying, found.not_sent) == (
        BackfillState.DONE, 4, {"ConnectionError: broker refused": 2}, 0, {})
    rows = {r.scheduled_at: r.status for r in ops.claims("minutely") if r.reason == "backfill" or r.scheduled_at in refused}
    assert sorted(at for at, status in rows.items() if status == "failed") == sorted(refused)
    text = backfill_result(found, 6)
    assert "4 sent; 2 failed to publish (ConnectionError: broker refused)" in text, text
