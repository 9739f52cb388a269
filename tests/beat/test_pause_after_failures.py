"""``pause_after_failures`` as the leader applies it, with a real Scheduler driven like beat drives
it and a real claim database; the runs' outcomes are written through the ledger's own calls
(``start_run`` / ``finish_run``, what ``LedgerTask`` does in a worker) on claim rows, so the test
decides the order of successes and failures: N failures in a row pause the schedule with the note,
the signal and the metric; a success in between resets the streak; ``resume`` restarts it;
skipped and missed occurrences neither extend nor break it."""
from __future__ import annotations

import time
import uuid
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, List

import pytest
from celery import Celery

from celery_cluster_beat import cron, every, signals
from celery_cluster_beat.beat import failures
from celery_cluster_beat.beat.scheduler import Scheduler
from celery_cluster_beat.errors import ConfigError
from celery_cluster_beat.dynamic import StoredSchedules
from celery_cluster_beat.ops.metrics import ClusterBeatMetrics
from celery_cluster_beat.schedules.occurrence import Occurrence
from celery_cluster_beat.store import ClaimStore
from celery_cluster_beat.store.schema import RunState


@pytest.fixture(autouse=True)
def _fast_passes(monkeypatch):
    monkeypatch.setattr(failures, "CHECK_EVERY", 0.2)


def _app(made, db, broker) -> Celery:
    name = "ccb_paf_" + uuid.uuid4().hex[:8]
    app = Celery(name, broker=broker, set_as_current=False)
    app.conf.update(task_default_queue="q_" + name, cluster_beat_db_url=db, cluster_beat_redis_url="",
                    cluster_beat_claim_grace=1.5,  # housekeeping, where failures are looked for, every 0.5 s
                    beat_schedule={"flaky": {"task": "t.x", "schedule": every(3600), "pause_after_failures": 3}})
    made.append(app)
    return app


def _drive(sched: Scheduler, done: Callable[[], Any], seconds: float) -> Any:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        found = done()
        if found:
            return found
        time.sleep(max(0.0, min(sched.tick(), 0.1)))
    return done()


class Runs:
    """Runs of past occurrences of one schedule, ended as the test says, through the ledger's calls."""

    def __init__(self, store: ClaimStore, name: str) -> None:
        self.store, self.name = store, name
        self.at = store.db_now().replace(microsecond=0) - timedelta(minutes=50)

    def run(self, outcome: RunState, error: str = "ValueError: boom") -> datetime:
        self.at += timedelta(minutes=1)
        occ = Occurrence(self.name, self.at)
        self.store.claim([occ])
        self.store.mark_sent([occ])
        start = self.store.start_run(self.name, occ.at, task_id=occ.task_id, worker="w@test", pid=1)
        self.store.finish_run(self.name, occ.at, start.token, outcome, 0.01,
                              error if outcome is RunState.FAILED else None)
        return occ.at

    def skip(self, status: str) -> None:
        self.at += timedelta(minutes=1)
        self.store.record([Occurrence(self.name, self.at)], status=status, reason="test")


def _passes(sched: Scheduler, more: int = 2) -> Callable[[], bool]:
    """Done once the leader looked for failed runs *more* times from now."""
    target = sched._stored.controls.failures.passes + more
    return lambda: sched._stored.controls.failures.passes >= target


def _paused(store: ClaimStore, name: str):
    return lambda: next((c for c in store.controls([name]) if c.paused), None)


