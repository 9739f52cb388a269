"""The scheduler's SQL tick claims: each occurrence sent at most once, by one of
several racing ``celery beat -S celery_cluster_beat.Scheduler`` processes.

Real beat processes, real claim databases (SQLite file, PostgreSQL, MariaDB),
real Redis brokers; what was sent is read from the messages waiting in the
test's own queue (nobody consumes them), what was decided from the claim rows.
Failures are made for real: a broker ``redis-server`` killed and restarted, a
PostgreSQL database closed to connections. A few tests drive one scheduler
in-process to count SQL statements and to stall its loop on purpose.

Times: every schedule here is ``every(1)`` (whole UTC seconds). Processes are
killed, stopped and faults injected half-way between two seconds, while every
node sleeps, so no test depends on interrupting a claim/send by luck.
"""
from __future__ import annotations

import base64
import collections
import json
import math
import signal
import time
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import List, Optional
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis
import sqlalchemy as sa
from celery import Celery
from celery.signals import after_task_publish
from sqlalchemy.engine import make_url

import services
from celery_cluster_beat import Scheduler, cron, every
from celery_cluster_beat.schedules.occurrence import Occurrence, occurrence_task_id
from celery_cluster_beat.store import ClaimStore
from procs import DEFAULT_TASKS, App, Proc, start_beat, wait_for, write_app

UTC = timezone.utc
BROKER_DB = 7  # a Redis database of these tests' own; every app also has its own queue
EVERY_SECOND = "{'tick': {'task': 't.record', 'schedule': every(1)}}"
GRACE = 2.0  # cluster_beat_claim_grace for the process tests: keeps the resend wait short
OUR_HEADERS = {"cluster_beat_schedule", "cluster_beat_scheduled_at", "cluster_beat_node", "cluster_beat_catchup",
               "cluster_beat_attempt", "cluster_beat_max_run_time", "celery_beat_task"}


# --------------------------------------------------------------------------- helpers


def _broker_url(redis_url: str) -> str:
    return urlunsplit(urlsplit(redis_url)._replace(path=f"/{BROKER_DB}"))


@pytest.fixture
def broker(redis_url) -> str:
    return _broker_url(redis_url)


@pytest.fixture
def cleanup_queues():
    """Delete the queues of the test's apps afterwards (nobody consumes them)."""
    apps: List[App] = []
    yield apps
    for app in apps:
        try:
            client = redis.Redis.from_url(app.broker, socket_connect_timeout=2)
            client.delete(app.queue)
            client.close()
        except redis.RedisError:
            pass  # a throwaway broker that is gone already


