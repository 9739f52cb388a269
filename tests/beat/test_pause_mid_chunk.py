"""A real ``celery beat`` paused between two messages of one publish chunk publishes nothing it lost.

The chunk is confirmed as this node's just before its first message; a pause that
falls between two of its messages (a GC pause, a frozen VM, SIGSTOP) can outlast
the grace, and another replica then takes the rows over and sends them. When the
paused node resumes, the rest of its chunk (and, on Redis, the messages it had
buffered but not flushed) must not go out: it confirms again before going on,
since more than ``claim_grace / 4`` passed since the chunk's confirmation, and
withholds what was taken over.

The pause is the package's fault point ``mid-chunk`` (SIGSTOP at the 50th message
of the burst's only chunk), armed for the leader while it is idle; the successor
is the second replica. What reached the broker is read from the test's queue,
which nobody consumes, so every delivery of each task id is counted.
"""
from __future__ import annotations

import signal
import socket
import time
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path
from typing import List

import pytest

from cluster import period_due_soon, timeline
from procs import Proc, wait_for, wait_for_log, write_app

pytestmark = pytest.mark.slow

UTC = timezone.utc
#: One burst a minute at least: nothing else falls due while the scene plays. The period is chosen
#: per test (60-90 s) so that the first burst falls about STARTUP + 7 s after the replicas start:
#: the leader is up by then and idle more than 6 s before the burst.
MIN_PERIOD = 60
STARTUP = 8.0
NAMES = [f"m{i:03d}" for i in range(200)]  # one chunk (250 at most), all due at one instant
FAULT_LINE = "cluster-beat fault point mid-chunk: stop"


def schedule(period: int) -> str:
    return "{" + f"f'm{{i:03d}}': {{'task': 't.record', 'schedule': every({period})}} for i in range(200)" + "}"


@pytest.fixture
def reader(pg_url):
    """A claim store of the test's own (it never claims), opened before any replica starts."""
    from celery_cluster_beat.store import ClaimStore

    store = ClaimStore(pg_url, node_id="test-reader")
    store.open()
    yield store
    store.close()


def node_id(proc: Proc) -> str:
    return f"{socket.gethostname()}:{proc.pid}"


def at_dt(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, UTC)


def next_boundary(after: float, period: int) -> float:
    return (int(after // period) + 1) * period


def log_tail(proc: Proc, n: int = 5000) -> str:
    return f"----- {proc.log_path.name} (pid {proc.pid})\n{proc.log()[-n:]}"


@pytest.mark.timeout(300)
def test_a_leader_paused_mid_chunk_past_the_grace_publishes_none_of_the_rows_taken_over_meanwhile(
        tmp_path: Path, redis_url, pg_url, reader, cluster_factory):
    """Window: the leader SIGSTOPs itself between the 50th and 51st message of the only chunk of
    a 200-occurrence burst (on Redis those 50 are buffered, not yet flushed). Its lease expires,
    the standby takes it, finds the rows' claimant gone by the database's clock and resends the
    200 (same task ids). Then the paused leader is resumed.

    Each task id reaches the broker exactly once, from the successor; the resumed node says it
    confirmed the chunk again and publishes none of it.

    How it fails if the behaviour breaks: a node that trusts the confirmation taken before the
    chunk's first message goes on after the pause and flushes the whole chunk: 200 same-id
    duplicates from the paused node.
    """
    grace, ttl = 5.0, 3.0
    sweep = grace / 3
    arm_dir = tmp_path / "arm"
    arm_dir.mkdir()
    period = period_due_soon(MIN_PERIOD, STARTUP + 7)
    app = write_app(tmp_path, broker=redis_url, db_url=pg_url, redis_url=None, schedule=schedule(period),
                    conf=f"{{'cluster_beat_claim_grace': {grace}, 'cluster_beat_lock_ttl': {ttl}}}")
    cluster = cluster_factory(app)
    cluster.start(2, env={"CCB_FAULTS": "mid-chunk=stop@50", "CCB_FAULT_ARM_DIR": str(arm_dir)})

    leaders: List[Proc] = []

    def led() -> bool:
        leaders[:] = [p for p in cluster.procs if "is now the leader" in p.log()]
        return bool(leaders)

    wait_for(led, 60, interval=0.2, what="a replica taking the lease")
    assert len(leaders) == 1, cluster.logs()
    [paused] = leaders
    successor = next(p for p in cluster.procs if p is not paused)

    # Arm while idle, well away from a boundary, so the hit count starts with this burst.
    def idle() -> bool:
        to_next = next_boundary(time.time(), period) - time.time()
        return 6 < to_next < period - 6 and not [
            r for r in reader.claims(since=at_dt(time.time() - 3 * period)) if r.status == "claimed"]

    wait_for(idle, 3 * period, interval=0.5, what="the leader idle, away from a boundary")
    (arm_dir / f"mid-chunk-{paused.pid}").touch()
    burst = at_dt(next_boundary(time.time(), period))

    wait_for_log(paused, FAULT_LINE, burst.timestamp() - time.time() + 60)
    stopped_at = time.time()

    def rows():
        return [r for r in reader.claims(since=burst) if r.scheduled_at == burst]

    def taken_over_and_sent() -> bool:
        got = rows()
        return len(got) == len(NAMES) and all(r.status == "sent" and r.node == node_id(successor) for r in got)

    try:
        wait_for(taken_over_and_sent, ttl + grace + 2 * sweep + 30, interval=0.5,
                 what="the paused leader's rows taken over and sent by the successor")
    except AssertionError:
        raise AssertionError(f"{Counter((r.status, r.node) for r in rows())}\n{log_tail(successor)}")
    assert paused.alive(), log_tail(paused)
    taken_in = time.time() - stopped_at

    paused.signal(signal.SIGCONT)
    # It goes on from the fault point: it says it confirms again, or (the bug) that it sent the chunk.
    wait_for(lambda: "held up while publishing a chunk" in paused.log() or "sent 200 occurrence(s)" in paused.log(),
             30, interval=0.2, what="the resumed node going on with its chunk")
    time.sleep(grace + sweep + 3)  # whatever the resumed node would publish is out by now
    cluster.watcher.poll()

    msgs = [m for m in cluster.watcher.messages() if m.at == burst]
    per_id = Counter(m.task_id for m in msgs)
    twice = {tid: n for tid, n in per_id.items() if n > 1}
    from_paused = [m for m in msgs if m.node == node_id(paused)]
    print(f"paused mid-chunk: rows taken over {taken_in:.1f}s after the stop; {len(msgs)} messages for "
          f"{len(NAMES)} occurrences, {len(from_paused)} from the paused node")
    assert not twice, f"{len(twice)} task ids delivered more than once\n{timeline(msgs)[:3000]}"
    assert sorted(m.schedule for m in msgs) == NAMES
    assert not from_paused, f"{len(from_paused)} messages from the paused node after its rows were taken over"
    assert {(r.status, r.node) for r in rows()} == {("sent", node_id(successor))}
    assert "held up while publishing a chunk; confirming its 200 unpublished occurrence(s) again" in paused.log(), \
        log_tail(paused)
