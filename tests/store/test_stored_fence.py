"""The hand-back of a stored schedule's next occurrence (``stored_set_next``) is fenced by the
leader's term and never moves ``next_at`` backwards, on each dialect's real server.

Why it matters: a leader paused between firing a schedule and handing it back to SQL can wake
after its successor moved the schedule on. Its late write of the older instant would put
``next_at`` behind the successor's window, which reads only forward, so the schedule would not
fire again until changed. A write from a term that is no longer current changes nothing and is
refused like a claim (``StaleTermError``); an instant older than the one recorded is not written.
"""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from celery_cluster_beat.store import StaleTermError

UTC = timezone.utc
T0 = datetime(2031, 3, 3, 12, 0, tzinfo=UTC)
T1, T2, T3 = (T0 + timedelta(minutes=m) for m in (10, 20, 30))


def _add(store, name: str, next_at: datetime) -> int:
    """A stored schedule *name* whose next occurrence is *next_at*; its version."""
    row = {"name": name, "task": "t.x", "schedule": "every 600s", "zone": None, "args": "[]", "kwargs": "{}",
           "options": "{}", "overlap": None, "max_run_time": None, "jitter": None, "catchup": None,
           "catchup_window": None, "description": None, "owner": None, "enabled": True}
    return store.stored_change([name], lambda existing, now: ([row], []), lambda r, now: next_at)


def _next_at(store, name: str) -> datetime:
    return store.stored_get([name])[0].next_at


@pytest.mark.timeout(60)
def test_an_old_terms_hand_back_after_a_newer_terms_changes_nothing(make_store):
    """Leader term 5 held the schedule; leader term 6 fired it and handed it back with T2; the
    old leader, waking from a pause, hands back its older T1, and even a later T3: both are
    refused with StaleTermError and next_at stays T2; the newer term stays recorded.

    Fails if the hand-back carries no fence (T1 written: the schedule would never be read again)."""
    old, new = make_store("node-old"), make_store("node-new")
    version = _add(old, "s", T0)
    assert old.stored_set_next([("s", version, T0)], term=5) == 1  # the old leader's earlier hand-back
    assert new.stored_set_next([("s", version, T2)], term=6) == 1

    for late in (T1, T3):
        with pytest.raises(StaleTermError) as info:
            old.stored_set_next([("s", version, late)], term=5)
        assert (info.value.seen_term, info.value.term) == (6, 5)
        assert _next_at(new, "s") == T2, late
    assert new.current_term() == 6


@pytest.mark.timeout(60)
def test_next_at_never_moves_backwards_whatever_the_term(make_store):
    """The current term (or a node without a lease, term None) writing an instant older than the
    recorded one changes nothing (0 rows); a later instant is written; a changed definition
    (another version) is left alone as before.

    Fails if the hand-back can move next_at behind an instant already recorded."""
    leader, lone = make_store("node-lead"), make_store("node-lone")
    version = _add(leader, "s", T0)
    assert leader.stored_set_next([("s", version, T2)], term=7) == 1
    assert leader.stored_set_next([("s", version, T1)], term=7) == 0
    assert lone.stored_set_next([("s", version, T1)]) == 0
    assert _next_at(leader, "s") == T2
    assert leader.stored_set_next([("s", version, T3)], term=7) == 1
    assert _next_at(leader, "s") == T3
    assert leader.stored_set_next([("s", version - 1, T3 + timedelta(hours=1))], term=7) == 0
    assert _next_at(leader, "s") == T3


@pytest.mark.timeout(60)
def test_a_refused_hand_back_writes_none_of_its_rows(make_store):
    """A batch from a stale term is refused whole: not one of its schedules moves."""
    old, new = make_store("node-old"), make_store("node-new")
    versions = {name: _add(old, name, T0) for name in ("a", "b", "c")}
    new.stored_set_next([("a", versions["a"], T1)], term=9)
    with pytest.raises(StaleTermError):
        old.stored_set_next([(name, v, T3) for name, v in versions.items()], term=8)
    assert {name: _next_at(new, name) for name in versions} == {"a": T1, "b": T0, "c": T0}
