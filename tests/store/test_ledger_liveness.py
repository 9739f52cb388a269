"""Liveness, not age, decides a re-run: the ledger's take-over rules on every dialect.

A run row names the process running it; that process heartbeats a row of its own
(``cluster_beat_workers``) that says until when it is alive, by the database's clock. The
tests make "dead" real: a tiny grace whose heartbeat is left to expire, or the process
recorded gone, as a worker's main process does when a pool child dies. Runs of any age are
started long ago by rewriting ``started_at``: age must not matter.
"""
from __future__ import annotations

import threading
import time
from collections import Counter
from datetime import datetime, timedelta, timezone
from typing import List, Optional

import pytest
import sqlalchemy as sa

from celery_cluster_beat.schedules.occurrence import Occurrence
from celery_cluster_beat.store import ClaimStore
from celery_cluster_beat.store.ledger import StartOutcome
from celery_cluster_beat.store.liveness import ProcessGone
from celery_cluster_beat.store.schema import RunState, claims_table

UTC = timezone.utc
T0 = datetime(2021, 1, 1, tzinfo=UTC)  # in the past: the ledger refuses an instant ahead of the database's clock
STARTED, CONTINUED, RERUN, DUPLICATE = (StartOutcome.STARTED, StartOutcome.CONTINUED, StartOutcome.RERUN,
                                        StartOutcome.DUPLICATE)
ALIVE = 120.0  # a grace no test outlives
TINY = 3.0  # a grace a test waits out (long enough to outlive the next round trips on a loaded machine)


def occ(name: str) -> Occurrence:
    return Occurrence(name, T0)


def deliver(store: ClaimStore, o: Occurrence, process: str, *, grace: float = ALIVE, retries: int = 0,
            takeover: bool = True, check: Optional[str] = None, token: Optional[str] = None,
            pid: Optional[int] = None):
    """A delivery by process *process* (``pN``, or a full ``host:pid:random`` id)."""
    if ":" not in process:
        pid, process = pid or int(process[1:] or 1), f"host:{process}:x"
    return store.start_run(o.schedule, o.at, task_id=o.task_id, worker=f"{process}@w", pid=pid or 1,
                           retries=retries, process=process, grace=grace, takeover=takeover, check=check,
                           token=token)


def row(store: ClaimStore, o: Occurrence):
    [found] = [r for r in store.claims(o.schedule) if r.scheduled_at == o.at]
    return found


def expire(grace: float = TINY) -> None:
    time.sleep(grace + 1.0)


def age_the_run(raw, o: Occurrence, days: int = 400) -> None:
    c = claims_table
    with raw.begin() as conn:
        conn.execute(sa.update(c).where(c.c.schedule == o.schedule, c.c.scheduled_at == o.at)
                     .values(started_at=datetime.now(UTC) - timedelta(days=days)))


def test_a_live_run_is_never_taken_over_however_old_its_start(make_store, raw):
    store = make_store("worker")
    o = occ("long")
    first = deliver(store, o, "p1")
    assert first.outcome is STARTED
    age_the_run(raw, o)  # started over a year ago by the database's clock
    store.worker_heartbeat("host:p1:x", host="host", pid=1, grace=ALIVE)
    for n in range(1, 4):
        again = deliver(store, o, "p2")
        assert again.outcome is DUPLICATE and not again.runs
    r = row(store, o)
    assert (r.run_state, r.run_process, r.duplicates) == ("running", "host:p1:x", 3)
    assert store.finish_run(o.schedule, o.at, first.token, RunState.SUCCEEDED, 1.0)
    assert store.run_states([(o.schedule, o.at)])[(o.schedule, o.at)].run_state == "succeeded"


def test_a_run_whose_heartbeat_expired_is_rerun_once_and_its_old_holder_cannot_overwrite(make_store):
    store = make_store("worker")
    o = occ("dead")
    first = deliver(store, o, "p1", grace=TINY)
    assert deliver(store, o, "p2").outcome is DUPLICATE  # alive still
    expire()
    assert store.run_states([(o.schedule, o.at)])[(o.schedule, o.at)].run_state == "failed"  # over, for the guard
    assert deliver(store, o, "p2", takeover=False).outcome is DUPLICATE  # acks early: never taken over
    rerun = deliver(store, o, "p2")
    assert rerun.outcome is RERUN and rerun.token != first.token
    for p in ("p3", "p2"):
        assert deliver(store, o, p).outcome is DUPLICATE  # the re-run is alive: once per death
    assert not store.finish_run(o.schedule, o.at, first.token, RunState.SUCCEEDED, 9.0)
    r = row(store, o)
    assert (r.run_state, r.run_process) == ("running", "host:p2:x")
    assert store.run_states([(o.schedule, o.at)])[(o.schedule, o.at)].run_state == "running"
    # The take-over recorded the old holder gone: a late heartbeat or delivery of it does not revive
    # it (the process takes a new identity) and does not give the run back.
    assert not store.worker_heartbeat("host:p1:x", host="host", pid=1, grace=ALIVE)
    assert not store.worker_alive("host:p1:x")
    with pytest.raises(ProcessGone):
        deliver(store, o, "p1")
    assert deliver(store, o, "host:p1:renewed", pid=1).outcome is DUPLICATE
    assert row(store, o).run_process == "host:p2:x"
    assert store.finish_run(o.schedule, o.at, rerun.token, RunState.SUCCEEDED, 0.5)


