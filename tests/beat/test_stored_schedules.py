"""Stored schedules inside one scheduler: what the leader holds in memory, what it leaves
in SQL, and how much SQL following the changes costs.

The scheduler is a real :class:`Scheduler` driven the way beat drives it
(``tick()``, then sleep what it returns), without a lease unless a test says
so, on a real claim database of each dialect and a real Redis broker (the
test's own queue, deleted afterwards). Schedules are made at run time through
the application's API (:class:`StoredSchedules`) on a store of its own, as an
application would. SQL is counted with SQLAlchemy's ``before_cursor_execute``
event on the scheduler's own store engine: the API's statements are not
counted.

The rules checked (from the issue): a removed schedule leaves no heap item;
only the schedules due within the horizon are in memory, the rest wait in SQL
with an exact ``next_at``; an idle tick does no SQL; the change counter is read
at most once a second; applying changes costs a constant number of statements,
never a walk over all schedules; a stored schedule may not share a name with a
``beat_schedule`` entry; and a removed or disabled schedule sends nothing, not
even the claim a dead node left unsent, which the stale-claim sweep resends for
the live ones.
"""
from __future__ import annotations

import json
import time
import uuid
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from typing import Callable, Dict, Iterator, List, Sequence
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis
import sqlalchemy as sa
from celery import Celery

from celery_cluster_beat import cron, every
from celery_cluster_beat.beat import scheduler as scheduler_module
from celery_cluster_beat.beat import stored as stored_module
from celery_cluster_beat.beat.scheduler import Scheduler
from celery_cluster_beat.dynamic import StoredSchedules
from celery_cluster_beat.errors import ConfigError
from celery_cluster_beat.leader.lease import cluster_key, lease_keys
from celery_cluster_beat.schedules.occurrence import Occurrence
from celery_cluster_beat.store import ClaimStore, StaleTermError

UTC = timezone.utc
BROKER_DB = 7  # a Redis database of these tests' own; every app also has its own queue
VERSION_TABLE = "cluster_beat_schedule_version"
STORED_TABLE = "cluster_beat_stored_schedules"
#: The rule: without Redis the change counter is read at most, and at least, about once a second.
RULE = 1.0
#: Room for a loaded 2-core machine on top of the rule (a tick, the statements of the read).
SLACK = 0.75


# --------------------------------------------------------------------------- harness


@pytest.fixture
def broker(redis_url) -> str:
    return urlunsplit(urlsplit(redis_url)._replace(path=f"/{BROKER_DB}"))


@pytest.fixture
def apps():
    """Celery apps made by the test; their queues (and lease keys) are deleted afterwards."""
    made: List[Celery] = []
    yield made
    for app in made:
        try:
            client = redis.Redis.from_url(app.conf.broker_url, socket_connect_timeout=2)
            client.delete(app.conf.task_default_queue, cluster_key(app.main), *lease_keys(app.main)[:2])
            client.close()
        except redis.RedisError:
            pass
        app.close()


@pytest.fixture
def closing():
    """Things with a close() (schedulers, API objects, stores) closed at the end, last first."""
    things: list = []
    yield things
    for thing in reversed(things):
        try:
            thing.close()
        except Exception:  # pragma: no cover - never hide the test's own failure
            pass


def _app(apps: List[Celery], db: str, broker: str, schedule: Dict[str, dict], **conf) -> Celery:
    name = "ccb_stored_" + uuid.uuid4().hex[:8]
    app = Celery(name, broker=broker)
    settings = dict(task_default_queue="q_" + name, cluster_beat_db_url=db, cluster_beat_redis_url="",
                    cluster_beat_claim_grace=30.0, cluster_beat_prune_interval=3600.0,
                    cluster_beat_node_id="node-" + name[-8:], beat_schedule=schedule)
    settings.update(conf)
    app.conf.update(settings)
    apps.append(app)
    return app


