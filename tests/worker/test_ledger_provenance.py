"""The worker's ledger checks what a message's headers tell it, on each real claim database.

Issue 20, item 4: the ledger trusted the ``cluster_beat_*`` headers alone. A message for task A
carrying schedule B's headers started B's occurrence: with a future instant it inserted B's claim
row, so beat later counted B's occurrence as claimed by another node and never sent it (no log
line); with a current one, task A ran as B's occurrence and B's real delivery was then skipped as
a duplicate. Now a delivery is refused (not run, no row written, one WARNING naming the schedule
and the instant, reported ``refused`` through ``run_handled``) when its instant is ahead of the
database's clock by more than ``FUTURE_MARGIN`` and beat has no claim row for it, or when its
schedule's task is not the delivered task (a config entry's task from the worker's
``beat_schedule``, a stored schedule's from its row, when the row has not changed since the
instant). A schedule nobody names, or a stored one changed since the instant, runs, its task
unchecked, with one WARNING. Celery's own tracer runs the task here (``apply()``), with a real
claim store.
"""
from __future__ import annotations

import logging
from datetime import timedelta
from typing import List

import pytest
import sqlalchemy as sa
from celery import Celery

from celery_cluster_beat import every, signals
from celery_cluster_beat.beat.duepass import CLAIM_AHEAD
from celery_cluster_beat.dynamic import StoredSchedules
from celery_cluster_beat.schedules.occurrence import Occurrence
from celery_cluster_beat.store import ClaimStore
from celery_cluster_beat.signals import RunOutcome
from celery_cluster_beat.store.ledger import FUTURE_MARGIN, Refusal, StartOutcome, Unchecked
from celery_cluster_beat.store.provenance import CHANGE_MARGIN
from celery_cluster_beat.store.schema import stored_schedules_table
from celery_cluster_beat.worker import LedgerTask, provenance

LOGGER = "celery_cluster_beat.worker"


def headers_for(o: Occurrence) -> dict:
    return {"cluster_beat_schedule": o.schedule, "cluster_beat_scheduled_at": o.at.isoformat().replace("+00:00", "Z"),
            "cluster_beat_node": "beat-1:42", "cluster_beat_catchup": False, "cluster_beat_attempt": 1}


class Rig:
    """An app with two ledger tasks, a config entry ``b`` of ``t.b``, and the claim store beat writes."""

    def __init__(self, db_url: str) -> None:
        self.app = Celery("provenance", set_as_current=False)
        self.app.conf.update(cluster_beat_db_url=db_url, cluster_beat_redis_url="",
                             beat_schedule={"b": {"task": "t.b", "schedule": every(60)}})
        self.ran: List[str] = []

        @self.app.task(shared=False, base=LedgerTask, name="t.a")
        def a():
            self.ran.append("t.a")

        @self.app.task(shared=False, base=LedgerTask, name="t.b")
        def b():
            self.ran.append("t.b")

        self.a, self.b = a, b
        self.db_url = db_url
        self.beat = ClaimStore(db_url, node_id="beat-1:42")
        self.beat.open()

    def deliver(self, task, o: Occurrence) -> str:
        return task.apply(task_id=o.task_id, headers=headers_for(o)).state

    def row(self, o: Occurrence):
        rows = [r for r in self.beat.claims(o.schedule) if r.scheduled_at == o.at]
        return rows[0] if rows else None

    def now(self):
        return self.beat.db_now().replace(microsecond=0)

    def defined_at(self, name: str, ago: timedelta = timedelta(minutes=5)):
        """Move stored schedule *name*'s last change *ago* into the past (as if defined then) and
        return that time: its occurrences since are its current definition's."""
        t = self.now() - ago
        engine = sa.create_engine(self.db_url)
        try:
            with engine.begin() as conn:
                conn.execute(sa.update(stored_schedules_table).where(stored_schedules_table.c.name == name)
                             .values(changed_at=t))
        finally:
            engine.dispose()
        return t


@pytest.fixture
def rig(db_url):
    r = Rig(db_url)
    yield r
    r.beat.close()


def _refusals(caplog) -> List[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and "refused" in r.getMessage()]


