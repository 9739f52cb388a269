"""The dashboard's reads of the claim store, on a real database of each dialect (SQLite, PostgreSQL,
MariaDB), with rows written by the store's own calls: claims, sends, and runs through the worker's
ledger (``start_run`` / ``finish_run``).

* ``failures_since``: occurrences of the window whose run failed or that were not sent (failed,
  missed) are counted, older ones and successes are not; the count stops at its cap (cap + 1 read);
* ``stored_page(state=...)``: the state filter keeps the schedules in that state (a failed run is
  failing; a running run is running) while the totals and attention counts stay those of the name
  filter, and ``matching`` says how many are in the state; ``order=`` sorts by name, next fire or
  last occurrence, the same in every database;
* ``schedule_marks`` says which schedules' last occurrence is running.
"""
from __future__ import annotations

from datetime import timedelta

import pytest

from celery_cluster_beat.schedules.occurrence import Occurrence
from celery_cluster_beat.store.pagequeries import Attention, PageOrder, StateFilter
from celery_cluster_beat.store.schema import RunState

NAMES = ["s-fail", "s-run", "s-ok", "s-paused", "s-missed", "s-old-fail", "s-none"]


def _row(name: str) -> dict:
    return dict(name=name, task="t.job", schedule="*/5 * * * *", zone="UTC", args="[]", kwargs="{}", options="{}",
                overlap=None, max_run_time=None, jitter=None, catchup=None, catchup_window=None,
                description=None, owner=None, enabled=True)


def _run(store, name, at, state=None, runtime=None, error=None):
    """A sent occurrence of *name* at *at*, its run started by a worker and (with *state*) ended."""
    occ = Occurrence(name, at)
    store.claim([occ], term=1)
    store.mark_sent([occ])
    started = store.start_run(name, at, task_id="", worker="w1@host", pid=42)
    assert started.token
    if state is not None:
        assert store.finish_run(name, at, started.token, state, runtime=runtime, error=error)


@pytest.fixture
def filled(make_store):
    store = make_store("dash")
    now = store.db_now().replace(microsecond=0)
    due = {n: now + timedelta(minutes=10 + i) for i, n in enumerate(NAMES)}
    store.stored_change(NAMES, lambda live, at: ([_row(n) for n in NAMES], []), lambda row, at: due[row["name"]])
    _run(store, "s-fail", now - timedelta(minutes=5), RunState.FAILED, 1.5, "ValueError: boom")
    _run(store, "s-run", now - timedelta(minutes=4))
    _run(store, "s-ok", now - timedelta(minutes=3), RunState.SUCCEEDED, 0.25)
    _run(store, "s-paused", now - timedelta(minutes=6), RunState.SUCCEEDED, 0.5)
    store.record([Occurrence("s-missed", now - timedelta(minutes=2))], status="missed", reason="no leader", term=1)
    _run(store, "s-old-fail", now - timedelta(hours=2), RunState.FAILED, 2.0, "old")
    store.set_paused("s-paused", True, by="tester")
    return store, now


@pytest.mark.timeout(120)
def test_failures_of_the_last_hour_are_counted_up_to_a_cap(filled):
    store, _ = filled
    assert store.failures_since(3600) == 2  # s-fail's run and s-missed; not s-old-fail (2 h ago), not the rest
    assert store.failures_since(3 * 3600) == 3
    assert store.failures_since(3600, cap=1) == 2  # "more than 1": the cap plus one, no more read
    assert store.failures_since(30) == 0


@pytest.mark.timeout(120)
def test_the_state_filter_keeps_the_schedules_in_that_state_and_the_counts_stay_the_name_filters(filled):
    store, _ = filled
    everything = store.stored_page(limit=100, grace=600, overdue=300)
    assert everything.total == len(NAMES) and everything.matching == len(NAMES)
    assert everything.counts[Attention.FAILING] == 3  # a failed run is failing, as a missed occurrence is
    assert everything.counts[Attention.PAUSED] == 1 and everything.running == 1
    expected = {StateFilter.FAILING: {"s-fail", "s-missed", "s-old-fail"}, StateFilter.PAUSED: {"s-paused"},
                StateFilter.RUNNING: {"s-run"}, StateFilter.OVERDUE: set(),
                StateFilter.OK: {"s-run", "s-ok", "s-none"}}
    for state, names in expected.items():
        page = store.stored_page(limit=100, grace=600, overdue=300, state=state)
        assert {e.name for e in page.entries} == names, state
        assert page.matching == len(names), state
        assert page.total == len(NAMES) and page.counts == everything.counts and page.running == 1, state
    one = store.stored_page(limit=1, grace=600, overdue=300, state=StateFilter.FAILING, contains="FAIL")
    assert len(one.entries) == 1 and one.matching == 2 and one.total == 2  # s-fail, s-old-fail


@pytest.mark.timeout(120)
def test_the_orders_are_the_same_in_every_database(filled):
    store, _ = filled
    by_name = store.stored_page(limit=100, grace=600, overdue=300, order=PageOrder.NAME)
    assert [e.name for e in by_name.entries] == sorted(NAMES)
    by_next = store.stored_page(limit=100, grace=600, overdue=300, order=PageOrder.NEXT)
    assert [e.name for e in by_next.entries] == NAMES  # due 10, 11, 12 ... minutes from now, in that order
    by_last = store.stored_page(limit=3, grace=600, overdue=300, order=PageOrder.LAST)
    assert [e.name for e in by_last.entries] == ["s-missed", "s-ok", "s-run"]  # newest first
    last = store.stored_page(limit=100, grace=600, overdue=300, order=PageOrder.LAST).entries[-1]
    assert last.name == "s-none" and last.last is None  # never ran: last
    ranked = store.stored_page(limit=100, grace=600, overdue=300)
    assert [e.attention for e in ranked.entries][:4] == [Attention.FAILING] * 3 + [Attention.PAUSED]


@pytest.mark.timeout(120)
def test_schedule_marks_say_which_last_occurrence_is_running(filled):
    store, _ = filled
    marks = store.schedule_marks(["s-run", "s-ok", "s-fail", "nobody"], grace=600)
    assert (marks["s-run"].running, marks["s-ok"].running, marks["s-fail"].running) == (True, False, False)
    assert marks["s-fail"].failing and not marks["s-ok"].failing and "nobody" not in marks
