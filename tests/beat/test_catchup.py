"""Catch-up: what a beat sends for occurrences that fell due while no beat ran.

Each test sets the scene in a real claim database (all three dialects): the
schedule ran until T (its last occurrence is claimed and sent by "old-node"),
then nothing ran for N occurrences, then a beat starts. The beat is an
in-process :class:`Scheduler` publishing to the real Redis broker; beat's loop is
its ``tick()``. What it sent is read back from the broker queue (headers) and
what it decided from the claim rows.

The schedules run every minute so that the instants are fixed for the length of a
test: each test starts at least 3 s after a minute boundary and at least 5 s
before the next one.

Policies (``cluster_beat_catchup`` / per-entry ``catchup``):

* ``latest`` (default): the most recent missed occurrence is sent once; the older
  ones are recorded as ``missed``;
* ``all``: each missed occurrence, oldest first, at most ``cluster_beat_catchup_max``
  (the most recent ones); the rest ``missed``;
* ``none``: nothing old is sent, all are ``missed``.

``cluster_beat_catchup_window`` / per-entry ``catchup_window``: occurrences older
than the window are never sent (``missed``). A schedule seen for the first time
does not catch up to before it existed.
"""
from __future__ import annotations

import json
import time
import uuid
from datetime import datetime, timedelta, timezone
from typing import Dict, List, Optional, Tuple

import pytest
import redis
from celery import Celery

from celery_cluster_beat import every
from celery_cluster_beat.schedules.occurrence import Occurrence, occurrence_task_id
from celery_cluster_beat.beat.scheduler import Scheduler
from celery_cluster_beat.store import ClaimStore

UTC = timezone.utc
MINUTE = timedelta(minutes=1)
MISSED = 5  # occurrences that fell due while no beat ran


def quiet_minute() -> datetime:
    """Wait until we are 3 s past a minute boundary and 5 s before the next; the last boundary."""
    while True:
        now = time.time()
        into = now % 60
        if 3 <= into <= 55:
            return datetime.fromtimestamp(now - into, UTC)
        time.sleep(60 - into + 3.05 if into > 55 else 3.05 - into)


class Scene:
    """A Celery app, its claim database and the broker queue the scheduler publishes to."""

    def __init__(self, db_url: str, redis_url: str, schedule: Dict[str, dict], **conf) -> None:
        self.db_url = db_url
        name = "catchup_" + uuid.uuid4().hex[:8]
        self.queue = "q_" + name
        self.app = Celery(name, broker=redis_url)
        self.app.conf.update(task_default_queue=self.queue, cluster_beat_db_url=db_url,
                             cluster_beat_redis_url="", cluster_beat_node_id="new-node",
                             beat_schedule=schedule, **conf)
        self.redis = redis.Redis.from_url(redis_url)
        self.store = ClaimStore(db_url, node_id="old-node")
        self.store.open()
        self.scheduler: Optional[Scheduler] = None

    def ran_until(self, schedule: str, at: datetime) -> None:
        """History: *schedule*'s occurrence at *at* was claimed and sent by an earlier beat."""
        occ = Occurrence(schedule, at)
        assert self.store.claim([occ]) == [occ]
        assert self.store.mark_sent([occ]) == 1

    def start_beat(self, seconds: float = 0.0) -> None:
        """Start the scheduler and run beat's loop: two ticks (activate, then send what is due),
        then on for *seconds* more."""
        self.scheduler = Scheduler(app=self.app)
        self.scheduler.tick()
        self.scheduler.tick()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            wait = self.scheduler.tick()
            time.sleep(max(0.0, min(wait, deadline - time.monotonic())))

    def sent(self, schedule: Optional[str] = None) -> List[datetime]:
        """Occurrences on the broker, in the order they were published (from the headers)."""
        out = []
        for raw in reversed(self.redis.lrange(self.queue, 0, -1)):  # LPUSH: oldest last
            msg = json.loads(raw)
            h = msg["headers"]
            at = datetime.fromisoformat(h["cluster_beat_scheduled_at"].replace("Z", "+00:00"))
            assert h["id"] == occurrence_task_id(h["cluster_beat_schedule"], at)
            assert h["cluster_beat_node"] == "new-node"
            if schedule is None or h["cluster_beat_schedule"] == schedule:
                out.append(at)
        return out

    def rows(self, schedule: str) -> List[Tuple[datetime, str]]:
        return [(r.scheduled_at, r.status) for r in self.store.claims(schedule)]

    def close(self) -> None:
        if self.scheduler is not None:
            self.scheduler.close()
        self.store.close()
        self.redis.delete(self.queue)
        self.redis.close()


