"""Failover of a cluster of real ``celery beat`` replicas sharing a Redis lease.

Three replicas run ``celery beat -S celery_cluster_beat.Scheduler`` from one
generated app module: an ``every(1)`` schedule, claims in PostgreSQL, the Redis
broker URL as the lease. A watcher thread polls the test's queue on the broker
every 50 ms and remembers every message it ever saw (with the wall time it first
saw it), so "sent twice" and "gap" are read from what reached the broker:

* the headers say which occurrence a message is (``cluster_beat_scheduled_at``)
  and which replica sent it (``cluster_beat_node`` = ``host:pid``);
* the watcher's first-seen time is the wall time of observation.

Then the leader is made to fail in each way a process can fail (SIGKILL,
SIGTERM, SIGSTOP past its lease, frozen right before a claim) and the broker
itself is restarted under the cluster. The last test checks term fencing
in-process: a scheduler whose lease term is below the term recorded in the
claim store sends nothing and steps down.
"""
from __future__ import annotations

import logging
import re
import signal
import statistics
import subprocess
import time
import uuid
from datetime import datetime, timedelta, timezone

import pytest
import redis

from procs import wait_for, write_app

pytestmark = pytest.mark.slow

UTC = timezone.utc
SECOND = timedelta(seconds=1)
EVERY_SECOND = "{'tick': {'task': 't.record', 'schedule': every(1)}}"
DEFAULT_TTL = 5.0


from cluster import (Cluster, Seen, Watcher, claim_rows, duplicates, kill_after_its_next_mark,  # noqa: E402,F401
                     kill_env, node_pid, timeline)


_LOG_LINE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}): [^\]]*\] (.*)$")


def _log_time(log: str, text: str) -> datetime:
    """The (local, naive) time of the last line of a beat log that contains *text*."""
    found = [m.group(1) for m in map(_LOG_LINE.match, log.splitlines()) if m and text in m.group(2)]
    assert found, f"no {text!r} in the log:\n{log[-3000:]}"
    return datetime.strptime(found[-1], "%Y-%m-%d %H:%M:%S,%f")


# ----------------------------------------------------------------------------- SIGKILL / SIGTERM


@pytest.mark.timeout(150)
def test_sigkill_of_the_leader_a_standby_sends_within_ttl_plus_one_second_nothing_twice(
        tmp_path, redis_url, pg_url, cluster_factory):
    ttl = DEFAULT_TTL  # the default cluster_beat_lock_ttl
    app = write_app(tmp_path, broker=redis_url, db_url=pg_url, redis_url=None, schedule=EVERY_SECOND)
    cluster = cluster_factory(app)
    cluster.start(3, env=kill_env(tmp_path))
    old = cluster.steady_leader()
    old_proc = cluster.proc(old)

    # Right after it marked a second's occurrence sent: the dead leader has nothing in flight.
    killed_at = kill_after_its_next_mark(tmp_path, old_proc)
    first_new = cluster.watcher.wait_for(lambda m: m.node != old and m.seen > killed_at, ttl + 20,
                                         "a standby's first send after SIGKILL of the leader")
    time.sleep(2.5)  # a few more occurrences: a late duplicate would show up now
    msgs = cluster.watcher.messages()
    cluster.stop_all()

    assert old_proc.popen.poll() == -signal.SIGKILL
    assert not duplicates(msgs), f"occurrences sent twice: {duplicates(msgs)}\n{timeline(msgs)}"
    last_old = max((m for m in msgs if m.node == old), key=lambda m: m.at)
    new_msgs = [m for m in msgs if m.node != old]
    assert first_new.at == min(m.at for m in new_msgs)
    assert all(m.at > last_old.at for m in new_msgs), timeline(msgs)

    # From the kill: the dead leader renewed its lease at the latest when it was killed, so its
    # key is gone ttl later at the latest and a standby sends at once then (at defaults: 5 s);
    # the 1 s is room for the new leader's first claim and send. A standby that missed the
    # expiry would wait for its next poll, one that ignored it for good would never send.
    since_kill = first_new.seen - killed_at
    # In the headers: the first occurrence the new leader sends is at most ttl + 1 s after the
    # last one the dead leader sent, the occurrence of the kill's second (at defaults: 6 s).
    header_gap = (first_new.at - last_old.at).total_seconds()
    # As observed on the broker: from the dead leader's last message, which it sent half a
    # second before the kill.
    seen_gap = first_new.seen - last_old.seen
    print(f"SIGKILL: header gap {header_gap:.0f}s, observed gap {seen_gap:.2f}s, first send {since_kill:.2f}s "
          f"after the kill")
    assert since_kill <= ttl + 1, timeline(msgs)
    rows = {r.scheduled_at: r for r in claim_rows(pg_url)}
    assert [r for r in rows.values() if r.node == old and r.status != "sent"] == [], \
        "set-up: the leader died with something claimed and not sent\n" + timeline(msgs)
    assert last_old.at == max(r.scheduled_at for r in rows.values() if r.node == old)
    assert header_gap <= ttl + 1, timeline(msgs)
    assert seen_gap <= ttl + 1.5, timeline(msgs)

    # What fell into the gap is not silently dropped: with catch-up 'latest' every occurrence
    # between the two leaders' sends is recorded as missed in the claim store.
    at = last_old.at + SECOND
    while at < first_new.at:
        assert at in rows and rows[at].status == "missed", (at, rows.get(at))
        at += SECOND
    assert rows[first_new.at].status == "sent"


