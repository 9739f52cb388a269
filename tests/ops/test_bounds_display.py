"""What operators see of one-offs and bounds: ``list`` says a schedule that fired its last
occurrence is ``ended`` (config or stored), ``list --wide`` shows the bounds in words, and the
schedule page shows them and says an ended schedule never fires again."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

from celery import Celery

from celery_cluster_beat import at, every
from celery_cluster_beat.dynamic import StoredSchedules
from celery_cluster_beat.ops import report
from celery_cluster_beat.ops.cli import render_list
from celery_cluster_beat.ops.pagehtml import render_schedule
from celery_cluster_beat.ops.schedulepage import schedule_detail
from celery_cluster_beat.store import ClaimStore

UTC = timezone.utc
START = datetime(2030, 1, 2, 3, 4, tzinfo=UTC)


def test_list_and_the_page_show_bounds_and_ended_schedules(db_url):
    app = Celery("boundsview", broker="memory://", set_as_current=False)
    app.conf.update(cluster_beat_db_url=db_url, cluster_beat_redis_url="", beat_schedule={
        "gone": {"task": "t.x", "schedule": at("2001-01-01T00:00:00Z")},
        "window": {"task": "t.x", "schedule": every(60), "start_at": START, "end_at": START + timedelta(days=1),
                   "max_runs": 2},
    })
    with StoredSchedules(app) as api:
        api.add("once", "t.x", at(datetime.now(UTC) + timedelta(hours=1)))
        api.add("ends", "t.x", every(60))
        api.update("ends", end_at=datetime.now(UTC) - timedelta(seconds=1))  # ended by the update
        store = ClaimStore(db_url, node_id="ops")
        store.open()
        try:
            listed = {s.name: s for s in report.schedule_list(app, store=store)}
            assert {n: listed[n].state for n in listed} == {"gone": "ended", "window": "enabled", "once": "enabled",
                                                              "ends": "ended"}
            assert listed["ends"].ended_at is not None and listed["gone"].next_fire is None
            assert listed["window"].bounds == "from 2030-01-02 03:04Z, until 2030-01-03 03:04Z, at most 2 runs"
            assert listed["window"].next_fire == START
            assert listed["once"].rule.startswith("once, at ") and listed["once"].compact.startswith("at ")
            wide = render_list(list(listed.values()), wide=True)
            assert "BOUNDS" in wide and "at most 2 runs" in wide and " ended " in wide
            narrow = render_list(list(listed.values()), store.db_now())
            assert " ended " in narrow
            page = render_schedule(title="t", node="n", detail=schedule_detail(app, store, "window"))
            assert 'id="bounds">from 2030-01-02 03:04Z, until 2030-01-03 03:04Z, at most 2 runs<' in page
            page = render_schedule(title="t", node="n", detail=schedule_detail(app, store, "ends"))
            assert "Ended: it never fires again." in page and ">ended<" in page
        finally:
            store.close()
