"""A clean stop (SIGTERM) of the leader landing inside a publish: never a resend.

The delivery contract: a node that lost (or gave away) a claim never publishes it
afterwards, and a clean stop never causes a resend; what a stopping node published
is recorded ``sent`` before it hands its unsent claims over. Beat's SIGTERM handler
raises ``SystemExit`` wherever the loop is: raised after the broker took a chunk and
before the pipeline knew it went out, the stop used to hand that chunk's rows over
as unsent, and the successor, woken by the lease's release notice, resent them at
once (same task id, a second message): the duplicate a fresh-clone run of
``test_faults_links.py`` (with a 14 s cut) saw once, when the test SIGTERMed the
leader right at an instant it was publishing.

The window is hit with the named fault point ``published`` (a chunk on the broker,
not yet owed its 'sent' mark) and the action ``term`` (SIGTERM to itself there:
beat's handler runs before the point returns unless the stop is held), armed for
the leader only. Real ``celery beat`` replicas, the Redis broker as the lease,
claims in PostgreSQL; what reached the broker is read by the shared Watcher.
"""
from __future__ import annotations

import time
from datetime import timedelta

import pytest

from cluster import claim_rows, duplicates, node_pid, timeline
from procs import wait_for, write_app

pytestmark = pytest.mark.slow

EVERY_SECOND = "{'tick': {'task': 't.record', 'schedule': every(1)}}"
TTL = 3.0
GRACE = 6.0
SWEEP = GRACE / 3
FAULT_LINE = "cluster-beat fault point published: term"


@pytest.mark.timeout(240)
def test_leader_sigtermed_after_its_publish_and_before_the_pipeline_knew_records_it_and_nobody_resends(
        tmp_path, redis_url, pg_url, cluster_factory):
    """Window: SIGTERM of the leader after the broker took an occurrence it claimed ahead and
    published at its instant, before the pipeline counted it as owed a 'sent' mark.

    The stop is held until the chunk's outcome is known (the occurrence owed its mark), then
    beat's handler runs: close() records it ``sent`` and only then releases the lease; the
    standby takes over from the next occurrence. Every occurrence reaches the broker once,
    the stopped node's last one is recorded as sent by it, and nothing is resent even after
    a further ``claim_grace`` and a sweep.

    Fails without the hold: the stop unwinds from the fault point with the occurrence on the
    broker but not owed a mark, close() hands its row over as unsent, and the successor's
    first sweep (at its take-over) resends it with the same task id: a duplicate from two
    nodes, and the row recorded as sent by the successor.
    """
    arm_dir = tmp_path / "arm"
    arm_dir.mkdir()
    app = write_app(tmp_path, broker=redis_url, db_url=pg_url, redis_url=None, schedule=EVERY_SECOND,
                    conf=f"{{'cluster_beat_claim_grace': {GRACE}, 'cluster_beat_lock_ttl': {TTL}}}")
    cluster = cluster_factory(app)
    cluster.start(2, env={"CCB_FAULTS": "published=term", "CCB_FAULT_ARM_DIR": str(arm_dir)})
    old = cluster.steady_leader(timeout=90)
    leader = cluster.proc(old)
    successor = next(p for p in cluster.procs if p is not leader)

    (arm_dir / f"published-{leader.pid}").touch()  # its next publish: within a second
    try:
        leader.popen.wait(30)
    except Exception:
        raise AssertionError("the leader did not exit on the SIGTERM of its fault point\n" + cluster.logs())
    stopped_at = time.time()
    log = leader.log()
    assert FAULT_LINE in log, log[-3000:]
    assert leader.popen.returncode == 0, log[-3000:]  # a clean stop, not a crash
    last = max(m.at for m in cluster.watcher.messages() if m.node == old)

    new = f"{old.rsplit(':', 1)[0]}:{successor.pid}"
    cluster.watcher.wait_for(lambda m: m.node == new and m.at >= last + timedelta(seconds=3), 40,
                             "the successor sending three occurrences after the stopped leader's last")
    time.sleep(GRACE + SWEEP + 2)  # a late resend (a sweep after the grace) would show up by now
    msgs = cluster.watcher.messages()
    print(f"SIGTERM at the publish of {last:%H:%M:%S}: successor sending "
          f"{min(m.seen for m in msgs if m.node == new) - stopped_at:+.2f}s after the exit")
    assert not duplicates(msgs), f"occurrences sent twice: {duplicates(msgs)}\n{timeline(msgs)}\n{cluster.logs()}"
    ids = {}
    for m in msgs:
        ids.setdefault(m.at, set()).add(m.task_id)
    assert all(len(v) == 1 for v in ids.values()), ids
    assert not [m for m in msgs if m.node == old and m.at > last], timeline(msgs)

    rows = {r.scheduled_at: r for r in claim_rows(pg_url)}
    # The stopped node's last publish is on record as its own send, made before it let go.
    assert rows[last].status == "sent" and rows[last].node == old, (rows[last], timeline(msgs))
    assert "held until the messages on their way to the broker were recorded" in log, log[-3000:]
    # No drops: every instant from the first message to the last is sent once or on record as missed.
    first, end = msgs[0].at, msgs[-1].at
    sent = {m.at for m in msgs}
    at = first
    while at <= end:
        assert at in sent or (at in rows and rows[at].status == "missed"), (at, rows.get(at), timeline(msgs))
        if at in sent:
            assert rows[at].status == "sent", rows[at]
        at += timedelta(seconds=1)
    assert node_pid(new) == successor.pid and successor.alive()
