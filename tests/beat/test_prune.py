"""Pruning of old claim rows.

Every claimed occurrence leaves a row in ``cluster_beat_claims``; the leader
deletes the finished ones (``sent``, ``missed``, ``skipped``, ``failed``) whose
occurrence is older than ``cluster_beat_claim_retention``, every
``cluster_beat_prune_interval`` seconds. Rows still ``claimed`` are kept (they
await a send or a resend), and so is the per-schedule state in
``cluster_beat_schedules`` (last occurrence, counters). Standbys never prune.
``Scheduler.prune(older_than_seconds)`` does the same on demand.
"""
from __future__ import annotations

import time
import uuid
from datetime import datetime, timedelta, timezone
from typing import List, Optional

import pytest
import redis
from celery import Celery

from celery_cluster_beat import every
from celery_cluster_beat.leader.lease import RedisLease, lease_keys
from celery_cluster_beat.schedules.occurrence import Occurrence
from celery_cluster_beat.leader.redisconn import redis_client_from_url
from celery_cluster_beat.beat.scheduler import Scheduler
from celery_cluster_beat.store import ClaimStore

from procs import start_beat, wait_for, write_app

UTC = timezone.utc
HOUR = timedelta(hours=1)


def _now() -> datetime:
    return datetime.now(UTC).replace(microsecond=0)


class History:
    """Rows another node left in the claim database, in each status."""

    def __init__(self, db_url: str) -> None:
        self.store = ClaimStore(db_url, node_id="old-node")
        self.store.open()

    def sent(self, name: str, *instants: datetime) -> None:
        occs = [Occurrence(name, at) for at in instants]
        assert len(self.store.claim(occs)) == len(occs)
        assert self.store.mark_sent(occs) == len(occs)

    def missed(self, name: str, *instants: datetime) -> None:
        self.store.record([Occurrence(name, at) for at in instants], status="missed", reason="catchup")

    def skipped(self, name: str, *instants: datetime) -> None:
        self.store.record([Occurrence(name, at) for at in instants], status="skipped", reason="overlap")

    def failed(self, name: str, at: datetime) -> None:
        occ = Occurrence(name, at)
        self.store.claim([occ])
        assert self.store.mark_failed(occ, "ConnectionError: broker down", final=True)

    def claimed(self, name: str, at: datetime) -> None:
        """Claimed and never sent (its node died in between)."""
        self.store.claim([Occurrence(name, at)])

    def statuses(self, name: Optional[str] = None) -> List[tuple]:
        return [(r.schedule, r.scheduled_at, r.status) for r in self.store.claims(name)]

    def state(self, name: str):
        return next(s for s in self.store.schedule_states() if s.name == name)

    def close(self) -> None:
        self.store.close()


@pytest.fixture
def old_rows(db_url):
    h = History(db_url)
    yield h
    h.close()


def make_app(db_url: str, redis_url: str, *, lease: bool, **conf) -> Celery:
    name = "prune_" + uuid.uuid4().hex[:8]
    app = Celery(name, broker=redis_url)
    app.conf.update(task_default_queue="q_" + name, cluster_beat_db_url=db_url, cluster_beat_node_id="leader-node",
                    cluster_beat_redis_url=redis_url if lease else "",
                    beat_schedule={"tick": {"task": "t.record", "schedule": every(1)}}, **conf)
    return app


