"""Every claim-database call is bounded by ``cluster_beat_db_timeout``, a black hole included.

A black hole is a path that accepts bytes and never answers (``TcpProxy.hang()``):
no server-side timeout can answer through it, so the store's own deadline must
cut the connection. Each test switches a live, pooled connection into the black
hole and asserts that the call fails as ``StoreUnavailable`` within the bound
(plus a generous margin for a loaded machine), that one WARNING names the server
(masked URL, never SQL parameters), and that the store works again once the
path is restored. The worker test does the same to a real ``celery worker``
whose ledger store goes dark mid-operation: it gives up after ``ledger_wait``
instead of hanging until SIGKILL.
"""
from __future__ import annotations

import logging
import re
import sqlite3
import time
import uuid
from datetime import datetime, timedelta, timezone

import pytest
import redis
from celery import Celery
from sqlalchemy.engine import make_url

import procs
from known_schedules import known_schedule
from celery_cluster_beat.config.settings import load_settings
from celery_cluster_beat.errors import ConfigError
from celery_cluster_beat.schedules.instants import utc_iso
from celery_cluster_beat.schedules.occurrence import Occurrence
from celery_cluster_beat.store import ClaimStore, StoreUnavailable
from netproxy import TcpProxy

UTC = timezone.utc
#: The bound the tests set, and how late past it a call may fail on a loaded 2-core machine.
BOUND = 2.0
MARGIN = 13.0
WARNING_LINE = re.compile(r"no answer within [0-9.]+s \(cluster_beat_db_timeout\)")


def _occ(name: str, minute: int = 0) -> Occurrence:
    return Occurrence(name, datetime(2030, 1, 1, 12, minute, tzinfo=UTC))


@pytest.fixture(params=["postgresql", "mysql"])
def server_url(request):
    return request.getfixturevalue("pg_url" if request.param == "postgresql" else "mysql_url")


@pytest.fixture
def proxied(server_url):
    """(proxy, the server's URL through the proxy)."""
    url = make_url(server_url)
    with TcpProxy(url.host or "127.0.0.1", url.port or (5432 if url.get_backend_name() == "postgresql" else 3306)) as proxy:
        yield proxy, url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)


def _bounded(call, caplog) -> tuple[StoreUnavailable, float]:
    caplog.clear()
    started = time.monotonic()
    with pytest.raises(StoreUnavailable) as info:
        call()
    return info.value, time.monotonic() - started


@pytest.mark.timeout(120)
def test_a_black_hole_fails_each_call_within_the_bound_and_the_store_recovers(proxied, caplog):
    proxy, url = proxied
    caplog.set_level(logging.WARNING, logger="celery_cluster_beat.store.claims")
    store = ClaimStore(url, node_id="node-a", db_timeout=BOUND)
    store.open()
    try:
        secret = "schedule-" + uuid.uuid4().hex  # a SQL parameter: never in a log line
        assert store.claim([_occ(secret)], term=1) == [_occ(secret)]  # a pooled connection through the proxy
        proxy.hang()
        # The pooled connection (cut by the watchdog), then new ones (the driver's connect/read limits).
        for what, call in [("claim", lambda: store.claim([_occ(secret, 1)], term=1)),
                           ("heartbeat", lambda: store.heartbeat(scheduling=True, register=True)),
                           ("overview read", lambda: store.claims(secret))]:
            exc, took = _bounded(call, caplog)
            assert took < BOUND + MARGIN, (what, took)
            assert took >= BOUND * 0.9, (what, took)  # it waited for the bound, not failed at once
            assert WARNING_LINE.search(str(exc)), (what, exc)
            warnings = [r for r in caplog.records if r.levelno == logging.WARNING and WARNING_LINE.search(r.getMessage())]
            assert len(warnings) == 1, (what, [r.getMessage() for r in caplog.records])
            line = warnings[0].getMessage()
            assert f"127.0.0.1:{proxy.port}" in line and secret not in line, line
        proxy.restore()
        # Recovered without a restart: the next call works, or (a loaded host: a connection the pool
        # opened into the black hole is only found dead by the bound) the one after it. Each bounded.
        for attempt in range(3):
            started = time.monotonic()
            try:
                won = store.claim([_occ(secret, 2)], term=1)
                break
            except StoreUnavailable:
                assert time.monotonic() - started < BOUND + MARGIN
                assert attempt < 2, "the store did not recover once the path was restored"
        assert won == [_occ(secret, 2)]
        assert [r.scheduled_at for r in store.claims(secret)] == [_occ(secret).at, _occ(secret, 2).at]
        assert time.monotonic() - started < BOUND + MARGIN
    finally:
        proxy.restore()
        store.close()