def test_a_process_recorded_gone_has_its_run_taken_over_at_once(make_store):
    store = make_store("worker")
    o = occ("gone")
    deliver(store, o, "p7")
    assert store.worker_gone("host:p7:x", reason="WorkerLostError: signal 9") == 1
    assert not store.worker_heartbeat("host:p7:x", host="host", pid=7, grace=ALIVE)  # never revived
    assert not store.worker_alive("host:p7:x")
    assert deliver(store, o, "p8").outcome is RERUN


@pytest.mark.parametrize("state", [RunState.LOST, RunState.FAILED])
def test_a_pool_child_lost_is_recorded_by_the_main_process_lost_reruns_failed_does_not(make_store, state):
    store = make_store("worker")
    o, other = occ(f"child-{state.value}"), Occurrence(f"child-{state.value}", T0 + timedelta(minutes=1))
    deliver(store, o, "p5")
    deliver(store, other, "p6")
    assert not store.end_lost_run(other.schedule, other.at, host="host", pid=5, state=state, error="x")  # not its run
    assert store.end_lost_run(o.schedule, o.at, host="host", pid=5, state=state, runtime=2.5,
                              error="WorkerLostError: Worker exited prematurely: signal 9 (SIGKILL)")
    r = row(store, o)
    assert (r.run_state, r.runtime) == (state.value, 2.5) and r.run_error.startswith("WorkerLostError")
    assert r.finished_at is not None
    assert not store.worker_alive("host:p5:x")
    assert row(store, other).run_state == "running"  # another process's run is left alone
    again = deliver(store, o, "p9")
    if state is RunState.LOST:  # Celery requeued the message: its redelivery runs it at once
        assert again.outcome is RERUN
    else:  # acknowledged, FAILURE: the run is over and stays so
        assert again.outcome is DUPLICATE
        assert store.run_states([(o.schedule, o.at)])[(o.schedule, o.at)].run_state == "failed"
    assert deliver(store, o, "p10").outcome is DUPLICATE


def test_one_check_later_mark_per_run_and_the_copy_takes_the_next(make_store):
    store = make_store("worker")
    o = occ("check")
    deliver(store, o, "p1")
    d1 = deliver(store, o, "p2")
    assert d1.outcome is DUPLICATE and d1.check_token and 0 < d1.check_in <= ALIVE + 1
    d2 = deliver(store, o, "p3")  # a redelivery while the copy is pending: a plain duplicate
    assert d2.outcome is DUPLICATE and d2.check_token is None
    assert deliver(store, o, "p3", takeover=False).check_token is None  # acks early: never checks
    copy = deliver(store, o, "p4", check=d1.check_token)  # the copy finds the run alive: the next check
    assert copy.outcome is DUPLICATE and copy.check_token and copy.check_token != d1.check_token
    assert deliver(store, o, "p4", check=d1.check_token).check_token is None  # a redelivery of that copy
    assert deliver(store, o, "p5").check_token is None
    assert store.drop_check(o.schedule, o.at, copy.check_token)  # its publish failed: the mark is given back
    assert deliver(store, o, "p5").check_token is not None


def test_the_check_copy_reruns_a_run_whose_process_died_meanwhile(make_store):
    store = make_store("worker")
    o = occ("check-dead")
    deliver(store, o, "p1", grace=TINY)
    d = deliver(store, o, "p2")
    assert d.check_token and d.check_in <= TINY + 0.5
    expire()
    assert deliver(store, o, "p2", check=d.check_token).outcome is RERUN
    r = row(store, o)
    assert r.run_process == "host:p2:x"
    assert deliver(store, o, "p3", check=d.check_token).outcome is DUPLICATE


