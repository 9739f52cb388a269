"""The worker-side ledger's statements: one atomic transition per run on the occurrence's claim row.

Each test runs against SQLite, a real PostgreSQL and a real MariaDB (``db_url``).
The race tests start many deliveries of one occurrence at once, each on a
connection of its own, and count the winners.
"""
from __future__ import annotations

import threading
from collections import Counter
from datetime import datetime, timedelta, timezone
from typing import List, Optional

import pytest

from celery_cluster_beat.schedules.occurrence import Occurrence
from celery_cluster_beat.store import ClaimStatus, ClaimStore
from celery_cluster_beat.store.ledger import NO_CLAIM_REASON, LedgerState, StartOutcome, error_summary
from celery_cluster_beat.store.schema import RUN_ERROR_LENGTH, RunState

UTC = timezone.utc
T0 = datetime(2020, 1, 1, tzinfo=UTC)  # in the past: the ledger refuses an instant ahead of the database's clock
STARTED, CONTINUED, RERUN, DUPLICATE = (StartOutcome.STARTED, StartOutcome.CONTINUED, StartOutcome.RERUN,
                                        StartOutcome.DUPLICATE)


def occ(name: str, minute: int) -> Occurrence:
    return Occurrence(name, T0 + timedelta(minutes=minute))


def start(store: ClaimStore, o: Occurrence, *, worker: str = "w1@host", retries: int = 0, takeover: bool = False,
          process: Optional[str] = None, grace: float = 60.0, check: Optional[str] = None):
    """A delivery run by *process* (default: one per worker name, alive for *grace* seconds)."""
    return store.start_run(o.schedule, o.at, task_id=o.task_id, worker=worker, pid=123, retries=retries,
                           process=process or f"host-{worker}:123:abc", grace=grace, takeover=takeover, check=check)


def row(store: ClaimStore, o: Occurrence):
    [found] = [r for r in store.claims(o.schedule) if r.scheduled_at == o.at]
    return found


def test_the_first_delivery_starts_the_run_and_every_other_is_a_counted_duplicate(make_store):
    beat, worker = make_store("beat"), make_store("worker")
    o = occ("report", 1)
    beat.claim([o])
    beat.mark_sent([o])
    first = start(worker, o)
    assert first.outcome is STARTED and first.token and first.runs
    r = row(worker, o)
    assert (r.run_state, r.worker, r.worker_pid, r.duplicates) == ("running", "w1@host", 123, None)
    assert r.started_at is not None and r.status == "sent"
    for n in (1, 2):
        again = start(worker, o, worker="w2@host")
        assert again.outcome is DUPLICATE and again.token is None and not again.runs
        assert (again.found_state, again.found_worker) == ("running", "w1@host")
        assert row(worker, o).duplicates == n
    assert worker.finish_run(o.schedule, o.at, first.token, RunState.SUCCEEDED, runtime=1.5)
    r = row(worker, o)
    assert (r.run_state, r.runtime, r.run_error) == ("succeeded", 1.5, None)
    assert r.finished_at is not None and r.finished_at >= r.started_at
    # A finished run is never started again, not even by a late redelivery of an acks_late task.
    assert start(worker, o, takeover=True, worker="w3@host").outcome is DUPLICATE


def test_a_message_faster_than_the_sent_mark_starts_the_run_and_the_mark_still_lands(make_store):
    """The broker can hand the message to a worker before beat marks the row sent."""
    beat, worker = make_store("beat"), make_store("worker")
    o = occ("fast", 1)
    beat.claim([o])
    assert start(worker, o).outcome is STARTED
    assert beat.mark_sent([o]) == 1
    r = row(beat, o)
    assert (r.status, r.run_state) == ("sent", "running")


def test_without_a_claim_row_the_worker_records_one_and_still_only_one_delivery_runs(make_store):
    store = make_store("worker")
    o = occ("elsewhere", 1)  # pruned, or sent by a beat writing another store
    first = start(store, o)
    assert first.outcome is STARTED and first.inserted
    r = row(store, o)
    assert (r.status, r.reason, r.run_state, r.task_id) == ("sent", NO_CLAIM_REASON, "running", o.task_id)
    assert start(store, o).outcome is DUPLICATE
    # Such a row is an ordinary finished claim: pruning removes it like any other.
    store.finish_run(o.schedule, o.at, first.token, RunState.FAILED, 0.1, "ValueError: x")
    assert store.prune(T0 + timedelta(days=1)) == 1


def test_a_celery_retry_continues_the_run_and_a_duplicate_of_the_retry_does_not(make_store):
    store = make_store("worker")
    o = occ("retrying", 1)
    store.claim([o])
    first = start(store, o)
    assert store.finish_run(o.schedule, o.at, first.token, RunState.RETRIED, 0.2, None)
    assert row(store, o).run_state == "retried"
    retry = start(store, o, retries=1)
    assert retry.outcome is CONTINUED and retry.token != first.token
    assert start(store, o, retries=1).outcome is DUPLICATE  # the retry message delivered twice
    assert start(store, o, retries=0).outcome is DUPLICATE  # the original message again
    assert store.finish_run(o.schedule, o.at, retry.token, RunState.SUCCEEDED, 0.3)
    assert start(store, o, retries=2).outcome is DUPLICATE  # nothing to continue after the end
    assert row(store, o).duplicates == 3