def test_consecutive_failures_pause_a_success_resets_and_resume_restarts(made, db, broker):
    app = _app(made, db, broker)
    sched = Scheduler(app, lazy=False)
    made.append(sched)
    metrics = ClusterBeatMetrics(sender=sched).connect()
    made.append(metrics)
    fired: List[dict] = []

    def receiver(sender=None, **kw):
        if sender is sched:
            fired.append(kw)

    signals.paused_after_failures.connect(receiver, weak=False)
    try:
        ops = ClaimStore(db, node_id="ops")
        ops.open()
        made.append(ops)
        runs = Runs(ops, "flaky")
        sched.tick()
        runs.run(RunState.FAILED)
        runs.run(RunState.FAILED)
        runs.skip("skipped")  # overlap skips and missed occurrences neither break nor extend it
        runs.skip("missed")
        runs.run(RunState.SUCCEEDED)  # resets
        runs.run(RunState.FAILED)
        runs.run(RunState.FAILED)
        assert _drive(sched, _passes(sched), 15)
        assert _paused(ops, "flaky")() is None
        runs.skip("missed")
        runs.run(RunState.FAILED, "ValueError: the third")
        paused = _drive(sched, _paused(ops, "flaky"), 15)
        assert paused is not None
        assert (paused.paused_by, paused.paused_note) == (
            "cluster-beat", "paused after 3 consecutive failed runs (last: ValueError: the third)")
        assert "flaky" in sched._stored.controls.paused and "flaky" not in sched._queue
        assert [(f["schedule"], f["failures"], f["last_error"]) for f in fired] == [
            ("flaky", 3, "ValueError: the third")]
        assert b"cluster_beat_paused_after_failures_total 1.0" in metrics.exposition()

        # resume: the streak restarts (the three failures before it no longer count)
        ops.set_paused("flaky", False, by="alice")
        assert _drive(sched, lambda: "flaky" not in sched._stored.controls.paused, 10)
        runs.run(RunState.FAILED)
        runs.run(RunState.FAILED)
        assert _drive(sched, _passes(sched), 15)
        assert _paused(ops, "flaky")() is None
        runs.run(RunState.FAILED)
        assert _drive(sched, _paused(ops, "flaky"), 15) is not None
        assert len(fired) == 2
    finally:
        signals.paused_after_failures.disconnect(receiver)


def test_a_stored_schedule_takes_the_setting_validated_and_is_paused_too(made, db, broker):
    app = _app(made, db, broker)
    app.conf.beat_schedule = {}
    api = StoredSchedules(app)
    made.append(api)
    for bad in (0, -1, True, 1.5, "3"):
        with pytest.raises(ConfigError, match="pause_after_failures"):
            api.add("nope", "t.x", every(3600), pause_after_failures=bad)
    api.add("stored", "t.x", every(3600), pause_after_failures=2)
    assert api.get("stored").pause_after_failures == 2
    api.update("stored", pause_after_failures=1)
    assert api.get("stored").pause_after_failures == 1
    sched = Scheduler(app, lazy=False)
    made.append(sched)
    sched.tick()
    Runs(api.store, "stored").run(RunState.FAILED, "KeyError: 'x'")
    paused = _drive(sched, _paused(api.store, "stored"), 15)
    assert paused is not None and paused.paused_note == "paused after 1 consecutive failed run (last: KeyError: 'x')"


def test_a_config_entry_with_a_bad_setting_is_refused():
    from celery_cluster_beat.config.entries import build_entries

    with pytest.raises(ConfigError, match="pause_after_failures: expected a whole number from 1 to 10000"):
        build_entries({"e": {"task": "t", "schedule": every(5), "pause_after_failures": 0}})


def test_without_the_ledger_failures_are_read_from_the_result_backend(made, db, broker):
    """A plain task (no ledger) whose results the Redis result backend stores: the leader reads
    the states of the runs it sent through the overlap guard's reader, in the order it sent them:
    a success in between resets the streak, two failures in a row pause it."""
    app = _app(made, db, broker)
    app.conf.result_backend = broker
    # Task ids derive from (name, instant): a name of its own keeps the results of the other
    # database's run of this test (same Redis backend, same instants) apart from this one's.
    name = "plain-" + uuid.uuid4().hex[:8]
    app.conf.beat_schedule = {name: {"task": "t.plain", "schedule": every(1), "overlap": "allow",
                                     "pause_after_failures": 2}}
    sched = Scheduler(app, lazy=False)
    made.append(sched)
    ops = ClaimStore(db, node_id="ops")
    ops.open()
    made.append(ops)
    script = ["FAILURE", "SUCCESS", "FAILURE", "FAILURE"]

    done: dict = {}

    def worker_results() -> None:
        """Store a result for each sent run, in instant order, as the script says (then nothing)."""
        for row in sorted((r for r in ops.claims(name) if r.status == "sent"), key=lambda r: r.scheduled_at):
            if row.task_id in done or len(done) == len(script):
                continue
            state = script[len(done)]
            result = ValueError("plain failed") if state == "FAILURE" else "ok"
            app.backend.store_result(row.task_id, result, state)
            done[row.task_id] = state

    def step() -> Any:
        worker_results()
        return _paused(ops, name)()

    script[3:] = []  # failed, succeeded, failed: the success reset the streak, no pause
    assert _drive(sched, lambda: step() or len(done) == 3, 30)
    assert _drive(sched, _passes(sched, 3), 15)
    assert _paused(ops, name)() is None
    script.append("FAILURE")  # the second failure in a row
    paused = _drive(sched, step, 30)
    assert paused is not None and list(done.values()) == ["FAILURE", "SUCCESS", "FAILURE", "FAILURE"]
    assert paused.paused_note.startswith("paused after 2 consecutive failed runs (last: task ")
    assert paused.paused_note.endswith("ended FAILURE)")
    last_failed = [t for t, s in done.items() if s == "FAILURE"][-1]
    assert last_failed in paused.paused_note


