"""``cluster-beat check`` builds every entry's message (publishing nothing) and says which cannot be
sent, which take Celery's own path and why, and whether this Celery and kombu are in the tested range.
Run as an operator runs it: ``celery -A app cluster-beat check`` in a subprocess, real Redis broker."""
from __future__ import annotations

import json

import celery
import kombu
import redis

from celery_cluster_beat.store import ClaimStore
from procs import write_app
from test_cli import cli

SCHEDULE = """{
    'fine': {'task': 't.record', 'schedule': every(5), 'args': (1, 'two')},
    'routed': {'task': 't.record', 'schedule': every(7), 'options': {'queue': 'elsewhere'}},
    'unsendable': {'task': 't.record', 'schedule': every(9), 'args': ({1, 2},)},
}"""


def test_check_builds_each_message_and_names_the_one_that_cannot_be_sent(tmp_path, redis_url, pg_url):
    app = write_app(tmp_path, broker=redis_url, db_url=pg_url, redis_url="",
                    schedule=SCHEDULE)
    with ClaimStore(pg_url, node_id="test-setup"):  # the tables, as a beat leaves them: check only reads
        pass
    r = cli(app, "check")
    assert r.returncode == 1 and "Traceback" not in r.stdout + r.stderr, (r.stdout, r.stderr)
    problems = r.stderr.strip().splitlines()
    assert len(problems) == 1, problems
    assert problems[0].startswith("problem  messages: entry 'unsendable' (task t.record) cannot be sent: ")
    assert "set" in problems[0], problems[0]  # the serializer's own words
    ok = {line.split()[1].rstrip(":"): line for line in r.stdout.splitlines()}
    assert f"celery {celery.__version__}, kombu {kombu.__version__} (tested: celery 5.3-5.7, kombu 5.3-5.7)" \
        in ok["versions"]
    assert "2 entries prebuilt, 0 through Celery's own path" in ok["messages"], ok["messages"]
    client = redis.Redis.from_url(redis_url)
    try:
        assert client.llen(app.queue) == 0 and client.llen("elsewhere") == 0  # built, never published
    finally:
        client.close()


def test_check_says_why_entries_take_celerys_own_path(tmp_path, redis_url, pg_url):
    app = write_app(tmp_path, broker=redis_url, db_url=pg_url, redis_url="",
                    schedule="{'fine': {'task': 't.record', 'schedule': every(5)}}",
                    conf="{'task_routes': (lambda name, args, kwargs, options, task=None, **kw: None,)}")
    with ClaimStore(pg_url, node_id="test-setup"):
        pass
    r = cli(app, "check", "--json")
    assert r.returncode == 0, (r.stdout, r.stderr)
    messages = [c for c in json.loads(r.stdout)["checks"] if c["check"] == "messages"]
    assert len(messages) == 1 and messages[0]["ok"], messages
    assert "0 entries prebuilt, 1 through Celery's own path (fine and others like it: task_routes has a " \
           "router function" in messages[0]["detail"], messages
