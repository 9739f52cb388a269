"""A stored-schedule change reaches the leader within half a second, also while an every-second
schedule keeps the loop in its claim-ahead wait.

The leader claims an every-second occurrence half a second ahead and then waits for its instant
inside the due pass; before, the change notice was looked at only on the tick that started that
wait, so it was read about once a second and a change made just after that look waited about a
second. Now the loop looks again right after the pass (a socket read, no SQL), i.e. twice a second,
as the README says.

A real :class:`Scheduler` with a Redis lease (its change notices) on a SQLite claim store, driven
the way beat drives it: tick, then sleep exactly what tick returned (a test loop that woke it more
often would hide the bug), on a thread of its own; the test's thread adds stored schedules at ten
offsets within the wall second and times how long each takes to appear in the leader's entries.
"""
from __future__ import annotations

import threading
import time
import uuid
from typing import List
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis
from celery import Celery

from celery_cluster_beat import every
from celery_cluster_beat.beat.scheduler import Scheduler
from celery_cluster_beat.dynamic import StoredSchedules
from celery_cluster_beat.leader.lease import cluster_key, lease_keys

#: The README's promise ("looks for a notice twice a second"), plus room for a loaded 2-core
#: machine. Measured: at most 0.48 s now; before the change the adds made just after the claim-ahead
#: look took 0.75-0.94 s.
BOUND = 0.7
OFFSETS = [i / 10 + 0.05 for i in range(10)]


@pytest.mark.timeout(90)
def test_a_stored_schedule_added_anywhere_in_the_second_is_applied_within_half_a_second(redis_url, tmp_path):
    broker = urlunsplit(urlsplit(redis_url)._replace(path="/7"))
    name = "ccb_notice_" + uuid.uuid4().hex[:8]
    app = Celery(name, broker=broker)
    app.conf.update(task_default_queue="q_" + name, cluster_beat_db_url=f"sqlite:///{tmp_path}/claims.sqlite3",
                    cluster_beat_redis_url=broker, cluster_beat_node_id="node-" + name[-8:],
                    cluster_beat_prune_interval=3600.0,
                    beat_schedule={"tick": {"task": "t.record", "schedule": every(1)}})
    sched = Scheduler(app, lazy=False)
    api = StoredSchedules(app)
    stop = threading.Event()
    failures: List[BaseException] = []

    def beat_loop() -> None:
        try:
            while not stop.is_set():
                stop.wait(sched.tick())  # exactly what beat does: sleep what tick asks
        except BaseException as exc:  # pragma: no cover - reported below
            failures.append(exc)

    loop = threading.Thread(target=beat_loop, daemon=True)
    latencies: List[float] = []
    try:
        loop.start()
        deadline = time.monotonic() + 15
        while not (sched._active and sched._stored.horizon is not None):
            assert time.monotonic() < deadline, "the scheduler did not take the lease"
            time.sleep(0.05)
        time.sleep(2.5)  # the notice channel is subscribed and the every-second rhythm has set in
        for k, offset in enumerate(OFFSETS):
            now = time.time()
            time.sleep((offset - now % 1.0) % 1.0 or 1.0)  # to that offset within the next wall second
            stored = f"added-{k}"
            api.add(stored, "t.record", every(5))  # due within the horizon: held in memory
            added = time.monotonic()
            while stored not in sched.entries:
                assert time.monotonic() - added < 10, f"{stored} was never applied"
                time.sleep(0.005)
            latencies.append(time.monotonic() - added)
    finally:
        stop.set()
        loop.join(timeout=10)
        api.close()
        sched.close()
        client = redis.Redis.from_url(broker)
        client.delete(app.conf.task_default_queue, cluster_key(app.main), *lease_keys(app.main)[:2])
        client.close()
        app.close()
    assert not failures, failures
    late = [(round(o, 2), round(t, 3)) for o, t in zip(OFFSETS, latencies) if t > BOUND]
    # One late sample is allowed for a hiccup of a loaded machine; the old loop was late for
    # about three of the ten offsets (those just after its look at the claim-ahead tick).
    assert len(late) <= 1, f"applied later than {BOUND} s at (offset, seconds) {late}; all: " \
                           f"{[round(t, 3) for t in latencies]}"
