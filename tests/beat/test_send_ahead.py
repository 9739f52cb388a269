"""Claiming ahead: the leader claims an instant's occurrences up to ``CLAIM_AHEAD`` before it and
publishes them at the instant, so a burst's claim is not part of its lateness; never a message
before its instant, and never an overlap guard judged early.

A real :class:`Scheduler` driven the way beat drives it (``tick()``, then sleep what it
returns) on a real PostgreSQL claim store and a real Redis broker and result backend; publish
times are read in-process from ``after_task_publish``.
"""
from __future__ import annotations

import time
import uuid
from datetime import datetime, timedelta, timezone
from typing import List, Tuple
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis
from celery import Celery, signals

from celery_cluster_beat import every
from celery_cluster_beat.beat.scheduler import CLAIM_AHEAD, Scheduler
from celery_cluster_beat.leader.lease import cluster_key, lease_keys
from celery_cluster_beat.store import ClaimStore

BROKER_DB = 7


def _run(sched: Scheduler, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(min(sched.tick(), max(end - time.monotonic(), 0.001)))


@pytest.fixture
def app(redis_url, pg_url):
    url = urlunsplit(urlsplit(redis_url)._replace(path=f"/{BROKER_DB}"))
    name = "ccb_ahead_" + uuid.uuid4().hex[:8]
    app = Celery(name, broker=url, backend=url)
    app.conf.update(task_default_queue="q_" + name, cluster_beat_db_url=pg_url, cluster_beat_redis_url="")
    yield app
    client = redis.Redis.from_url(url)
    client.delete(app.conf.task_default_queue, cluster_key(app.main), *lease_keys(app.main)[:2])
    client.close()
    app.close()


@pytest.mark.timeout(90)
def test_unguarded_occurrences_are_claimed_ahead_and_none_is_published_before_its_instant(app, pg_url):
    """20 unguarded every-2 s entries and one guarded by ``overlap: skip``, over 7 s.

    Fails if a message goes out before its instant (the wait for the instant is missing), if
    no unguarded occurrence was claimed before its instant (the claim is still on the send
    path), or if the guarded entry was claimed before its instant (its guard would judge the
    previous run early).
    """
    schedule = {f"free{i:02d}": {"task": "ahead.free", "schedule": every(2), "overlap": "allow"}
                for i in range(20)}
    schedule["guarded"] = {"task": "ahead.guarded", "schedule": every(2), "overlap": "skip"}
    app.conf.beat_schedule = schedule
    published: List[Tuple[float, str, str]] = []

    def on_publish(sender=None, headers=None, **kw):
        if headers and headers.get("cluster_beat_schedule"):
            published.append((time.time(), headers["cluster_beat_schedule"], headers["cluster_beat_scheduled_at"]))

    signals.after_task_publish.connect(on_publish, weak=False)
    sched = Scheduler(app, lazy=False)
    try:
        _run(sched, 7)
    finally:
        sched.close()
        signals.after_task_publish.disconnect(on_publish)

    assert len({name for _, name, _ in published}) == 21, sorted({name for _, name, _ in published})
    early = [(name, at, round(instant_of(at) - t, 3)) for t, name, at in published if t < instant_of(at)]
    assert not early, f"published before the instant: {early[:5]}"

    store = ClaimStore(pg_url, node_id="reader")
    store.open()
    try:
        rows = [r for r in store.claims() if r.status == "sent"]
    finally:
        store.close()
    ahead = [r for r in rows if r.schedule.startswith("free") and r.claimed_at < r.scheduled_at]
    assert ahead, "no unguarded occurrence was claimed ahead of its instant"
    assert all(r.scheduled_at - r.claimed_at <= CLAIM_AHEAD + timedelta(seconds=0.2) for r in ahead)
    guarded = [r for r in rows if r.schedule == "guarded"]
    assert guarded and all(r.claimed_at >= r.scheduled_at - timedelta(milliseconds=20) for r in guarded), \
        [(r.scheduled_at, r.claimed_at) for r in guarded]


def instant_of(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).astimezone(timezone.utc).timestamp()


@pytest.mark.timeout(120)
def test_messages_of_entries_due_within_a_minute_are_built_before_their_fire(app):
    """While nothing is due, the leader builds the messages of entries due within 60 s, so a
    burst only stamps them: every entry has its template before its first fire, and the fire
    is sent from it (not through Celery's per-message path).

    Fails if templates were built only at the first send (a first burst would pay Celery's
    whole per-message path plus the capture)."""
    # A period within the 60 s horizon whose next instant (k * period since the epoch) is 22-28 s
    # away: well after the start (no fire before the check, room to build on a loaded machine),
    # and the test waits no more than that for the fire, not for a fixed period's boundary.
    period = next((p for p in range(25, 61) if 22 <= p - time.time() % p <= 28), 30)
    schedule = {f"soon{i:02d}": {"task": "ahead.soon", "schedule": every(period), "overlap": "allow"}
                for i in range(40)}
    app.conf.beat_schedule = schedule
    if period - time.time() % period < 22:  # no period fitted: start well before a boundary
        time.sleep(period - time.time() % period + 0.5)
    sched = Scheduler(app, lazy=False)
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not sched._active:
            time.sleep(min(sched.tick(), 0.2))
        assert sched._active
        publisher = sched._pipeline.publisher

        def built():
            return [name for name in schedule if publisher.templates.has(name)]

        # The loop builds them in slices while nothing is due (a loaded machine gives it few
        # slices a second): wait for them, well before the fire.
        end = time.monotonic() + min(15.0, period - time.time() % period - 5)
        while time.monotonic() < end and len(built()) < len(schedule):
            _run(sched, 0.5)
        assert (publisher.stamped, publisher.celery_path) == (0, 0), "nothing is due yet"
        assert sorted(built()) == sorted(schedule), f"{len(built())} of {len(schedule)} built ahead"
        _run(sched, period - time.time() % period + 1.5)  # through the fire
        assert (publisher.stamped, publisher.celery_path) == (len(schedule), 0)
    finally:
        sched.close()


@pytest.mark.timeout(120)
def test_a_stop_while_waiting_for_the_instant_publishes_what_was_claimed_ahead_then_exits(redis_url, tmp_path):
    """Window: a real beat has claimed an instant's occurrence ahead and waits for the instant
    (held there by the ``claimed-ahead`` fault point, a 20 s sleep) when it gets SIGTERM.

    Beat's SIGTERM handler calls close(): the occurrence goes out (its instant has passed by
    then), its row ends ``sent``, and the process exits 0. How it fails without the handling:
    close() hands the row over unsent, nothing is published, and a node started later would
    resend that instant however long after, whatever its catch-up policy."""
    import signal as signals_

    import procs
    from test_faults_send_path import FAULT_LINE, arm, fault_env, next_boundary

    arm_dir = tmp_path / "arm"
    app = procs.write_app(tmp_path, broker=redis_url, db_url=f"sqlite:///{tmp_path}/claims.sqlite3",
                          schedule="{'rare': {'task': 't.record', 'schedule': every(10)}}")
    beat = procs.start_beat(app, tmp_path, "beat", env=fault_env(arm_dir, "claimed-ahead=sleep:20"))
    try:
        procs.wait_for_log(beat, "cluster-beat: node", 30)
        while not 3 < next_boundary(10) - time.time() < 8:  # arm away from an instant
            time.sleep(0.2)
        arm(arm_dir, "claimed-ahead", beat)
        instant = next_boundary(10)
        procs.wait_for_log(beat, f"{FAULT_LINE} claimed-ahead: sleep:20", 30)
        stopped_at = time.time()
        assert not [m for m in app.sent_occurrences() if m[0] == "rare" and m[1] == iso(instant)], \
            "published before the stop: the window was not hit"
        beat.signal(signals_.SIGTERM)
        procs.wait_for(lambda: not beat.alive(), 15, what="beat exiting on SIGTERM")
        assert beat.popen.returncode == 0, beat.log()[-3000:]
        assert time.time() - stopped_at < 15
    finally:
        beat.stop()
    sent = [m for m in app.sent_occurrences() if m[0] == "rare" and m[1] == iso(instant)]
    assert len(sent) == 1, (sent, beat.log()[-3000:])
    store = ClaimStore(f"sqlite:///{tmp_path}/claims.sqlite3", node_id="reader")
    store.open()
    try:
        [row] = [r for r in store.claims("rare") if r.scheduled_at.timestamp() == instant]
    finally:
        store.close()
    assert row.status == "sent" and row.node == sent[0][2], row
    import redis as redis_

    client = redis_.Redis.from_url(redis_url)
    client.delete(app.queue)
    client.close()


def iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, timezone.utc).isoformat().replace("+00:00", "Z")
