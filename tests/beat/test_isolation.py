"""Isolation: one schedule that cannot be planned or sent never costs another schedule its run.

Issue 19, item 7: a stored schedule with ``catchup_window=inf`` (accepted then) made catch-up
planning raise ``OverflowError`` after every due schedule had been moved forward, so each
schedule due in that pass lost its occurrences, with no row written. Now a stored row whose
values are out of range (written past the API: by hand, by another release) is still
scheduled on its instants, and each of its occurrences ends ``failed`` with the reason; and any
error while planning one schedule records that schedule's occurrence ``failed`` with the
reason, while the other schedules of the pass are planned and sent as usual.

The scene is a late pass, as after a restart or a failover: the schedules ran until T (their
occurrence at T claimed and sent by "old-node"), then nothing ran for :data:`MISSED` minutes, then
a beat starts. The beat is an in-process :class:`Scheduler` on a real claim database (each
dialect) publishing to the real Redis broker; what it sent is read back from the queue, what
it decided from the claim rows. The schedules run every minute, so each test starts at least
3 s after a minute boundary and 5 s before the next (the instants hold still meanwhile).
"""
from __future__ import annotations

import json
import time
import uuid
from datetime import datetime, timedelta, timezone
from typing import Dict, List, Optional

import pytest
import redis
import sqlalchemy as sa
from celery import Celery

from celery_cluster_beat import every
from celery_cluster_beat.beat.scheduler import Scheduler
from celery_cluster_beat.dynamic import StoredSchedules
from celery_cluster_beat.schedules.occurrence import Occurrence
from celery_cluster_beat.store import ClaimStore
from celery_cluster_beat.store.types import naive_utc

UTC = timezone.utc
MINUTE = timedelta(minutes=1)
MISSED = 4  # occurrences that fell due while no beat ran


def quiet_minute() -> datetime:
    """Wait until we are 3 s past a minute boundary and 5 s before the next; the last boundary."""
    while True:
        now = time.time()
        into = now % 60
        if 3 <= into <= 55:
            return datetime.fromtimestamp(now - into, UTC)
        time.sleep(60 - into + 3.05 if into > 55 else 3.05 - into)


class Scene:
    """A Celery app, its claim database (read as "old-node" did) and the queue beat publishes to."""

    def __init__(self, db_url: str, redis_url: str, schedule: Dict[str, dict]) -> None:
        self.db_url = db_url
        name = "isolation_" + uuid.uuid4().hex[:8]
        self.queue = "q_" + name
        self.app = Celery(name, broker=redis_url, set_as_current=False)
        self.app.conf.update(task_default_queue=self.queue, cluster_beat_db_url=db_url, cluster_beat_redis_url="",
                             cluster_beat_node_id="new-node", cluster_beat_catchup="all",
                             cluster_beat_overlap="allow", beat_schedule=schedule)
        self.redis = redis.Redis.from_url(redis_url)
        self.store = ClaimStore(db_url, node_id="old-node")
        self.store.open()
        self.scheduler: Optional[Scheduler] = None

    def ran_until(self, schedule: str, at: datetime) -> None:
        occ = Occurrence(schedule, at)
        assert self.store.claim([occ]) == [occ]
        assert self.store.mark_sent([occ]) == 1

    def start_beat(self) -> None:
        """Start the scheduler and run beat's loop: activate, then the late pass."""
        self.scheduler = Scheduler(app=self.app)
        self.scheduler.tick()
        self.scheduler.tick()

    def sent(self, schedule: str) -> List[datetime]:
        out = []
        for raw in reversed(self.redis.lrange(self.queue, 0, -1)):  # LPUSH: oldest last
            h = json.loads(raw)["headers"]
            if h["cluster_beat_schedule"] == schedule:
                out.append(datetime.fromisoformat(h["cluster_beat_scheduled_at"].replace("Z", "+00:00")))
        return out

    def rows(self, schedule: str):
        return {r.scheduled_at: r for r in self.store.claims(schedule)}

    def close(self) -> None:
        if self.scheduler is not None:
            self.scheduler.close()
        self.store.close()
        self.redis.delete(self.queue)
        self.redis.close()
        self.app.close()


