"""Bounds as beat meets them, from a review: a stored row written by hand with bounds past year
9999 fails alone (its occurrence recorded ``failed`` with the reason) while a good schedule beside
it keeps firing; stored rows with ``max_runs`` are loaded by the leader without walking their
count (the API stored where it ends: ``runs_end_at``)."""
from __future__ import annotations

import time
import uuid
from datetime import datetime, timedelta, timezone

import pytest
import sqlalchemy as sa
from celery import Celery

from celery_cluster_beat import cron, every
from celery_cluster_beat.beat.scheduler import Scheduler
from celery_cluster_beat.dynamic import StoredSchedules
from celery_cluster_beat.schedules import bounds
from celery_cluster_beat.store import ClaimStore
from celery_cluster_beat.store.schema import stored_schedules_table

UTC = timezone.utc


def _app(made, db, broker, schedule=None) -> Celery:
    name = "ccb_brv_" + uuid.uuid4().hex[:8]
    app = Celery(name, broker=broker, set_as_current=False)
    app.conf.update(task_default_queue="q_" + name, cluster_beat_db_url=db, cluster_beat_redis_url="",
                    cluster_beat_claim_grace=30.0, cluster_beat_node_id="node-" + name[-8:],
                    cluster_beat_overlap="allow", beat_schedule=schedule or {})
    made.append(app)
    return app


def _ops(made, db) -> ClaimStore:
    store = ClaimStore(db, node_id="ops")
    store.open()
    made.append(store)
    return store


def _by_hand(db: str, name: str, **values) -> None:
    """Write columns of stored row *name* past the API (as an operator's SQL would)."""
    engine = sa.create_engine(db)
    try:
        with engine.begin() as conn:
            t = stored_schedules_table
            conn.execute(sa.update(t).where(t.c.name == name).values(**values))
    finally:
        engine.dispose()


def _run(sched: Scheduler, seconds: float, until=lambda: False) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end and not until():
        time.sleep(max(0.0, min(sched.tick(), 0.05, end - time.monotonic())))


@pytest.mark.timeout(90)
def test_a_hand_written_row_with_bounds_past_year_9999_fails_alone(made, db, broker):
    ops = _ops(made, db)
    app = _app(made, db, broker)
    api = StoredSchedules(app)
    made.append(api)
    api.add("good", "t.good", every(1))
    api.add("bad-count", "t.bad", every(60))
    api.add("bad-next", "t.bad", every(60))
    soon = ops.db_now() + timedelta(seconds=1)
    # max_runs whose end lies past year 9999 (and no runs_end_at: written past the API)
    _by_hand(db, "bad-count", start_at=datetime(9999, 12, 30, tzinfo=UTC), max_runs=10_000, next_at=soon)
    # a start whose next instant is past year 9999
    _by_hand(db, "bad-next", start_at=datetime(9999, 12, 31, 23, 59, 30, tzinfo=UTC), next_at=soon)
    sched = Scheduler(app, lazy=False)
    made.append(sched)
    _run(sched, 40, until=lambda: len([c for c in ops.claims("good") if c.status == "sent"]) >= 3
         and ops.claims("bad-next"))
    assert len([c for c in ops.claims("good") if c.status == "sent"]) >= 3
    failed = ops.claims("bad-next")
    assert [c.status for c in failed] == ["failed"]
    assert "cannot be computed" in failed[0].reason
    assert sched.tick() >= 0  # the loop goes on


