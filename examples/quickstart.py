"""A Celery app whose periodic tasks are scheduled by celery-cluster-beat.

Embedded defaults, nothing to install or start: the broker is kombu's
SQLAlchemy transport on a SQLite file, results go to a SQLite file too, and
tick claims to ``celerybeat-cluster.sqlite3``. Run (from this folder)::

    celery -A quickstart worker -B -S celery_cluster_beat.Scheduler -l info

For a cluster, install the PostgreSQL driver (``pip install -e '.[postgres]'``),
point it at Redis and PostgreSQL and start beat on each host::

    CCB_BROKER_URL=redis://127.0.0.1:6379/0 \\
    CCB_RESULT_BACKEND=redis://127.0.0.1:6379/1 \\
    CCB_DB_URL=postgresql+psycopg://postgres@127.0.0.1:5432/test \\
    celery -A quickstart beat -S celery_cluster_beat.Scheduler -l info
"""
import os

from celery import Celery

from celery_cluster_beat import cron, every

app = Celery(
    "quickstart",
    broker=os.environ.get("CCB_BROKER_URL", "sqla+sqlite:///celery-broker.sqlite3"),
    backend=os.environ.get("CCB_RESULT_BACKEND", "db+sqlite:///celery-results.sqlite3"),
)
app.conf.update(
    timezone=os.environ.get("CCB_TIMEZONE", "UTC"),
    task_track_started=True,  # lets the overlap guard see a long run as STARTED
    broker_connection_retry_on_startup=True,
    cluster_beat_db_url=os.environ.get("CCB_DB_URL", "sqlite:///celerybeat-cluster.sqlite3"),
    beat_schedule={
        # Every 10 s on the epoch grid: :00, :10, :20 ... on every replica alike.
        "heartbeat": {"task": "quickstart.heartbeat", "schedule": every(10)},
        # Vixie cron, in the app's time zone unless tz= says otherwise.
        "minutely-report": {
            "task": "quickstart.report",
            "schedule": cron("* * * * *"),
            "kwargs": {"name": "minutely"},
            "description": "a report every minute",
        },
        # Every 6 hours anchored at 02:30 London time each day.
        "rollup": {
            "task": "quickstart.report",
            "schedule": every(6 * 3600, baseline="02:30", tz="Europe/London"),
            "kwargs": {"name": "rollup"},
        },
    },
)


@app.task(bind=True)
def heartbeat(self):
    """Print which occurrence this run serves (the headers beat put on it)."""
    print(
        f"heartbeat: occurrence {self.request.get('cluster_beat_scheduled_at')} "
        f"of {self.request.get('cluster_beat_schedule')} sent by {self.request.get('cluster_beat_node')}"
    )


@app.task(bind=True)
def report(self, name):
    print(f"report {name!r} for {self.request.get('cluster_beat_scheduled_at')}")
    return name