@pytest.fixture
def scene(db_url, redis_url):
    made: List[Scene] = []

    def make(schedule: Dict[str, dict], **conf) -> Scene:
        s = Scene(db_url, redis_url, schedule, **conf)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def minutely(**extra) -> dict:
    return dict({"task": "t.record", "schedule": every(60)}, **extra)


def history(scene_, name: str = "report") -> Tuple[datetime, List[datetime]]:
    """The schedule ran until T, then MISSED occurrences fell due; (T, the missed instants)."""
    last_fire = quiet_minute()
    t = last_fire - MISSED * MINUTE
    scene_.ran_until(name, t)
    return t, [t + i * MINUTE for i in range(1, MISSED + 1)]


# ----------------------------------------------------------------------------- the policies


def test_latest_sends_only_the_most_recent_missed_occurrence_and_records_the_rest_missed(scene):
    s = scene({"report": minutely()})  # catch-up 'latest' is the default
    t, missed = history(s)
    s.start_beat()
    assert s.sent() == [missed[-1]]
    assert s.rows("report") == [(t, "sent")] + [(at, "missed") for at in missed[:-1]] + [(missed[-1], "sent")]


def test_all_sends_each_missed_occurrence_oldest_first(scene):
    s = scene({"report": minutely()}, cluster_beat_catchup="all")
    t, missed = history(s)
    s.start_beat()
    assert s.sent() == missed  # in publishing order: oldest first
    assert s.rows("report") == [(t, "sent")] + [(at, "sent") for at in missed]


def test_all_sends_at_most_catchup_max_the_most_recent_ones_the_older_are_missed(scene):
    s = scene({"report": minutely()}, cluster_beat_catchup="all", cluster_beat_catchup_max=3)
    t, missed = history(s)
    s.start_beat()
    assert s.sent() == missed[-3:]
    assert s.rows("report") == ([(t, "sent")] + [(at, "missed") for at in missed[:-3]]
                                + [(at, "sent") for at in missed[-3:]])


def test_none_sends_nothing_old_and_records_every_missed_occurrence(scene):
    s = scene({"report": minutely()}, cluster_beat_catchup="none")
    t, missed = history(s)
    s.start_beat()
    assert s.sent() == []
    assert s.rows("report") == [(t, "sent")] + [(at, "missed") for at in missed]
    # The schedule itself goes on: the next occurrence is due at the next minute, not before.
    assert s.scheduler._queue.get("report") == missed[-1] + MINUTE


# ----------------------------------------------------------------------------- the window


def test_global_window_older_occurrences_are_not_sent_even_under_all(scene):
    # 120 s back from "now" reaches two minute boundaries: only those two are sent.
    s = scene({"report": minutely()}, cluster_beat_catchup="all", cluster_beat_catchup_window=120)
    t, missed = history(s)
    s.start_beat()
    assert s.sent() == missed[-2:]
    assert s.rows("report") == ([(t, "sent")] + [(at, "missed") for at in missed[:-2]]
                                + [(at, "sent") for at in missed[-2:]])


def test_global_window_shorter_than_the_age_of_the_latest_occurrence_sends_nothing(scene):
    # The latest missed occurrence is at least 3 s old: a 2-second window excludes it too.
    s = scene({"report": minutely()}, cluster_beat_catchup_window=2)
    t, missed = history(s)
    s.start_beat()
    assert s.sent() == []
    assert s.rows("report") == [(t, "sent")] + [(at, "missed") for at in missed]


