"""Delivery under trouble, with the scheduler in-process: what it logs when its
claim store fails, how it reports a catch-up, that nothing undercuts its
back-off, and that idle ticks stay free of SQL.

The scheduler is a real :class:`Scheduler` driven the way beat drives it
(``tick()``, then sleep what it returns), on a real claim database and a real
Redis broker (the test's own queue, deleted afterwards). Failures are made for
real: a PostgreSQL table renamed or locked, or the database itself renamed or
closed to connections, under the running scheduler.
"""
from __future__ import annotations

import json
import logging
import time
import uuid
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from typing import Dict, Iterator, List, Optional

import pytest
import redis
import sqlalchemy as sa
from celery import Celery
from sqlalchemy.engine import make_url

import services
from celery_cluster_beat import cron, every
from celery_cluster_beat.beat.scheduler import Scheduler
from celery_cluster_beat.leader.lease import cluster_key, lease_keys
from celery_cluster_beat.schedules.occurrence import Occurrence
from celery_cluster_beat.store import ClaimStore

UTC = timezone.utc
PASSWORD = "Pw-s3cret-4711"  # PostgreSQL trusts local connections: the password is carried, never checked
#: Text that only SQL, its parameters or SQLAlchemy's statement dump would put in a log line.
SQL_TEXT = ("[SQL", "[parameters", "INSERT", "SELECT", "UPDATE ", "DELETE ", "cluster_beat_claims.")




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


def _app(apps: List[Celery], db: str, broker: str, schedule: Dict[str, dict], **conf) -> Celery:
    name = "ccb_delivery_" + uuid.uuid4().hex[:8]
    app = Celery(name, broker=broker)
    app.conf.update(task_default_queue="q_" + name, cluster_beat_db_url=db, cluster_beat_redis_url="",
                    beat_schedule=schedule, **conf)
    apps.append(app)
    return app


def _queued(app: Celery) -> List[dict]:
    client = redis.Redis.from_url(app.conf.broker_url)
    try:
        return [json.loads(raw)["headers"] for raw in reversed(client.lrange(app.conf.task_default_queue, 0, -1))]
    finally:
        client.close()


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


def _with_password(url: str) -> str:
    return make_url(url).set(password=PASSWORD).render_as_string(hide_password=False)


def _logged(caplog) -> List[str]:
    """Every captured record as an operator reads it: message plus any traceback."""
    out = []
    for rec in caplog.records:
        text = f"{rec.name} {rec.levelname} {rec.getMessage()}"
        if rec.exc_info:
            text += "\n" + logging.Formatter().formatException(rec.exc_info)
        out.append(text)
    return out


# --------------------------------------------------------------------------- 9. no SQL in logs