@pytest.mark.timeout(60)
def test_a_statement_slower_than_the_bound_is_cancelled_by_the_server_and_the_connection_kept(server_url):
    """On a live server the server's own limit (inside the bound) answers first: the statement
    is cancelled, the call fails as StoreUnavailable, and the store's next call just works."""
    store = ClaimStore(server_url, node_id="node-a", db_timeout=BOUND)
    store.open()
    sleep = "SELECT pg_sleep(30)" if server_url.startswith("postgresql") else "SELECT SLEEP(30) FROM DUAL"
    try:
        started = time.monotonic()
        with pytest.raises(StoreUnavailable) as info:
            store._run(lambda conn: conn.exec_driver_sql(sleep).all())
            # MariaDB's SLEEP() returns 1 when its statement is interrupted rather than failing;
            # a result that late is the same failure to this test.
            raise StoreUnavailable(f"returned after {time.monotonic() - started:.1f}s")
        took = time.monotonic() - started
        assert took < BOUND + MARGIN, (took, info.value)
        assert store.db_now() is not None
    finally:
        store.close()


@pytest.mark.timeout(60)
def test_sqlite_waits_for_a_locked_file_no_longer_than_the_bound(tmp_path):
    path = tmp_path / "claims.sqlite3"
    store = ClaimStore(f"sqlite:///{path}", node_id="node-a", lock_timeout=60, db_timeout=1.0)
    store.open()
    holder = sqlite3.connect(path, isolation_level=None)
    try:
        holder.execute("BEGIN IMMEDIATE")  # another process's writer, holding the file
        started = time.monotonic()
        with pytest.raises(StoreUnavailable):
            store.claim([_occ("a")], term=1)
        assert time.monotonic() - started < 1.0 + MARGIN
        holder.execute("ROLLBACK")
        assert store.claim([_occ("a")], term=1) == [_occ("a")]
    finally:
        holder.close()
        store.close()


def test_the_bound_is_one_checked_setting():
    app = Celery("t", broker="redis://127.0.0.1:6379/0", set_as_current=False)
    assert load_settings(app.conf, has_result_backend=lambda: False).db_timeout == 15.0
    for bad in (0, -1, float("inf"), float("nan"), "10", 0.1, 10**9):
        app.conf.cluster_beat_db_timeout = bad
        with pytest.raises(ConfigError, match="cluster_beat_db_timeout"):
            load_settings(app.conf, has_result_backend=lambda: False)
        with pytest.raises(ConfigError, match="cluster_beat_db_timeout"):
            ClaimStore("sqlite://", node_id="n", db_timeout=bad)
    app.conf.cluster_beat_db_timeout = 3
    assert load_settings(app.conf, has_result_backend=lambda: False).db_timeout == 3.0


# --------------------------------------------------------------------------- a real worker

