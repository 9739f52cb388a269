"""The ledger task base class in this process: Celery's own tracer runs the task (``apply()``),
the ledger is a real claim store (SQLite file here; the statements themselves are proven on
all three servers in tests/store/test_ledger.py, and with real workers in
test_worker_processes.py)."""
from __future__ import annotations

import socket
import uuid
from datetime import datetime, timedelta, timezone
from typing import List

import pytest
from celery import Celery
from celery.exceptions import Ignore

import celery_cluster_beat
from celery_cluster_beat import signals
from celery_cluster_beat.schedules.occurrence import Occurrence
from celery_cluster_beat.signals import RunOutcome
from celery_cluster_beat.store import ClaimStore
from celery_cluster_beat.worker import LedgerTask, LedgerUnavailable, OccurrenceContext, current_occurrence
from celery_cluster_beat.worker.protocol import HEADER_SCHEDULE, HEADER_SCHEDULED_AT

UTC = timezone.utc
AT = datetime(2021, 3, 4, 5, 6, tzinfo=UTC)  # in the past: the ledger refuses an instant ahead of the database's clock


def headers_for(o: Occurrence, **extra) -> dict:
    h = {"cluster_beat_schedule": o.schedule, "cluster_beat_scheduled_at": o.at.isoformat().replace("+00:00", "Z"),
         "cluster_beat_node": "beat-1:42", "cluster_beat_catchup": False, "cluster_beat_attempt": 1,
         "cluster_beat_max_run_time": 30.0}
    h.update(extra)
    return h


@pytest.fixture
def ledger(tmp_path):
    url = f"sqlite:///{tmp_path}/ledger.sqlite3"
    app = Celery("ledger-inproc", set_as_current=False)
    app.conf.cluster_beat_db_url = url
    # The ledger runs only occurrences of schedules it knows to run this task (worker/provenance.py).
    app.conf.beat_schedule = {name: {"task": "t.body", "schedule": 60} for name in ("nightly", "hourly", "failing")}
    runs: List[tuple] = []

    @app.task(shared=False, base=LedgerTask, bind=True, name="t.body")
    def body(self, value=None, fail=False):
        runs.append((value, self.occurrence, current_occurrence()))
        if fail:
            raise ValueError("bad value\nsecond line")
        return value

    store = ClaimStore(url, node_id="reader")
    store.open()
    yield app, body, runs, store
    store.close()


@pytest.fixture
def reported():
    seen: List[dict] = []

    def receiver(sender=None, **kw):
        seen.append(kw)

    signals.run_handled.connect(receiver, weak=False)
    yield seen
    signals.run_handled.disconnect(receiver)


def row(store: ClaimStore, o: Occurrence):
    [r] = [r for r in store.claims(o.schedule) if r.scheduled_at == o.at]
    return r


def test_a_second_delivery_of_an_occurrence_is_not_run_and_is_reported(ledger, reported):
    app, body, runs, store = ledger
    o = Occurrence("nightly", AT)
    store.claim([o])
    store.mark_sent([o])
    first = body.apply(("a",), task_id=o.task_id, headers=headers_for(o))
    second = body.apply(("b",), task_id=o.task_id, headers=headers_for(o))
    assert first.state == "SUCCESS" and first.result == "a"
    assert second.state == "IGNORED"
    assert [v for v, _, _ in runs] == ["a"]
    r = row(store, o)
    assert (r.run_state, r.duplicates, r.worker_pid is not None, r.run_error) == ("succeeded", 1, True, None)
    assert r.runtime is not None and r.runtime >= 0
    assert [e["outcome"] for e in reported] == [RunOutcome.STARTED, RunOutcome.SUCCEEDED,
                                                RunOutcome.DUPLICATE_SKIPPED]
    assert reported[-1]["schedule"] == "nightly" and reported[-1]["scheduled_at"] == AT
    assert reported[1]["runtime"] is not None and reported[-1]["task_id"] == o.task_id


