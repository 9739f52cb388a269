"""Which nodes form one cluster: a lease is named by ``cluster_beat_cluster_name``
(default: the Celery app's name) and belongs to one claim database.

Real ``celery beat`` processes of one app module (same app name, same broker)
with their own claim databases, on a Redis server of the test's own (a
throwaway ``redis-server``: broker and lease), so every ``cluster_beat:*`` key
in it is one these beats wrote.

* Two claim databases behind one lease would each keep a history of their own
  and resend what the other sent: the second node refuses to start, saying
  what to change.
* With a cluster name of its own the second is another cluster: it leads its
  own lease beside the first.
* Key names carry the cluster name only: nothing derived from a URL (which may
  hold a password) is published in Redis.
"""
from __future__ import annotations

import hashlib
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import redis
from sqlalchemy.engine import make_url

from celery_cluster_beat.leader.lease import ForeignClusterError, RedisLease, cluster_key, lease_keys
from celery_cluster_beat.store import ClaimStore
from procs import APP_TEMPLATE, DEFAULT_TASKS, App, Proc, start_beat, wait_for, wait_for_log

EVERY_SECOND = "{'tick': {'task': 't.record', 'schedule': every(1)}}"
PASSWORD = "Pw-s3cret-4711"  # PostgreSQL trusts local connections: carried in the URL, never checked
START = 90  # seconds a beat may take to start on a loaded host
LEADER = "is now the leader"


def _module(directory: Path, module: str, *, broker: str, db_url: str, conf: str = "{}") -> App:
    """App module *module* (the Celery app is named after it) in *directory*, its lease on *broker*."""
    directory.mkdir(exist_ok=True)
    source = APP_TEMPLATE.format(name=module, broker=broker, backend=None, queue="q_" + module, db_url=db_url,
                                 redis_url=broker, schedule=EVERY_SECOND, conf=conf, tasks=DEFAULT_TASKS)
    (directory / f"{module}.py").write_text(source)
    return App(directory, module, "q_" + module, broker, broker)


def _cluster_id(db_url: str) -> str:
    store = ClaimStore(db_url, node_id="reader")
    with store:
        return store.cluster_id


def _wait_exit(proc: Proc, timeout: float) -> int:
    try:
        return proc.popen.wait(timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"beat still running after {timeout:.0f}s:\n{proc.log()[-3000:]}") from None


def _senders(app: App) -> set:
    return {node for _, _, node, _ in app.sent_occurrences()}


def test_a_second_claim_database_behind_the_same_lease_refuses_to_start_saying_what_to_change(
        tmp_path, throwaway_redis):
    """Two ``celery beat`` of the same app (same name, same Redis) but each with
    its own SQLite claim file: the first runs and leads; the second exits
    non-zero within a bounded time, and its output names the settings to change
    (``cluster_beat_db_url`` / ``cluster_beat_cluster_name``). The first is
    unaffected: it still runs and is the only sender, and the lease's cluster id
    key still names the first's claim database.

    Fails if the cluster check at start-up is missing (the second would stand by
    for ever, or with a lease per URL would lead a second history) or if its
    message does not say what to change.
    """
    broker = throwaway_redis.url
    module = "ccbapp_" + uuid.uuid4().hex[:8]
    first_db = f"sqlite:///{tmp_path}/first/claims.sqlite3"
    first = _module(tmp_path / "first", module, broker=broker, db_url=first_db)
    second = _module(tmp_path / "second", module, broker=broker, db_url=f"sqlite:///{tmp_path}/second/claims.sqlite3")
    b1 = start_beat(first, tmp_path / "first", "first")
    b2 = None
    try:
        wait_for_log(b1, LEADER, START)
        wait_for(lambda: len(first.sent_occurrences()) >= 1, 30, what="a message from the first beat")
        b2 = start_beat(second, tmp_path / "second", "second")
        started = time.monotonic()
        rc = _wait_exit(b2, START)
        took = time.monotonic() - started
        out = b2.log()
        sent_then = len(first.sent_occurrences())
        wait_for(lambda: len(first.sent_occurrences()) >= sent_then + 2, 30, what="the first beat sending on")
        assert b1.alive(), b1.log()
    finally:
        b1.stop()
        if b2 is not None:
            b2.stop()
    assert rc != 0, out
    assert "ForeignClusterError" in out, out
    assert "cluster_beat_db_url" in out and "cluster_beat_cluster_name" in out, out
    assert LEADER not in out and "Sending due task" not in out, out
    print(f"\nthe second beat exited with status {rc} after {took:.1f}s")
    assert _senders(first) == {f for f in _senders(first) if f.endswith(f":{b1.pid}")}, "only the first sends"
    client = redis.Redis.from_url(broker)
    try:
        assert client.get(cluster_key(module)).decode() == _cluster_id(first_db)
    finally:
        client.close()