def _queued(app: Celery, name: str = None) -> List[datetime]:
    """Instants of the messages of schedule *name* (all, if None) waiting in the app's queue, oldest first."""
    client = redis.Redis.from_url(app.conf.broker_url)
    try:
        raw = client.lrange(app.conf.task_default_queue, 0, -1)
    finally:
        client.close()
    out = []
    for item in reversed(raw):  # LPUSH: oldest last
        h = json.loads(item)["headers"]
        if name is None or h["cluster_beat_schedule"] == name:
            out.append(_at(h["cluster_beat_scheduled_at"]))
    return out


def _at(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).astimezone(UTC)


def _run(sched: Scheduler, seconds: float) -> int:
    """Beat's loop for *seconds*: tick, sleep what it says; returns the number of ticks."""
    ticks = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        wait = sched.tick()
        ticks += 1
        assert wait > 0
        time.sleep(max(0.0, min(wait, end - time.monotonic())))
    return ticks


def _run_until(sched: Scheduler, predicate: Callable[[], bool], timeout: float, what: str,
               poll: float = 0.05) -> float:
    """Beat's loop until *predicate* holds after a tick (checked at least every *poll* s); the wall
    time it first held. Sleeping less than the tick asked for is what a woken beat does."""
    deadline = time.monotonic() + timeout
    while True:
        wait = sched.tick()
        assert wait > 0
        if predicate():
            return time.time()
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(min(wait, poll))


@contextmanager
def _sql(sched: Scheduler) -> Iterator[List[str]]:
    """Every statement the scheduler's own store engine executes inside the block."""
    engine = sched._store._engine
    assert engine is not None, "the scheduler's store is not open"
    seen: List[str] = []

    def count(conn, cursor, statement, parameters, context, executemany):
        seen.append(" ".join(statement.split()))

    sa.event.listen(engine, "before_cursor_execute", count)
    try:
        yield seen
    finally:
        sa.event.remove(engine, "before_cursor_execute", count)


#: Transaction control some drivers send as statements (pysqlite's BEGIN): not work of their own.
_CONTROL = ("BEGIN", "COMMIT", "ROLLBACK", "SAVEPOINT", "RELEASE")


def _work(statements: Sequence[str]) -> List[str]:
    """The statements that read or write something (transaction control left out)."""
    return [s for s in statements if not s.upper().startswith(_CONTROL)]


def _version_reads(statements: Sequence[str]) -> List[str]:
    return [s for s in statements if s.upper().startswith("SELECT") and VERSION_TABLE in s]


def _far_schedule():
    """A cron whose next fire is at least a day away (yearly instants, two candidates)."""
    now = datetime.now(UTC)
    for expr in ("0 0 29 2 *", "0 12 1 7 *"):
        sched = cron(expr, tz="UTC")
        if sched.next_fire(now) - now > timedelta(days=1):
            return sched
    raise AssertionError("no far-away schedule found")  # pragma: no cover


def _every_first_in(lo: float, hi: float, steps: Sequence[int]) -> int:
    """A step n of *steps* such that every(n) (on the epoch grid) first fires between *lo* and *hi*
    seconds from now; waits (briefly) for a phase where one does."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        now = time.time()
        for n in steps:
            if lo <= n - now % n <= hi:
                return n
        time.sleep(0.05)
    raise AssertionError(f"no every(n) of {list(steps)} first fires in [{lo}, {hi}] s")  # pragma: no cover


def _rows(db_url: str, name: str):
    reader = ClaimStore(db_url, node_id="test-reader")
    reader.open()
    try:
        return reader.claims(name)
    finally:
        reader.close()


def _stored_row(db_url: str, name: str):
    reader = ClaimStore(db_url, node_id="test-reader")
    reader.open()
    try:
        rows = reader.stored_get([name])
    finally:
        reader.close()
    return rows[0] if rows else None


def _heap_names(sched: Scheduler) -> List[str]:
    """Every name with an item in the scheduler's heap (dead items included, if there were any)."""
    return sorted(name for _, name in sched._queue)


# --------------------------------------------------------------------------- (a) removal