def test_without_the_ledger_a_stored_schedule_not_held_in_memory_is_paused_too(made, db, broker):
    """Runs of a stored schedule that is not held in memory (hourly, its next fire half an hour away:
    a backfill sends two of its past occurrences) fail in the result backend: what the leader needs
    of the schedule (N, its max_run_time) was kept when they went out, so it waits for their results
    and pauses it."""
    app = _app(made, db, broker)
    app.conf.result_backend = broker
    app.conf.beat_schedule = {}
    name = "plain-stored-" + uuid.uuid4().hex[:8]
    api = StoredSchedules(app)
    made.append(api)
    # Never within the 2-minute horizon, whatever the time of day the test runs (every(3600) was, in
    # the two minutes before each hour).
    minute = (datetime.now(timezone.utc).minute + 30) % 60
    api.add(name, "t.plain", cron(f"{minute} * * * *"), overlap="allow", pause_after_failures=2)
    sched = Scheduler(app, lazy=False)
    made.append(sched)
    ops = ClaimStore(db, node_id="ops")
    ops.open()
    made.append(ops)
    sched.tick()
    assert name not in sched.entries  # its next fire is past the horizon
    start = ops.db_now().replace(minute=0, second=0, microsecond=0) - timedelta(hours=3)
    _, request = ops.request_backfill(name, start, start + timedelta(hours=2, seconds=-1))  # two instants
    assert _drive(sched, lambda: ops.backfill_request(request.id).state == "done", 20)
    assert name not in sched.entries
    assert _drive(sched, _passes(sched, 3), 15)  # the results are not known yet: the runs wait
    for row in ops.claims(name):
        app.backend.store_result(row.task_id, ValueError("plain failed"), "FAILURE")
    paused = _drive(sched, _paused(ops, name), 20)
    assert paused is not None and paused.paused_note.startswith("paused after 2 consecutive failed runs")


def test_memory_for_the_result_backend_path_is_bounded_and_an_unobservable_setting_is_said(
        made, db, broker, caplog, monkeypatch):
    app = _app(made, db, broker)  # no result backend
    app.conf.beat_schedule = {"plain": {"task": "t.plain", "schedule": every(3600), "overlap": "allow",
                                        "pause_after_failures": 2}}
    with caplog.at_level("WARNING", logger="celery_cluster_beat"):
        sched = Scheduler(app, lazy=False)
        made.append(sched)
        sched.tick()
    said = [r.getMessage() for r in caplog.records if "pause_after_failures cannot work" in r.getMessage()]
    assert len(said) == 1 and "plain" in said[0] and "no result backend" in said[0], said
    watch = sched._stored.controls.failures
    entry = sched.entries["plain"]
    at = datetime(2026, 1, 1, tzinfo=timezone.utc)
    watch.sent(entry, Occurrence("plain", at))  # unobservable: nothing is kept
    assert not watch._waiting and not watch._watched
    app.conf.result_backend = broker  # observable from now on
    monkeypatch.setattr(failures, "MAX_WATCHED", 3)
    for i in range(6):  # six schedules sent: the three sent longest ago are forgotten
        other = replace(entry, name=f"n{i}")
        watch.sent(other, Occurrence(other.name, at))
    assert list(watch._watched) == ["n3", "n4", "n5"] and set(watch._waiting) == {"n3", "n4", "n5"}


