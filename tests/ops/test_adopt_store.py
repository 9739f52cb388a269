"""A rebuilt claim store has a way back: ``celery -A proj cluster-beat adopt-store`` (issue 21, item 6).

The lease's Redis records the id of the claim store its holders write to, for 30 days after the
last holding, so that two stores are never sent from under one lease. A claim database rebuilt
from scratch gets a new id, and every beat refused to start for those 30 days, with a message
that did not say what to do, and no command did it. Here, with a real Redis and real SQLite files:

* store A is bound to the lease; the database is "rebuilt" (a new file, store B); a real ``celery
  beat`` on B exits with status 1 and one ERROR line, no traceback, that names the Redis key, the
  store it names and B's id, and the command to run;
* ``adopt-store`` refuses while a node of A holds the lease (that node is alive: the old store is
  live), asks before it changes anything, and ``--dry-run`` changes nothing;
* after it a real beat on B starts, leads and sends, and a node of A is refused in its turn;
* the change is a compare-and-set that also requires a free lease (the script itself is asked);
* a store no beat prepared (an empty PostgreSQL database, a missing SQLite file) is ``not
  initialised yet`` (exit 3), and stays as it was.
"""
from __future__ import annotations

import json
import uuid

import pytest
import redis
import sqlalchemy as sa

from celery_cluster_beat.leader.identity import AdoptStatus, ClusterIdentity, adopt, adopt_command
from celery_cluster_beat.leader.lease import ForeignClusterError, RedisLease, cluster_key
from celery_cluster_beat.store import ClaimStore
from procs import start_beat, wait_for, wait_for_log, write_app
from test_cli import cli

START = 90  # seconds a beat may take to start (or to refuse) on a loaded host
EVERY_SECOND = "{'tick': {'task': 't.record', 'schedule': every(1)}}"


def _store_id(db_url: str) -> str:
    with ClaimStore(db_url, node_id="reader") as store:
        return store.cluster_id


def _recorded(client: redis.Redis, name: str):
    value = client.get(cluster_key(name))
    return None if value is None else value.decode()


@pytest.mark.timeout(300)
def test_a_rebuilt_store_is_refused_naming_adopt_store_which_brings_the_cluster_back(tmp_path, redis_url):
    app = write_app(tmp_path, broker=redis_url, db_url=f"sqlite:///{tmp_path}/rebuilt.sqlite3", redis_url=redis_url,
                    schedule=EVERY_SECOND)
    name = app.module  # the cluster name: the app's
    store_a = _store_id(f"sqlite:///{tmp_path}/old.sqlite3")
    client = redis.Redis.from_url(redis_url)

    def lease(node: str, cluster_id: str) -> RedisLease:
        return RedisLease(lambda: redis.Redis.from_url(redis_url), name=name, node_id=node, ttl=120.0,
                          cluster_id=cluster_id)

    old = lease("old-node", store_a)
    beat = None
    try:
        assert old.try_acquire()  # a live beat of store A leads (its key lives 120 s: no renewals needed)
        assert _recorded(client, name) == store_a

        # -- a beat on the rebuilt store: one line, saying what to do, status 1
        refused = start_beat(app, tmp_path, "refused")
        rc = refused.popen.wait(START)
        out = refused.log()
        refused.stop()
        store_b = _store_id(f"sqlite:///{tmp_path}/rebuilt.sqlite3")  # the beat prepared it before it refused
        assert rc == 1, out
        assert "Traceback" not in out and "is now the leader" not in out, out
        (line,) = [ln for ln in out.splitlines() if "ForeignClusterError" in ln]
        assert (f"the lease {name!r} serves claim store {store_a} (Redis key {cluster_key(name)} on {redis_url}), "
                f"but this node's claim store is {store_b}.") in line, line
        assert f"run `celery -A {app.module} cluster-beat adopt-store`" in line, line
        assert [ln for ln in out.splitlines() if "ERROR" in ln] == [line], out

        # -- refused while the old store's node holds the lease
        r = cli(app, "adopt-store", "--yes")
        assert r.returncode == 1, (r.stdout, r.stderr)
        assert r.stderr.startswith(f"error: refused: node old-node holds the lease {name!r} (term "), r.stderr
        assert "Traceback" not in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
        assert _recorded(client, name) == store_a
        old.release()

        # -- it asks (no answer: nothing changes), and --dry-run only says
        r = cli(app, "adopt-store")
        assert r.returncode == 1 and "Make the lease" in r.stderr, (r.stdout, r.stderr)
        assert _recorded(client, name) == store_a
        r = cli(app, "adopt-store", "--dry-run")
        assert r.returncode == 0, r.stderr
        assert f"would make the lease {name!r} serve claim store {store_b} (nothing changed)" in r.stdout, r.stdout
        assert f"it serves      claim store {store_a}" in r.stdout and f"this store     {store_b}" in r.stdout
        assert _recorded(client, name) == store_a

        # -- adopted
        r = cli(app, "adopt-store", "--yes", "--json")
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        assert (doc["adopted"], doc["recorded"], doc["store"], doc["key"]) == (True, store_a, store_b, cluster_key(name))
        assert _recorded(client, name) == store_b
        r = cli(app, "adopt-store", "--yes")
        assert r.returncode == 0 and "nothing to do: it serves this claim store already" in r.stdout, r.stdout

        # -- a real beat on the rebuilt store starts, leads and sends
        beat = start_beat(app, tmp_path, "adopted")
        wait_for_log(beat, "is now the leader", START)
        wait_for(lambda: len(app.sent_occurrences()) >= 2, 60, what="the adopted cluster's beat sending")
        assert "ForeignClusterError" not in beat.log()

        # -- and now a node of the old store is the one refused
        stale = lease("old-node-restarted", store_a)
        try:
            with pytest.raises(ForeignClusterError):
                stale.check_cluster()
            assert not stale.try_acquire()
        finally:
            stale.close()
        assert _recorded(client, name) == store_b
    finally:
        old.close()
        if beat is not None:
            beat.stop()
        client.delete(*client.keys(f"cluster_beat:{{{name}}}:*"), app.queue)
        client.close()