@contextmanager
def _pg_fault(kind: str, db_url: str) -> Iterator[None]:
    """Break the claim database under a running scheduler for the duration of the block."""
    name = make_url(db_url).database
    admin = sa.create_engine(services.PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    target = sa.create_engine(make_url(db_url).set(password=None))
    holder = None
    undo: List[str] = []
    try:
        if kind == "table-renamed":
            with target.begin() as conn:
                conn.exec_driver_sql("ALTER TABLE cluster_beat_claims RENAME TO cluster_beat_claims_away")
            undo.append("ALTER TABLE cluster_beat_claims_away RENAME TO cluster_beat_claims")
        elif kind == "table-locked":
            holder = target.connect()
            trans = holder.begin()
            holder.exec_driver_sql("LOCK TABLE cluster_beat_claims IN ACCESS EXCLUSIVE MODE")
        elif kind == "database-renamed":
            with admin.connect() as conn:
                conn.exec_driver_sql(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
                undo.append("allow")
                # Terminated sessions take a moment to go: retry while the server says they are there.
                deadline = time.monotonic() + 30
                while True:
                    conn.execute(sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                         "WHERE datname = :d AND pid <> pg_backend_pid()"), {"d": name})
                    try:
                        conn.exec_driver_sql(f'ALTER DATABASE "{name}" RENAME TO "{name}_away"')
                        break
                    except sa.exc.OperationalError as exc:
                        if "being accessed by other users" not in str(exc) or time.monotonic() > deadline:
                            raise
                        time.sleep(0.2)
                undo.insert(0, "rename")
        else:  # pragma: no cover
            raise AssertionError(kind)
        yield
    finally:
        if holder is not None:
            trans.rollback()
            holder.close()
        if undo and kind == "table-renamed":
            with target.begin() as conn:
                conn.exec_driver_sql(undo[0])
        if kind == "database-renamed":
            with admin.connect() as conn:
                if "rename" in undo:
                    conn.exec_driver_sql(f'ALTER DATABASE "{name}_away" RENAME TO "{name}"')
                if "allow" in undo:
                    conn.exec_driver_sql(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
        target.dispose()
        admin.dispose()


#: fault -> what the store error's one line must say (class name and the server's first line)
FAULTS = {
    "table-renamed": ("UndefinedTable", 'relation "cluster_beat_claims" does not exist'),
    "table-locked": ("LockNotAvailable", "lock timeout"),
    "database-renamed": ("OperationalError", "does not exist"),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_failing_claim_store_is_logged_without_sql_parameters_or_password(fault, pg_url, broker, apps, caplog):
    """The claim database (PostgreSQL, URL with a password) fails under a running
    scheduler: its claims table renamed away (the server's error quotes the
    INSERT on its second line), locked by another session (lock timeout), or
    the database itself renamed (no connection possible). The scheduler logs
    the failure (an ERROR naming the claim store, the error class and the
    server's first line, the URL masked) and keeps running, but no record it
    logs carries SQL text, bound parameters, SQLAlchemy's ``[SQL: ...]`` dump or
    the password; once the fault is undone it sends again.

    Fails if an error is logged with ``str()`` of SQLAlchemy's exception (which
    appends the statement and its parameters), with a traceback of it
    (``logger.exception``), or with the raw URL.
    """
    db = _with_password(pg_url)
    app = _app(apps, db, broker, {"tick": {"task": "t.record", "schedule": every(1)}},
               cluster_beat_claim_grace=3.0, cluster_beat_node_id="node-logs")
    caplog.set_level(logging.DEBUG, logger="celery_cluster_beat")
    sched = Scheduler(app, lazy=False)
    try:
        _run(sched, 2.5)
        sent_before = len(_queued(app))
        assert sent_before >= 1, "nothing sent before the fault"
        caplog.clear()
        with _pg_fault(fault, pg_url):
            _run(sched, 4.0)
            during = _logged(caplog)
            sent_during = len(_queued(app))
        # Back-off is at most 4 s after three failures: 15 s is plenty to resume.
        deadline = time.monotonic() + 15
        while len(_queued(app)) <= sent_during and time.monotonic() < deadline:
            _run(sched, 0.5)
        resumed = len(_queued(app)) > sent_during
        everything = _logged(caplog)
    finally:
        sched.close()

    errors = [line for line in during if " ERROR " in line and "claim store" in line]
    assert errors, "the failure was not logged:\n" + "\n".join(during)
    cls, first_line = FAULTS[fault]
    assert any(cls in line and first_line in line for line in errors), errors
    assert any("***" in line for line in errors), errors  # the URL is named, masked
    leaks = [line for line in everything if any(t in line for t in SQL_TEXT) or PASSWORD in line]
    assert not leaks, "SQL, parameters or the password in the log:\n" + "\n".join(leaks)
    assert resumed, "the scheduler did not send again after the fault was undone:\n" + "\n".join(everything[-20:])


# --------------------------------------------------------------------------- 10. one catch-up line a pass


def _quiet_minute() -> datetime:
    """Wait until we are 3 s past a minute boundary and 5 s before the next; the last boundary."""
    while True:
        now = time.time()
        into = now % 60
        if 3 <= into <= 55:
            return datetime.fromtimestamp(now - into, UTC)
        time.sleep(60 - into + 3.05 if into > 55 else 3.05 - into)


def test_a_catch_up_of_fifty_schedules_is_one_warning_line_not_fifty(db_url, broker, apps, caplog):
    """50 every-minute schedules last ran two hours ago (their occurrences claimed
    and sent by an earlier beat). The scheduler starts, sends each one's latest
    occurrence once (catch-up ``latest``) and records the rest ``missed``; its log
    has exactly one WARNING about the catch-up for that pass, with the number of
    occurrences missed (as many as the rows recorded), the number of schedules and
    the first names, and no WARNING per schedule (the details are at DEBUG).

    Fails if the per-schedule catch-up line goes back to WARNING (50 lines) or the
    summary miscounts.
    """
    names = [f"job-{i:02d}" for i in range(50)]
    schedule = {n: {"task": "t.record", "schedule": every(60)} for n in names}
    app = _app(apps, db_url, broker, schedule, cluster_beat_node_id="new-node")
    history = ClaimStore(db_url, node_id="old-node")
    history.open()
    sched: Optional[Scheduler] = None
    try:
        last_ran = _quiet_minute() - timedelta(hours=2)
        ran = [Occurrence(n, last_ran) for n in names]
        assert history.claim(ran) == ran and history.mark_sent(ran) == len(ran)
        caplog.set_level(logging.DEBUG, logger="celery_cluster_beat")
        sched = Scheduler(app, lazy=False)
        deadline = time.monotonic() + 60
        while len(_queued(app)) < 50 and time.monotonic() < deadline:
            _run(sched, 0.2)
        records = [r for r in caplog.records if r.name.startswith("celery_cluster_beat")]
        rows = history.claims()
    finally:
        if sched is not None:
            sched.close()
        history.close()

    queued = _queued(app)
    assert sorted(h["cluster_beat_schedule"] for h in queued) == names, "one catch-up send per schedule"
    missed = [r for r in rows if r.status == "missed"]
    assert len(missed) >= 50 * 118  # two hours of minutes, the last one sent
    summaries = [r.getMessage() for r in records if r.levelno >= logging.WARNING and "catch-up" in r.getMessage()]
    assert len(summaries) == 1, summaries
    line = summaries[0]
    assert f"{len(missed)} occurrence(s) of 50 schedule(s) missed" in line, (line, len(missed))
    assert "(job-00, job-01, job-02, job-03, job-04, ...)" in line, line
    # no per-schedule warnings (the start-up line naming the entries left unguarded is one line for all)
    loud = [r.getMessage() for r in records if r.levelno >= logging.WARNING and "job-4" in r.getMessage()
            and "overlap guard off" not in r.getMessage()]
    assert not loud, loud
    details = [r for r in records if r.levelno == logging.DEBUG and "missed (catch-up policy" in r.getMessage()]
    assert len(details) == 50


# --------------------------------------------------------------------------- 11. buffer_one and the back-off


def test_a_buffered_occurrence_does_not_undercut_the_store_back_off(pg_url, broker, apps, caplog):
    """A schedule under ``buffer_one`` has an occurrence waiting in the buffer (its
    previous run is STARTED in the Redis result backend) when its claim
    database stops accepting connections. Beat's loop (tick, then sleep what it
    returns) must honour the store back-off: over 3 s at most 20 ticks happen,
    not a busy loop polling the buffer (hundreds a second).

    Fails if the buffer's 0.25 s poll, or a due fire, made ``_sleep_time`` return
    less than the back-off while the store is down.
    """
    # A name of its own: task ids come from (name, instant), and the result backend is shared
    # with tests running meanwhile (one forgetting "job" at the same instant would end this run).
    job = f"job-{uuid.uuid4().hex[:8]}"
    app = _app(apps, pg_url, broker, {job: {"task": "t.record", "schedule": every(1), "overlap": "buffer_one"}},
               result_backend=broker, cluster_beat_node_id="node-buffer")
    name = make_url(pg_url).database
    # History: the previous run of "job" was sent a moment ago and is running.
    history = ClaimStore(pg_url, node_id="old-node")
    history.open()
    now = datetime.now(UTC).replace(microsecond=0)
    previous = Occurrence(job, now - timedelta(seconds=1))
    try:
        assert history.claim([previous]) == [previous] and history.mark_sent([previous]) == 1
    finally:
        history.close()
    app.backend.store_result(previous.task_id, None, "STARTED")
    admin = sa.create_engine(services.PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    caplog.set_level(logging.INFO, logger="celery_cluster_beat")
    sched = Scheduler(app, lazy=False)
    closed = False
    try:
        deadline = time.monotonic() + 15
        while sched._guard.next_check_in() is None and time.monotonic() < deadline:
            _run(sched, 0.1)
        assert sched._guard.next_check_in() is not None, "no occurrence was buffered"
        with admin.connect() as conn:
            conn.exec_driver_sql(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
            closed = True
            conn.execute(sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                 "WHERE datname = :d AND pid <> pg_backend_pid()"), {"d": name})
        caplog.clear()
        ticks = _run(sched, 3.0)
        still_buffered = sched._guard.next_check_in() is not None
        logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    finally:
        if closed:
            with admin.connect() as conn:
                conn.exec_driver_sql(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
        sched.close()
        admin.dispose()
        app.backend.forget(previous.task_id)
    print(f"\n{ticks} ticks in 3 s with the store down and an occurrence buffered")
    assert still_buffered, "the buffered occurrence went away: the test did not exercise the buffer"
    assert any("claim store" in m for m in logged), logged  # the outage was noticed: back-off in force
    assert ticks <= 20, f"{ticks} ticks in 3 s: the back-off was undercut"


# --------------------------------------------------------------------------- 12. idle ticks issue no SQL


def _far_schedule():
    """A cron whose next fire is at least a day away (yearly instants, two candidates)."""
    now = datetime.now(UTC)
    for expr in ("0 0 29 2 *", "0 12 1 7 *"):
        sched = cron(expr, tz="UTC")
        if sched.next_fire(now) - now > timedelta(days=1):
            return sched
    raise AssertionError("no far-away schedule found")  # pragma: no cover


@contextmanager
def _statements() -> Iterator[List[str]]:
    seen: List[str] = []

    def count(conn, cursor, statement, parameters, context, executemany):
        seen.append(statement)

    sa.event.listen(sa.engine.Engine, "before_cursor_execute", count)
    try:
        yield seen
    finally:
        sa.event.remove(sa.engine.Engine, "before_cursor_execute", count)


@pytest.mark.parametrize("lease", [False, True], ids=["no-lease", "lease"])
def test_idle_ticks_issue_no_sql_housekeeping_runs_only_every_third_of_the_grace(lease, tmp_path, broker,
                                                                                  redis_url, apps):
    """Right after start (and, with a lease, right after becoming leader), 200
    ticks with nothing due issue no SQL statement at all: housekeeping
    (heartbeat, settle, stale sweep) is due only every ``claim_grace / 3``
    (here 10 s). With ``claim_grace`` 1.5 s the same idle loop does housekeep,
    every 0.5 s and no more often: the heartbeats counted over 2.5 s are at
    least 1 and at most elapsed / 0.5 + 1.

    Fails if a tick heartbeats, sweeps or reads the store on every call (the
    first part), or if housekeeping never runs or runs more often (the second).
    """
    far = _far_schedule()
    schedule = {f"entry-{i:03d}": {"task": "t.record", "schedule": far} for i in range(100)}
    results = {}
    for grace in (30.0, 1.5):
        app = _app(apps, f"sqlite:///{tmp_path}/claims-{grace:g}.sqlite3", broker, schedule,
                   cluster_beat_claim_grace=grace, cluster_beat_node_id=f"node-{grace:g}")
        if lease:
            app.conf.cluster_beat_redis_url = broker
        sched = Scheduler(app, lazy=False)
        try:
            started = time.monotonic()
            if lease:
                sched.tick()  # takes the lease and activates (reads the store)
                assert sched._active, "did not become leader"
            if grace == 30.0:
                with _statements() as seen:
                    sleeps = [sched.tick() for _ in range(200)]
                assert time.monotonic() - started < grace / 3, "the host is too slow for this test"
                idle_took = time.monotonic() - started
                assert all(0 < s <= sched.max_interval for s in sleeps), sorted(sleeps)[:5]
                results[grace] = seen
            else:
                with _statements() as seen:
                    _run(sched, 2.5)
                elapsed = time.monotonic() - started
                beats = [s for s in seen if "cluster_beat_nodes" in s and s.lstrip().upper().startswith("INSERT")]
                results[grace] = (beats, elapsed, seen)
        finally:
            sched.close()
    # The stored-schedule change counter is the change feed, not housekeeping: with a lease it
    # is read every 5 s without a notice, or every second while the notice channel is not up
    # yet (a loaded host). At most that often; nothing else.
    feed = [s for s in results[30.0] if "version" in s or s == "BEGIN"]
    assert [s for s in results[30.0] if s not in feed] == []
    assert len(feed) <= 2 * (idle_took + 1), feed
    beats, elapsed, seen = results[1.5]
    assert 1 <= len(beats) <= elapsed / 0.5 + 1, (len(beats), elapsed, seen)


def test_a_buffered_occurrence_whose_claim_fails_is_not_lost(pg_url, broker, apps):
    """``buffer_one`` keeps one occurrence while the previous run is in flight.
    If the previous run finishes while the claim database is unreachable, the
    buffered occurrence's claim fails; it must not vanish: once the database is
    back it is sent (or, at least, accounted for by a claim row: every
    occurrence ends sent, skipped, missed or failed).

    Fails if the guard drops the occurrence from its buffer before its claim
    has succeeded (no row, no message for that instant, ever).
    """
    from celery_cluster_beat import signals

    # A name of its own: task ids come from (name, instant), and the result backend is shared
    # with tests running meanwhile (one forgetting "job" at the same instant would end this run).
    job = f"job-{uuid.uuid4().hex[:8]}"
    app = _app(apps, pg_url, broker, {job: {"task": "t.record", "schedule": every(1), "overlap": "buffer_one"}},
               result_backend=broker, cluster_beat_node_id="node-buffer")
    name = make_url(pg_url).database
    history = ClaimStore(pg_url, node_id="old-node")
    history.open()
    previous = Occurrence(job, datetime.now(UTC).replace(microsecond=0) - timedelta(seconds=1))
    try:
        assert history.claim([previous]) == [previous] and history.mark_sent([previous]) == 1
    finally:
        history.close()
    app.backend.store_result(previous.task_id, None, "STARTED")
    buffered: List[datetime] = []

    def on_outcome(sender=None, outcome=None, scheduled_at=None, **kwargs):
        if outcome == "buffered":
            buffered.append(scheduled_at)

    signals.occurrence_handled.connect(on_outcome, weak=False)
    admin = sa.create_engine(services.PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    sched = Scheduler(app, lazy=False)
    closed = False
    try:
        deadline = time.monotonic() + 15
        while not buffered and time.monotonic() < deadline:
            _run(sched, 0.1)
        assert len(buffered) == 1, buffered
        with admin.connect() as conn:
            conn.exec_driver_sql(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false')
            closed = True
            conn.execute(sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                 "WHERE datname = :d AND pid <> pg_backend_pid()"), {"d": name})
        app.backend.store_result(previous.task_id, 1, "SUCCESS")  # the previous run ends meanwhile
        _run(sched, 2.0)
        with admin.connect() as conn:
            conn.exec_driver_sql(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
            closed = False
        reader = ClaimStore(pg_url, node_id="reader")
        reader.open()
        try:
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not reader.claims(job, since=buffered[0])[:1]:
                _run(sched, 0.5)
            _run(sched, 2.0)
            rows = {r.scheduled_at: r.status for r in reader.claims(job)}
        finally:
            reader.close()
    finally:
        signals.occurrence_handled.disconnect(on_outcome)
        if closed:
            with admin.connect() as conn:
                conn.exec_driver_sql(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true')
        sched.close()
        admin.dispose()
        app.backend.forget(previous.task_id)
    sent = [h["cluster_beat_scheduled_at"] for h in _queued(app)]
    # Accounted for: sent once the store is back (what buffer_one promises), or at least recorded.
    assert buffered[0] in rows, (buffered[0], sorted(rows.items()), sent)
