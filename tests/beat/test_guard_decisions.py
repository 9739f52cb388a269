"""The overlap guard's decision table, with task states injected: no result backend, no
Redis. What each policy does with the previous run's state and age; the same table runs
against a real Redis result backend in test_overlap.py."""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Dict, Optional, Sequence

import pytest
from celery import Celery

from celery_cluster_beat import every, signals
from celery_cluster_beat.beat.guard import OverlapGuard
from celery_cluster_beat.config import Entry, OverlapPolicy, load_settings
from celery_cluster_beat.schedules import Occurrence

UTC = timezone.utc
NOW = datetime(2026, 5, 4, 10, 0, tzinfo=UTC)


@dataclass
class LastRun:  # what ClaimStore.schedule_states() gives the guard
    name: str
    last_task_id: str
    last_sent_at: datetime


class States:
    """An injected state reader: {task id: state}; counts the reads."""

    def __init__(self, states: Optional[Dict[str, Optional[str]]] = None) -> None:
        self.states = dict(states or {})
        self.reads = []

    def __call__(self, ids: Sequence[str]) -> Dict[str, Optional[str]]:
        self.reads.append(list(ids))
        return {t: self.states.get(t, "PENDING") for t in ids}


def make_guard(states: States, **settings) -> OverlapGuard:
    app = Celery("guard-decisions")
    app.conf.update({f"cluster_beat_{k}": v for k, v in settings.items()})
    return OverlapGuard(app, load_settings(app.conf, has_result_backend=lambda: True), states=states)


def entry(name: str, overlap: Optional[str] = None) -> Entry:
    return Entry(name=name, task="t.work", schedule=every(60), overlap=overlap and OverlapPolicy(overlap))


TABLE = [
    # state of the previous run, its age in s -> sent?
    ("PENDING", 5, False),
    ("RECEIVED", 5, False),
    ("STARTED", 5, False),
    ("RETRY", 5, False),
    ("PROGRESS", 5, False),  # a custom state: in flight
    ("SUCCESS", 5, True),
    ("FAILURE", 5, True),
    ("REVOKED", 5, True),
    ("IGNORED", 5, True),
    ("PENDING", 700, True),  # unknown and old: frees quietly
    ("STARTED", 700, True),  # the watchdog
    (None, 5, True),  # unreadable: fail open
]


@pytest.mark.parametrize("state, age, sent", TABLE)
def test_skip_sends_only_when_the_previous_run_is_over_or_overdue(state, age, sent):
    tid = str(uuid.uuid4())
    states = States({tid: state})
    guard = make_guard(states, overlap="skip", max_run_time=600)
    e = entry("job")
    guard.load([LastRun(e.name, tid, NOW - timedelta(seconds=age))])
    d = guard.filter([(e, Occurrence(e.name, NOW))], NOW)
    assert (len(d.send), len(d.skipped)) == ((1, 0) if sent else (0, 1))
    assert states.reads == [[tid]], "one read for the batch"


def test_the_watchdog_fires_once_per_hung_run():
    tid = str(uuid.uuid4())
    guard = make_guard(States({tid: "STARTED"}), overlap="skip", max_run_time=600)
    e = entry("hung")
    guard.load([LastRun(e.name, tid, NOW - timedelta(seconds=700))])
    fired = []
    receiver = lambda sender, schedule=None, **kw: fired.append(schedule)  # noqa: E731
    signals.watchdog_fired.connect(receiver, weak=False)
    try:
        for k in range(3):
            guard.filter([(e, Occurrence(e.name, NOW + timedelta(minutes=k)))], NOW)
    finally:
        signals.watchdog_fired.disconnect(receiver)
    assert fired == ["hung"]


def test_a_schedule_never_sent_is_free_and_nothing_is_read():
    states = States()
    guard = make_guard(states, overlap="skip")
    e = entry("new")
    assert len(guard.filter([(e, Occurrence(e.name, NOW))], NOW).send) == 1
    assert not any(states.reads), "no previous run: no state to read"


def test_allow_never_reads_states():
    states = States()
    guard = make_guard(states, overlap="allow")
    e = entry("free-for-all")
    guard.load([LastRun(e.name, "x", NOW)])
    assert len(guard.filter([(e, Occurrence(e.name, NOW))], NOW).send) == 1
    assert states.reads == []


@pytest.mark.parametrize("policy, send, buffered, skipped", [
    ("skip", [], [], [0, 1, 2]),
    ("buffer_one", [], [0], [1, 2]),
    ("replace", [0], [], [1, 2]),
    ("allow", [0, 1, 2], [], []),
])
def test_a_burst_of_one_schedule_under_a_running_previous_run(policy, send, buffered, skipped):
    """Three occurrences due at once (catch-up 'all') while the previous run is STARTED:
    only ``replace`` (revoking it) and ``allow`` send now, and at most one is buffered."""
    running = str(uuid.uuid4())
    guard = make_guard(States({running: "STARTED"}), max_run_time=600)
    e = entry(policy, overlap=policy)
    guard.load([LastRun(e.name, running, NOW - timedelta(seconds=5))])
    occs = [Occurrence(e.name, NOW - timedelta(minutes=k)) for k in (3, 2, 1)]
    d = guard.filter([(e, o) for o in occs], NOW)
    assert [o for _, o in d.send] == [occs[i] for i in send]
    assert [o for _, o in d.buffered] == [occs[i] for i in buffered]
    assert [o for _, o in d.skipped] == [occs[i] for i in skipped]
    assert d.replaces == ({occs[0]: running} if policy == "replace" else {})


def test_a_buffered_occurrence_goes_once_its_predecessor_finishes():
    running = str(uuid.uuid4())
    states = States({running: "STARTED"})
    guard = make_guard(states, overlap="buffer_one", max_run_time=600)
    e = entry("buffered")
    guard.load([LastRun(e.name, running, NOW - timedelta(seconds=5))])
    occ = Occurrence(e.name, NOW)
    assert guard.filter([(e, occ)], NOW).buffered == [(e, occ)]
    assert guard.ready(NOW) == []
    states.states[running] = "SUCCESS"
    assert guard.ready(NOW) == [(e, occ)]
    assert not guard.has_buffered() and guard.next_check_in() is None


def test_a_run_is_aged_on_the_schedulers_clock_not_the_hosts():
    """The guard stamps a send with the scheduler's (database-corrected) clock, the one its
    decisions and the store's times use: on a host whose own clock is off, a run's age would
    otherwise be off by the skew (a guard blocking 30 s too long, or never)."""
    past = datetime(2020, 1, 1, tzinfo=UTC)  # the cluster's clock, far from this host's
    tid = str(uuid.uuid4())
    app = Celery("guard-clock")
    app.conf.update(cluster_beat_overlap="skip", cluster_beat_max_run_time=600)
    guard = OverlapGuard(app, load_settings(app.conf, has_result_backend=lambda: True),
                         states=States({tid: "STARTED"}), now=lambda: past)
    e = entry("clocked")
    guard.sent(e, Occurrence(e.name, past, task_id=tid))
    later = past + timedelta(seconds=700)
    d = guard.filter([(e, Occurrence(e.name, later))], later)
    assert len(d.send) == 1, "700 s after the send on the cluster's clock: past max_run_time, the watchdog frees it"