def _at(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def _sleep_to_half_second() -> float:
    """Sleep until the next x.5 s of the wall clock (every node sleeps then) and return the time."""
    now = time.time()
    time.sleep((0.5 - now % 1.0) % 1.0 or 1.0)
    return time.time()


def _second(t: float) -> datetime:
    """The whole UTC second at or before epoch time *t*."""
    return datetime.fromtimestamp(math.floor(t), UTC)


def _seconds(first: datetime, last: datetime) -> List[datetime]:
    n = int((last - first).total_seconds())
    return [first + timedelta(seconds=i) for i in range(n + 1)]


def _read_store(url: str):
    store = ClaimStore(url, node_id="reader")
    store.open()
    try:
        return store.claims(), store.schedule_states()
    finally:
        store.close()


def _node_of(proc: Proc, nodes) -> Optional[str]:
    return next((n for n in nodes if n.endswith(f":{proc.pid}")), None)


# --------------------------------------------------------------------------- three racing beats


class ClusterRun:
    """What one run of three lease-less beats sharing a claim database left behind."""

    def __init__(self, **kw) -> None:
        self.__dict__.update(kw)


def _run_three_beats(tmp: Path, db_url: str, broker: str) -> ClusterRun:
    app = write_app(tmp, broker=broker, db_url=db_url, schedule=EVERY_SECOND, redis_url="",
                    conf=f"{{'cluster_beat_claim_grace': {GRACE}}}")
    beats = [start_beat(app, tmp, f"b{i}") for i in range(3)]
    try:
        wait_for(lambda: all("cluster-beat: node" in b.log() for b in beats), 45, what="three beats started")
        first_all_up = _second(time.time()) + timedelta(seconds=1)
        wait_for(lambda: any(_at(m[1]) >= first_all_up for m in app.sent_occurrences()), 20,
                 what="a message after all three beats started")

        # A node that claims an occurrence and dies before sending it: its row stays 'claimed'.
        # Opened (schema check, session set-up) before the half second: only the claim itself
        # races the live beats' claim-ahead, not a loaded host's connection set-up.
        dead = ClaimStore(db_url, node_id="dead-node")
        dead.open()
        dead.current_term()  # a read: the pooled connection is up
        t0 = _sleep_to_half_second()
        orphan = Occurrence("tick", _second(t0) + timedelta(seconds=2))
        try:
            assert dead.claim([orphan]) == [orphan], "the live beats claimed the orphan first: test set-up too slow"
        finally:
            dead.close()

        time.sleep(3.6)
        _sleep_to_half_second()
        # SIGKILL the node that sent the latest message: the others must carry on.
        latest = app.sent_occurrences()[-1][2]
        victim = next(b for b in beats if latest.endswith(f":{b.pid}"))
        victim.signal(signal.SIGKILL)
        t_kill = time.time()

        time.sleep(4.6)
        _sleep_to_half_second()
        survivors_alive = [b.alive() for b in beats if b is not victim]
        t_stop = time.time()
        for b in beats:
            b.signal(signal.SIGTERM)
    finally:
        for b in beats:
            b.stop()
    client = redis.Redis.from_url(broker)
    try:
        messages = app.queued_messages()
        client.delete(app.queue)
    finally:
        client.close()
    claims, states = _read_store(db_url)
    return ClusterRun(app=app, beats=beats, victim=victim, orphan=orphan, t_kill=t_kill, t_stop=t_stop,
                      first_all_up=first_all_up, survivors_alive=survivors_alive, messages=messages,
                      claims=claims, states=states, logs={b.pid: b.log() for b in beats})


@pytest.fixture(scope="module", params=["sqlite", "postgresql", "mysql"])
def cluster_run(request, tmp_path_factory, redis_url) -> ClusterRun:
    """One run per dialect, shared by the tests that read its messages and its rows."""
    tmp = tmp_path_factory.mktemp(f"cluster-{request.param}")
    broker = _broker_url(redis_url)
    if request.param == "sqlite":
        return _run_three_beats(tmp, f"sqlite:///{tmp}/claims.sqlite3", broker)
    try:
        cm = services.fresh_database(request.param)
        url = cm.__enter__()
    except services.ServiceUnavailable as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        return _run_three_beats(tmp, url, broker)
    finally:
        cm.__exit__(None, None, None)


def _occurrences(run: ClusterRun):
    out = []
    for msg in run.messages:
        h = msg["headers"]
        out.append((h["cluster_beat_schedule"], _at(h["cluster_beat_scheduled_at"]), h["cluster_beat_node"], h["id"]))
    return out


def _span(run: ClusterRun, occ) -> List[datetime]:
    """Every second from the first message to the last one before the stop signal."""
    return _seconds(min(at for _, at, _, _ in occ), _second(run.t_stop) - timedelta(seconds=1))


@pytest.mark.slow
def test_three_racing_beats_send_each_occurrence_exactly_once_and_survive_a_sigkill(cluster_run):
    """Three lease-less beats race on one claim database; one is SIGKILLed half-way.

    Every occurrence of the observed span was queued exactly once (no duplicate
    scheduled_at, no gap), each with the uuid5 task id of its occurrence; an
    occurrence a node claimed and never sent (it "died") is resent by a live
    node with the same task id within claim_grace; after the kill only
    survivors send; at least two nodes won claims (the race is real).
    """
    run = cluster_run
    occ = _occurrences(run)
    assert all(run.survivors_alive), "a surviving beat exited:\n" + "\n".join(run.logs.values())
    assert occ, "nothing was sent"
    assert {s for s, _, _, _ in occ} == {"tick"}
    counts = collections.Counter(at for _, at, _, _ in occ)
    dups = sorted(at.isoformat() for at, n in counts.items() if n > 1)
    assert not dups, f"occurrences sent more than once: {dups}"
    missing = [at.isoformat() for at in _span(run, occ) if at not in counts]
    assert not missing, f"occurrences never sent: {missing}"
    for _, at, _, task_id in occ:
        assert task_id == occurrence_task_id("tick", at)

    nodes = {n for _, _, n, _ in occ}
    victim_node = _node_of(run.victim, nodes)
    assert victim_node is not None, "the killed node had sent something: that is why it was picked"
    kill_second = _second(run.t_kill)
    assert all(at <= kill_second for _, at, n, _ in occ if n == victim_node), "a killed node kept sending"
    after_kill = [n for _, at, n, _ in occ if at > kill_second]
    assert after_kill and victim_node not in after_kill
    assert len(nodes) >= 2, f"only {nodes} sent: the three beats did not race"
    assert "dead-node" not in nodes

    # The orphaned claim: resent once, by a live node, same task id, within claim_grace of its claim.
    orphan = [(at, n, tid) for _, at, n, tid in occ if at == run.orphan.at]
    assert len(orphan) == 1
    at, node, tid = orphan[0]
    assert tid == run.orphan.task_id == occurrence_task_id("tick", run.orphan.at)
    row = next(r for r in run.claims if r.scheduled_at == run.orphan.at)
    assert row.node == node and row.status == "sent"
    # claimed 1.5 s before its instant; stale GRACE s later; sweeps run every GRACE/2 at a tick
    assert row.sent_at - run.orphan.at <= timedelta(seconds=GRACE + 2.5), row
    pid = int(node.rsplit(":", 1)[1])
    assert f"Sending due task tick (t.record) for {run.orphan.at.isoformat()} (resent)" in run.logs[pid]


@pytest.mark.slow
def test_three_racing_beats_leave_one_sent_claim_row_per_message_and_matching_counters(cluster_run):
    """After the race, ``cluster_beat_claims`` holds one row per queued message
    (same task id, same node, status ``sent``), nothing missed or failed in the
    span, and ``schedule_states()`` counts sent == messages, claim_lost > 0
    (three nodes raced for every occurrence), resent >= 1 (the orphan)."""
    run = cluster_run
    occ = _occurrences(run)
    by_at = {at: (n, tid) for _, at, n, tid in occ}
    rows = {r.scheduled_at: r for r in run.claims}
    assert len(rows) == len(run.claims)
    span = _span(run, occ)
    for at in span:
        r = rows.get(at)
        assert r is not None and r.status == "sent", (at, r)
        assert (r.node, r.task_id) == by_at[at], r
        assert r.sent_at is not None and r.attempts >= 1
    for at, r in rows.items():
        if r.status == "sent":
            assert at in by_at, f"row says sent but no message: {r}"
        else:  # only what was in flight when the beats were stopped
            assert at > span[-1], f"unexpected {r.status} row: {r}"
    for at in by_at:
        assert rows[at].status == "sent"

    states = {s.name: s for s in run.states}
    assert set(states) == {"tick"}
    st = states["tick"]
    assert st.sent == len(occ), st
    assert st.claim_lost > 0, st
    assert st.resent >= 1, st
    assert st.failed == 0 and st.missed == 0, st
    assert st.last_occurrence >= span[-1]


# --------------------------------------------------------------------------- the broker goes away


@pytest.mark.slow
def test_a_broker_outage_is_retried_without_crashing_or_duplicating(tmp_path, throwaway_redis):
    """The broker (a throwaway redis-server) is SIGKILLed for about 3 s and
    restarted on the same port: beat keeps running and logs the error; the rows of
    occurrences that fell due meanwhile carry the error as ``reason`` and end up
    ``sent`` (retried 1, 2, 4, 8 s apart) or ``failed`` after the last attempt;
    no occurrence is queued twice."""
    server = throwaway_redis
    db = f"sqlite:///{tmp_path}/claims.sqlite3"
    app = write_app(tmp_path, broker=server.url, db_url=db, schedule=EVERY_SECOND, redis_url="",
                    conf=f"{{'cluster_beat_claim_grace': {GRACE}}}")
    beat = start_beat(app, tmp_path, "b")
    try:
        wait_for(lambda: len(app.sent_occurrences()) >= 2, 30, what="two messages before the outage")
        _sleep_to_half_second()
        before = app.sent_occurrences()  # the restarted server starts empty: keep what it held
        server.kill()
        t_down = time.time()
        time.sleep(3.0)
        t_restart = time.time()
        server.start()
        t_up = time.time()
        # Due while the broker was surely down: after the kill, up to the restart. The seconds
        # between the restart and its first PING answer (normally none) may go either way.
        down_first = _second(t_down) + timedelta(seconds=1)
        down_last = _second(t_restart)
        up_first = _second(t_up) + timedelta(seconds=1)

        def settled() -> bool:
            claims, _ = _read_store(db)
            outage = [r for r in claims if down_first <= r.scheduled_at <= down_last]
            return bool(outage) and all(r.status in ("sent", "failed") for r in outage)

        wait_for(settled, 30, interval=0.5, what="the outage's occurrences to be sent or given up")
        wait_for(lambda: any(_at(m[1]) > down_last + timedelta(seconds=1) for m in app.sent_occurrences()), 15,
                 what="on-time sends after the outage")
        _sleep_to_half_second()
        assert beat.alive(), beat.log()
        t_stop = time.time()
        after = app.sent_occurrences()
    finally:
        beat.stop()
        server.kill()
    log = beat.log()
    assert "ERROR" in log and "failed" in log, log

    occ = [(_at(at), node, tid) for _, at, node, tid in before + after]
    counts = collections.Counter(at for at, _, _ in occ)
    assert not [at for at, n in counts.items() if n > 1], f"queued twice: {counts}"
    for at, _, tid in occ:
        assert tid == occurrence_task_id("tick", at)

    claims, states = _read_store(db)
    rows = {r.scheduled_at: r for r in claims}
    outage = [r for r in claims if down_first <= r.scheduled_at <= down_last]
    assert len(outage) >= 2, outage
    for r in outage:
        assert r.reason and "Error" in r.reason, r  # the publish error, kept for operators
        assert r.status in ("sent", "failed"), r
        assert r.attempts >= 2, r
        if r.status == "sent":
            assert r.scheduled_at in counts, f"row sent but its message is not queued: {r}"
            assert r.sent_at - r.scheduled_at <= timedelta(seconds=16), r  # within 1+2+4+8 s of retries
        else:
            assert r.scheduled_at not in counts
    assert any(r.status == "sent" for r in outage), "nothing of the outage was delivered after the broker came back"
    # before and after the outage: everything sent on time, once
    for at in _seconds(min(counts), _second(t_stop) - timedelta(seconds=1)):
        r = rows.get(at)
        assert r is not None, at
        assert (r.status == "sent") == (at in counts), r
        if at < down_first or at >= up_first:
            assert r.status == "sent" and r.reason is None, r
        else:  # the outage, and the restart's own second(s)
            assert r.status in ("sent", "failed"), r
    st = {s.name: s for s in states}["tick"]
    assert st.sent == sum(1 for r in claims if r.status == "sent")
    assert st.failed == sum(1 for r in claims if r.status == "failed")
    assert st.last_error and "Error" in st.last_error


# --------------------------------------------------------------------------- the claim store goes away


@pytest.mark.slow
def test_an_unreachable_claim_database_stops_sending_until_it_is_back_then_latest_catches_up(
        tmp_path, pg_url, broker, cleanup_queues):
    """The claim database (PostgreSQL) refuses connections for ~4 s: beat keeps
    running, logs the error and queues nothing meanwhile (at most once: no claim,
    no send); once the database is back it resumes by itself, sends the most
    recent due occurrence once (catch-up ``latest``) and records the others as
    ``missed``; no occurrence is sent twice, none is left unaccounted for."""
    name = make_url(pg_url).database
    admin = sa.create_engine(services.PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    app = write_app(tmp_path, broker=broker, db_url=pg_url, schedule=EVERY_SECOND, redis_url="",
                    conf=f"{{'cluster_beat_claim_grace': {GRACE}}}")
    cleanup_queues.append(app)
    beat = start_beat(app, tmp_path, "b")
    blocked = False
    try:
        wait_for(lambda: len(app.sent_occurrences()) >= 2, 30, what="two messages before the outage")
        t_block = _sleep_to_half_second()
        with admin.connect() as conn:
            conn.execute(sa.text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false'))
            blocked = True
            conn.execute(sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                 "WHERE datname = :d AND pid <> pg_backend_pid()"), {"d": name})
        t_down = time.time()
        # Until the terminate, beat's own connection still worked: an occurrence it claimed ahead
        # (at most claim_grace / 8 = 0.25 s before its instant) goes out at that instant, after
        # the block. Count from past that instant (the next whole second), so only sends that
        # would need the blocked database are counted.
        time.sleep(max(0.0, math.floor(t_down) + 1.3 - time.time()))
        queued_at_down = len(app.queued_messages())
        time.sleep(4.0)
        queued_at_up = len(app.queued_messages())
        assert beat.alive(), beat.log()
        t_up = time.time()  # (before the database accepts connections again: nothing can be claimed earlier)
        with admin.connect() as conn:
            conn.execute(sa.text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true'))
            blocked = False
        wait_for(lambda: len(app.queued_messages()) > queued_at_up, 30, interval=0.2,
                 what="beat to resume sending by itself")
        t_resumed = time.time()
        wait_for(lambda: len(app.queued_messages()) >= queued_at_up + 3, 15, what="on-time sends after resuming")
        _sleep_to_half_second()
        assert beat.alive(), beat.log()
        t_stop = time.time()
        messages = app.sent_occurrences()
    finally:
        if blocked:
            with admin.connect() as conn:
                conn.execute(sa.text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true'))
        beat.stop()
        admin.dispose()
    log = beat.log()
    assert queued_at_up == queued_at_down, "beat sent while its claim database was unreachable"
    # The error is logged by whichever of the loop's store calls meets the outage first: the due
    # occurrences' claim ("the claim store failed") or the heartbeat ("claim store unavailable").
    errors = [line for line in log.splitlines() if "ERROR" in line and "cluster-beat:" in line
              and "claim store" in line and "not currently accepting connections" in line]
    assert errors, log

    ats = [_at(at) for _, at, _, _ in messages]
    assert len(ats) == len(set(ats)), f"sent twice: {ats}"
    for _, at, _, tid in messages:
        assert tid == occurrence_task_id("tick", _at(at))
    resumed_with = ats[queued_at_up]  # the first message after the outage
    assert resumed_with >= _second(t_up) and resumed_with <= _second(t_resumed), (resumed_with, t_up, t_resumed)

    claims, states = _read_store(pg_url)
    rows = {r.scheduled_at: r for r in claims}
    missed = sorted(at for at, r in rows.items() if r.status == "missed")
    # every occurrence between the outage's start and the catch-up send was missed, and only those.
    # The outage starts with the block, half-way through a second: the next second's occurrence
    # is the first missed (a later one if blocking took longer: what beat claimed ahead on its
    # connection before the terminate, up to 0.25 s before its instant, was sent).
    assert missed, (rows, resumed_with)
    assert _second(t_block) + timedelta(seconds=1) <= missed[0] <= _second(t_down + 0.25) + timedelta(seconds=1), (
        missed, t_block, t_down)
    assert missed == _seconds(missed[0], resumed_with - timedelta(seconds=1)), (missed, resumed_with)
    assert all(rows[at].reason == "catchup" for at in missed)
    assert not set(missed) & set(ats)
    # nothing unaccounted for: from the first send to the stop, each second is sent or missed
    for at in _seconds(min(ats), _second(t_stop) - timedelta(seconds=1)):
        r = rows.get(at)
        assert r is not None and r.status in ("sent", "missed"), (at, r)
        assert (r.status == "sent") == (at in ats)
    st = {s.name: s for s in states}["tick"]
    assert st.missed == len(missed) and st.sent == len(ats)


# --------------------------------------------------------------------------- the messages themselves


SIGNAL_TASKS = DEFAULT_TASKS + '''
from celery.signals import before_task_publish, after_task_publish
_SIGNAL_LOG = os.environ.get("CCB_SIGNAL_LOG")

@before_task_publish.connect
def _before(sender=None, headers=None, **kwargs):
    if _SIGNAL_LOG:
        with open(_SIGNAL_LOG, "a") as f:
            f.write("before %s %s\\n" % (sender, headers["id"]))

@after_task_publish.connect
def _after(sender=None, headers=None, **kwargs):
    if _SIGNAL_LOG:
        with open(_SIGNAL_LOG, "a") as f:
            f.write("after %s %s\\n" % (sender, headers["id"]))
'''


def _body(msg: dict):
    assert msg["properties"]["body_encoding"] == "base64"
    return json.loads(base64.b64decode(msg["body"]))


@pytest.mark.slow
def test_messages_have_celerys_own_shape_plus_our_headers_and_publish_signals_fire_once(
        tmp_path, broker, cleanup_queues):
    """A message from our scheduler has the Celery protocol-2 shape of one from
    ``app.send_task`` (same envelope, same properties, same header keys, same body
    encoding and layout) plus ``cluster_beat_schedule``, ``cluster_beat_scheduled_at``,
    ``cluster_beat_node`` and ``celery_beat_task``; ``before_task_publish`` and
    ``after_task_publish`` fire once per queued message in the beat process."""
    signal_log = tmp_path / "signals.log"
    app = write_app(tmp_path, broker=broker, db_url=f"sqlite:///{tmp_path}/claims.sqlite3",
                    schedule="{'tick': {'task': 't.record', 'schedule': every(1), 'args': (1, 'a'),"
                             " 'kwargs': {'k': [1, 2]}}}",
                    tasks=SIGNAL_TASKS)
    cleanup_queues.append(app)
    beat = start_beat(app, tmp_path, "b", env={"CCB_SIGNAL_LOG": str(signal_log)})
    try:
        wait_for(lambda: len(app.queued_messages()) >= 3, 30, what="three messages")
        _sleep_to_half_second()
    finally:
        beat.stop()
    ours = app.queued_messages()

    ref_app = Celery("ccb_ref", broker=broker)
    ref_queue = app.queue + "_ref"
    ref_app.conf.task_default_queue = ref_queue
    try:
        ref_app.send_task("t.record", args=(1, "a"), kwargs={"k": [1, 2]})
        client = redis.Redis.from_url(broker)
        try:
            ref = json.loads(client.lrange(ref_queue, 0, -1)[0])
            client.delete(ref_queue)
        finally:
            client.close()
    finally:
        ref_app.close()

    assert len(ours) >= 3
    for msg in ours:
        assert set(msg) == set(ref), (sorted(msg), sorted(ref))
        assert msg["content-type"] == ref["content-type"] == "application/json"
        assert msg["content-encoding"] == ref["content-encoding"]
        assert set(msg["properties"]) == set(ref["properties"])
        assert set(msg["properties"]["delivery_info"]) == set(ref["properties"]["delivery_info"])
        assert msg["properties"]["delivery_info"]["routing_key"] == app.queue
        h, rh = msg["headers"], ref["headers"]
        assert set(h) - set(rh) == OUR_HEADERS, sorted(set(h) ^ set(rh))
        assert set(rh) <= set(h)
        for key in ("lang", "task", "argsrepr", "kwargsrepr", "retries", "eta", "expires", "group", "shadow"):
            assert h[key] == rh[key], key
        assert h["celery_beat_task"] is True
        assert h["cluster_beat_schedule"] == "tick"
        assert h["cluster_beat_node"].endswith(f":{beat.pid}")
        assert h["id"] == msg["properties"]["correlation_id"] == occurrence_task_id(
            "tick", _at(h["cluster_beat_scheduled_at"]))
        assert _body(msg) == _body(ref)  # [args, kwargs, embed]: identical for identical arguments

    lines = signal_log.read_text().splitlines()
    ids = [m["headers"]["id"] for m in ours]
    for kind in ("before", "after"):
        fired = [line.split()[2] for line in lines if line.startswith(kind + " t.record ")]
        assert sorted(fired) == sorted(ids), f"{kind}_task_publish: {len(fired)} for {len(ids)} messages"


# --------------------------------------------------------------------------- the loop, in-process


def _inprocess_app(db: str, broker: str, schedule: dict, queue: str = "") -> Celery:
    app = Celery("ccb_inproc", broker=broker)
    app.conf.update(cluster_beat_db_url=db, cluster_beat_redis_url="", beat_schedule=schedule)
    if queue:
        app.conf.task_default_queue = queue
    return app


def _far_schedule():
    """A cron whose next fire is at least a day away (yearly instants, two candidates)."""
    now = datetime.now(UTC)
    for expr in ("0 0 29 2 *", "0 12 1 7 *"):
        sched = cron(expr, tz="UTC")
        if sched.next_fire(now) - now > timedelta(days=1):
            return sched
    raise AssertionError("no far-away schedule found")  # pragma: no cover


def test_idle_ticks_issue_no_sql_and_always_sleep_a_positive_time(tmp_path):
    """With 1,000 entries due far in the future, 200 ``tick()`` calls issue zero
    SQL statements (a tick with nothing due is a heap peek) and each returns a
    positive sleep of at most ``max_interval``."""
    sched_obj = _far_schedule()
    schedule = {f"entry-{i:04d}": {"task": "t.record", "schedule": sched_obj} for i in range(1000)}
    app = _inprocess_app(f"sqlite:///{tmp_path}/claims.sqlite3", "memory://", schedule)
    statements: List[str] = []

    def count(conn, cursor, statement, parameters, context, executemany):
        statements.append(statement)

    sched = Scheduler(app, lazy=False)
    try:
        assert len(sched.entries) == 1000
        sa.event.listen(sa.engine.Engine, "before_cursor_execute", count)
        started = time.monotonic()
        try:
            sleeps = [sched.tick() for _ in range(200)]
        finally:
            sa.event.remove(sa.engine.Engine, "before_cursor_execute", count)
        took = time.monotonic() - started
    finally:
        sched.close()
        app.close()
    # Without a lease's Redis, the stored-schedule change counter is read once a second (one
    # SELECT in its own transaction): on a loaded machine the 200 ticks may span such a read.
    # Nothing else: no claim, no schedule read.
    counter = [st for st in statements if "cluster_beat_schedule_version" in st]
    rest = [st for st in statements if st not in counter and st.strip().upper() not in ("BEGIN", "COMMIT", "ROLLBACK")]
    assert rest == [] and len(counter) <= took + 1, (statements, took)
    assert all(0 < s <= sched.max_interval for s in sleeps), sorted(sleeps)[:5]
    # the counter does see the store's statements (the listener works)
    store = ClaimStore(f"sqlite:///{tmp_path}/claims.sqlite3", node_id="reader")
    sa.event.listen(sa.engine.Engine, "before_cursor_execute", count)
    try:
        store.open()
        store.claims()
    finally:
        sa.event.remove(sa.engine.Engine, "before_cursor_execute", count)
        store.close()
    assert statements


def test_a_stalled_loop_sends_one_latest_occurrence_and_records_the_rest_missed(tmp_path, broker, cleanup_queues):
    """Beat's loop stalls 3.5 s (no tick) with an every-1 s schedule: the next tick
    sends exactly one occurrence, the most recent due one (catch-up ``latest``),
    records the ones in between as ``missed``, and the following ticks go on
    from now, one per second: never a burst of backlog. No tick returns <= 0."""
    db = f"sqlite:///{tmp_path}/claims.sqlite3"
    queue = "q_stall_" + uuid.uuid4().hex[:10]  # tmp_path names repeat across workers and suites
    app = _inprocess_app(db, broker, {"tick": {"task": "t.record", "schedule": every(1)}}, queue=queue)
    holder = App(tmp_path, "unused", queue, broker, None)
    cleanup_queues.append(holder)
    published: List[str] = []

    def on_publish(sender=None, headers=None, **kwargs):
        published.append(headers["cluster_beat_scheduled_at"])

    def run_until(count: int) -> None:
        """Run the loop until *count* messages were published in all (at most 15 s)."""
        end = time.monotonic() + 15
        while len(published) < count:
            assert time.monotonic() < end, f"timed out waiting for {count} publishes: {published}"
            wait = sched.tick()
            assert wait > 0
            time.sleep(min(wait, 0.25))

    after_task_publish.connect(on_publish, weak=False)
    sched = Scheduler(app, lazy=False)
    try:
        run_until(2)
        on_time = list(published)
        assert len(on_time) >= 2
        time.sleep(3.5)  # the stall
        before_tick = time.time()
        wait = sched.tick()
        after_tick = time.time()
        assert wait > 0
        burst = published[len(on_time):]
        run_until(len(published) + 2)
    finally:
        after_task_publish.disconnect(on_publish)
        sched.close()
        app.close()

    assert len(burst) == 1, burst
    latest_due = _at(burst[0])
    assert _second(before_tick) <= latest_due <= _second(after_tick), (burst, before_tick, after_tick)
    last_on_time = _at(on_time[-1])
    claims, states = _read_store(db)
    rows = {r.scheduled_at: r for r in claims}
    missed = sorted(at for at, r in rows.items() if r.status == "missed")
    assert missed == _seconds(last_on_time + timedelta(seconds=1), latest_due - timedelta(seconds=1))
    assert len(missed) >= 2
    assert all(rows[at].reason == "catchup" for at in missed)
    after = [_at(t) for t in published[len(on_time) + 1:]]
    assert after == _seconds(latest_due + timedelta(seconds=1), after[-1]) and len(after) >= 2, after
    queued = [_at(m["headers"]["cluster_beat_scheduled_at"]) for m in holder.queued_messages()]
    assert sorted(queued) == sorted(_at(t) for t in published) and len(set(queued)) == len(queued)
    st = {s.name: s for s in states}["tick"]
    assert st.missed == len(missed) and st.sent == len(published)