def test_a_retry_that_arrives_before_its_attempt_recorded_retried_still_continues(make_store):
    """``self.retry`` publishes the retry before it raises, so a fast worker may start the retry
    while the row still says ``running``: the retry wins, and the late RETRIED mark of the old
    attempt changes nothing."""
    store = make_store("worker")
    o = occ("fast-retry", 1)
    store.claim([o])
    first = start(store, o)
    retry = start(store, o, retries=1, worker="w2@host")
    assert retry.outcome is CONTINUED
    assert not store.finish_run(o.schedule, o.at, first.token, RunState.RETRIED, 0.1)
    r = row(store, o)
    assert (r.run_state, r.worker) == ("running", "w2@host")
    assert store.finish_run(o.schedule, o.at, retry.token, RunState.SUCCEEDED, 0.1)


def test_the_error_summary_is_class_and_first_line_and_bounded(make_store):
    store = make_store("worker")
    o = occ("failing", 1)
    store.claim([o])
    run = start(store, o)
    text = error_summary(ValueError("first line\nsecond line"))
    assert text == "ValueError: first line"
    long = error_summary(RuntimeError("x" * 5000))
    assert len(long) == RUN_ERROR_LENGTH and long.startswith("RuntimeError: xxx")
    assert store.finish_run(o.schedule, o.at, run.token, RunState.FAILED, 0.1, "E: " + "y" * 5000)
    assert len(row(store, o).run_error) == RUN_ERROR_LENGTH


def test_run_states_reads_the_rows_of_many_occurrences_and_leaves_out_unknown_ones(make_store):
    beat, worker = make_store("beat"), make_store("worker")
    running, done, queued, skipped = occ("a", 1), occ("b", 1), occ("c", 1), occ("d", 1)
    beat.claim([running, done, queued])
    beat.mark_sent([running, done, queued])
    beat.record([skipped], status="skipped", reason="overlap")
    start(worker, running)
    token = start(worker, done).token
    worker.finish_run(done.schedule, done.at, token, RunState.SUCCEEDED, 0.1)
    missing = occ("e", 1)
    keys = [(o.schedule, o.at) for o in (running, done, queued, skipped, missing)] + [(f"x{i}", T0) for i in range(450)]
    states = beat.run_states(keys)
    assert set(states) == {(o.schedule, o.at) for o in (running, done, queued, skipped)}
    got = {k[0]: (s.status, s.run_state) for k, s in states.items()}
    assert got == {"a": ("sent", "running"), "b": ("sent", "succeeded"), "c": ("sent", None),
                   "d": ("skipped", None)}
    assert all(isinstance(s, LedgerState) for s in states.values())
    assert states[("a", running.at)].started_at is not None and states[("c", queued.at)].sent_at is not None


def _race(db_url: str, occurrences: List[Occurrence], deliveries: int, *, claimed: bool, retries: int = 0):
    """*deliveries* threads, each with a store (connection) of its own, start every occurrence at once."""
    if claimed:
        beat = ClaimStore(db_url, node_id="beat")
        beat.open()
        beat.claim(occurrences)
        beat.close()
    stores = [ClaimStore(db_url, node_id=f"w{i}", lock_timeout=20) for i in range(deliveries)]
    for s in stores:
        s.open()
    barrier = threading.Barrier(deliveries)
    results: List[tuple] = []
    errors: List[BaseException] = []
    lock = threading.Lock()

    def deliver(i: int) -> None:
        try:
            store = stores[i]
            order = occurrences if i % 2 else list(reversed(occurrences))
            barrier.wait(30)
            for o in order:
                r = start(store, o, worker=f"w{i}@host", retries=retries)
                with lock:
                    results.append((o.schedule, r.outcome))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=deliver, args=(i,)) for i in range(deliveries)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    try:
        assert errors == [] and not any(t.is_alive() for t in threads)
        return Counter(results), stores[0]
    finally:
        for s in stores[1:]:
            s.close()


@pytest.mark.parametrize("claimed", [True, False], ids=["claimed-row", "no-row"])
def test_concurrent_deliveries_of_one_occurrence_start_it_exactly_once(db_url, claimed):
    occurrences = [occ(f"race{k}", 1) for k in range(12)]
    deliveries = 8
    counts, store = _race(db_url, occurrences, deliveries, claimed=claimed)
    try:
        for o in occurrences:
            assert counts[(o.schedule, STARTED)] == 1, counts
            assert counts[(o.schedule, DUPLICATE)] == deliveries - 1, counts
            r = row(store, o)
            assert r.run_state == "running" and r.duplicates == deliveries - 1
            assert r.status == ClaimStatus.CLAIMED if claimed else r.status == ClaimStatus.SENT
    finally:
        store.close()
