"""Schema 6 (bounds and one-offs): a version-5 store is migrated by the first beat that opens it,
on each dialect, and its stored schedules read as they were (no bounds, not ended)."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

import sqlalchemy as sa

from celery_cluster_beat.store import ClaimStore
from celery_cluster_beat.store.schema import SCHEMA_VERSION, meta_table, metadata, stored_schedules_table

UTC = timezone.utc
BOUNDS = ("start_at", "end_at", "max_runs", "ended_at")


def test_a_version_5_store_gets_the_bound_columns_and_keeps_its_rows(db_url, raw):
    with raw.begin() as conn:
        metadata.create_all(conn)
    for column in BOUNDS:
        with raw.begin() as conn:
            conn.exec_driver_sql(f"ALTER TABLE {stored_schedules_table.name} DROP COLUMN {column}")
    old = sa.Table(stored_schedules_table.name, sa.MetaData(),
                   *[c._copy() for c in stored_schedules_table.columns if c.name not in BOUNDS])
    t0 = datetime(2026, 1, 1, 9, 0, tzinfo=UTC)
    with raw.begin() as conn:
        conn.execute(meta_table.insert(), [{"key": "schema_version", "value": "5"}, {"key": "cluster_id", "value": "c"}])
        conn.execute(old.insert(), [{"name": "report:1", "task": "t", "schedule": "0 9 * * *", "zone": "UTC",
                                     "args": "[]", "kwargs": "{}", "options": "{}", "enabled": True, "deleted": False,
                                     "version": 1, "created_at": t0, "changed_at": t0, "next_at": t0}])
    store = ClaimStore(db_url, node_id="new-beat")
    store.open()
    try:
        with raw.connect() as conn:
            assert conn.execute(sa.select(meta_table.c.value).where(meta_table.c.key == "schema_version")).scalar() \
                == str(SCHEMA_VERSION) == "6"
            columns = {c["name"] for c in sa.inspect(conn).get_columns(stored_schedules_table.name)}
            assert set(BOUNDS) <= columns
        (row,) = store.stored_get(["report:1"])
        assert (row.schedule, row.next_at, row.start_at, row.end_at, row.max_runs, row.ended_at) == \
            ("0 9 * * *", t0, None, None, None, None)
        # The migrated table takes bounded rows, and the leader's "ended" write.
        store.stored_change(["one"], lambda live, now: ([{
            "name": "one", "task": "t", "schedule": "at 2026-12-07T15:00:00Z", "zone": None, "args": "[]",
            "kwargs": "{}", "options": "{}", "overlap": None, "max_run_time": None, "jitter": None, "catchup": None,
            "catchup_window": None, "description": None, "owner": None, "enabled": True,
            "start_at": t0, "end_at": t0 + timedelta(days=400), "max_runs": 3}], []),
            lambda row, now: t0 + timedelta(days=1))
        (one,) = store.stored_get(["one"])
        assert (one.start_at, one.max_runs, one.ended_at, one.next_at) == (t0, 3, None, t0 + timedelta(days=1))
        assert store.stored_set_next([("one", one.version, None)]) == 1
        (one,) = store.stored_get(["one"])
        assert one.next_at is None and one.ended_at is not None
        assert store.stored_due(t0 + timedelta(days=1000)) == [row]  # an ended row is never loaded again
    finally:
        store.close()