@pytest.mark.timeout(90)
def test_a_removed_stored_schedule_leaves_no_heap_item_and_no_entry(db_url, broker, apps, closing):
    """Three stored schedules are removed while the scheduler runs: one firing every second
    (held in memory), one a year away (only in SQL) and one disabled (in neither). Within a
    second and a tick of the remove() returning, the heap has no item of any of them (its items
    are exactly the entries' names, no dead item left behind), ``entries`` has no entry, and the
    removed every-second schedule sends and records nothing after that; the one kept fires on.

    Fails if a removal is only marked (a tombstone item left in the heap, skipped when popped),
    if the entry stays in ``entries``, or if the change is seen later than about a second.
    """
    app = _app(apps, db_url, broker, {"static": {"task": "t.record", "schedule": _far_schedule()}})
    api = StoredSchedules(app)
    closing.append(api)
    api.add("keep", "t.record", every(1))
    api.add("gone", "t.record", every(1))
    api.add("gone-far", "t.record", _far_schedule())
    api.add("gone-disabled", "t.record", every(1), enabled=False)
    sched = Scheduler(app, lazy=False)
    closing.append(sched)

    assert _heap_names(sched) == ["gone", "keep", "static"], "set-up: what is held after start-up"
    _run_until(sched, lambda: len(_queued(app, "gone")) >= 2, 15, "two sends of 'gone'")
    for name in ("gone", "gone-far", "gone-disabled"):
        assert api.remove(name) is True
    removed_at = time.time()
    applied_at = _run_until(sched, lambda: "gone" not in sched._queue, 10, "the removal applied")
    _run(sched, 2.5)

    assert applied_at - removed_at <= RULE + SLACK, f"applied {applied_at - removed_at:.2f}s after remove()"
    assert _heap_names(sched) == ["keep", "static"]
    assert len(sched._queue) == 2
    assert sorted(sched.entries) == ["keep", "static"]
    late = [at for at in _queued(app, "gone") if at.timestamp() > applied_at]
    assert not late, f"'gone' sent after its removal was applied: {late}"
    recorded = [r for r in _rows(db_url, "gone") if r.scheduled_at.timestamp() > applied_at]
    assert not recorded, recorded
    for name in ("gone-far", "gone-disabled"):
        assert not _queued(app, name) and not _rows(db_url, name), name
    kept = [at for at in _queued(app, "keep") if at.timestamp() > applied_at]
    assert len(kept) >= 2, "the kept schedule stopped firing: the loop did not run on"
    assert api.get("gone") is None and [s.name for s in api.list()] == ["keep"]


# --------------------------------------------------------------------------- (b), (c) the horizon

HORIZON = 4.0  # seconds, instead of 120: the same code paths, in a test's time


@pytest.mark.timeout(90)
def test_a_schedule_beyond_the_horizon_waits_in_sql_and_is_loaded_before_it_is_due(
        db_url, broker, apps, closing, monkeypatch):
    """With a horizon of 4 s, a stored ``every(n)`` whose first fire is 13-17 s away is not in
    memory after start-up (no entry, no heap item), only in SQL, with that exact next_at. When
    the horizon's window reaches it (the window moves on every HORIZON / 2) it is loaded, before
    it is due, and fires at that instant, once.

    Fails if start-up loads every stored schedule (a reload of all), or if the window never
    loads it (it would never fire) or loads it too late (a late or missed first occurrence).
    """
    monkeypatch.setattr(stored_module, "HORIZON", HORIZON)  # the horizon's module
    app = _app(apps, db_url, broker, {"static": {"task": "t.record", "schedule": _far_schedule()}})
    api = StoredSchedules(app)
    closing.append(api)
    # First fire 9-13 s past the horizon: start-up (its window read) may take up to 8 s on a
    # loaded machine and the schedule is still well beyond the horizon it reads.
    n = _every_first_in(HORIZON + 9, HORIZON + 13, range(8, 31))
    first = api.add("sparse", "t.record", every(n)).next_at
    sched = Scheduler(app, lazy=False)
    closing.append(sched)
    started = time.time()

    assert first.timestamp() - started > HORIZON + 1, "set-up: start-up took too long for this test"
    assert "sparse" not in sched.entries and "sparse" not in sched._queue
    assert _stored_row(db_url, "sparse").next_at == first
    loaded_at = _run_until(sched, lambda: "sparse" in sched._queue, first.timestamp() - time.time() + 5,
                           "the window loading 'sparse'")
    assert sched._queue.get("sparse") == first
    assert loaded_at <= first.timestamp() - 0.5, f"loaded {loaded_at - first.timestamp():+.2f}s from its fire"
    _run_until(sched, lambda: bool(_queued(app, "sparse")), first.timestamp() - time.time() + 5,
               "'sparse' firing")
    _run(sched, 0.5)
    assert _queued(app, "sparse") == [first]
    assert [(r.scheduled_at, r.status) for r in _rows(db_url, "sparse")] == [(first, "sent")]


