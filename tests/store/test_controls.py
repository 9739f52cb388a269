"""Operators' controls on each real database: pause and resume persist, "run now" is keyed on the
request (a second press while one is pending joins it), and every control bumps the change
counter the leader reads."""
from __future__ import annotations

import threading

import pytest


def test_pause_and_resume_are_persisted_and_each_bumps_the_counter(make_store):
    store = make_store()
    v0 = store.stored_version()
    v1, changed = store.set_paused("nightly", True, by="alice")
    assert changed and v1 == v0 + 1
    [row] = store.control_changes(v0)
    assert (row.name, row.paused, row.paused_by, row.version) == ("nightly", True, "alice", v1)
    assert row.paused_at is not None
    assert store.set_paused("nightly", True)[1] is False  # already paused: no change
    v3, changed = store.set_paused("nightly", False)
    assert changed and store.control_changes(v3) == []
    [row] = store.controls(["nightly"])
    assert not row.paused and row.paused_at is None
    # Resumed once: a new leader must know when (it starts the schedule from there).
    [active] = make_store("other-node").controls(active_only=True)
    assert active.name == "nightly" and not active.paused and active.resumed_at is not None


def test_run_now_pressed_twice_while_pending_is_one_request(make_store):
    store = make_store()
    _, first, at, joined = store.request_run("report", by="alice")
    assert not joined
    _, second, at2, joined2 = make_store("node-b").request_run("report", by="bob")
    assert joined2 and (second, at2) == (first, at)
    [row] = store.controls(active_only=True)
    assert (row.run_request, row.run_requested_at, row.run_requested_by) == (first, at, "alice")
    assert store.finish_run_request("report", "some-other-request") is False
    assert store.finish_run_request("report", first) is True
    _, third, at3, joined3 = store.request_run("report")
    assert not joined3 and third != first and at3 >= at


def test_concurrent_presses_give_one_request(make_store):
    """Eight nodes press run-now for one schedule at once: they all get the same request id."""
    stores = [make_store(f"node-{i}") for i in range(8)]
    results, errors = [], []

    def press(s):
        try:
            results.append(s.request_run("report")[1])
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=press, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and len(results) == 8 and len(set(results)) == 1


def test_a_bad_name_is_refused(make_store):
    store = make_store()
    with pytest.raises(ValueError):
        store.set_paused("", True)
    with pytest.raises(ValueError):
        store.request_run("x" * 300)


def test_the_leaders_pause_after_failures_yields_to_a_resume_and_to_an_operators_note(make_store):
    """``pause_after_failures`` pauses only if the schedule was not resumed since the leader read
    its runs, and never replaces the note of an operator's pause."""
    store = make_store()
    store.set_paused("nightly", True, by="alice", note="mine")
    store.set_paused("nightly", False)
    [read] = store.controls(["nightly"])
    store.set_paused("nightly", True, by="bob")
    store.set_paused("nightly", False)  # resumed again after the leader read
    _, changed = store.set_paused("nightly", True, by="cluster-beat", note="3 failed", resumed_at=read.resumed_at)
    assert not changed and not store.controls(["nightly"])[0].paused
    [now] = store.controls(["nightly"])
    _, changed = store.set_paused("nightly", True, by="cluster-beat", note="3 failed", resumed_at=now.resumed_at)
    assert changed and store.controls(["nightly"])[0].paused_note == "3 failed"
    store.set_paused("other", True, by="alice", note="theirs")
    _, changed = store.set_paused("other", True, by="cluster-beat", note="2 failed", replace_note=False)
    assert not changed and (store.controls(["other"])[0].paused_by, store.controls(["other"])[0].paused_note) == (
        "alice", "theirs")