@pytest.mark.timeout(150)
def test_sigterm_of_the_leader_hands_over_within_a_second_without_duplicate_or_gap(
        tmp_path, redis_url, pg_url, cluster_factory):
    app = write_app(tmp_path, broker=redis_url, db_url=pg_url, redis_url=None, schedule=EVERY_SECOND)
    cluster = cluster_factory(app)
    cluster.start(3)
    old = cluster.steady_leader()
    old_proc = cluster.proc(old)

    termed_at = time.time()
    old_proc.signal(signal.SIGTERM)
    first_new = cluster.watcher.wait_for(lambda m: m.node != old, 20, "a standby's first send after SIGTERM")
    time.sleep(2.5)
    msgs = cluster.watcher.messages()
    exit_code = old_proc.stop()

    assert exit_code == 0, old_proc.log()[-3000:]
    assert "released the leadership" in old_proc.log()
    assert not duplicates(msgs), f"occurrences sent twice: {duplicates(msgs)}\n{timeline(msgs)}"
    last_old = max((m for m in msgs if m.node == old), key=lambda m: m.at)
    header_gap = (first_new.at - last_old.at).total_seconds()
    since_term = first_new.seen - termed_at
    # From the two replicas' own logs: the old leader's release, the new leader's acquisition.
    released = _log_time(old_proc.log(), "released the leadership")
    acquired = _log_time(cluster.proc(first_new.node).log(), "is now the leader")
    handover = (acquired - released).total_seconds()
    print(f"SIGTERM: header gap {header_gap:.0f}s, first send by a standby {since_term:.2f}s after SIGTERM, "
          f"lease taken {handover:.3f}s after the release")
    # The release notice wakes a standby at once (a few ms): well within its 1 s poll of the
    # lease, and long before the released key would have expired (ttl 5 s). (Each replica logs
    # after its Redis call returns, so this can be a few ms below zero.)
    assert handover < 0.2, (handover, timeline(msgs))
    # It sends the next occurrence due: at worst one occurrence is lost in between (header gap
    # of 2 s), and it is sent within about a second of the SIGTERM (room for a loaded machine).
    assert header_gap <= 2, timeline(msgs)
    assert since_term <= 1.0 + 1.0, timeline(msgs)
    # And the rest of the schedule runs on from the new leader, one a second.
    after = [m for m in msgs if m.at >= first_new.at]
    assert [m.at for m in after] == [first_new.at + i * SECOND for i in range(len(after))], timeline(msgs)

    # A standby blocked waiting for the lease exits on SIGTERM at once too (its shutdown is not
    # swallowed by the Redis wait it is in).
    standby = next(p for p in cluster.procs if p.alive() and p.pid != node_pid(first_new.node))
    standby.signal(signal.SIGTERM)
    t0 = time.monotonic()
    try:
        code = standby.popen.wait(5)
    except subprocess.TimeoutExpired:
        code = None
    assert code == 0, f"the standby did not exit within 5 s of SIGTERM:\n{standby.log()[-2000:]}"
    print(f"SIGTERM of a standby: exited in {time.monotonic() - t0:.2f}s")


# ----------------------------------------------------------------------------- SIGSTOP past the lease