@pytest.mark.timeout(90)
def test_after_it_fires_a_sparse_schedule_is_handed_back_to_sql_with_its_next_occurrence(
        db_url, broker, apps, closing, monkeypatch):
    """With a horizon of 3 s, a stored ``every(n)`` (n 5-8 s) first due 1.5-2.5 s after start is
    held; right after it fires, its next fire is past the horizon, so the scheduler writes it to
    SQL (its row's next_at is exactly the next occurrence) and forgets it (no entry, no heap
    item). The window loads it again in time and it fires at that next occurrence, once.

    Fails if a fired sparse schedule stays in memory for ever (memory grows with the number of
    schedules, not with those due soon), if next_at is not written (or written wrong: the
    window would load it at the wrong time, and a new leader would resume from a stale
    instant), or if it is not picked up again.
    """
    # The horizon's module; shorter than the others' (the next fire is still 2 s or more past it
    # when the first one is handed back, as with n 6-10 s and 4 s), so the second fire comes sooner.
    monkeypatch.setattr(stored_module, "HORIZON", HORIZON - 1)
    app = _app(apps, db_url, broker, {"static": {"task": "t.record", "schedule": _far_schedule()}})
    api = StoredSchedules(app)
    closing.append(api)
    n = _every_first_in(1.5, 2.5, range(5, 9))
    first = api.add("sparse", "t.record", every(n)).next_at
    second = first + timedelta(seconds=n)
    sched = Scheduler(app, lazy=False)
    closing.append(sched)

    assert sched._queue.get("sparse") == first, "set-up: due within the horizon, it is held from start-up"
    _run_until(sched, lambda: bool(_queued(app, "sparse")), 10, "the first fire of 'sparse'")
    row = _stored_row(db_url, "sparse")
    in_memory = ("sparse" in sched.entries, "sparse" in sched._queue)

    assert _queued(app, "sparse") == [first]
    assert row.next_at == second, (row.next_at, second)
    assert in_memory == (False, False), "a fired sparse schedule is still held in memory"
    _run_until(sched, lambda: len(_queued(app, "sparse")) >= 2, n + 5, "the second fire of 'sparse'")
    _run(sched, 0.5)
    assert _queued(app, "sparse") == [first, second]
    assert [(r.scheduled_at, r.status) for r in _rows(db_url, "sparse")] == [(first, "sent"), (second, "sent")]


# --------------------------------------------------------------------------- (d), (e) idle cost


