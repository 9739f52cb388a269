"""The backfill's claim rule on each real database: which rows a backfill takes (none, and missed /
skipped / failed ones that never ran) and which it leaves (sent, claimed, run), atomically; the
request rows; and the version-5 store migrated to 6 (the new column, index and table)."""
from __future__ import annotations

import threading
from datetime import datetime, timedelta, timezone

import pytest
import sqlalchemy as sa

from celery_cluster_beat.schedules.occurrence import Occurrence
from celery_cluster_beat.store import ClaimStore
from celery_cluster_beat.store.backfill import NotSent, backfill_problem, fires_between
from celery_cluster_beat.store.schema import (SCHEMA_VERSION, BackfillState, RunState, backfills_table, claims_table,
                                              meta_table, metadata, stored_schedules_table)

UTC = timezone.utc
T0 = datetime(2026, 1, 1, 9, 0, tzinfo=UTC)


def _occ(i: int) -> Occurrence:
    return Occurrence("nightly", T0 + timedelta(minutes=i))


def test_a_backfill_takes_what_never_ran_and_leaves_the_rest(make_store):
    store = make_store("beat-1")
    other = make_store("beat-2")
    other.heartbeat(scheduling=True, register=True)
    # 0: no row; 1 missed; 2 skipped; 3 failed (publish); 4 failed publish but a worker ran it;
    # 5 sent; 6 claimed by a live node.
    store.record([_occ(1)], status="missed", reason="catchup")
    store.record([_occ(2)], status="skipped", reason="overlap")
    store.claim([_occ(3), _occ(4), _occ(5)])
    store.fail_claimed([(_occ(3), "broker down"), (_occ(4), "broker down")])
    started = store.start_run("nightly", _occ(4).at, task_id=_occ(4).task_id, worker="w", pid=1)
    store.finish_run("nightly", _occ(4).at, started.token, RunState.FAILED, 0.1, "ValueError: x")
    store.mark_sent([_occ(5)])
    other.claim([_occ(6)])

    result = store.claim_backfill([_occ(i) for i in range(7)])

    assert [o.at for o in result.won] == [_occ(i).at for i in range(4)]
    assert {o.at: r for o, r in result.left.items()} == {
        _occ(4).at: NotSent.ALREADY_RAN, _occ(5).at: NotSent.ALREADY_SENT, _occ(6).at: NotSent.BEING_SENT}
    rows = {r.scheduled_at: r for r in store.claims("nightly")}
    for i in range(4):
        assert (rows[_occ(i).at].status, rows[_occ(i).at].reason, rows[_occ(i).at].node) == \
            ("claimed", "backfill", "beat-1")
    assert (rows[_occ(6).at].node, rows[_occ(6).at].status) == ("beat-2", "claimed")
    # Claimed once: a second backfill of the same range finds them being sent, then sent.
    assert store.claim_backfill([_occ(i) for i in range(4)]).won == []
    store.mark_sent(result.won)
    again = store.claim_backfill([_occ(i) for i in range(7)])
    assert again.won == [] and set(again.left.values()) >= {NotSent.ALREADY_SENT}