@pytest.mark.timeout(150)
def test_leader_paused_past_its_lease_wakes_up_as_a_standby_and_sends_nothing_twice(
        tmp_path, redis_url, pg_url, cluster_factory):
    ttl = 2.0
    app = write_app(tmp_path, broker=redis_url, db_url=pg_url, redis_url=None, schedule=EVERY_SECOND,
                    conf=f"{{'cluster_beat_lock_ttl': {ttl}}}")
    cluster = cluster_factory(app)
    cluster.start(3)
    old = cluster.steady_leader()
    paused = cluster.proc(old)

    paused.signal(signal.SIGSTOP)
    stopped_at = time.time()  # (after the signal: nothing due from now on was decided before the stop)
    cluster.watcher.wait_for(lambda m: m.node != old and m.seen > stopped_at, ttl + 15,
                             "a standby taking over from the paused leader")
    time.sleep(max(0.0, stopped_at + ttl + 3 - time.time()))  # paused for ttl + 3 s in all
    continued_at = time.time()
    paused.signal(signal.SIGCONT)
    wait_for(lambda: "lost the leadership" in paused.log(), 15, what="the woken leader noticing its lease is gone")
    time.sleep(2.5)

    assert paused.alive(), paused.log()[-3000:]
    log = paused.log()
    assert "stops scheduling" in log and "Traceback" not in log, log[-3000:]
    msgs = cluster.watcher.messages()
    assert not duplicates(msgs), f"occurrences sent twice: {duplicates(msgs)}\n{timeline(msgs)}"
    # Woken up, it sends nothing of its own: no occurrence that fell due after it was stopped
    # (a send it had in flight when stopped may complete; a duplicate would show above).
    assert not [m for m in msgs if m.node == old and m.at.timestamp() > stopped_at], timeline(msgs)

    # It is a working standby: when the two others stop, it takes over and schedules again.
    others = [p for p in cluster.procs if p is not paused]
    current = [m for m in msgs if m.node != old][-1].node
    for p in sorted(others, key=lambda p: p.pid == node_pid(current)):  # the other standby first
        p.stop()
    stopped_others = time.time()
    cluster.watcher.wait_for(lambda m: m.node == old and m.seen > stopped_others, ttl + 15,
                             "the formerly paused replica leading again")
    time.sleep(1.5)
    msgs = cluster.watcher.messages()
    assert not duplicates(msgs), f"occurrences sent twice: {duplicates(msgs)}\n{timeline(msgs)}"


# ----------------------------------------------------------------------------- catch-up 'all' across SIGKILL


@pytest.mark.timeout(150)
def test_with_catchup_all_a_sigkill_failover_sends_every_occurrence_exactly_once(
        tmp_path, redis_url, pg_url, cluster_factory):
    app = write_app(tmp_path, broker=redis_url, db_url=pg_url, redis_url=None, schedule=EVERY_SECOND,
                    conf="{'cluster_beat_catchup': 'all', 'cluster_beat_claim_grace': 3}")
    cluster = cluster_factory(app)
    cluster.start(3, env=kill_env(tmp_path))
    old = cluster.steady_leader()

    killed_at = kill_after_its_next_mark(tmp_path, cluster.proc(old))  # nothing in flight
    cluster.watcher.wait_for(lambda m: m.node != old and m.seen > killed_at, DEFAULT_TTL + 20,
                             "a standby's first send after SIGKILL of the leader")
    time.sleep(3)
    msgs = cluster.watcher.messages()
    cluster.stop_all()
    first_new = min((m for m in msgs if m.node != old), key=lambda m: m.at)

    assert not duplicates(msgs), f"occurrences sent twice: {duplicates(msgs)}\n{timeline(msgs)}"
    instants = [m.at for m in msgs]
    expected = [instants[0] + i * SECOND for i in range(int((instants[-1] - instants[0]).total_seconds()) + 1)]
    assert instants == expected, "occurrences lost:\n" + timeline(msgs)
    # The new leader caught up on the seconds of the failover in one burst, oldest first.
    last_old = max(m.at for m in msgs if m.node == old)
    burst = [m for m in msgs if m.node != old and m.at <= first_new.at + 2 * SECOND]
    assert first_new.at == last_old + SECOND, timeline(msgs)
    assert first_new.seen - killed_at > 2, "no catch-up happened: the failover was too quick to test anything"
    assert len(burst) >= 3
    rows = [r for r in claim_rows(pg_url) if instants[0] <= r.scheduled_at <= instants[-1]]
    assert [r.status for r in rows] == ["sent"] * len(instants)


# ----------------------------------------------------------------------------- Redis restarted