@pytest.mark.timeout(60)
@pytest.mark.parametrize("lease", [False, True], ids=["no-lease", "lease"])
def test_an_idle_tick_does_no_sql_with_stored_schedules(lease, db_url, broker, apps, closing):
    """Stored schedules in both places (30 a year away, only in SQL; 10 due in 20 s or more,
    held) and nothing due: right after a read of the change counter, 200 back-to-back ticks
    execute no statement at all; and over 3 s of beat's loop the only statements are reads of
    the change counter (no lease: at most one a second, i.e. <= 4; with the lease and its
    notices, none but the 5 s fallback: <= 1).

    Fails if a tick reads the counter, the change feed or the horizon window on every call,
    or if the loop's reads come more often than the rules allow.
    """
    # Housekeeping (heartbeat, sweep) every claim_grace / 3 = 30 s: not inside this test's window.
    app = _app(apps, db_url, broker, {"static": {"task": "t.record", "schedule": _far_schedule()}},
               cluster_beat_claim_grace=90.0)
    if lease:
        app.conf.cluster_beat_redis_url = broker
    api = StoredSchedules(app)
    closing.append(api)
    n = _every_first_in(25, 110, range(60, 116))
    api.add_many([{"name": f"far-{i:02d}", "task": "t.record", "schedule": _far_schedule()} for i in range(30)]
                 + [{"name": f"near-{i:02d}", "task": "t.record", "schedule": every(n)} for i in range(10)])
    sched = Scheduler(app, lazy=False)
    closing.append(sched)
    if lease:
        _run_until(sched, lambda: sched._active, 10, "taking the lease")
    assert sorted(sched.entries) == ["near-%02d" % i for i in range(10)] + ["static"]
    # Settle: the first read after start-up (or after subscribing) and the first pruning pass
    # (due 5 s after activation, brought forward to now; the next one is prune_interval, an hour,
    # away) are behind us.
    sched._next_prune = time.monotonic()
    with _sql(sched) as settling:
        _run_until(sched, lambda: any(s.upper().startswith("DELETE") and STORED_TABLE in s for s in settling),
                   15, "the first pruning pass", poll=0.2)

    # Right after a read of the counter: the next one is a second (or five) away.
    with _sql(sched) as seen:
        _run_until(sched, lambda: bool(_version_reads(seen)), 7, "a read of the change counter", poll=0.01)
    with _sql(sched) as idle:
        t0 = time.monotonic()
        sleeps = [sched.tick() for _ in range(200)]
        elapsed = time.monotonic() - t0
    with _sql(sched) as loop:
        _run(sched, 3.0)

    assert elapsed < RULE * 0.9, f"200 ticks took {elapsed:.2f}s: the host is too slow for this test"
    assert all(0 < s <= sched.max_interval for s in sleeps), sorted(sleeps)[:5]
    assert idle == [], f"{len(idle)} statement(s) in 200 idle ticks: {idle[:5]}"
    work = _work(loop)
    assert work == _version_reads(work), f"an idle loop did more than read the counter: {work}"
    assert len(work) <= (1 if lease else 4), work
    if not lease:
        assert len(work) >= 2, f"the counter was not read about once a second: {work}"


@pytest.mark.timeout(60)
def test_changes_are_read_at_most_once_a_second_without_redis_and_each_is_applied(
        db_url, broker, apps, closing):
    """Without Redis, another process changes a held stored schedule about every 0.2 s for
    3 s while beat's loop runs: the scheduler reads the change counter at least twice and at
    most 4 times (once a second, plus the edge), and by a second and a tick after the last
    change it holds that last definition.

    Fails if a read is triggered by every tick (or every change) instead of being rate-limited,
    or if changes are read less often than once a second (the 5 s fallback used without Redis).
    """
    app = _app(apps, db_url, broker, {"static": {"task": "t.record", "schedule": _far_schedule()}})
    api = StoredSchedules(app)
    closing.append(api)
    n = _every_first_in(20, 110, range(60, 116))
    api.add("busy", "t.record", every(n), args=[0])
    sched = Scheduler(app, lazy=False)
    closing.append(sched)
    _run(sched, 1.2)

    changes = 0
    next_change = started = time.monotonic()
    with _sql(sched) as seen:
        # At least 3 s and 8 changes: on a loaded machine an update can take longer than 0.2 s,
        # so the window stretches (to 8 s at most) rather than the set-up falling short.
        end = started + 3.0
        while time.monotonic() < end:
            if time.monotonic() >= next_change:
                changes += 1
                api.update("busy", args=[changes])
                next_change = time.monotonic() + 0.2
                if changes < 8 and time.monotonic() + 0.2 >= end:
                    end = min(started + 8.0, time.monotonic() + 0.25)
            wait = sched.tick()
            time.sleep(max(0.0, min(wait, next_change - time.monotonic(), end - time.monotonic())))
        window = time.monotonic() - started
    last_change = time.time()
    applied_at = _run_until(sched, lambda: tuple(sched.entries["busy"].args) == (changes,), 5,
                            "the last change applied")

    reads = _version_reads(seen)
    assert changes >= 8, f"set-up: only {changes} changes were made"
    assert 2 <= len(reads) <= int(window) + 1, \
        f"{len(reads)} reads of the change counter in {window:.1f} s with {changes} changes"
    assert applied_at - last_change <= RULE + SLACK, f"applied {applied_at - last_change:.2f}s late"