def test_with_a_cluster_name_of_its_own_a_second_cluster_runs_beside_the_first_and_keys_name_only_clusters(
        tmp_path, throwaway_redis, pg_url):
    """The same app (same name, same Redis) with another claim database *and*
    ``cluster_beat_cluster_name`` set: two clusters, two leases. Both beats lead
    their own lease and send. The ``cluster_beat:*`` keys in Redis are exactly
    the lease, term and cluster id keys of the two cluster names; none carries
    the claim database's password or anything derived from its URL (a digest
    of the URL, masked or not), and each cluster id key names its own store.

    Fails if the lease were named after the app only (the second refused, or a
    single lease for both), or after anything computed from the database URL.
    """
    broker = throwaway_redis.url
    module = "ccbapp_" + uuid.uuid4().hex[:8]
    other = "other-" + uuid.uuid4().hex[:8]
    first_db = f"sqlite:///{tmp_path}/first/claims.sqlite3"
    second_db = make_url(pg_url).set(password=PASSWORD).render_as_string(hide_password=False)
    first = _module(tmp_path / "first", module, broker=broker, db_url=first_db)
    second = _module(tmp_path / "second", module, broker=broker, db_url=second_db,
                     conf=f"{{'cluster_beat_cluster_name': {other!r}}}")
    b1 = start_beat(first, tmp_path / "first", "first")
    b2 = None
    try:
        wait_for_log(b1, LEADER, START)
        b2 = start_beat(second, tmp_path / "second", "second")
        wait_for_log(b2, LEADER, START)

        def both_send() -> bool:
            senders = _senders(first)  # one queue: the same app module
            return any(s.endswith(f":{b1.pid}") for s in senders) and any(s.endswith(f":{b2.pid}") for s in senders)

        wait_for(both_send, 30, what="messages from both beats")
        assert b1.alive() and b2.alive(), b1.log() + b2.log()
        client = redis.Redis.from_url(broker)
        try:
            names = sorted(k.decode() for k in client.keys("cluster_beat:*"))
            ids = {name: client.get(cluster_key(name)).decode() for name in (module, other)}
        finally:
            client.close()
    finally:
        b1.stop()
        if b2 is not None:
            b2.stop()
    out = b1.log() + b2.log()
    assert "ForeignClusterError" not in out
    expected = {*lease_keys(module)[:2], cluster_key(module), *lease_keys(other)[:2], cluster_key(other)}
    # Every key is one of the two clusters' lease, term or cluster id keys; the term and cluster id keys
    # (which do not expire during the test) are there for both. (A lease key may be absent for a moment
    # if a loaded host delays a renewal past the ttl.)
    assert set(names) <= expected, names
    assert {lease_keys(module)[1], cluster_key(module), lease_keys(other)[1], cluster_key(other)} <= set(names), names
    assert all(k.startswith((f"cluster_beat:{{{module}}}:", f"cluster_beat:{{{other}}}:")) for k in names)
    masked = make_url(second_db).render_as_string(hide_password=True)
    derived = [PASSWORD] + [
        getattr(hashlib, algo)(text.encode()).hexdigest()[:8]
        for text in (second_db, masked, first_db) for algo in ("md5", "sha1", "sha256")
    ]
    assert not [k for k in names for d in derived if d in k], (names, derived)
    assert ids == {module: _cluster_id(first_db), other: _cluster_id(second_db)}
    assert ids[module] != ids[other]
    assert PASSWORD not in out


def test_a_long_lived_leader_keeps_its_cluster_id_and_a_foreign_standby_cannot_take_the_lease_over(
        throwaway_redis):
    """A leader that holds its lease without interruption keeps the lease's
    cluster id key alive (renewals refresh it), so a node of another claim store
    is still refused at start-up, and a standby's acquire attempt never records
    its own cluster id while another node holds the lease.

    The end of the key's 30 days is brought forward with PEXPIRE (1.5 s): the
    leader then renews for 3 s.
    """
    name = "idtest-" + uuid.uuid4().hex[:8]
    client = redis.Redis.from_url(throwaway_redis.url)

    def factory():
        return redis.Redis.from_url(throwaway_redis.url)

    leader = RedisLease(factory, name=name, node_id="leader", ttl=1.0, cluster_id="store-A")
    foreign = RedisLease(factory, name=name, node_id="foreign", ttl=1.0, cluster_id="store-B")
    try:
        assert leader.try_acquire()
        client.pexpire(cluster_key(name), 1500)
        end = time.monotonic() + 3.0
        while time.monotonic() < end:
            assert leader.maintain(), "the leader lost its lease"
            time.sleep(0.1)
        refused_at_start = True
        try:
            foreign.check_cluster()
            refused_at_start = False
        except ForeignClusterError:
            pass
        assert not foreign.try_acquire()
        recorded = client.get(cluster_key(name))
        leader.release()
        assert leader.try_acquire(), "the rightful cluster was refused its own lease"
        assert refused_at_start, "a node of another claim store passed the start-up check"
        assert recorded == b"store-A", recorded
    finally:
        leader.close()
        foreign.close()
        client.close()