@pytest.mark.timeout(180)
def test_redis_restarted_under_the_cluster_replicas_survive_and_scheduling_resumes(
        tmp_path, pg_url, throwaway_redis, cluster_factory):
    # The throwaway server is both the broker and the lease (the broker URL is the default lease URL).
    app = write_app(tmp_path, broker=throwaway_redis.url, db_url=pg_url, redis_url=None, schedule=EVERY_SECOND)
    cluster = cluster_factory(app)
    cluster.start(3)
    cluster.steady_leader()

    cluster.watcher.poll()
    throwaway_redis.kill()  # no persistence: the queue, the lease key and the term counter are gone
    killed_at = time.time()
    time.sleep(3)
    throwaway_redis.start()
    restarted_at = time.time()

    cluster.watcher.wait_for(lambda m: m.seen > restarted_at, 30, "a message after Redis came back")
    cluster.watcher.wait_for(lambda m: m.seen > restarted_at + 3, 15, "scheduling running on after the restart")
    msgs = cluster.watcher.messages()
    assert all(p.alive() for p in cluster.procs), cluster.logs()

    print(f"Redis restart: first message {min(m.seen for m in msgs if m.seen > restarted_at) - restarted_at:.2f}s "
          f"after the restart, {restarted_at - killed_at:.1f}s outage")
    assert not duplicates(msgs), f"occurrences sent twice: {duplicates(msgs)}\n{timeline(msgs)}"
    # After the restart one replica leads and sends the new occurrences on time, one a second.
    recent = [m for m in msgs if m.at.timestamp() > restarted_at + 2]
    assert recent and len({m.node for m in recent}) == 1, timeline(msgs)
    # On time: typically seen within a fraction of a second of its instant, and none later than
    # ON_TIME (2 s; a later send would have been a catch-up)
    lateness = [m.seen - m.at.timestamp() for m in recent]
    assert statistics.median(lateness) < 0.5 and max(lateness) < 2.0, (lateness, timeline(msgs))
    assert [m.at for m in recent] == [recent[0].at + i * SECOND for i in range(len(recent))], timeline(msgs)
    # (Occurrences that fell due during the outage are either sent late, once, or recorded.)
    cluster.stop_all()
    rows = {r.scheduled_at: r.status for r in claim_rows(pg_url)}
    sent = {m.at for m in msgs}
    assert all(rows.get(at) == "sent" for at in sent), "a message reached the broker that the store does not know"


# ----------------------------------------------------------------------------- term fencing


def _process_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


@pytest.mark.timeout(150)
def test_leader_frozen_between_its_lease_check_and_its_claim_is_fenced_by_the_newer_term(
        tmp_path, redis_url, pg_url, cluster_factory):
    from procs import DEFAULT_TASKS

    ttl = 2.0
    app = write_app(tmp_path, broker=redis_url, db_url=pg_url, redis_url=None, schedule=EVERY_SECOND,
                    conf=f"{{'cluster_beat_lock_ttl': {ttl}}}", tasks=DEFAULT_TASKS)
    cluster = cluster_factory(app)
    # Fault point: the leader stops itself (SIGSTOP) right before its next claim statement,
    # i.e. *after* it checked that it still leads. Armed below, for the leader's pid only.
    cluster.start(3, env={"CCB_FAULTS": "before-claim=stop", "CCB_FAULT_ARM_DIR": str(tmp_path)})
    old = cluster.steady_leader()
    frozen = cluster.proc(old)

    (tmp_path / f"before-claim-{frozen.pid}").touch()
    wait_for(lambda: _process_state(frozen.pid) == "T", 10, what="the leader freezing before a claim")
    frozen_at = time.time()
    # A standby takes over once the lease expires, and its first claim records its (higher) term.
    cluster.watcher.wait_for(lambda m: m.node != old and m.seen > frozen_at, ttl + 15, "a new leader sending")
    time.sleep(1)
    woken_at = time.time()
    frozen.signal(signal.SIGCONT)
    # It resumes inside its claim with the old term: the store refuses, it steps down.
    wait_for(lambda: "stepped down" in frozen.log(), 15, what="the woken leader stepping down")
    time.sleep(2)

    log = frozen.log()
    # (the claim's refusal names the recorded term: "a newer leader term <n> is recorded")
    assert re.search(r"stepped down \(term \d+\): a newer leader term \d+ is recorded", log), log[-3000:]
    assert "stops scheduling: a newer leader holds the claim store" in log, log[-3000:]
    assert frozen.alive()
    msgs = cluster.watcher.messages()
    assert not duplicates(msgs), f"occurrences sent twice: {duplicates(msgs)}\n{timeline(msgs)}"
    assert not [m for m in msgs if m.node == old and m.seen > woken_at], timeline(msgs)
    # The scheduling went on from the new leader without a hiccup.
    assert cluster.watcher.messages()[-1].node != old


