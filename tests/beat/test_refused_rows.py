"""Many stored rows refused for their options, falling due together, cost the scheduling loop one
batch, not a transaction each (issue 20: found by ``benchmarks/bench_hostile.py``).

Before: each refused occurrence was claimed and failed in transactions of its own (an INFO line
each), 10-90 ms apiece; 595 due on one instant held the loop ~27 s, so the lease was lost and an
every-second entry went unsent for minutes. Counted here in transactions (load-independent): an
in-process ``Scheduler`` on a real claim database and Redis broker, 300 stored rows given a
reserved header past the API, all due on one instant.
"""
from __future__ import annotations

import json
import time
import uuid

import sqlalchemy as sa
from celery import Celery

from celery_cluster_beat import every
from celery_cluster_beat.beat.scheduler import Scheduler
from celery_cluster_beat.dynamic import StoredSchedules
from celery_cluster_beat.store.schema import stored_schedules_table

N = 300


def test_three_hundred_refused_rows_due_together_are_failed_in_a_few_transactions(made, db, broker):
    name = "ccb_refused_" + uuid.uuid4().hex[:8]
    app = Celery(name, broker=broker, set_as_current=False)
    app.conf.update(task_default_queue="q_" + name, cluster_beat_db_url=db, cluster_beat_redis_url="",
                    beat_schedule={})
    made.append(app)
    api = StoredSchedules(app)
    made.append(api)
    for i in range(N):
        api.add(f"r{i:03d}", "t.record", every(2))
    engine = sa.create_engine(db)
    try:
        with engine.begin() as conn:  # past the API: a reserved header on every row
            conn.execute(sa.update(stored_schedules_table).values(
                options=json.dumps({"headers": {"task": "evil.task"}})))
    finally:
        engine.dispose()
    sched = Scheduler(app, lazy=False)
    made.append(sched)
    begins: list = []

    def count(conn, *_):
        begins.append(1)

    sa.event.listen(sa.engine.Engine, "begin", count)
    try:
        end = time.monotonic() + 5.0
        while time.monotonic() < end:  # at least two instants of every(2)
            time.sleep(max(0.0, min(sched.tick(), end - time.monotonic())))
    finally:
        sa.event.remove(sa.engine.Engine, "begin", count)
    rows = [r for r in api.store.claims() if r.schedule.startswith("r")]
    failed = [r for r in rows if r.status == "failed"]
    assert len(failed) >= N and {r.status for r in rows} <= {"failed", "missed"}, {r.status for r in rows}
    assert all("options.headers.task: reserved" in r.reason for r in failed)
    instants = len({r.scheduled_at for r in failed})
    # Per instant: a claim and a fail (plus what a pass reads anyway), never one per row.
    assert len(begins) < 40 * instants, (len(begins), instants)