def test_per_entry_catchup_and_window_override_the_global_settings(scene):
    s = scene({
        "windowed": minutely(catchup_window=120),  # global 'all', but only the last 120 s
        "unbounded": minutely(),  # global 'all', global window (none)
        "nothing": minutely(catchup="none"),
        "one": minutely(catchup="latest"),
        "narrow": minutely(catchup="latest", catchup_window=2),
    }, cluster_beat_catchup="all", cluster_beat_catchup_window=None)
    histories = {name: history(s, name) for name in ("windowed", "unbounded", "nothing", "one", "narrow")}
    s.start_beat()
    expected_sent = {
        "windowed": histories["windowed"][1][-2:],
        "unbounded": histories["unbounded"][1],
        "nothing": [],
        "one": histories["one"][1][-1:],
        "narrow": [],
    }
    for name, (t, missed) in histories.items():
        assert s.sent(name) == expected_sent[name], name
        statuses = dict(s.rows(name))
        assert statuses.pop(t) == "sent"
        assert statuses == {at: ("sent" if at in expected_sent[name] else "missed") for at in missed}, name


def test_a_window_wider_than_the_outage_changes_nothing(scene):
    s = scene({"report": minutely()}, cluster_beat_catchup="all", cluster_beat_catchup_window=3600)
    t, missed = history(s)
    s.start_beat()
    assert s.sent() == missed


# ----------------------------------------------------------------------------- new schedules


def test_a_schedule_seen_for_the_first_time_does_not_catch_up_to_before_it_existed(scene):
    s = scene({
        "report": minutely(),  # has a history: catches up
        "new_minutely": minutely(),  # never ran: its past minute boundaries are not "missed"
        "new_every_second": {"task": "t.record", "schedule": every(1)},
    }, cluster_beat_catchup="all")
    t, missed = history(s, "report")
    started = datetime.now(UTC)
    s.start_beat(seconds=2.5)
    stopped = datetime.now(UTC)

    assert s.sent("report") == missed
    assert s.sent("new_minutely") == [] and s.rows("new_minutely") == []
    # The every-second schedule starts with the first second after the beat started, and runs on.
    ticks = s.sent("new_every_second")
    assert ticks and all(started < at <= stopped for at in ticks), (started, ticks)
    assert ticks == [ticks[0] + timedelta(seconds=i) for i in range(len(ticks))]
    assert len(ticks) >= 2
    assert all(status == "sent" for _, status in s.rows("new_every_second"))


def test_a_first_occurrence_that_fell_due_in_a_failover_gap_is_caught_up_not_lost(scene):
    """A schedule a previous leader first saw (and registered) before it died, whose first
    occurrence fell due while no node scheduled: the next leader catches up from when the
    schedule was first seen, by its policy, instead of starting from "now" and losing it
    unseen (no claim row, no message: what the chaos soak found for a new hourly job)."""
    import sqlalchemy as sa

    from celery_cluster_beat.store.schema import schedules_table

    s = scene({"report": minutely()})  # catch-up 'latest'
    last_fire = quiet_minute()
    first_seen = last_fire - MINUTE - timedelta(seconds=30)
    s.store.register(["report"])
    engine = sa.create_engine(s.db_url)
    try:
        with engine.begin() as conn:  # registered 1.5 minutes ago, by the leader that then died
            conn.execute(sa.update(schedules_table).where(schedules_table.c.name == "report")
                         .values(registered_at=first_seen))
    finally:
        engine.dispose()
    s.start_beat()
    assert s.sent("report") == [last_fire]
    assert s.rows("report") == [(last_fire - MINUTE, "missed"), (last_fire, "sent")]


def test_after_catching_up_the_next_beat_start_does_not_send_them_again(scene):
    """Catch-up is recorded: a second beat starting right after finds nothing to catch up."""
    s = scene({"report": minutely()}, cluster_beat_catchup="all")
    t, missed = history(s)
    s.start_beat()
    s.scheduler.close()
    s.start_beat()  # a new Scheduler on the same database
    assert s.sent() == missed
