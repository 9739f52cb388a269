"""The data behind ``cluster-beat status / list / history`` (and the status page), in process, on a
claim store of each dialect, without beat: rows are written the way beat and the worker write them."""
from __future__ import annotations

import json
import time
from datetime import timedelta
from zoneinfo import ZoneInfo

import pytest
from celery import Celery

from celery_cluster_beat import cron, every
from celery_cluster_beat.ops import report
from celery_cluster_beat.ops.cli import parse_duration, render_list, render_status, table
from celery_cluster_beat.schedules.occurrence import Occurrence
from celery_cluster_beat.store import ClaimStore


@pytest.mark.parametrize("text, seconds", [("7d", 7 * 86400), ("12h", 43200), ("90m", 5400), ("30s", 30),
                                           ("1h30m", 5400), ("2w", 14 * 86400), ("3600", 3600), ("0.5s", 0.5)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "7x", "d", "0", "0s", "-3d", "1h 30m", "inf", "nan"])
def test_bad_durations(text):
    with pytest.raises(ValueError, match="bad duration"):
        parse_duration(text)


def test_tables_are_aligned():
    out = table(["A", "LONGER"], [("xxxx", 1), (None, "y")]).splitlines()
    assert out == ["A     LONGER", "xxxx  1", "-     y"]


def _app(db_url: str) -> Celery:
    app = Celery("reportapp", broker="memory://")
    app.conf.update(
        cluster_beat_db_url=db_url, cluster_beat_redis_url="", cluster_beat_claim_grace=0.2, timezone="Europe/Paris",
        beat_schedule={"tick": {"task": "t.tick", "schedule": every(10)},
                       "nightly": {"task": "t.nightly", "schedule": cron("30 2 * * *"), "description": "export"},
                       "off": {"task": "t.off", "schedule": every(60), "enabled": False}},
    )
    return app


def test_reports_read_what_beat_and_the_worker_wrote(db_url):
    app = _app(db_url)
    from celery_cluster_beat.dynamic import StoredSchedules

    with StoredSchedules(app) as api:
        api.add("report:1", "t.report", cron("0 9 * * 1-5", tz="America/New_York"), owner="bob")
    store = ClaimStore(db_url, node_id="beat-1")
    store.open()
    try:
        now = store.db_now().replace(microsecond=0)
        t1, t2 = now - timedelta(seconds=20), now - timedelta(seconds=10)
        store.heartbeat(scheduling=True, clock_offset=0.012, register=True)
        store.claim([Occurrence("tick", t1)], term=3)
        store.mark_sent([Occurrence("tick", t1)])
        store.record([Occurrence("tick", t2)], status="skipped", reason="overlap", term=3)
        store.claim([Occurrence("nightly", now - timedelta(hours=1))], term=3, reason="manual")
        store.set_paused("nightly", True, by="alice@host")
        store.request_run("tick", by="alice@host")
        time.sleep(0.4)  # the nightly claim stays unsent past the grace

        st = report.cluster_status(app, store=store)
        assert (st.leader, st.term, st.store_term, st.lease.enabled) == ("beat-1", 3, 3, False)
        assert (st.schedules, st.config_schedules, st.stored_schedules, st.paused) == (4, 3, 1, ("nightly",))
        assert st.unsent == 1 and st.unsent_shown[0].schedule == "nightly" and st.unsent_shown[0].age >= 0.2
        (node,) = st.nodes
        assert (node.node, node.state, node.scheduling, node.clock_offset) == ("beat-1", "leader", True, 0.012)
        assert "no lease" in render_status(st)
        json.dumps(st.as_dict())

        before = store.db_now()
        listed = {s.name: s for s in report.schedule_list(app, store=store)}
        after = store.db_now()  # a loaded machine may take seconds between these two readings
        assert list(listed) == ["nightly", "off", "tick", "report:1"]
        tick = listed["tick"]
        assert (tick.source, tick.schedule, tick.zone, tick.last_occurrence, tick.last_status, tick.outcome) == (
            "config", "every 10s", None, t2, "skipped", "skipped (overlap)")
        assert (tick.counters.sent, tick.counters.skipped, tick.run_requested_at is not None) == (1, 1, True)
        assert before < tick.next_fire <= after + timedelta(seconds=10)
        nightly = listed["nightly"]
        assert (nightly.paused, nightly.paused_by, nightly.next_fire, nightly.zone, nightly.description) == (
            True, "alice@host", None, "Europe/Paris", "export")
        assert (listed["off"].enabled, listed["off"].next_fire) == (False, None)
        stored = listed["report:1"]
        assert (stored.source, stored.schedule, stored.zone, stored.owner) == (
            "stored", "0 9 * * 1-5", "America/New_York", "bob")
        assert stored.next_fire.astimezone(ZoneInfo("America/New_York")).hour == 9
        text = render_list(list(listed.values()))
        assert "paused" in text and "disabled" in text
        assert json.loads(json.dumps([s.as_dict() for s in listed.values()]))[2]["outcome"] == "skipped (overlap)"

        rows = report.history(app, "tick", store=store)
        assert [(r.scheduled_at, r.status, r.manual) for r in rows] == [(t2, "skipped", False), (t1, "sent", False)]
        assert rows[1].sent_at is not None and rows[1].term == 3
        (manual,) = report.history(app, "nightly", store=store)
        assert manual.manual and manual.status == "claimed"
        assert len(report.history(app, "tick", limit=1, store=store)) == 1
        assert report.history(app, "report:1", store=store) == []
        with pytest.raises(report.NoSuchSchedule, match="no schedule is named 'nope'"):
            report.history(app, "nope", store=store)
    finally:
        store.close()


def test_an_occurrence_claimed_ahead_of_its_instant_is_the_next_fire_not_the_last_outcome(db_url):
    """Beat claims an instant's occurrences a moment before it: ``list`` keeps showing the last
    occurrence that happened, not the one about to."""
    app = _app(db_url)
    store = ClaimStore(db_url, node_id="beat-1")
    store.open()
    try:
        now = store.db_now().replace(microsecond=0)
        past, ahead = now - timedelta(seconds=10), now + timedelta(seconds=30)
        store.claim([Occurrence("tick", past)], term=1)
        store.mark_sent([Occurrence("tick", past)])
        store.claim([Occurrence("tick", ahead)], term=1)
        tick = {s.name: s for s in report.schedule_list(app, store=store)}["tick"]
        assert (tick.last_occurrence, tick.last_status, tick.outcome) == (past, "sent", "sent")
        store.claim([Occurrence("nightly", now + timedelta(seconds=30))], term=1)  # nothing before it
        nightly = {s.name: s for s in report.schedule_list(app, store=store)}["nightly"]
        assert (nightly.last_occurrence, nightly.last_status) == (None, None)
    finally:
        store.close()