def test_two_nodes_backfilling_at_once_claim_each_occurrence_once(make_store):
    stores = [make_store(f"beat-{i}") for i in range(2)]
    occurrences = [_occ(i) for i in range(40)]
    stores[0].record(occurrences[::2], status="missed", reason="catchup")
    won: list = []
    barrier = threading.Barrier(2)

    def go(store: ClaimStore) -> None:
        barrier.wait(timeout=10)
        won.extend(store.claim_backfill(occurrences).won)

    threads = [threading.Thread(target=go, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert sorted(o.at for o in won) == [o.at for o in occurrences]


def test_a_request_is_validated_recorded_and_finished_once(make_store):
    store = make_store("ops")
    now = store.db_now()
    with pytest.raises(ValueError, match="in the future"):
        store.request_backfill("nightly", now - timedelta(hours=1), now + timedelta(hours=1))
    with pytest.raises(ValueError, match="after --to"):
        store.request_backfill("nightly", now - timedelta(hours=1), now - timedelta(hours=2))
    with pytest.raises(ValueError, match="--limit"):
        store.request_backfill("nightly", now - timedelta(hours=1), now, limit=10001)
    assert store.pending_backfills() == []
    v0 = store.stored_version()
    version, request = store.request_backfill("nightly", now - timedelta(hours=1), now, limit=5, by="alice")
    assert version == v0 + 1
    (pending,) = store.pending_backfills()
    assert (pending.id, pending.state, pending.max_count, pending.requested_by) == (request.id, "pending", 5, "alice")
    assert store.finish_backfill(request.id, BackfillState.DONE, sent=3, not_sent={"already sent": 2})
    assert not store.finish_backfill(request.id, BackfillState.REFUSED, error="late")
    done = store.backfill_request(request.id)
    assert (done.state, done.sent, done.not_sent, done.node) == ("done", 3, {"already sent": 2}, "ops")
    assert store.pending_backfills() == []


def test_fires_between_is_inclusive_and_stops_one_past_the_limit():
    from celery_cluster_beat import every

    rule = every(60)
    start = T0
    assert fires_between(rule, start, start + timedelta(minutes=3), 10) == [
        start + timedelta(minutes=i) for i in range(4)]
    assert len(fires_between(rule, start, start + timedelta(days=365), 5)) == 6
    assert backfill_problem(start, start, start, 0) is not None
    assert backfill_problem(start, start, start, 1) is None


def test_a_version_5_store_is_migrated_to_6(db_url, raw):
    """Built as release 5 left it: no pause_after_failures column, no run-state index, no backfill
    table, stamped 5. Opening it as beat does adds all three and stamps 6."""
    with raw.begin() as conn:
        metadata.create_all(conn)
        backfills_table.drop(conn)
        index = next(i for i in claims_table.indexes if i.name == "ix_cluster_beat_claims_run_state_finished_at")
        index.drop(conn)
    with raw.begin() as conn:
        conn.exec_driver_sql(f"ALTER TABLE {stored_schedules_table.name} DROP COLUMN pause_after_failures")
        conn.exec_driver_sql(f"ALTER TABLE {claims_table.name} DROP COLUMN origin")
        conn.execute(meta_table.insert(), [{"key": "schema_version", "value": "5"},
                                           {"key": "cluster_id", "value": "c"}])
    store = ClaimStore(db_url, node_id="new-beat")
    store.open()
    try:
        with raw.connect() as conn:
            assert conn.execute(sa.select(meta_table.c.value).where(meta_table.c.key == "schema_version")).scalar() \
                == str(SCHEMA_VERSION) == "6"
            inspector = sa.inspect(conn)
            assert "pause_after_failures" in {c["name"] for c in inspector.get_columns(stored_schedules_table.name)}
            assert "origin" in {c["name"] for c in inspector.get_columns(claims_table.name)}
            assert "ix_cluster_beat_claims_run_state_finished_at" in {
                i["name"] for i in inspector.get_indexes(claims_table.name)}
            assert inspector.has_table(backfills_table.name)
        now = store.db_now()
        store.request_backfill("nightly", now - timedelta(hours=1), now)
        assert len(store.pending_backfills()) == 1
    finally:
        store.close()


def test_the_range_of_a_rule_that_ends_holds_only_its_instants():
    """A one-off or a bounded schedule has no instant after its last: the range stops there."""
    from celery_cluster_beat.schedules import at, bounded, every

    t0 = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)
    once = at(t0 + timedelta(minutes=5))
    assert fires_between(once, t0, t0 + timedelta(hours=1), 100) == [t0 + timedelta(minutes=5)]
    assert fires_between(once, t0 + timedelta(minutes=6), t0 + timedelta(hours=1), 100) == []
    capped = bounded(every(60), end_at=t0 + timedelta(minutes=3))
    assert fires_between(capped, t0, t0 + timedelta(hours=1), 100) == [t0 + timedelta(minutes=m) for m in range(4)]
    # one more than the limit still says "too many" for a rule that goes on
    assert len(fires_between(every(60), t0, t0 + timedelta(hours=1), 10)) == 11