def test_retries_have_no_upper_bound_and_a_duplicate_of_any_retry_is_recognised(make_store):
    store = make_store("worker")
    o = occ("retry-forever")
    run = deliver(store, o, "p1", retries=9998)
    assert run.outcome is STARTED
    assert store.finish_run(o.schedule, o.at, run.token, RunState.RETRIED)
    for n in (9999, 10000, 10001, 2 ** 40):
        nxt = deliver(store, o, "p1", retries=n)
        assert nxt.outcome is CONTINUED, n
        assert deliver(store, o, "p2", retries=n).outcome is DUPLICATE  # that retry delivered twice
        assert deliver(store, o, "p2", retries=n - 1).outcome is DUPLICATE  # a late copy of the one before
        assert row(store, o).run_attempt == n
        assert store.finish_run(o.schedule, o.at, nxt.token, RunState.RETRIED)
    last = deliver(store, o, "p1", retries=2 ** 40 + 1)
    assert last.outcome is CONTINUED
    assert store.finish_run(o.schedule, o.at, last.token, RunState.SUCCEEDED)


def test_concurrent_redeliveries_of_a_dead_run_rerun_it_exactly_once(db_url):
    setup = ClaimStore(db_url, node_id="setup")
    setup.open()
    occurrences = [Occurrence(f"dead-race{k}", T0) for k in range(8)]
    for o in occurrences:
        deliver(setup, o, "p1", grace=TINY)
    expire()
    n = 6
    stores = [ClaimStore(db_url, node_id=f"w{i}", lock_timeout=20) for i in range(n)]
    for s in stores:
        s.open()
    barrier = threading.Barrier(n)
    results: List[tuple] = []
    errors: List[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait(30)
            for o in (occurrences if i % 2 else occurrences[::-1]):
                results.append((o.schedule, deliver(stores[i], o, f"p{10 + i}").outcome))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    try:
        assert errors == [] and not any(t.is_alive() for t in threads)
        counts = Counter(results)
        for o in occurrences:
            assert counts[(o.schedule, RERUN)] == 1, counts
            assert counts[(o.schedule, DUPLICATE)] == n - 1, counts
    finally:
        for s in stores + [setup]:
            s.close()


def test_a_run_written_without_a_process_is_never_judged(make_store):
    """Rows of a release without heartbeats: neither taken over nor reported over."""
    store = make_store("worker")
    o = occ("legacy")
    assert store.start_run(o.schedule, o.at, task_id=o.task_id, worker="old@w", pid=1).outcome is STARTED
    assert deliver(store, o, "p2").outcome is DUPLICATE
    assert store.run_states([(o.schedule, o.at)])[(o.schedule, o.at)].run_state == "running"


_V4_COLUMNS = ("run_process", "run_attempt", "check_token", "check_at")


def test_a_version_3_database_is_migrated_and_its_unfinished_runs_keep_their_attempt(db_url, raw):
    """Version 3 kept the attempt of a run as the 4-digit prefix of its token. Opening migrates
    to version 4 (the columns, the workers table) and carries that attempt over: the next retry
    still continues the run and a duplicate of the current one still does not."""
    from celery_cluster_beat.store.schema import SCHEMA_VERSION, meta_table, metadata, workers_table

    with raw.begin() as conn:
        metadata.create_all(conn)
    with raw.begin() as conn:
        conn.exec_driver_sql(f"DROP TABLE {workers_table.name}")
    for col in _V4_COLUMNS:
        with raw.begin() as conn:
            conn.exec_driver_sql(f"ALTER TABLE {claims_table.name} DROP COLUMN {col}")
    v3_claims = sa.Table(claims_table.name, sa.MetaData(),
                         *[c._copy() for c in claims_table.columns if c.name not in _V4_COLUMNS])
    o = occ("upgraded")
    with raw.begin() as conn:
        conn.execute(meta_table.insert(), [{"key": "schema_version", "value": "3"}, {"key": "cluster_id", "value": "c"}])
        conn.execute(v3_claims.insert(), [{
            "schedule": o.schedule, "scheduled_at": o.at, "claimed_at": T0, "node": "old", "term": 1,
            "task_id": o.task_id, "status": "sent", "attempts": 1, "run_state": "retried",
            "run_token": "0007" + "a" * 28, "worker": "old@w", "worker_pid": 1, "started_at": T0}])
    store = ClaimStore(db_url, node_id="new")
    store.open()
    try:
        with raw.connect() as conn:
            assert conn.execute(sa.select(meta_table.c.value).where(meta_table.c.key == "schema_version")).scalar() \
                == str(SCHEMA_VERSION) == "6"
            assert sa.inspect(conn).has_table(workers_table.name)
        assert row(store, o).run_attempt == 7
        assert deliver(store, o, "p1", retries=7).outcome is DUPLICATE
        assert deliver(store, o, "p1", retries=8).outcome is CONTINUED
    finally:
        store.close()


def test_the_main_process_verdict_overrides_the_lost_its_stopped_child_recorded(make_store):
    """A child stopped by SIGTERM (revoke(terminate=True)) records 'lost' as it goes (its message
    may come back); its worker's main process knows Celery acknowledged it and records 'failed'."""
    store = make_store("worker")
    o = occ("stopped")
    run = deliver(store, o, "p4")
    assert store.finish_run(o.schedule, o.at, run.token, RunState.LOST, 1.0, "worker process stopped mid-run")
    assert store.end_lost_run(o.schedule, o.at, host="host", pid=4, state=RunState.FAILED,
                              error="revoked (terminated): Terminated: 15")
    r = row(store, o)
    assert (r.run_state, r.run_error) == ("failed", "revoked (terminated): Terminated: 15")
    assert deliver(store, o, "p5").outcome is DUPLICATE


def test_a_start_that_committed_unseen_is_this_deliverys_own_not_a_duplicate(make_store):
    """The watchdog may cut the connection during COMMIT: the start is stored but the worker saw an
    error and tries again with the same delivery token. That try must run the body (STARTED), not
    be a duplicate that drops the run; another delivery's token is still a duplicate."""
    store = make_store("worker")
    for o, claimed in ((occ("unseen"), False), (Occurrence("unseen", T0 + timedelta(minutes=1)), True)):
        if claimed:  # beat's row first (the update path); else the worker inserts the row
            store.claim([o])
        got = deliver(store, o, "p1", token="delivery-1")
        assert got.outcome is STARTED and got.token == "delivery-1"
        again = deliver(store, o, "p1", token="delivery-1")  # the retry of the same delivery
        assert again.outcome is STARTED and again.runs and again.token == "delivery-1"
        assert deliver(store, o, "p2", token="delivery-2").outcome is DUPLICATE
        assert store.finish_run(o.schedule, o.at, "delivery-1", RunState.SUCCEEDED, 0.1)
        assert deliver(store, o, "p1", token="delivery-1").outcome is DUPLICATE  # over: never again


def test_a_lost_child_is_judged_by_the_process_its_run_names_never_by_host_and_pid(make_store):
    """Two containers sharing a host name: each has a pool child with pid 7. The one whose child
    died records the loss of its own run only; the other's live child and run are untouched."""
    store = make_store("worker")
    mine, theirs = occ("pidns-mine"), occ("pidns-theirs")
    deliver(store, mine, "host:7:aaaa", pid=7)
    deliver(store, theirs, "host:7:bbbb", pid=7)
    assert not store.end_lost_run(theirs.schedule, theirs.at, host="host", pid=8, state=RunState.FAILED, error="x")
    assert store.end_lost_run(mine.schedule, mine.at, host="host", pid=7, state=RunState.LOST, error="x")
    assert not store.worker_alive("host:7:aaaa")
    assert store.worker_alive("host:7:bbbb")
    assert row(store, theirs).run_state == "running"
    assert deliver(store, theirs, "p9").outcome is DUPLICATE  # a live run is never started twice
    assert deliver(store, mine, "p9").outcome is RERUN


def test_a_process_recorded_gone_never_runs_under_that_name_and_one_merely_expired_keeps_its_run(make_store):
    store = make_store("worker")
    o, kept = occ("revived"), Occurrence("revived", T0 + timedelta(minutes=1))
    assert store.worker_heartbeat("host:p3:x", host="host", pid=3, grace=ALIVE)
    assert store.worker_gone("host:p3:x", reason="WorkerLostError") == 1
    assert not store.worker_heartbeat("host:p3:x", host="host", pid=3, grace=ALIVE)  # gone for good
    with pytest.raises(ProcessGone):
        deliver(store, o, "p3")
    assert store.run_states([(o.schedule, o.at)]) == {}  # nothing was started under the dead name
    assert deliver(store, o, "host:p3:fresh", pid=3).outcome is STARTED  # a new identity runs it
    # An outage longer than the grace, nobody took the run over: the next heartbeat refreshes the
    # row and the run is alive again (never started twice while its body still runs).
    deliver(store, kept, "p4", grace=TINY)
    expire()
    assert store.run_states([(kept.schedule, kept.at)])[(kept.schedule, kept.at)].worker_gone
    assert store.worker_heartbeat("host:p4:x", host="host", pid=4, grace=ALIVE)
    assert deliver(store, kept, "p5").outcome is DUPLICATE
    assert store.run_states([(kept.schedule, kept.at)])[(kept.schedule, kept.at)].run_state == "running"