# --------------------------------------------------------------------------- (f) a name clash


def test_a_stored_schedule_named_like_a_beat_schedule_entry_stops_the_scheduler_at_setup(
        db_url, broker, apps, closing):
    """A stored schedule 'report' (owner alice) exists; a scheduler whose Celery config has a
    ``beat_schedule`` entry 'report' refuses to start: ConfigError naming the entry, the stored
    schedule and its owner, and the way out. The API refuses the reverse (adding a stored
    schedule with an entry's name) the same way. Nothing was sent.

    Fails if one silently shadows the other (two schedules claiming under one name).
    """
    db_app = _app(apps, db_url, broker, {})
    api = StoredSchedules(db_app)
    closing.append(api)
    api.add("report", "t.record", every(60), owner="alice")
    app = _app(apps, db_url, broker, {"report": {"task": "t.record", "schedule": every(1)},
                                      "other": {"task": "t.record", "schedule": every(1)}})

    with pytest.raises(ConfigError) as info:
        sched = Scheduler(app, lazy=False)
        closing.append(sched)
    message = str(info.value)
    assert "beat_schedule entry 'report'" in message, message
    assert "stored schedule 'report' of 'alice'" in message, message
    assert "remove" in message, message
    assert "'other'" not in message, message

    other_api = StoredSchedules(app)
    closing.append(other_api)
    with pytest.raises(ConfigError) as info2:
        other_api.add("other", "t.record", every(5))
    assert "'other'" in str(info2.value) and "beat_schedule" in str(info2.value), str(info2.value)
    assert other_api.get("other") is None
    assert _queued(app) == []


# --------------------------------------------------------------------------- (g) many changes, one read


def _apply_in_one_tick(sched: Scheduler) -> List[str]:
    """Wait out the rate limit, then one tick; the statements it executed (transaction control left out,
    and the node's own housekeeping too: its heartbeat and clock read fall into any tick on a loaded
    host, whatever the changes)."""
    time.sleep(scheduler_module.CHANGE_READ_MIN + 0.1)
    with _sql(sched) as seen:
        sched.tick()
    work = [s for s in _work(seen) if not _housekeeping(s)]
    # A moved change counter may also mean a backfill request: one read of the pending ones, served
    # after the due pass when the pass leaves room, so on a loaded host it can fall into this tick
    # or the next whatever the number of changes. One at most, never one per change.
    backfill_reads = [s for s in work if "cluster_beat_backfills" in s]
    assert len(backfill_reads) <= 1, backfill_reads
    return [s for s in work if "cluster_beat_backfills" not in s]


def _housekeeping(statement: str) -> bool:
    """The node's own upkeep, which falls into any tick on a loaded host whatever the changes: its
    heartbeat, its clock read, and the pause-after-failures look at runs failed since its last pass
    (beat/failures.py: one indexed read a housekeeping pass)."""
    failed_runs_read = "cluster_beat_claims.run_state =" in statement and "cluster_beat_claims.finished_at >" in statement
    return "cluster_beat_nodes" in statement or "clock_timestamp" in statement or "UTC_TIMESTAMP" in statement \
        or "strftime" in statement or failed_runs_read


