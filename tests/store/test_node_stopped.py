"""Schema version 5 on each real database: a node's clean stop (``stopped_at``) and an operator's
pause note, and the migration that adds both to a version-4 store.

A clean stop is only what operators read ("stopped", not "gone"): it must not change which
claims another node may take over, so that is checked here against the same rows.
"""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
import sqlalchemy as sa

from celery_cluster_beat.schedules.occurrence import Occurrence
from celery_cluster_beat.store import ClaimStore
from celery_cluster_beat.store.controls import MAX_NOTE_LENGTH, ControlRow
from celery_cluster_beat.store.schema import SCHEMA_VERSION, controls_table, meta_table, metadata, nodes_table

UTC = timezone.utc


def test_a_clean_stop_is_recorded_by_the_database_clock_and_cleared_by_the_next_start(make_store):
    store = make_store("beat-1")
    assert store.node_stopped() is None  # never heartbeated: no row to mark, none made
    assert store.nodes() == []
    started = store.heartbeat(scheduling=True, clock_offset=0.01, register=True)
    (node,) = store.nodes()
    assert (node.node, node.scheduling, node.stopped_at) == ("beat-1", True, None)

    stopped = store.node_stopped()
    assert stopped is not None and stopped >= started
    (node,) = store.nodes()
    assert (node.scheduling, node.stopped_at, node.heartbeat_at) == (False, stopped, started)
    (seen,) = make_store("ops").overview(grace=5).nodes
    assert (seen.node, seen.scheduling, seen.stopped_at) == ("beat-1", False, stopped)

    store.heartbeat(scheduling=False)  # a late heartbeat of the same run: the stop stays recorded
    assert store.nodes()[0].stopped_at == stopped
    again = store.heartbeat(scheduling=False, register=True)  # started again
    (node,) = store.nodes()
    assert (node.stopped_at, node.started_at) == (None, again)


def test_a_clean_stop_changes_no_take_over(make_store):
    """A stopped node's unreleased claim is judged as before: by its heartbeat and the grace."""
    first, second = make_store("beat-1"), make_store("beat-2")
    first.heartbeat(scheduling=True, register=True)
    now = first.db_now()
    occ = Occurrence("tick", now - timedelta(seconds=5))
    assert first.claim([occ], term=1) == [occ]
    first.node_stopped()
    assert second.take_over_stale(3600.0, term=2) == []  # heartbeat and claim within the grace: not gone
    taken = second.take_over_stale(0.0, term=2)  # past a grace of 0: gone by the same rule as ever
    assert [(o.schedule, o.at) for o in taken] == [(occ.schedule, occ.at)]


def test_a_pause_note_is_kept_clipped_replaced_and_cleared_on_resume(make_store):
    store = make_store()
    _, changed = store.set_paused("nightly", True, by="alice@host", note="  deploying v2  ")
    assert changed
    (row,) = store.controls(["nightly"])
    assert (row.paused, row.paused_by, row.paused_note) == (True, "alice@host", "deploying v2")
    paused_at = row.paused_at

    v, changed = store.set_paused("nightly", True, by="bob@host", note="still deploying\nsee #42")
    assert not changed  # paused already: the newer reason replaces the old one, with its author; when stays
    (row,) = store.controls(["nightly"])
    assert (row.paused_by, row.paused_note, row.version) == ("bob@host", "still deploying\nsee #42", v)
    assert row.paused_at == paused_at

    store.set_paused("nightly", False)
    (row,) = store.controls(["nightly"])
    assert (row.paused, row.paused_note, row.paused_by) == (False, None, None)

    store.set_paused("long", True, note="x" * 5000 + "é")
    (row,) = store.controls(["long"])
    assert len(row.paused_note) == MAX_NOTE_LENGTH and row.paused_note.endswith("...")
    store.set_paused("blank", True, note="   ")
    assert store.controls(["blank"])[0].paused_note is None


@pytest.mark.parametrize("note", ["evil\x1b[2J", "rtl \u202e override", "nul\x00", "isolate\u2066x"])
def test_a_pause_note_that_would_change_what_operators_read_is_refused(make_store, note):
    store = make_store()
    v0 = store.stored_version()
    with pytest.raises(ValueError, match="pause note contains a (control character|bidi control)"):
        store.set_paused("nightly", True, note=note)
    assert store.controls(["nightly"]) == [] and store.stored_version() == v0  # nothing written


def test_control_rows_built_by_position_still_read_right():
    at = datetime(2026, 1, 1, tzinfo=UTC)
    row = ControlRow("n", True, at, "alice", None, None, None, None, 7)
    assert (row.version, row.paused_note) == (7, None)


def test_a_version_4_store_is_migrated_by_the_first_beat_and_keeps_working(db_url, raw):
    """Built as release 4 left it: the tables without the two columns, stamped 4, with a node and a
    paused schedule. Opening it as beat does (prepare) adds both, keeps the rows, stamps the current version."""
    with raw.begin() as conn:
        metadata.create_all(conn)
    for table, column in ((nodes_table, "stopped_at"), (controls_table, "paused_note")):
        with raw.begin() as conn:
            conn.exec_driver_sql(f"ALTER TABLE {table.name} DROP COLUMN {column}")
    old_nodes = sa.Table(nodes_table.name, sa.MetaData(), *[c._copy() for c in nodes_table.columns
                                                            if c.name != "stopped_at"])
    old_controls = sa.Table(controls_table.name, sa.MetaData(), *[c._copy() for c in controls_table.columns
                                                                  if c.name != "paused_note"])
    t0 = datetime(2026, 1, 1, 9, 0, tzinfo=UTC)
    with raw.begin() as conn:
        assert "stopped_at" not in {c["name"] for c in sa.inspect(conn).get_columns(nodes_table.name)}
        conn.execute(meta_table.insert(), [{"key": "schema_version", "value": "4"},
                                           {"key": "cluster_id", "value": "c"}])
        conn.execute(old_nodes.insert(), [{"node": "old-beat", "started_at": t0, "heartbeat_at": t0,
                                           "scheduling": True, "clock_offset": 0.0}])
        conn.execute(old_controls.insert(), [{"name": "nightly", "paused": True, "paused_at": t0,
                                              "paused_by": "alice", "version": 1}])

    store = ClaimStore(db_url, node_id="new-beat")
    store.open()
    try:
        with raw.connect() as conn:
            assert conn.execute(sa.select(meta_table.c.value).where(meta_table.c.key == "schema_version")).scalar() \
                == str(SCHEMA_VERSION) == "6"
            inspector = sa.inspect(conn)
            assert "stopped_at" in {c["name"] for c in inspector.get_columns(nodes_table.name)}
            assert "paused_note" in {c["name"] for c in inspector.get_columns(controls_table.name)}
        (old,) = store.nodes()
        assert (old.node, old.scheduling, old.stopped_at) == ("old-beat", True, None)
        (paused,) = store.controls(["nightly"])
        assert (paused.paused, paused.paused_by, paused.paused_note) == (True, "alice", None)
        store.heartbeat(scheduling=True, register=True)
        assert store.node_stopped() is not None
        store.set_paused("nightly", True, note="kept paused across the upgrade")
        assert store.controls(["nightly"])[0].paused_note == "kept paused across the upgrade"
        assert {n.node: n.stopped_at is not None for n in store.nodes()} == {"old-beat": False, "new-beat": True}
    finally:
        store.close()
