"""A worker process's heartbeat (worker/liveness.py) on a real store: a process the database
recorded gone goes on under a new identity; deferred finishes are written before the heartbeat;
a grace too short for ``cluster_beat_db_timeout`` is refused, naming the setting.
"""
from __future__ import annotations

from datetime import datetime, timezone

import pytest
import sqlalchemy as sa
from celery import Celery

from celery_cluster_beat.errors import ConfigError
from celery_cluster_beat.store import ClaimStore
from celery_cluster_beat.store.schema import RunState, workers_table
from celery_cluster_beat.worker import liveness

AT = datetime(2023, 1, 1, tzinfo=timezone.utc)  # in the past: the ledger refuses an instant ahead of the database's clock


@pytest.fixture
def store(tmp_path):
    s = ClaimStore(f"sqlite:///{tmp_path / 'hb.sqlite3'}", node_id="hb")
    s.open()
    yield s
    s.close()


def app(**conf) -> Celery:
    a = Celery("hb", set_as_current=False)
    a.conf.update(conf)
    return a


@pytest.mark.timeout(30)
def test_a_process_recorded_gone_takes_a_new_identity_and_heartbeats_under_it(store):
    beat = liveness.Heartbeat(store, grace=60.0)
    assert beat.beat()
    old = beat.process
    assert store.worker_alive(old)
    assert store.worker_gone(old, reason="its run was taken over") == 1
    assert beat.beat()  # not the end of the heartbeat: a new name, alive
    new = beat.process
    assert new != old and new == liveness.process_id()
    assert store.worker_alive(new) and not store.worker_alive(old)
    assert new.rsplit(":", 2)[1] == old.rsplit(":", 2)[1]  # same pid, another random part


@pytest.mark.timeout(30)
def test_deferred_finishes_are_written_before_the_heartbeat(store):
    """After an outage, the first thing the database learns is that the run ended: a redelivery
    must never find it running under a process that heartbeats again."""
    beat = liveness.Heartbeat(store, grace=60.0)
    assert beat.beat()
    process = beat.process
    run = store.start_run("deferred", AT, task_id="t-deferred", worker="w", pid=1, process=process, grace=60.0)
    w = workers_table
    with store._engine.connect() as conn:  # the test reads the row as it stands
        before = conn.execute(sa.select(w.c.heartbeat_at).where(w.c.process == process)).scalar_one()
    seen = []

    def finish() -> None:
        with store._engine.connect() as conn:
            seen.append(conn.execute(sa.select(w.c.heartbeat_at).where(w.c.process == process)).scalar_one())
        assert store.finish_run("deferred", AT, run.token, RunState.SUCCEEDED, 1.0)

    liveness.defer(finish)
    assert beat.beat()
    assert seen == [before]  # written while the heartbeat was still the old one
    assert store.run_states([("deferred", AT)])[("deferred", AT)].run_state == "succeeded"


def test_a_grace_too_short_for_the_database_timeout_is_refused_naming_the_setting():
    assert liveness.worker_grace(app()) == liveness.DEFAULT_GRACE >= liveness.min_grace(15.0)
    assert liveness.worker_grace(app(cluster_beat_db_timeout=2, cluster_beat_worker_grace=5.5)) == 5.5
    assert liveness.worker_grace(app(cluster_beat_db_timeout=30)) == pytest.approx(80.0)  # unset: the minimum
    with pytest.raises(ConfigError, match=r"cluster_beat_worker_grace: 30s is too short .*db_timeout 15s"):
        liveness.worker_grace(app(cluster_beat_worker_grace=30))
    with pytest.raises(ConfigError, match="cluster_beat_worker_grace"):
        liveness.worker_grace(app(cluster_beat_worker_grace="soon"))