def test_failures_of_an_earlier_schedule_of_the_same_name_do_not_count(made, db, broker):
    """A stored schedule removed and added again (a new definition) starts its streak afresh: the
    failed run of the earlier one does not count (the window starts at the row's change, by the
    database's clock)."""
    app = _app(made, db, broker)
    app.conf.beat_schedule = {}
    api = StoredSchedules(app)
    made.append(api)
    api.add("again", "t.x", every(3600), pause_after_failures=2)
    runs = Runs(api.store, "again")
    runs.run(RunState.FAILED, "KeyError: 'old'")
    api.remove("again")
    api.add("again", "t.other", every(3600), pause_after_failures=2)
    sched = Scheduler(app, lazy=False)
    made.append(sched)
    sched.tick()
    runs.run(RunState.FAILED, "KeyError: 'new'")  # the first failure of the new schedule
    assert _drive(sched, _passes(sched, 4), 15)
    assert _paused(api.store, "again")() is None
    runs.run(RunState.FAILED, "KeyError: 'new'")  # the second: now it pauses
    paused = _drive(sched, _paused(api.store, "again"), 15)
    assert paused is not None and paused.paused_note == "paused after 2 consecutive failed runs (last: KeyError: 'new')"


def test_a_pause_whose_reply_was_lost_still_fires_the_signal_and_metric_once(made, db, broker):
    """The pause commits but its reply is lost (the store raises after the commit): the pause shows
    later, by cluster-beat with its note, and the signal and the metric fire then, once."""
    from celery_cluster_beat.store import StoreUnavailable

    app = _app(made, db, broker)
    sched = Scheduler(app, lazy=False)
    made.append(sched)
    metrics = ClusterBeatMetrics(sender=sched).connect()
    made.append(metrics)
    fired: List[dict] = []

    def receiver(sender=None, **kw):
        if sender is sched:
            fired.append(kw)

    signals.paused_after_failures.connect(receiver, weak=False)
    try:
        sched.tick()
        store = sched._node.store
        real = store.set_paused
        lost: List[str] = []

        def set_paused(name, paused, **kw):
            result = real(name, paused, **kw)
            if not lost:
                lost.append(name)
                raise StoreUnavailable("the reply was lost (committed)")
            return result

        store.set_paused = set_paused
        ops = ClaimStore(db, node_id="ops")
        ops.open()
        made.append(ops)
        runs = Runs(ops, "flaky")
        for _ in range(3):
            runs.run(RunState.FAILED, "ValueError: lost")
        assert _drive(sched, lambda: "flaky" in sched._stored.controls.paused, 20)
        assert _drive(sched, _passes(sched, 3), 15)
        assert lost == ["flaky"]
        assert [(f["schedule"], f["failures"], f["last_error"]) for f in fired] == [("flaky", 3, "ValueError: lost")]
        assert b"cluster_beat_paused_after_failures_total 1.0" in metrics.exposition()
    finally:
        signals.paused_after_failures.disconnect(receiver)


def test_failed_runs_finished_at_the_same_instant_are_all_read_across_pages(made, db, broker, monkeypatch):
    """Three schedules' runs failed with the same finish time and a page holds two: the next page
    goes on from the last row read (finish time, schedule, instant), so the third is not skipped."""
    import sqlalchemy as sa

    from celery_cluster_beat.store.schema import claims_table

    monkeypatch.setattr(failures, "READ_AT_ONCE", 2)
    app = _app(made, db, broker)
    names = ["a-one", "b-two", "c-three"]
    app.conf.beat_schedule = {n: {"task": "t.x", "schedule": every(3600), "pause_after_failures": 1} for n in names}
    ops = ClaimStore(db, node_id="ops")
    ops.open()
    made.append(ops)
    Scheduler(app, lazy=False).close()  # prepares the store
    for name in names:
        Runs(ops, name).run(RunState.FAILED, f"ValueError: {name}")
    same = ops.db_now().replace(microsecond=0)
    engine = sa.create_engine(db)
    try:
        with engine.begin() as conn:
            conn.execute(sa.update(claims_table).where(claims_table.c.schedule.in_(names)).values(finished_at=same))
    finally:
        engine.dispose()
    assert [r[0] for r in ops.failed_since(same - timedelta(seconds=1), limit=2)] == names[:2]
    assert [r[0] for r in ops.failed_since(same, limit=2, after=(same, names[1], ops.claims(names[1])[0].scheduled_at))
            ] == names[2:]
    (ended,) = ops.last_ended_runs(names[0], 1)
    assert type(ended.run_state) is RunState and ended.run_state is RunState.FAILED
    sched = Scheduler(app, lazy=False)
    made.append(sched)
    assert _drive(sched, lambda: all(_paused(ops, n)() for n in names), 20)
