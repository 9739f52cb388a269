"""One-offs and bounds across real ``celery beat`` replicas (a Redis lease, claims in PostgreSQL),
as the broker sees them: a config ``at()`` entry and a stored one-off are each sent once, also
when the leader that sent them is SIGKILLed right after and a standby takes over (checked past
claim_grace and a stale-claim sweep); ``max_runs=2`` sends two and ``end_at`` stops a schedule
whichever replica leads; stored one-offs whose instant passed while no replica ran are, when one
starts, sent late (catch-up ``latest``) or recorded missed (``none``)."""
from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone

import pytest
from celery import Celery

from cluster import claim_rows, duplicates, kill_after_its_next_mark, kill_env, timeline
from procs import start_beat, wait_for, write_app

from celery_cluster_beat import at
from celery_cluster_beat.dynamic import StoredSchedules

pytestmark = pytest.mark.slow

UTC = timezone.utc
GRACE = 3.0


@pytest.mark.timeout(180)
def test_one_offs_are_sent_once_across_a_failover_and_a_stop_and_bounds_hold(tmp_path, redis_url, pg_url,
                                                                              cluster_factory):
    now = datetime.now(UTC).replace(microsecond=0)
    # The replicas are up and one leads by then, with room for a loaded host (a config at() first
    # registered after its instant is recorded missed, never sent).
    once = now + timedelta(seconds=20)
    schedule = f"""{{
        'tick': {{'task': 't.record', 'schedule': every(1)}},
        'once': {{'task': 't.record', 'schedule': __import__('celery_cluster_beat').at({once.isoformat()!r})}},
        'two': {{'task': 't.record', 'schedule': every(2), 'max_runs': 2}},
        'until': {{'task': 't.record', 'schedule': every(1), 'end_at': {(once + timedelta(seconds=2)).isoformat()!r}}},
    }}"""
    app = write_app(tmp_path, broker=redis_url, db_url=pg_url, redis_url=None, schedule=schedule,
                    conf=f"{{'cluster_beat_claim_grace': {GRACE}}}")
    api_app = Celery("oneoff-api", set_as_current=False)
    api_app.conf.update(cluster_beat_db_url=pg_url, cluster_beat_redis_url="")
    with StoredSchedules(api_app) as api:
        api.add("st-once", "t.record", at(once))

    cluster = cluster_factory(app)
    cluster.start(2, env=kill_env(tmp_path))
    watcher = cluster.watcher
    cluster.steady_leader()
    sent = lambda name: [m for m in watcher.messages() if m.schedule == name]  # noqa: E731
    wait_for(lambda: sent("once") and sent("st-once"), 40, what="both one-offs sent")
    kill_after_its_next_mark(tmp_path, cluster.proc(sent("once")[0].node))
    killed_at = time.time()
    # A standby takes over; it must not send either one-off again, even after a stale-claim sweep.
    watcher.wait_for(lambda m: m.schedule == "tick" and m.seen > killed_at + 0.5, 30, "the standby leading")
    time.sleep(GRACE + 3)
    cluster.stop_all()  # nobody runs while the late one-offs fall due
    late = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=6)  # room for the adds on a loaded host
    with StoredSchedules(api_app) as api:
        api.add("late-latest", "t.record", at(late))
        api.add("late-none", "t.record", at(late), catchup="none")
    wait_for(lambda: datetime.now(UTC) > late + timedelta(seconds=3), 40, what="the late instant passing")
    cluster.procs.append(start_beat(app, tmp_path, "b-again"))
    wait_for(lambda: claim_rows(pg_url, "late-latest") and claim_rows(pg_url, "late-none"), 40,
             what="the late one-offs handled by the restarted replica")
    time.sleep(2.0)  # anything more would show now
    msgs = watcher.messages()
    cluster.stop_all()

    assert not duplicates(msgs), f"sent twice: {duplicates(msgs)}\n{timeline(msgs)}"
    assert [m.at for m in sent("once")] == [once] and [m.at for m in sent("st-once")] == [once], timeline(msgs)
    assert len(sent("two")) == 2, timeline(msgs)
    assert all(m.at <= once + timedelta(seconds=2) for m in sent("until")), timeline(msgs)
    assert [m.at for m in sent("late-latest")] == [late] and sent("late-none") == []
    assert [(r.scheduled_at, r.status) for r in claim_rows(pg_url, "late-latest")] == [(late, "sent")]
    assert [(r.scheduled_at, r.status, r.reason) for r in claim_rows(pg_url, "late-none")] == \
        [(late, "missed", "catchup")]
    with StoredSchedules(api_app) as api:
        for name in ("st-once", "late-latest", "late-none"):
            row = api.get(name)
            assert row.next_at is None and row.ended_at is not None, row