@pytest.mark.timeout(120)
def test_a_hundred_changes_are_applied_in_one_read_with_a_constant_number_of_statements(
        db_url, broker, apps, closing):
    """500 stored schedules a year away and 20 due in 20 s or more; then 100 changes, each its own
    API call (its own version): 40 adds and 30 reschedules that bring schedules within the
    horizon, 10 disables and 10 removals of held ones, 10 argument changes of far ones. One tick
    applies them all: the held set is exactly what the changes say, and the tick executed the
    same statements as a tick applying a single change: one counter read, one read of the
    change feed (rows changed since the applied version, never the whole table), and the
    per-schedule states of those now held in one statement.

    Fails if changes are applied one read (or one statement) per change, or by reloading or
    walking the stored schedules.
    """
    app = _app(apps, db_url, broker, {"static": {"task": "t.record", "schedule": _far_schedule()}})
    api = StoredSchedules(app)
    closing.append(api)
    n = _every_first_in(25, 110, range(60, 116))
    near = every(n)
    api.add_many([{"name": f"far-{i:03d}", "task": "t.record", "schedule": _far_schedule()} for i in range(500)])
    api.add_many([{"name": f"near-{i:02d}", "task": "t.record", "schedule": near} for i in range(20)])
    sched = Scheduler(app, lazy=False)
    closing.append(sched)
    _run(sched, 1.2)
    assert len(sched.entries) == 21 and len(sched._queue) == 21
    # The first pruning pass (5 s after activation) must not fall into the ticks measured below:
    # on a slow machine the 100 API calls take longer than that.
    sched._next_prune = time.monotonic() + 3600

    # A single change first: what applying one costs.
    api.update("far-499", args=["one"])
    one = _apply_in_one_tick(sched)
    assert sched._stored_version == api.store.stored_version(), "set-up: the single change was not applied"

    t0 = time.monotonic()
    for i in range(40):
        api.add(f"new-{i:02d}", "t.record", near)
    for i in range(30):
        api.update(f"far-{i:03d}", schedule=near)
    for i in range(10):
        api.disable(f"near-{i:02d}")
    for i in range(10, 20):
        api.remove(f"near-{i:02d}")
    for i in range(30, 40):
        api.update(f"far-{i:03d}", args=[i])
    made_in = time.monotonic() - t0
    version = api.store.stored_version()
    hundred = _apply_in_one_tick(sched)
    print(f"\n100 changes made in {made_in:.1f}s; one change: {len(one)} statement(s), "
          f"100 changes: {len(hundred)} statement(s)")

    held = sorted(sched.entries)
    expected = sorted(["static"] + [f"new-{i:02d}" for i in range(40)] + [f"far-{i:03d}" for i in range(30)])
    assert sched._stored_version == version, "not every change was applied in that one tick"
    assert held == expected, sorted(set(held) ^ set(expected))
    assert _heap_names(sched) == expected
    assert all(sched._queue.get(f"new-{i:02d}") == near.next_fire(datetime.now(UTC)) for i in range(40))
    stored_reads = [s for s in hundred if STORED_TABLE in s]
    assert len(stored_reads) == 1 and "version >" in stored_reads[0], stored_reads
    assert len(_version_reads(hundred)) == 1, hundred
    assert all(s.upper().startswith("SELECT") for s in hundred), hundred
    assert len(hundred) == len(one) + 1, (one, hundred)  # + the states of the 70 now held (none for one)


# --------------------------------------------------------------------------- the stale sweep


def _sweep_after_change(db_url: str, broker: str, apps, closing, change: str):
    """Stored schedules 'live' and '<change>' (each once held in memory: every hour, and once only in
    SQL: a year away) have an occurrence claimed 5 s ago by a node that never sent it and is gone;
    then '<change>' and '<change>-far' are removed or disabled, and a scheduler (claim grace 1.5 s)
    runs past the grace and two sweeps. Returns (claim rows by name, messages by name)."""
    app = _app(apps, db_url, broker, {"static": {"task": "t.record", "schedule": _far_schedule()}},
               cluster_beat_claim_grace=1.5)
    api = StoredSchedules(app)
    closing.append(api)
    names = ["live", "live-far", change, f"{change}-far"]
    for name in names:
        api.add(name, "t.record", _far_schedule() if name.endswith("-far") else every(3600))
    dead = ClaimStore(db_url, node_id="dead-node")  # never heartbeats: gone as soon as its claims are old
    closing.append(dead)
    dead.open()
    at = datetime.now(UTC).replace(microsecond=0) - timedelta(seconds=5)
    assert len(dead.claim([Occurrence(name, at) for name in names])) == 4
    for name in names[2:]:
        if change == "removed":
            assert api.remove(name) is True
        else:
            api.disable(name)
    sched = Scheduler(app, lazy=False)
    closing.append(sched)
    _run_until(sched, lambda: len(_queued(app)) >= 2, 10, "the sweep resending the live schedules' claims")
    _run(sched, 1.5 + 1.0)  # past the grace once more, with another sweep (every grace / 3)
    rows = {name: [(r.scheduled_at, r.status) for r in _rows(db_url, name)] for name in names}
    sent = {name: _queued(app, name) for name in names}
    assert sent["live"] == sent["live-far"] == [at], "set-up: the sweep did not resend the live schedules' claims"
    return at, rows, sent