def run(scheduler: Scheduler, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(max(0.0, min(scheduler.tick(), deadline - time.monotonic(), 0.25)))


def run_until(scheduler: Scheduler, done, timeout: float, what: str) -> None:
    """Run the scheduler's loop until ``done()`` (checked between ticks); fail after *timeout* s."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f}s waiting for {what}"
        time.sleep(max(0.0, min(scheduler.tick(), 0.25)))


@pytest.fixture
def cleanup(redis_url):
    """Closes schedulers and removes their queues and lease keys."""
    schedulers: List[Scheduler] = []
    yield schedulers.append
    client = redis.Redis.from_url(redis_url)
    for s in schedulers:
        s.close()
        client.delete(s.app.conf.task_default_queue, *lease_keys(s._lease_name())[:2])
    client.close()


def seed(old_rows: History) -> datetime:
    """An hour-old history of a schedule no longer configured, in every finished status, plus one
    row still claimed; returns its instant."""
    base = _now() - HOUR
    old_rows.sent("report", base - timedelta(minutes=4), base - timedelta(minutes=3))
    old_rows.missed("report", base - timedelta(minutes=2))
    old_rows.skipped("report", base - timedelta(minutes=1))
    old_rows.failed("report", base - timedelta(seconds=30))
    old_rows.claimed("stuck", base)
    return base


# ----------------------------------------------------------------------------- by the leader


def test_the_leader_prunes_finished_rows_past_retention_keeps_claimed_rows_and_schedule_state(
        db_url, redis_url, old_rows, cleanup, monkeypatch):
    stuck_at = seed(old_rows)
    before = old_rows.state("report")
    retention = 5  # s: more than a loaded machine's stall between an occurrence and the prune after it
    # The cut-offs of the leader's prune passes, with the wall time each pass began.
    passes: List[tuple] = []
    prune_pass = ClaimStore.prune_pass

    def spy(store, older_than, **kwargs):
        if store.node_id == "leader-node":
            passes.append((datetime.now(UTC), older_than))
        return prune_pass(store, older_than, **kwargs)

    monkeypatch.setattr(ClaimStore, "prune_pass", spy)
    # claim_grace of an hour: the stuck row is not resent by the stale-claim sweep during the test.
    app = make_app(db_url, redis_url, lease=True, cluster_beat_claim_retention=retention,
                   cluster_beat_prune_interval=1, cluster_beat_claim_grace=7200)
    scheduler = Scheduler(app=app)
    cleanup(scheduler)

    def sent() -> int:
        states = {s.name: s for s in old_rows.store.schedule_states()}
        return states["tick"].sent if "tick" in states else 0

    run_until(scheduler, lambda: sent() >= 12, 45, "twelve occurrences sent")
    assert scheduler._lease.is_leader

    rows = old_rows.statuses()
    assert [r for r in rows if r[0] == "report"] == []
    assert [r for r in rows if r[0] == "stuck"] == [("stuck", stuck_at, "claimed")]
    # The leader's own rows: only the last few seconds are left of the 12 or more it sent
    # (retention 5 s, pruned every second, plus room for a late pass).
    ticks = [r for r in rows if r[0] == "tick"]
    state = old_rows.state("tick")
    assert state.sent >= 12 and 1 <= len(ticks) <= retention + 3, (state.sent, ticks)
    # Each pass cut at its own time less the retention, and after the last one no finished row
    # older than its cut-off is left (whenever that pass came, however late).
    assert passes, "the leader never pruned"
    assert all(abs((began - cutoff).total_seconds() - retention) < 0.5 for began, cutoff in passes), passes
    last_cutoff = passes[-1][1]
    assert all(at >= last_cutoff - timedelta(seconds=1) for _, at, status in ticks if status != "claimed"), \
        (last_cutoff, ticks)
    # Per-schedule state survives the pruning of its rows.
    after = old_rows.state("report")
    assert (after.last_occurrence, after.sent, after.missed, after.skipped, after.failed) == \
        (before.last_occurrence, 2, 1, 1, 1)
    assert after.last_task_id == before.last_task_id is not None
    assert old_rows.store.last_occurrences()["report"] == before.last_occurrence


def test_a_standby_does_not_prune_until_it_becomes_leader(db_url, redis_url, old_rows, cleanup):
    seed(old_rows)
    app = make_app(db_url, redis_url, lease=True, cluster_beat_claim_retention=2, cluster_beat_prune_interval=1,
                   cluster_beat_claim_grace=7200)
    scheduler = Scheduler(app=app)
    cleanup(scheduler)
    # Another replica holds the lease (for longer than the test runs; it hands over below).
    other = RedisLease(lambda: redis_client_from_url(redis_url), name=scheduler._lease_name(), node_id="other-node",
                       ttl=60)
    try:
        assert other.try_acquire()
        run(scheduler, 2.5)
        assert not scheduler._active
        assert len([r for r in old_rows.statuses() if r[0] == "report"]) == 5
    finally:
        other.release()  # hand over
    run_until(scheduler, lambda: not [r for r in old_rows.statuses() if r[0] == "report"], 15,
              "the new leader to prune")
    assert scheduler._lease.is_leader


# ----------------------------------------------------------------------------- on demand


def test_manual_prune_deletes_finished_rows_older_than_the_given_age(db_url, redis_url, old_rows, cleanup):
    stuck_at = seed(old_rows)
    recent = _now() - timedelta(minutes=5)
    old_rows.sent("report", recent)
    app = make_app(db_url, redis_url, lease=False)
    scheduler = Scheduler(app=app)  # never ticked: pruning does not need the loop
    cleanup(scheduler)

    assert scheduler.prune(older_than=1800) == 5
    assert old_rows.statuses() == [("stuck", stuck_at, "claimed"), ("report", recent, "sent")]
    assert scheduler.prune(older_than=1800) == 0  # nothing left that old
    assert scheduler.prune(older_than=60) == 1
    assert old_rows.statuses() == [("stuck", stuck_at, "claimed")]
    state = old_rows.state("report")
    assert (state.last_occurrence, state.sent) == (recent, 3)


# ----------------------------------------------------------------------------- a real beat


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_running_beat_keeps_its_claim_table_small(tmp_path, redis_url, pg_url):
    app = write_app(tmp_path, broker=redis_url, db_url=pg_url, redis_url=None,
                    schedule="{'tick': {'task': 't.record', 'schedule': every(1)}}",
                    conf="{'cluster_beat_claim_retention': 2, 'cluster_beat_prune_interval': 1}")
    beat = start_beat(app, tmp_path, "b0")
    reader = ClaimStore(pg_url, node_id="reader")
    try:
        wait_for(lambda: "pruned" in beat.log(), 30, what="the beat pruning")
        wait_for(lambda: len(app.queued_messages()) >= 10, 30, what="ten occurrences sent")
        reader.open()
        rows = reader.claims("tick")
        state = next(s for s in reader.schedule_states() if s.name == "tick")
    finally:
        beat.stop()
        reader.close()
        redis.Redis.from_url(redis_url).delete(app.queue)
    # of the 10 or more sent, the last few seconds' (retention 2 s, pruned every second, plus room)
    assert state.sent >= 10 and len(rows) <= 5, (state.sent, rows)
    assert "cluster-beat: pruned" in beat.log()