def test_a_forged_future_instant_writes_no_row_and_beat_still_claims_the_occurrence(rig, caplog):
    o = Occurrence("b", rig.now() + timedelta(minutes=1))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert rig.deliver(rig.a, o) == "IGNORED"  # another task, and a future instant
        assert rig.deliver(rig.b, o) == "IGNORED"  # even the schedule's own task: not before its instant
    assert rig.ran == [] and rig.row(o) is None
    [first, second] = _refusals(caplog)
    assert f"delivery for 'b' at {o.at.isoformat()} refused: its instant is ahead" in first
    assert "ahead of the claim database's clock" in second
    assert rig.beat.claim([o]) == [o], "beat claims the occurrence: it is not lost to a forged row"


def test_a_future_instant_beat_has_claimed_runs_as_a_worker_with_a_fast_clock_runs_it(rig, caplog):
    """Beat inserts its claim row before it publishes. A worker whose clock runs ahead of the
    database's runs an ``eta`` message (jitter, a countdown) early by the database's time: with the
    row there it runs, exactly once, like any delivery (it used to be refused, acknowledged: lost)."""
    o = Occurrence("b", rig.now() + FUTURE_MARGIN + timedelta(seconds=30))
    assert rig.beat.claim([o]) == [o] and rig.beat.mark_sent([o]) == 1
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert rig.deliver(rig.b, o) == "SUCCESS"
        assert rig.deliver(rig.b, o) == "IGNORED"  # a second delivery is a duplicate, as ever
        assert rig.deliver(rig.a, Occurrence("b", o.at + timedelta(seconds=1))) == "IGNORED"  # no row: refused
    assert rig.ran == ["t.b"] and rig.row(o).run_state == "succeeded"
    [line] = _refusals(caplog)
    assert "ahead of the claim database's clock" in line and "it has no claim row" in line


def test_a_forged_delivery_of_another_task_writes_no_row_and_the_real_one_runs(rig, caplog):
    o = Occurrence("b", rig.now() - timedelta(seconds=1))
    assert rig.beat.claim([o]) == [o] and rig.beat.mark_sent([o]) == 1
    reported: List[tuple] = []

    def on_run(sender=None, outcome=None, schedule=None, **_):
        reported.append((outcome, schedule))

    signals.run_handled.connect(on_run, weak=False)
    try:
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            assert rig.deliver(rig.a, o) == "IGNORED"
    finally:
        signals.run_handled.disconnect(on_run)
    assert reported == [(RunOutcome.REFUSED, "b")], "a refused delivery is reported, so metrics count it"
    [line] = _refusals(caplog)
    assert "delivery for 'b' at" in line and "schedule 'b' runs task 't.b', not 't.a'" in line
    r = rig.row(o)
    assert (r.run_state, r.duplicates, r.worker) == (None, None, None), "the claim row is untouched"
    assert rig.deliver(rig.b, o) == "SUCCESS" and rig.ran == ["t.b"]
    assert rig.row(o).run_state == "succeeded"


def test_a_delivery_for_a_schedule_nobody_knows_runs_with_one_warning(rig, caplog):
    """No entry of the worker's config and no stored row names it: a config entry beat has and this
    worker lacks (a rolling deploy) must not lose its runs, and a name no beat schedules cancels
    nothing. It runs once, its task unchecked, with one WARNING per schedule and process."""
    provenance._unchecked_warned.clear()  # once per process: earlier parameters warned already
    o = Occurrence("nobody", rig.now() - timedelta(seconds=1))
    later = Occurrence("nobody", rig.now() - timedelta(seconds=2))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert rig.deliver(rig.a, o) == "SUCCESS"
        assert rig.deliver(rig.a, later) == "SUCCESS"
        assert rig.deliver(rig.a, o) == "IGNORED"  # still exactly once
    assert rig.ran == ["t.a", "t.a"] and len(rig.beat.claims("nobody")) == 2
    unchecked = [r.getMessage() for r in caplog.records if "cannot be checked" in r.getMessage()]
    assert len(unchecked) == 1 and "schedule 'nobody' is in neither this worker's beat_schedule" in unchecked[0]
    assert _refusals(caplog) == []