def test_the_change_is_a_compare_and_set_on_a_free_lease(redis_url):
    name = f"adopt-{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(redis_url)
    holder = RedisLease(lambda: redis.Redis.from_url(redis_url), name=name, node_id="a-node", ttl=60.0,
                        cluster_id="store-A")
    try:
        assert holder.try_acquire()
        held = adopt(client, name, expected="store-A", new="store-B")
        assert held.status is AdoptStatus.HELD and held.value.endswith(":1:a-node") and 0 < held.pttl <= 60_000
        assert _recorded(client, name) == "store-A"
        holder.release()
        changed = adopt(client, name, expected="store-X", new="store-B")  # not what the operator was shown
        assert (changed.status, changed.value) == (AdoptStatus.CHANGED, "store-A")
        assert _recorded(client, name) == "store-A"
        done = adopt(client, name, expected="store-A", new="store-B")
        assert (done.status, done.value) == (AdoptStatus.DONE, "store-A")
        assert _recorded(client, name) == "store-B"
        assert 29 * 86400 < client.ttl(cluster_key(name)) <= 30 * 86400  # the key lives as the lease keeps it
        assert not holder.try_acquire()  # store A's nodes are refused now
    finally:
        holder.close()
        client.delete(*client.keys(f"cluster_beat:{{{name}}}:*"))
        client.close()


def test_the_refusal_masks_the_redis_password_and_names_the_app_it_was_started_with():
    identity = ClusterIdentity(name="proj", node_id="n1", cluster_id="B", redis_url="redis://:s3cret@redis:6379/0")
    message = identity.message("A")
    assert "s3cret" not in message and "redis://:***@redis:6379/0" in message
    assert "\n" not in message
    assert adopt_command(["celery", "-A", "proj.celery:app", "beat"]) == \
        "celery -A proj.celery:app cluster-beat adopt-store"
    assert adopt_command(["celery", "--app=proj", "beat"]) == "celery -A proj cluster-beat adopt-store"
    assert adopt_command(["python", "run.py"]) == "celery -A <app> cluster-beat adopt-store"


@pytest.mark.timeout(120)
def test_a_store_no_beat_prepared_is_not_initialised_and_stays_as_it_was(tmp_path, redis_url, pg_url):
    for db_url in (pg_url, f"sqlite:///{tmp_path}/missing.sqlite3"):
        app = write_app(tmp_path, broker=redis_url, db_url=db_url, redis_url=redis_url, schedule=EVERY_SECOND)
        r = cli(app, "adopt-store", "--yes")
        assert r.returncode == 3, (db_url, r.stdout, r.stderr)
        assert r.stderr.startswith("not initialised yet: "), r.stderr
    engine = sa.create_engine(pg_url)
    try:
        assert sa.inspect(engine).get_table_names() == []
    finally:
        engine.dispose()
    assert not (tmp_path / "missing.sqlite3").exists()