@pytest.mark.timeout(120)
def test_stored_rows_with_max_runs_load_without_walking_their_count(made, db, broker, monkeypatch):
    ops = _ops(made, db)
    app = _app(made, db, broker)
    api = StoredSchedules(app)
    made.append(api)
    n = 300
    api.add_many([dict(name=f"r{i:04d}", task="t.r", schedule=cron("* * * * *"), max_runs=10_000,
                       enabled=True) for i in range(n)])
    rows = {r.name: r for r in ops.stored_list()}
    assert all(r.runs_end_at is not None for r in rows.values())
    # The 10,000th minute from each row's creation (every row created in the same transaction).
    created = rows["r0000"].created_at
    first = created.replace(second=0, microsecond=0) + timedelta(minutes=1)
    assert rows["r0000"].runs_end_at == first + timedelta(minutes=9_999)

    walks = []
    real = bounds._nth.__wrapped__

    def counting(*a):
        walks.append(a)
        return real(*a)

    monkeypatch.setattr(bounds, "_nth", counting)
    monkeypatch.setattr(bounds, "runs_end", lambda *a, **k: walks.append(a))
    replicas = []
    for _ in range(2):  # two replicas load the same rows and agree on where each ends
        sched = Scheduler(_app(made, db, broker), lazy=False)
        made.append(sched)
        started = time.monotonic()
        _run(sched, 15, until=lambda: sched._node.active)
        sched.tick()
        replicas.append((sched, time.monotonic() - started))
    assert walks == []
    for sched, _ in replicas:
        held = {name: e.schedule.last_instant() for name, e in sched._node.entries.items() if name.startswith("r")}
        assert held and all(held[name] == rows[name].runs_end_at for name in held)


@pytest.mark.timeout(90)
def test_a_config_one_off_first_seen_after_its_instant_is_recorded_missed_once(made, db, broker, caplog):
    from celery_cluster_beat import at
    ops = _ops(made, db)
    when = ops.db_now() - timedelta(seconds=30)
    schedule = {"late": {"task": "t.late", "schedule": at(when)}, "good": {"task": "t.good", "schedule": every(1)}}
    for _ in range(2):  # a restart (or another replica) records nothing more
        app = _app(made, db, broker, schedule)
        sched = Scheduler(app, lazy=False)
        made.append(sched)
        with caplog.at_level("WARNING", logger="celery_cluster_beat"):
            _run(sched, 30, until=lambda: ops.claims("late") and ops.claims("good"))
        sched.close()
    rows = [(c.scheduled_at, c.status) for c in ops.claims("late")]
    assert rows == [(when, "missed")]
    assert "before the entry was first registered" in ops.claims("late")[0].reason
    assert len([r for r in caplog.records if "'late'" in r.getMessage() and "recorded missed" in r.getMessage()]) == 1


@pytest.mark.timeout(90)
def test_max_runs_added_to_an_old_config_entry_ends_it_with_a_warning(made, db, broker, caplog):
    ops = _ops(made, db)
    app = _app(made, db, broker, {"old": {"task": "t.old", "schedule": every(1)}})
    sched = Scheduler(app, lazy=False)
    made.append(sched)
    _run(sched, 30, until=lambda: len(ops.claims("old")) >= 3)  # it has run a few times
    sched.close()
    app = _app(made, db, broker, {"old": {"task": "t.old", "schedule": every(1), "max_runs": 2}})
    sched = Scheduler(app, lazy=False)
    made.append(sched)
    with caplog.at_level("WARNING", logger="celery_cluster_beat"):
        _run(sched, 10, until=lambda: any("'old' has ended" in r.getMessage() for r in caplog.records))
    lines = [r.getMessage() for r in caplog.records if "'old' has ended" in r.getMessage()]
    assert len(lines) == 1 and "max_runs=2" in lines[0] and "first registration" in lines[0]