def test_a_stored_schedule_runs_only_its_own_task_and_its_messages_in_flight_run_after_its_removal(rig, caplog):
    with StoredSchedules(rig.app) as api:
        api.add("report:1", "t.b", every(60), enabled=False)
        o = Occurrence("report:1", rig.defined_at("report:1") + CHANGE_MARGIN)  # well after its definition
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            assert rig.deliver(rig.a, o) == "IGNORED"
        assert rig.beat.claims("report:1") == []
        assert "schedule 'report:1' runs task 't.b', not 't.a'" in _refusals(caplog)[0]
        api.remove("report:1")  # a message sent before the removal still runs
    assert rig.deliver(rig.b, o) == "SUCCESS" and rig.ran == ["t.b"]


def test_an_occurrence_sent_before_its_schedule_s_task_changed_still_runs_with_one_warning(rig, caplog):
    """update(task=...) while an occurrence of the old task is in flight (a backlog, an eta or
    retry countdown, an acks_late redelivery): the row changed after its instant, so the row's
    task is not the one it was sent with. It runs, unchecked, with one WARNING (it used to be
    refused and acknowledged: lost). A delivery for an instant since the change is checked."""
    provenance._unchecked_warned.clear()
    with StoredSchedules(rig.app) as api:
        api.add("report:2", "t.a", every(60))
        o = Occurrence("report:2", rig.defined_at("report:2") + CHANGE_MARGIN)
        assert rig.beat.claim([o]) == [o] and rig.beat.mark_sent([o]) == 1
        api.update("report:2", task="t.b")
    later = Occurrence("report:2", rig.defined_at("report:2", timedelta(minutes=1)) + CHANGE_MARGIN)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert rig.deliver(rig.a, o) == "SUCCESS"
        assert rig.deliver(rig.a, later) == "IGNORED"
    assert rig.ran == ["t.a"] and rig.row(o).run_state == "succeeded"
    warned = [r.getMessage() for r in caplog.records if "cannot be checked" in r.getMessage()]
    assert len(warned) == 1 and "stored schedule 'report:2' changed after this occurrence's instant" in warned[0]
    [line] = _refusals(caplog)
    assert "schedule 'report:2' runs task 't.b', not 't.a'" in line


def test_beat_s_own_claim_ahead_is_within_the_margin(rig):
    """Beat claims up to CLAIM_AHEAD early and publishes at the instant by its estimate of the
    database's clock: an instant a second ahead (an estimate off by a second) still runs."""
    assert FUTURE_MARGIN >= CLAIM_AHEAD + timedelta(seconds=1)
    o = Occurrence("b", rig.beat.db_now() + timedelta(seconds=1))
    assert rig.deliver(rig.b, o) == "SUCCESS" and rig.ran == ["t.b"]


def test_the_store_refuses_in_the_statement_itself_and_writes_nothing(rig):
    """The checks live in start_run's transaction: a caller that names the delivered task gets
    REFUSED with the reason, a caller that names none (no task to compare) only the future check,
    which a claim row for the instant passes."""
    now = rig.beat.db_now()
    past, future = now - timedelta(minutes=1), now + FUTURE_MARGIN + timedelta(seconds=5)
    got = rig.beat.start_run("b", past, task_id="x", worker="w", pid=1, task="t.a", schedule_task="t.b")
    assert (got.outcome, got.refusal, got.schedule_task, got.runs) == (StartOutcome.REFUSED, Refusal.OTHER_TASK,
                                                                       "t.b", False)
    got = rig.beat.start_run("stored-nowhere", past, task_id="y", worker="w", pid=1, task="t.a")
    assert (got.outcome, got.unchecked, got.runs) == (StartOutcome.STARTED, Unchecked.UNKNOWN, True)
    got = rig.beat.start_run("b", future, task_id="x", worker="w", pid=1)
    assert (got.outcome, got.refusal) == (StartOutcome.REFUSED, Refusal.FUTURE)
    assert rig.beat.claims("b") == []
    assert rig.beat.claim([Occurrence("b", future)])
    got = rig.beat.start_run("b", future, task_id="x", worker="w", pid=1, task="t.b", schedule_task="t.b")
    assert (got.outcome, got.unchecked) == (StartOutcome.STARTED, None)
