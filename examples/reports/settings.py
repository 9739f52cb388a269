"""Everything the example reads from the environment, in one place.

With nothing set, everything is embedded: SQLite files and the snapshots go to
``examples/reports/data/`` (``REPORTS_DATA_DIR``), and the broker is kombu's SQLAlchemy
transport on a SQLite file, so no server is needed. For a cluster::

    REPORTS_DB_URL=postgresql+psycopg://postgres@127.0.0.1:5432/test       # the app's tables
    CLUSTER_BEAT_DB_URL=postgresql+psycopg://postgres@127.0.0.1:5432/test  # claims, stored schedules, ledger
    BROKER_URL=redis://127.0.0.1:6379/0                                    # Celery's broker
    REDIS_URL=redis://127.0.0.1:6379/0                                     # the lease (default: a Redis broker)

``REPORTS_OUTPUT_DIR`` is where the CSV snapshots go (every worker must see it: a
shared volume or, in real life, object storage). ``REPORTS_QUEUE`` and
``CLUSTER_BEAT_NAME`` only matter when several copies of the example share one
Redis (the tests do): the queue and the lease name must then differ.

The folders this example creates (the data folder, the snapshots and each report's folder in
it) are 0700, whatever the umask: snapshots hold the users' data. A folder that exists keeps
its mode.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Mapping, Optional

from celery import Celery

#: Where the SQLite files, logs and snapshots go unless REPORTS_DATA_DIR says otherwise.
DEFAULT_DATA_DIR = Path(__file__).resolve().parent / "data"


@dataclass(frozen=True)
class Settings:
    data_dir: Path
    reports_db_url: str
    cluster_db_url: str
    broker_url: str
    redis_url: Optional[str]  # None: the scheduler's default (the broker when it is Redis)
    output_dir: Path
    queue: str
    cluster_name: str

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "Settings":
        """The settings the environment gives (see the module docstring); creates the data folders."""
        env = os.environ if environ is None else environ
        data = Path(env.get("REPORTS_DATA_DIR", str(DEFAULT_DATA_DIR))).resolve()
        settings = cls(
            data_dir=data,
            reports_db_url=env.get("REPORTS_DB_URL", f"sqlite:///{data}/reports.sqlite3"),
            cluster_db_url=env.get("CLUSTER_BEAT_DB_URL", f"sqlite:///{data}/cluster-beat.sqlite3"),
            broker_url=env.get("BROKER_URL", f"sqla+sqlite:///{data}/broker.sqlite3"),
            redis_url=env.get("REDIS_URL") or None,
            output_dir=Path(env.get("REPORTS_OUTPUT_DIR", str(data / "snapshots"))).resolve(),
            queue=env.get("REPORTS_QUEUE", "reports"),
            cluster_name=env.get("CLUSTER_BEAT_NAME", "reports"),
        )
        if settings.reports_db_url == settings.cluster_db_url and settings.reports_db_url.startswith("sqlite"):
            # service.py holds the report's write transaction open while it writes the schedule.
            raise ValueError("REPORTS_DB_URL and CLUSTER_BEAT_DB_URL name the same SQLite file: use two files "
                             "(or one server database)")
        settings.prepare_dirs()
        return settings

    def celery_config(self) -> Dict[str, Any]:
        conf: Dict[str, Any] = {
            "broker_url": self.broker_url,
            "broker_connection_retry_on_startup": True,
            "task_default_queue": self.queue,
            "timezone": "UTC",
            # Claims, stored schedules and the worker ledger live in this database.
            "cluster_beat_db_url": self.cluster_db_url,
            "cluster_beat_cluster_name": self.cluster_name,
            # No result backend: every occurrence writes its own snapshot and the ledger
            # refuses a second delivery, so runs of different occurrences may overlap.
            "cluster_beat_overlap": "allow",
            "beat_schedule": {},  # every schedule of this app is a stored one
        }
        if self.redis_url:
            conf["cluster_beat_redis_url"] = self.redis_url
        return conf

    def prepare_dirs(self) -> None:
        """Create the folders the SQLite files and snapshots go to (0700, see the module docstring)."""
        private_dir(self.data_dir)
        private_dir(self.output_dir)


#: Mode of the folders this example creates, and of its snapshots (0600): the owner's alone.
DIR_MODE = 0o700


def private_dir(path: Path) -> None:
    """Create *path* and its missing parents with mode 0700, whatever the umask. Another process
    creating one of them at the same time is fine (it creates it the same way)."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=DIR_MODE)
        except FileExistsError:
            continue
        os.chmod(folder, DIR_MODE)  # the umask may have taken bits off


def make_celery(settings: Settings) -> Celery:
    """The Celery app, configured from *settings* (tasks are registered in tasks.py)."""
    app = Celery("reports")
    app.conf.update(settings.celery_config())
    return app
