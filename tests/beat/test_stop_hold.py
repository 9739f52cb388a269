"""Nothing a publish put out is handed over unrecorded, in-process.

Beat's SIGTERM handler raises SystemExit wherever the loop is; between a chunk's publish
and the moment its messages are owed a 'sent' mark the handler must wait, then run once,
exactly as installed (celery_cluster_beat.beat.stophold; the real-process proof is
tests/beat/test_faults_stop.py). The same goes for a node that stops scheduling from
inside a publish (SendPipeline.abandon while publishing): it records, then releases.
"""
from __future__ import annotations

import os
import signal
import threading

import pytest

from celery_cluster_beat.beat.stophold import stop_held


@pytest.fixture
def beat_handler():
    """Beat's handler, as Celery installs it: it records the call, then raises SystemExit."""
    calls = []

    def _sync(signum, frame):
        calls.append(signum)
        raise SystemExit()

    previous = signal.signal(signal.SIGTERM, _sync)
    try:
        yield _sync, calls
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_sigterm_inside_the_hold_runs_beats_handler_once_after_the_block(beat_handler):
    handler, calls = beat_handler
    done = []
    with pytest.raises(SystemExit):
        with stop_held():
            os.kill(os.getpid(), signal.SIGTERM)
            signal.raise_signal(signal.SIGTERM)  # a second one: the stop is one stop
            done.append("recorded")  # what the publish owes: reached although the signal came first
            assert calls == []
    assert done == ["recorded"] and calls == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) is handler


def test_without_a_signal_the_hold_changes_nothing(beat_handler):
    handler, calls = beat_handler
    with stop_held():
        assert signal.getsignal(signal.SIGTERM) is not handler  # held meanwhile
    assert calls == [] and signal.getsignal(signal.SIGTERM) is handler
    with pytest.raises(SystemExit):  # and the handler is in force again
        signal.raise_signal(signal.SIGTERM)


def test_an_error_inside_the_hold_still_restores_the_handler(beat_handler):
    handler, calls = beat_handler
    with pytest.raises(RuntimeError):
        with stop_held():
            raise RuntimeError("the broker went away")
    assert calls == [] and signal.getsignal(signal.SIGTERM) is handler


def test_a_default_disposition_is_not_held_and_other_threads_hold_nothing(beat_handler):
    handler, _ = beat_handler
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a kill, the crash window: left as it is
    with stop_held():
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    signal.signal(signal.SIGTERM, handler)
    seen = []

    def in_thread():
        with stop_held():  # beat in a worker's thread: handlers only ever run in the main thread
            seen.append(signal.getsignal(signal.SIGTERM))

    t = threading.Thread(target=in_thread)
    t.start()
    t.join(5)
    assert seen == [handler]


# ----------------------------------------------------------------------------- giving up inside a publish


@pytest.mark.timeout(60)
def test_giving_up_inside_a_publish_records_what_went_out_before_handing_over(db, broker):
    """The same hand-over window without a signal: the node stops scheduling from inside a publish
    (a re-confirmation mid-chunk found the lease lost: Leadership.deactivate via still_leader).
    What the publish had put out must be marked ``sent`` by this node before its claims are released.

    Fails if abandon() releases at once: the published row is handed over unrecorded (its node
    cleared, still ``claimed``), the 'sent' mark then misses it, and the next leader's sweep
    resends it at once.
    """
    import time
    import uuid

    import redis
    from celery import Celery

    from celery_cluster_beat import every
    from celery_cluster_beat.beat.scheduler import Scheduler
    from celery_cluster_beat.store import ClaimStore

    name = "ccb_giveup_" + uuid.uuid4().hex[:8]
    app = Celery(name, broker=broker)
    app.conf.update(task_default_queue="q_" + name, cluster_beat_db_url=db, cluster_beat_redis_url="",
                    cluster_beat_node_id="node-giveup", beat_schedule={"tick": {"task": "t.record",
                                                                                "schedule": every(1)}})
    sched = Scheduler(app, lazy=False)
    publish = sched._pipeline.publisher.publish
    published = []

    def publish_then_give_up(dispatches, ownership=None):
        errors = publish(dispatches, ownership)
        if not published:
            published.extend(d.occurrence for d, err in zip(dispatches, errors) if err is None)
            sched._leadership.deactivate("the lease was lost (found by a re-confirmation mid-publish)")
        return errors

    sched._pipeline.publisher.publish = publish_then_give_up
    try:
        deadline = time.monotonic() + 20
        while not published and time.monotonic() < deadline:
            time.sleep(min(sched.tick(), 0.05))
        assert published, "nothing was published within 20 s"
    finally:
        sched.close()
        client = redis.Redis.from_url(broker)
        client.delete(app.conf.task_default_queue)
        client.close()
        app.close()
    reader = ClaimStore(db, node_id="reader")
    reader.open()
    try:
        rows = {r.scheduled_at: r for r in reader.claims("tick")}
    finally:
        reader.close()
    for occ in published:
        row = rows[occ.at]
        assert (row.status, row.node) == ("sent", "node-giveup"), row