def _last_buffered(made, db, broker):
    """A stored ``every(1)`` schedule with ``max_runs=2`` and ``buffer_one`` whose previous run (written
    by an "old-node") is STARTED, ticked until both its instants were handled: the first waits in the
    buffer, the last is recorded skipped. ``(ops, app, sched, name, previous, last)``.

    The schedule's name is the test's own: task ids come from (name, instant), and other tests
    running meanwhile write and forget results of theirs on the same Redis result backend (a
    ``forget`` of the same id read as PENDING, in flight for ``max_run_time``, kept the occurrence
    buffered). ``catchup="all"``: a first tick late on a loaded host still sends (buffers) the first
    instant instead of recording it missed."""
    from celery_cluster_beat.schedules.occurrence import Occurrence
    ops = _ops(made, db)
    app = _app(made, db, broker)
    # Results in this process's memory, not on the Redis every test shares: nothing another test
    # writes or forgets there can change what the guard reads of this schedule's previous run.
    app.conf.update(result_backend="cache+memory://", cluster_beat_overlap="buffer_one")
    api = StoredSchedules(app)
    made.append(api)
    name = "job-" + uuid.uuid4().hex[:8]
    # A task name no other test registers: Celery's app.task is shared by default, so a LedgerTask
    # "t.job" from an app another test imported in this process becomes every later app's "t.job",
    # and the guard would read the ledger (where this run never starts) instead of its result.
    api.add(name, "t.brv_job", every(1), max_runs=2, overlap="buffer_one", catchup="all")
    row = ops.stored_get([name])[0]
    previous = Occurrence(name, row.created_at.replace(microsecond=0) - timedelta(seconds=1))
    history = ClaimStore(db, node_id="old-node")
    history.open()
    made.append(history)
    assert history.claim([previous]) == [previous] and history.mark_sent([previous]) == 1
    app.backend.store_result(previous.task_id, None, "STARTED")
    sched = Scheduler(app, lazy=False)
    made.append(sched)
    last = row.runs_end_at
    _run(sched, 30, until=lambda: any(c.scheduled_at == last for c in ops.claims(name)))
    _run(sched, 1.0)  # a few more passes and buffer polls: an end written too early would show
    rows = {c.scheduled_at: (c.status, c.reason) for c in ops.claims(name)}
    assert rows == {previous.at: ("sent", None), last: ("skipped", "overlap")}, rows  # the first: in memory only
    assert sched._guard.is_buffered(name), "set-up: no occurrence is buffered"
    buffered_entry = sched._guard._buffer[name][0]
    assert not sched._guard.uses_ledger(buffered_entry), "set-up: the guard would read the ledger, not the result"
    return ops, app, sched, name, previous, last


@pytest.mark.timeout(90)
def test_a_bounded_stored_schedule_is_not_ended_while_its_last_occurrence_is_only_buffered(made, db, broker):
    """``buffer_one``: the previous run is STARTED, so the last occurrence waits in memory. The row
    must not be ended (a crash would lose that occurrence with it) until it is claimed."""
    ops, app, sched, name, previous, last = _last_buffered(made, db, broker)
    assert ops.stored_get([name])[0].ended_at is None  # not ended while only in memory
    app.backend.store_result(previous.task_id, None, "SUCCESS")
    _run(sched, 30, until=lambda: ops.stored_get([name])[0].ended_at is not None)
    rows = {c.scheduled_at: c.status for c in ops.claims(name)}
    # both instants of max_runs=2 have their row: the buffered one sent, the other skipped (buffer_one)
    assert rows == {previous.at: "sent", last - timedelta(seconds=1): "sent", last: "skipped"}, (
        rows, "previous run read as", sched._guard.states([previous.task_id]),
        "buffered:", sched._guard.is_buffered(name), "store back-off over:", sched._node.backoff.over())
    assert ops.stored_get([name])[0].ended_at is not None


@pytest.mark.timeout(90)
def test_a_clean_stop_records_the_buffered_last_occurrence_skipped_and_the_next_leader_ends_the_row(
        made, db, broker):
    """Closing the scheduler while a bounded schedule's occurrence waits in the buffer records it
    ``skipped`` with the reason (README: a clean stop records it skipped and the next leader ends the
    row). Fails if close() drops the buffer unrecorded: that occurrence never gets a claim row, and
    the next leader, finding the last instant recorded, ends the row after it."""
    ops, app, sched, name, previous, last = _last_buffered(made, db, broker)
    sched.close()
    buffered = last - timedelta(seconds=1)
    rows = {c.scheduled_at: c for c in ops.claims(name)}
    assert buffered in rows, "the buffered occurrence ended without a claim row"
    assert rows[buffered].status == "skipped" and "stopped scheduling" in rows[buffered].reason, rows[buffered]
    assert ops.stored_get([name])[0].ended_at is None  # the end was owed to the claim: the next leader writes it
    nxt = _app(made, db, broker)
    nxt.conf.update(result_backend="cache+memory://", cluster_beat_overlap="buffer_one")
    successor = Scheduler(nxt, lazy=False)
    made.append(successor)
    _run(successor, 10, until=lambda: ops.stored_get([name])[0].ended_at is not None)
    assert ops.stored_get([name])[0].ended_at is not None
    assert {c.scheduled_at: c.status for c in ops.claims(name)} == {
        previous.at: "sent", buffered: "skipped", last: "skipped"}