def test_scheduler_whose_lease_term_is_below_the_recorded_term_sends_nothing_and_steps_down(
        db_url, redis_url, caplog):
    """In-process: the claim store has seen term 1000 (a leader elsewhere); our lease gets term 1."""
    from celery import Celery

    from celery_cluster_beat import every
    from celery_cluster_beat.leader.lease import lease_keys
    from celery_cluster_beat.schedules.occurrence import Occurrence
    from celery_cluster_beat.beat.scheduler import Scheduler
    from celery_cluster_beat.store import ClaimStore

    name = "fence_" + uuid.uuid4().hex[:8]
    app = Celery(name, broker=redis_url)
    app.conf.update(task_default_queue="q_" + name, cluster_beat_db_url=db_url, cluster_beat_node_id="node-low",
                    beat_schedule={"tick": {"task": "t.record", "schedule": every(1)}})
    other = ClaimStore(db_url, node_id="node-elsewhere")
    other.open()
    # The other leader's last claim was 5 s ago: for us, the schedule is overdue right away.
    last = datetime.now(UTC).replace(microsecond=0) - 5 * SECOND
    assert other.claim([Occurrence("tick", last)], term=1000)
    other.mark_sent([Occurrence("tick", last)])

    client = redis.Redis.from_url(redis_url)
    scheduler = Scheduler(app=app)
    keys = lease_keys(scheduler._lease_name())
    try:
        with caplog.at_level(logging.INFO):
            scheduler.tick()  # acquires the lease (term 1), sees the recorded term 1000 and steps down
            assert scheduler._lease.term is None and not scheduler._active
            assert client.get(keys[0]) is None, "the lease key should be released for the others"
            assert client.llen(app.conf.task_default_queue) == 0
            assert "stepped down (term 1)" in caplog.text and "below the recorded term 1000" in caplog.text
            assert other.current_term() == 1000
            assert [(r.scheduled_at, r.node) for r in other.claims()] == [(last, "node-elsewhere")]

            # Having seen term 1000, its next acquisition takes a term above it, and it schedules.
            deadline = time.monotonic() + 10
            while client.llen(app.conf.task_default_queue) == 0 and time.monotonic() < deadline:
                time.sleep(min(scheduler.tick(), 0.2))
            assert scheduler._lease.term is not None and scheduler._lease.term > 1000
            assert client.llen(app.conf.task_default_queue) >= 1
            assert other.current_term() == scheduler._lease.term
    finally:
        scheduler.close()
        other.close()
        client.delete(app.conf.task_default_queue, *keys[:2])
        client.close()


@pytest.mark.timeout(150)
def test_broker_down_longer_than_the_claim_grace_while_the_lease_holds_sends_each_occurrence_once(
        tmp_path, redis_url, pg_url, throwaway_redis, cluster_factory):
    """The broker (a throwaway Redis) goes away; the lease (the shared Redis) does not, so the
    leader stays leader and keeps retrying its failed sends. Its own stale-claim sweep must not
    start a second resend of occurrences it is still retrying."""
    grace = 2
    app = write_app(tmp_path, broker=throwaway_redis.url, db_url=pg_url, redis_url=redis_url,
                    schedule=EVERY_SECOND, conf=f"{{'cluster_beat_claim_grace': {grace}}}")
    cluster = cluster_factory(app)
    cluster.start(2)
    leader = cluster.steady_leader()

    cluster.watcher.poll()
    throwaway_redis.kill()
    killed_at = time.time()
    time.sleep(3 * grace + 1)  # several sweeps fall inside the outage
    throwaway_redis.start()
    restarted_at = time.time()
    cluster.watcher.wait_for(lambda m: m.seen > restarted_at + 9, 30, "scheduling running on after the restart")
    msgs = cluster.watcher.messages()
    cluster.stop_all()

    assert not duplicates(msgs), f"occurrences sent twice: {duplicates(msgs)}\n{timeline(msgs)}"
    assert {m.node for m in msgs} == {leader}, "the lease never moved"
    # Each occurrence of the outage ends either sent (its message reached the broker, late, once)
    # or failed after its retries; none is left claimed.
    rows = {r.scheduled_at: r.status for r in claim_rows(pg_url)}
    outage = sorted(at for at in rows if killed_at < at.timestamp() < restarted_at)
    seen = {m.at for m in msgs}
    print(f"broker outage {restarted_at - killed_at:.1f}s: " + ", ".join(
        f"{at:%S}s {rows[at]}{'+msg' if at in seen else ''}" for at in outage))
    assert len(outage) >= 3 * grace
    assert {rows[at] for at in outage} <= {"sent", "failed"}, rows
    assert {at for at in outage if rows[at] == "sent"} == {at for at in outage if at in seen}
