"""A real ``celery beat`` and a real ``celery worker`` on the Celery installed here, on Redis and on
RabbitMQ: every occurrence of cron, every, jittered, expiring and ledger entries runs once.

This is the test each Celery minor of the support table passes in CI (``.ci/run`` runs it in a
virtual environment per minor): a beat that builds its messages wrongly for its Celery sends
nothing a worker accepts, and this test sees no runs.
"""
from __future__ import annotations

import json
import sqlite3
import time
import uuid
from collections import Counter
from datetime import datetime, timezone

import pytest
import redis

from procs import start_beat, start_worker, wait_for, write_app

pytestmark = pytest.mark.slow

SCHEDULE = '''{
    "cron": {"task": "t.run", "schedule": cron("* * * * * */5"), "args": ("cron",)},
    "every": {"task": "t.run", "schedule": every(2), "args": ("every",)},
    "jittered": {"task": "t.run", "schedule": every(3), "jitter": 2, "args": ("jittered",)},
    "expiring": {"task": "t.run", "schedule": every(2), "args": ("expiring",), "options": {"expires": 30}},
    "ledger": {"task": "t.ledger", "schedule": every(2), "args": ("ledger",)},
    "celery-type": {"task": "t.run", "schedule": schedule(timedelta(seconds=4)), "args": ("celery-type",)},
}'''

TASKS = '''
import json, time, redis
from celery_cluster_beat import LedgerTask

_runs = redis.Redis.from_url({runs_url!r})

def _note(task, kind):
    r = task.request
    _runs.rpush({runs_key!r}, json.dumps({{
        "kind": kind, "schedule": r.get("cluster_beat_schedule"), "at": r.get("cluster_beat_scheduled_at"),
        "id": r.id, "eta": r.eta, "expires": r.expires, "started": time.time()}}))

@app.task(bind=True, name="t.run")
def run(self, kind):
    _note(self, kind)

@app.task(bind=True, base=LedgerTask, name="t.ledger")
def ledger(self, kind):
    _note(self, kind)
'''


def _iso(text: str) -> float:
    """Seconds since the epoch of an ISO stamp (a naive one, as SQLite stores them, is UTC)."""
    at = datetime.fromisoformat(text.replace("Z", "+00:00"))
    return (at if at.tzinfo else at.replace(tzinfo=timezone.utc)).timestamp()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("broker", ["redis", "rabbitmq"])
def test_every_occurrence_of_every_kind_of_entry_runs_once(broker, redis_url, tmp_path, request):
    broker_url = redis_url if broker == "redis" else request.getfixturevalue("rabbitmq_vhost")
    runs_key = f"ccbtest:runs:{uuid.uuid4().hex}"
    db = tmp_path / "claims.sqlite3"
    app = write_app(tmp_path, broker=broker_url, db_url=f"sqlite:///{db}", schedule=SCHEDULE,
                    redis_url=redis_url, backend=redis_url,
                    tasks=TASKS.format(runs_url=redis_url, runs_key=runs_key))
    client = redis.Redis.from_url(redis_url)
    client.delete(runs_key)

    def runs():
        return [json.loads(r) for r in client.lrange(runs_key, 0, -1)]

    worker = start_worker(app, tmp_path, concurrency=2)
    beat = start_beat(app, tmp_path, "a")
    try:
        # Cron runs (the seconds field: every 5 s, no wait for a minute boundary; the same
        # cron path, our own arithmetic on every Celery minor) and several of each interval entry.
        wait_for(lambda: Counter(r["kind"] for r in runs())["cron"] >= 2
                 and min(Counter(r["kind"] for r in runs()).get(k, 0) for k in
                         ("every", "jittered", "expiring", "ledger", "celery-type")) >= 3,
                 timeout=110, interval=0.5, what="two cron runs and three runs of every interval entry")
        beat.stop()
        time.sleep(4)  # what beat sent last (jitter up to 2 s) reaches the worker
        seen = runs()
    finally:
        beat.stop()
        worker.stop()
        client.delete(runs_key)
        client.close()
    assert "ERROR" not in beat.log(), beat.log()[-3000:]
    rows = sqlite3.connect(db).execute(
        "SELECT schedule, scheduled_at, status, task_id FROM cluster_beat_claims").fetchall()
    sent = {(s, a) for s, a, status, _ in rows if status == "sent"}
    assert sent, rows
    ran = Counter((r["schedule"], r["at"]) for r in seen)
    assert [k for k, n in ran.items() if n > 1] == [], "an occurrence ran twice"
    # Every occurrence beat recorded as sent ran (the last ones may still have been on their way).
    by_schedule = Counter(s for s, _ in sent)
    assert set(by_schedule) == {"cron", "every", "jittered", "expiring", "ledger", "celery-type"}, by_schedule
    ran_keys = {(s, _iso(a)) for s, a in ran}
    missing = [(s, a) for s, a in sent if (s, _iso(str(a))) not in ran_keys]
    assert len(missing) <= len(by_schedule), f"sent but never ran: {missing}"
    for r in seen:
        assert r["kind"] == r["schedule"], r  # each message reached its own entry's task
        assert r["id"], r
        if r["kind"] == "expiring":
            assert r["expires"] is not None, r
        if r["kind"] == "cron":
            assert _iso(r["at"]) % 5 == 0, r  # the seconds field's instants, not a minute's
        if r["kind"] == "jittered" and r["eta"] is not None:
            assert _iso(r["eta"]) >= _iso(r["at"]), r
    assert any(r["eta"] for r in seen if r["kind"] == "jittered"), "jitter never delayed a message"
    assert any(_iso(r["at"]) % 60 for r in seen if r["kind"] == "cron"), "the cron's seconds field was ignored"
    # The ledger entry's runs are recorded in the claim table by the worker.
    ledger = sqlite3.connect(db).execute(
        "SELECT count(*) FROM cluster_beat_claims WHERE schedule = 'ledger' AND run_state = 'succeeded'"
    ).fetchone()[0]
    assert ledger >= 3
