"""A beat that cannot send says so: a real ``celery beat`` whose broker refuses every connection
logs one ERROR (not one a second) naming the error and the count, and its ``/healthz`` answers
503 until a send goes through; once the broker is back, sends resume and health recovers."""
from __future__ import annotations

import re
import urllib.error
import urllib.request

import pytest

from procs import start_beat, wait_for, write_app

pytestmark = pytest.mark.slow

URL_LOG = re.compile(r"status page, /metrics and /healthz on (http://\S+/)")


def healthz(base: str):
    try:
        with urllib.request.urlopen(base + "healthz", timeout=3) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.mark.timeout(120)
def test_a_beat_whose_every_send_fails_logs_it_once_and_fails_health(tmp_path, throwaway_redis, redis_url):
    throwaway_redis.kill()  # the broker is down from the start
    app = write_app(tmp_path, broker=throwaway_redis.url, db_url=f"sqlite:///{tmp_path}/claims.sqlite3",
                    redis_url="", schedule="{'tick': {'task': 't.record', 'schedule': every(1)}}",
                    conf="{'cluster_beat_http_port': 0, 'broker_connection_timeout': 1, "
                         "'task_publish_retry_policy': {'max_retries': 1, 'interval_start': 0, "
                         "'interval_step': 0.1, 'interval_max': 0.1}}")
    beat = start_beat(app, tmp_path, "a")
    try:
        wait_for(lambda: URL_LOG.search(beat.log()) is not None, 60, what="beat logging its HTTP address")
        base = URL_LOG.search(beat.log()).group(1)
        wait_for(lambda: healthz(base)[0] == 503, 40, interval=0.25, what="/healthz saying 503")
        status, text = healthz(base)
        assert "the last" in text and "sends all failed with" in text, text
        wait_for(lambda: beat.log().count("sending") >= 6, 40, what="several failed sends")
        said = [line for line in beat.log().splitlines() if "this node sends nothing" in line]
        assert len(said) == 1, said  # once a minute, however many sends fail
        assert "ERROR" in said[0]
        throwaway_redis.start()  # the broker comes back: sends go out, health recovers
        wait_for(lambda: healthz(base)[0] == 200, 40, interval=0.25, what="/healthz back to 200")
        assert "sending works again after" in beat.log()
    finally:
        beat.stop()
