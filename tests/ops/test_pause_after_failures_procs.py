"""``pause_after_failures`` end to end: a real ``celery beat`` and a real worker whose ``LedgerTask``
fails every run. The leader pauses the schedule after three failed runs with the note, its
``/metrics`` counts it (the metric is a receiver of the ``paused_after_failures`` signal), and
``cluster-beat resume`` restarts the streak: three more failures pause it again."""
from __future__ import annotations

import time
from datetime import datetime

import pytest

from celery_cluster_beat.store import ClaimStore
from procs import _free_port, start_beat, start_worker, wait_for, write_app
from test_cli import cli
from test_metrics_http import scrape, value

TASKS = '''
from celery_cluster_beat import LedgerTask

@app.task(bind=True, base=LedgerTask, name="t.flaky")
def flaky(self):
    raise ValueError("boom")
'''
CONF = """{
    'cluster_beat_claim_grace': 1.5,
    'cluster_beat_http_port': int(os.environ['CCB_TEST_HTTP_PORT']) if 'CCB_TEST_HTTP_PORT' in os.environ else None,
}"""


def _pause(store: ClaimStore, after: datetime):
    return next((c for c in store.controls(["flaky"]) if c.paused and c.paused_at > after), None)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_real_worker_failing_three_times_pauses_the_schedule_and_resume_restarts(tmp_path, redis_url, pg_url):
    app = write_app(tmp_path, broker=redis_url, db_url=pg_url, redis_url="", conf=CONF, tasks=TASKS,
                    schedule="{'flaky': {'task': 't.flaky', 'schedule': every(1), 'pause_after_failures': 3}}")
    port = _free_port()
    beat = start_beat(app, tmp_path, "b0", env={"CCB_TEST_HTTP_PORT": str(port)})
    worker = start_worker(app, tmp_path, concurrency=2)
    base = f"http://127.0.0.1:{port}/"
    store = ClaimStore(pg_url, node_id="test")
    try:
        wait_for(lambda: _db_ready(store), 60, interval=0.5, what="the claim store prepared by beat")
        start = store.db_now()
        found = []
        wait_for(lambda: found.append(_pause(store, start)) or found[-1] is not None, 90, interval=0.5,
                 what="the pause after three failures (see beat-b0.log and worker.log)")
        paused = found[-1]
        assert (paused.paused_by, paused.paused_note) == (
            "cluster-beat", "paused after 3 consecutive failed runs (last: ValueError: boom)")
        failed = [r for r in store.claims("flaky") if r.run_state == "failed"]
        assert len(failed) >= 3 and all(r.run_error == "ValueError: boom" for r in failed)
        assert "paused after 3 consecutive failed runs" in beat.log()
        wait_for(lambda: value(scrape(base), "cluster_beat_paused_after_failures_total") == 1, 20, interval=0.5,
                 what="the metric")

        resumed = cli(app, "resume", "flaky")
        assert resumed.returncode == 0 and "resumed 'flaky'" in resumed.stdout, resumed.stdout + resumed.stderr
        (control,) = store.controls(["flaky"])
        assert (control.paused, control.paused_note) == (False, None)
        found.clear()
        wait_for(lambda: found.append(_pause(store, control.resumed_at)) or found[-1] is not None, 90,
                 interval=0.5, what="the second pause")
        after = [r for r in store.claims("flaky") if r.run_state == "failed" and r.finished_at > control.resumed_at]
        assert len(after) >= 3
        wait_for(lambda: value(scrape(base), "cluster_beat_paused_after_failures_total") == 2, 20, interval=0.5,
                 what="the metric counting both")
    finally:
        store.close()
        worker.stop()
        beat.stop()


def _db_ready(store: ClaimStore) -> bool:
    try:
        store.open()
        return True
    except Exception:
        time.sleep(0.2)
        return False
