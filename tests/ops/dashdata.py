"""A small cluster's worth of history for the dashboard tests, written through the store's own calls.

A temp SQLite claim store with: config entries and a stored schedule (a hostile description), two
nodes' heartbeats, sent occurrences whose runs went through the worker's ledger (``start_run`` /
``finish_run``): one schedule's latest run failed with an error, another's is still running. Only
the send times are then moved to when they would have been (a sent occurrence is marked sent at
the database's "now"; history is written in one go here), through a plain engine behind the
store's back, as tests/store does for history.
"""
from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any, Dict

import sqlalchemy as sa
from celery import Celery

from celery_cluster_beat import cron, every
from celery_cluster_beat.schedules.occurrence import Occurrence
from celery_cluster_beat.store import ClaimStore
from celery_cluster_beat.store.schema import RunState, claims_table

ACTIONS_TOKEN = "actions-t0ken-for-the-tests-0123"
FAILING = "billing.nightly-invoices"
RUNNING = "reports.hourly-export"
LONG = "reports.weekly-summary-for-the-finance-team-with-a-name-much-longer-than-any-screen-is-wide"
HOSTILE = "ops:<b>cleanup</b>@host"
ERROR = "ConnectionError: database refused the connection <b>x</b>"
ARTEFACTS = Path(__file__).resolve().parents[2] / "test-artefacts"

SCHEDULE = {
    "tick": {"task": "app.tasks.tick", "schedule": every(10)},
    FAILING: {"task": "billing.tasks.invoices", "schedule": cron("*/5 * * * *"),
              "description": "Generates the day's invoices <script>alert(1)</script>"},
    RUNNING: {"task": "reports.tasks.export", "schedule": cron("0 * * * *", tz="Europe/Paris")},
    LONG: {"task": "reports.tasks.weekly", "schedule": cron("30 2 * * 1-5", tz="Europe/Paris")},
}


def _stored(name: str) -> Dict[str, Any]:
    return dict(name=name, task="ops.tasks.cleanup", schedule="every 21600s from 02:30", zone="UTC", args="[]",
                kwargs="{}", options="{}", overlap=None, max_run_time=None, jitter=None, catchup=None,
                catchup_window=None, description="removes <img src=x onerror=alert(1)> temp files", owner="ops",
                enabled=True)


def fill(url: str) -> None:
    store = ClaimStore(url, node_id="beat-a@host-1:4242")
    store.open()
    other = ClaimStore(url, node_id="beat-b@host-2:4343")
    other.open()
    try:
        store.heartbeat(scheduling=True, clock_offset=0.004, register=True)
        other.heartbeat(scheduling=False, clock_offset=-0.012, register=True)
        now = store.db_now().replace(microsecond=0)
        store.stored_change([HOSTILE], lambda live, at: ([_stored(HOSTILE)], []),
                            lambda row, at: at + timedelta(hours=2))
        late: Dict[tuple, float] = {}

        def run(name: str, at, state, runtime, error=None, delay: float = 0.05) -> None:
            occ = Occurrence(name, at)
            store.claim([occ], term=3)
            store.mark_sent([occ])
            started = store.start_run(name, at, task_id="", worker="worker-1@host-3", pid=77)
            if state is not None:
                store.finish_run(name, at, started.token, state, runtime=runtime, error=error)
            late[(name, at)] = delay

        for i in range(12):  # every 5 min for an hour; the latest failed, one in the middle too
            failed = i in (5, 11)
            run(FAILING, now - timedelta(minutes=5 * (12 - i)) + timedelta(seconds=3),
                RunState.FAILED if failed else RunState.SUCCEEDED, 40.0 + 3.5 * i + (25 if failed else 0),
                ERROR if failed else None, delay=0.04 + 0.02 * (i % 4))
        for i in range(6):
            run("tick", now - timedelta(seconds=10 * (6 - i)), RunState.SUCCEEDED, 0.08 + 0.01 * i, delay=0.02)
        run(RUNNING, now - timedelta(minutes=2), None, None, delay=0.3)
        run(HOSTILE, now - timedelta(hours=3), RunState.SUCCEEDED, 12.0, delay=0.1)
        engine = sa.create_engine(url)
        try:
            c = claims_table
            with engine.begin() as conn:
                for (name, at), delay in late.items():
                    conn.execute(sa.update(c).where(c.c.schedule == name, c.c.scheduled_at == at)
                                 .values(sent_at=at + timedelta(seconds=delay),
                                         started_at=at + timedelta(seconds=delay + 0.01)))
        finally:
            engine.dispose()
    finally:
        store.close()
        other.close()


def make_app(url: str, **conf: Any) -> Celery:
    app = Celery("dashboard-tests", broker="memory://", set_as_current=False)
    app.conf.update(cluster_beat_db_url=url, cluster_beat_redis_url="", cluster_beat_http_port=0,
                    cluster_beat_claim_grace=60, cluster_beat_cluster_name="payments-prod", beat_schedule=SCHEDULE,
                    **conf)
    return app