def test_the_body_reads_its_occurrence(ledger):
    app, body, runs, store = ledger
    o = Occurrence("hourly", AT)
    body.apply((1,), task_id=o.task_id, headers=headers_for(o, cluster_beat_catchup=True, cluster_beat_attempt=2))
    [(_, mine, current)] = runs
    assert mine == current
    assert mine == OccurrenceContext(schedule="hourly", scheduled_at=AT, node="beat-1:42", catchup=True, attempt=1,
                                     send_attempt=2, task_id=o.task_id, max_run_time=30.0)
    assert mine.scheduled_at.tzinfo is UTC


def test_a_failing_body_records_the_failure_with_a_short_error(ledger, reported):
    app, body, runs, store = ledger
    o = Occurrence("failing", AT)
    store.claim([o])
    result = body.apply((1,), {"fail": True}, task_id=o.task_id, headers=headers_for(o))
    assert result.state == "FAILURE" and isinstance(result.result, ValueError)
    r = row(store, o)
    assert (r.run_state, r.run_error) == ("failed", "ValueError: bad value")
    assert reported[-1]["outcome"] == RunOutcome.FAILED and reported[-1]["error"] == "ValueError: bad value"


def test_a_task_not_sent_by_beat_runs_exactly_as_without_the_base_class(ledger, reported):
    app, body, runs, store = ledger
    assert body(7) == 7  # called directly
    assert body.apply((8,)).result == 8  # a message without the headers
    assert body.apply((9,), task_id="same").result == 9
    assert body.apply((10,), task_id="same").result == 10  # no ledger: ids mean nothing here
    assert [v for v, _, _ in runs] == [7, 8, 9, 10]
    assert all(occ is None and cur is None for _, occ, cur in runs)
    assert store.claims() == [] and reported == []


def test_headers_that_do_not_parse_run_without_the_ledger_and_say_so(ledger, caplog):
    app, body, runs, store = ledger
    with caplog.at_level("WARNING", logger="celery_cluster_beat.worker"):
        body.apply((1,), headers={HEADER_SCHEDULE: "x", HEADER_SCHEDULED_AT: "yesterday"})
    assert [v for v, _, _ in runs] == [1]
    assert "not an ISO 8601 instant" in caplog.text and store.claims() == []


def test_an_unreachable_ledger_does_not_run_the_body_and_says_why(tmp_path, reported):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens here
    app = Celery("ledger-down", set_as_current=False)
    app.conf.cluster_beat_db_url = f"postgresql+psycopg://u:secret@127.0.0.1:{port}/x"
    ran = []

    class Quick(LedgerTask):
        ledger_wait = 1.0

    @app.task(shared=False, base=Quick, name="t.early")
    def early():
        ran.append(1)

    @app.task(shared=False, base=Quick, name="t.late", acks_late=True)
    def late():
        ran.append(2)

    o = Occurrence("down", AT)
    result = early.apply(task_id=o.task_id, headers=headers_for(o))
    assert result.state == "FAILURE" and isinstance(result.result, LedgerUnavailable)
    assert "secret" not in str(result.result)
    rejected = late.apply(task_id=o.task_id, headers=headers_for(o))
    assert rejected.state == "REJECTED"  # acks_late: requeued, comes back when the database does
    assert ran == []
    assert [e["outcome"] for e in reported] == [RunOutcome.LEDGER_UNAVAILABLE] * 2


def test_the_base_class_app_wide_through_task_cls_and_from_the_package_root(tmp_path):
    app = Celery("ledger-wide", set_as_current=False, task_cls="celery_cluster_beat:LedgerTask")
    app.conf.cluster_beat_db_url = f"sqlite:///{tmp_path}/wide.sqlite3"
    app.conf.beat_schedule = {"wide": {"task": "t.wide", "schedule": 60}}

    @app.task(shared=False, name="t.wide")
    def wide(x):
        return x

    assert celery_cluster_beat.LedgerTask is LedgerTask and isinstance(wide, LedgerTask)
    o = Occurrence("wide", AT)
    assert wide.apply((1,), task_id=o.task_id, headers=headers_for(o)).state == "SUCCESS"
    assert wide.apply((2,), task_id=o.task_id, headers=headers_for(o)).state == "IGNORED"