TASKS = '''
import redis as _redis
from celery_cluster_beat import LedgerTask

_rec = _redis.Redis.from_url({redis_url!r})


@app.task(bind=True, base=LedgerTask, name="t.quick", ledger_wait={ledger_wait!r})
def quick(self):
    _rec.rpush({runs_key!r}, self.request.id)
    return "ran"
'''


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_worker_whose_ledger_database_goes_dark_gives_up_after_ledger_wait(tmp_path, redis_url, pg_url):
    ledger_wait = 3.0
    runs_key = "ccbtest:dbtimeout:" + uuid.uuid4().hex[:10]
    url = make_url(pg_url)
    beat = ClaimStore(pg_url, node_id="beat-under-test")
    beat.open()
    rec = redis.Redis.from_url(redis_url)
    producer = Celery("dbtimeout-producer", broker=redis_url, set_as_current=False)
    with TcpProxy(url.host or "127.0.0.1", url.port or 5432) as proxy:
        worker_url = url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
        app = procs.write_app(tmp_path, broker=redis_url, db_url=worker_url, schedule="{}",
                              conf=f'{{"cluster_beat_db_timeout": {BOUND!r}}}',
                              tasks=TASKS.format(redis_url=redis_url, runs_key=runs_key, ledger_wait=ledger_wait))
        worker = procs.start_worker(app, tmp_path, "worker", concurrency=1)
        try:
            procs.wait_for(lambda: "ready." in worker.log() or not worker.alive(), 60, what="the worker to be ready")

            def publish(name: str) -> Occurrence:
                o = Occurrence(name, datetime.now(UTC).replace(microsecond=0) - timedelta(seconds=1))
                assert beat.claim([o]) == [o]
                assert beat.mark_sent([o]) == 1
                known_schedule(pg_url, o.schedule, "t.quick")
                headers = {"cluster_beat_schedule": o.schedule, "cluster_beat_scheduled_at": utc_iso(o.at),
                           "cluster_beat_node": "beat-under-test", "cluster_beat_catchup": False,
                           "cluster_beat_attempt": 1, "cluster_beat_max_run_time": 600.0}
                producer.send_task("t.quick", (), task_id=o.task_id, headers=headers, queue=app.queue)
                return o

            def ran(o: Occurrence) -> bool:
                return o.task_id.encode() in rec.lrange(runs_key, 0, -1)

            first = publish("dark-first")  # the worker's ledger store opens, its connection pooled
            procs.wait_for(lambda: ran(first), 60, what="the first run")
            time.sleep(0.5)  # its finish recorded (the connection back in the pool)
            proxy.hang()
            dark = publish("dark-second")
            published = time.monotonic()
            procs.wait_for(lambda: "LedgerUnavailable" in worker.log() or "claim database unavailable" in worker.log(),
                           60, what="the worker to give the run up")
            took = time.monotonic() - published
            log = worker.log()
            # ledger_wait, overrun by at most one call's bound (the call under way when it ran out)
            assert took < ledger_wait + BOUND + MARGIN, (took, log[-3000:])
            assert WARNING_LINE.search(log), log[-3000:]
            assert f"within {BOUND:g}s" in log, log[-3000:]  # the worker's store honours the setting
            assert not ran(dark), log[-3000:]
            assert worker.alive(), log[-3000:]
            proxy.restore()
            after = publish("dark-third")
            procs.wait_for(lambda: ran(after), 60, what="a run once the database answers again")
        finally:
            proxy.restore()
            worker.stop(timeout=5)
            beat.close()
            try:
                rec.delete(runs_key, app.queue)
            finally:
                rec.close()


# --------------------------------------------------------------------------- a real beat

@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_beat_whose_database_goes_dark_keeps_its_loop_backs_off_and_resumes(tmp_path, redis_url, pg_url):
    """Fails if the beat hangs inside a database call (no line, no back-off, and SIGTERM would
    not be handled until a SIGKILL), or does not schedule again once the path is restored."""
    url = make_url(pg_url)
    reader = ClaimStore(pg_url, node_id="reader")
    reader.open()
    with TcpProxy(url.host or "127.0.0.1", url.port or 5432) as proxy:
        beat_url = url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
        app = procs.write_app(tmp_path, broker=redis_url, db_url=beat_url, redis_url=None,
                              schedule="{'tick': {'task': 't.record', 'schedule': every(1)}}",
                              conf=f'{{"cluster_beat_db_timeout": {BOUND!r}, "cluster_beat_lock_ttl": 3.0}}')
        beat = procs.start_beat(app, tmp_path, "dark")
        try:
            def sent_since(at: datetime) -> bool:
                return any(r.status == "sent" and r.scheduled_at > at for r in reader.claims("tick"))

            procs.wait_for(lambda: sent_since(datetime.now(UTC) - timedelta(days=1)), 60, interval=0.2,
                           what="the beat sending through the proxy")
            proxy.hang()
            dark_at = time.monotonic()
            procs.wait_for(lambda: WARNING_LINE.search(beat.log()) is not None or not beat.alive(),
                           BOUND + MARGIN + 10, what="the beat's call cut off at the bound")
            assert beat.alive(), beat.log()[-3000:]
            assert f"within {BOUND:g}s" in beat.log(), beat.log()[-3000:]
            assert time.monotonic() - dark_at < BOUND * 3 + MARGIN, beat.log()[-3000:]
            time.sleep(BOUND * 2)  # a few more rounds of the back-off in the dark
            assert beat.alive(), beat.log()[-3000:]
            proxy.restore()
            restored = datetime.now(UTC)
            procs.wait_for(lambda: sent_since(restored), 60, interval=0.2,
                           what="the beat sending again once the database answers")
            proxy.hang()  # and a beat in the dark still stops on SIGTERM, within the bound
            time.sleep(0.5)
            stopping = time.monotonic()
            beat.signal(15)
            procs.wait_for(lambda: not beat.alive(), BOUND * 2 + MARGIN, what="the beat to stop on SIGTERM")
            assert time.monotonic() - stopping < BOUND * 2 + MARGIN
        finally:
            proxy.restore()
            beat.stop(timeout=5)
            reader.close()
            r = redis.Redis.from_url(redis_url)
            try:
                r.delete(app.queue)
            finally:
                r.close()