@pytest.fixture
def scene(db_url, redis_url):
    made: List[Scene] = []

    def make(schedule: Dict[str, dict]) -> Scene:
        s = Scene(db_url, redis_url, schedule)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def _history() -> tuple:
    """(T, the instants that fell due after T while no beat ran)."""
    t = quiet_minute() - MISSED * MINUTE
    return t, [t + i * MINUTE for i in range(1, MISSED + 1)]


def _assert_sent_in_full(s: Scene, name: str, due: List[datetime]) -> None:
    assert s.sent(name) == due, f"{name}: every occurrence of the late pass is sent (catch-up 'all')"
    rows = s.rows(name)
    assert [(at, rows[at].status) for at in due] == [(at, "sent") for at in due]


@pytest.mark.timeout(90)
def test_a_stored_row_made_bad_past_the_api_fails_its_own_occurrences_and_no_other_schedule_loses_one(scene):
    """A stored schedule whose row says ``catchup_window`` 1e30 and ``max_run_time`` inf (written
    in the database directly, as the API refuses both) and a good stored schedule are both due
    after a stop, with a config entry too. The late pass sends every occurrence of the good ones,
    and records each occurrence of the bad one ``failed``, the reason naming the field.

    Before: the plan of the bad one raised OverflowError after both had been moved forward: none
    of the occurrences of the pass was sent or recorded."""
    s = scene({"cfg": {"task": "t.record", "schedule": every(60)}})
    api = StoredSchedules(s.app)
    try:
        api.add("good", "t.record", every(60))
        api.add("bad", "t.record", every(60))
    finally:
        api.close()
    t, due = _history()
    for name in ("cfg", "good", "bad"):
        s.ran_until(name, t)
    table = sa.table("cluster_beat_stored_schedules", sa.column("name"), sa.column("next_at"),
                     sa.column("catchup_window"), sa.column("max_run_time"))
    engine = sa.create_engine(s.db_url)
    try:
        with engine.begin() as conn:  # the stop: both were next due right after T
            conn.execute(sa.update(table).values(next_at=naive_utc(due[0])))
            # (1e30: past what timedelta holds, within MySQL's FLOAT; no infinity there)
            conn.execute(sa.update(table).where(table.c.name == "bad")
                         .values(catchup_window=1e30, max_run_time=1e30 if "mysql" in s.db_url else float("inf")))
    finally:
        engine.dispose()

    s.start_beat()

    _assert_sent_in_full(s, "cfg", due)
    _assert_sent_in_full(s, "good", due)
    assert s.sent("bad") == []
    rows = s.rows("bad")
    assert [(at, rows[at].status) for at in due] == [(at, "failed") for at in due]
    assert all("catchup_window" in rows[at].reason for at in due), rows[due[0]].reason
    state = {st.name: st for st in s.store.schedule_states(["bad"])}["bad"]
    assert state.failed == MISSED and "catchup_window" in (state.last_error or "")


class PlanBreaks(every):
    """A rule whose catch-up plan cannot be computed (as an instant past what datetime holds):
    its on-time fires work, listing past ones raises."""

    def fires_between(self, start, end, limit=None):
        raise OverflowError("date value out of range")


@pytest.mark.timeout(90)
def test_an_error_planning_one_schedule_fails_its_occurrence_with_the_reason_and_the_others_are_sent(scene):
    """Two config entries are due after a stop; the catch-up plan of one raises. Its first due
    occurrence ends ``failed`` with the error as the reason; every occurrence of the other is sent;
    the broken one is not retried in a loop (it moved on to its next fire).

    Before: the error left the due pass after both entries had been moved forward: the other
    entry's occurrences were neither sent nor recorded."""
    s = scene({"broken": {"task": "t.record", "schedule": PlanBreaks(60)},
               "fine": {"task": "t.record", "schedule": every(60)}})
    t, due = _history()
    s.ran_until("broken", t)
    s.ran_until("fine", t)

    s.start_beat()

    _assert_sent_in_full(s, "fine", due)
    assert s.sent("broken") == []
    rows = s.rows("broken")
    assert sorted(rows) == [t, due[0]] and rows[due[0]].status == "failed"
    assert "catch-up planning failed (OverflowError: date value out of range)" in rows[due[0]].reason
    s.scheduler.tick()
    assert sorted(s.rows("broken")) == [t, due[0]], "recorded once, not again on each tick"