@pytest.mark.timeout(60)
def test_the_stale_sweep_does_not_resend_a_claim_of_a_removed_stored_schedule(db_url, broker, apps, closing):
    """A removed schedule never fires again, even through the stale-claim sweep: a claim a dead
    node left unsent is resent for the live schedules (held or only in SQL) but not for the
    removed ones, whose rows end ``failed`` instead of ``claimed`` for ever.

    Fails if the sweep resolves a removed schedule (its tombstone) and sends it."""
    at, rows, sent = _sweep_after_change(db_url, broker, apps, closing, "removed")
    assert sent["removed"] == [] and sent["removed-far"] == [], sent
    assert rows["removed"] == rows["removed-far"] == [(at, "failed")], rows


@pytest.mark.timeout(60)
def test_the_stale_sweep_does_not_resend_a_claim_of_a_disabled_stored_schedule(db_url, broker, apps, closing):
    """A disabled schedule sends nothing until enabled again (the API's promise for disable()),
    the stale-claim sweep included: a claim a dead node left unsent before the disable is resent
    for the live schedules but not for the disabled ones.

    Fails if the sweep resolves a disabled stored schedule and resends its old claim while it is
    disabled."""
    at, rows, sent = _sweep_after_change(db_url, broker, apps, closing, "disabled")
    assert sent["disabled"] == [] and sent["disabled-far"] == [], \
        f"a disabled schedule was sent while disabled: {sent}; claim rows: {rows}"


@pytest.mark.timeout(90)
def test_a_paused_old_leaders_late_hand_back_does_not_stop_a_stored_schedule(
        db_url, broker, apps, closing, monkeypatch):
    """With the lease and a horizon of 2 s, a stored ``every(n)`` fires and is handed back to SQL
    with its next occurrence. Then a paused old leader (a lower term) wakes and hands the same
    schedule back with the instant it had computed before (the first one): refused with
    StaleTermError; a node without a term writing it is not written either (never backwards).
    next_at stays the second occurrence, and the schedule fires at it.

    Fails if the hand-back is not fenced and may move next_at back: the window, which reads only
    forward, would never load the schedule again, and it would not fire until changed."""
    # A shorter horizon than the others' (the window is not what is checked here): the next fire
    # is still 3 s or more past it when the first one is handed back, and comes sooner.
    monkeypatch.setattr(stored_module, "HORIZON", HORIZON / 2)
    app = _app(apps, db_url, broker, {"static": {"task": "t.record", "schedule": _far_schedule()}},
               cluster_beat_redis_url=broker)
    api = StoredSchedules(app)
    closing.append(api)
    n = _every_first_in(2.0, 4.0, range(5, 9))
    first = api.add("sparse", "t.record", every(n)).next_at
    second = first + timedelta(seconds=n)
    sched = Scheduler(app, lazy=False)
    closing.append(sched)
    _run_until(sched, lambda: sched._active, 10, "taking the lease")
    _run_until(sched, lambda: bool(_queued(app, "sparse")) and "sparse" not in sched.entries, 10,
               "the first fire of 'sparse' and its hand-back")
    row = _stored_row(db_url, "sparse")
    assert row.next_at == second, "set-up: handed back with its next occurrence"
    old = ClaimStore(db_url, node_id="paused-old-leader")
    closing.append(old)
    old.open()

    with pytest.raises(StaleTermError):
        old.stored_set_next([("sparse", row.version, first)], term=sched._lease.term - 1)
    assert old.stored_set_next([("sparse", row.version, first)]) == 0
    assert _stored_row(db_url, "sparse").next_at == second
    _run_until(sched, lambda: len(_queued(app, "sparse")) >= 2, n + 6, "the second fire of 'sparse'")
    assert _queued(app, "sparse") == [first, second]
