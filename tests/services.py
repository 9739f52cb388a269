"""Real services for the tests: Redis, PostgreSQL, MariaDB.

Each is looked for at its usual local address (or the URL in an environment
variable). When it does not answer, we try the command that starts it on our CI
machines; when that fails too the test *fails* with a message saying what to
start. Nothing is skipped silently.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import uuid
from contextlib import contextmanager
from typing import Iterator

REDIS_URL = os.environ.get("CCB_REDIS_URL", "redis://127.0.0.1:6379/0")
PG_ADMIN_URL = os.environ.get("CCB_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
MYSQL_ADMIN_URL = os.environ.get("CCB_MYSQL_URL", "mysql+pymysql://root@127.0.0.1:3306/test")

_START = {
    "redis": "redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save '' "
    "--appendonly no --dir /var/lib/redis --logfile /var/log/redis/ci.log",
    "postgresql": "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start",
    "mariadb": "start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd",
}
_PORTS = {"redis": 6379, "postgresql": 5432, "mariadb": 3306}


class ServiceUnavailable(RuntimeError):
    pass


def _port_open(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def ensure_service(kind: str, timeout: float = 30.0) -> None:
    """Make sure *kind* answers on its local port, starting it if we can."""
    port = _PORTS[kind]
    if _port_open(port):
        return
    cmd = _START[kind]
    exe = cmd.split()[0]
    if shutil.which(exe) is None:
        raise ServiceUnavailable(
            f"{kind} is not answering on 127.0.0.1:{port} and `{exe}` is not installed here; "
            f"start {kind} (or point the CCB_*_URL variables at one) and run the tests again"
        )
    subprocess.run(cmd, shell=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _port_open(port):
            time.sleep(0.5)
            return
        time.sleep(0.25)
    raise ServiceUnavailable(
        f"{kind} is not answering on 127.0.0.1:{port}, and `{cmd}` did not start it within {timeout:.0f}s"
    )


def redis_url() -> str:
    if "CCB_REDIS_URL" not in os.environ:
        ensure_service("redis")
    import redis

    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=2)
    try:
        client.ping()
    except redis.RedisError as exc:
        raise ServiceUnavailable(f"Redis at {REDIS_URL} does not answer PING: {exc}") from exc
    finally:
        client.close()
    return REDIS_URL


@contextmanager
def fresh_database(kind: str) -> Iterator[str]:
    """Create an empty database on *kind* ('postgresql' or 'mysql') and yield its URL.

    A database of its own per test keeps tests (and developers running suites
    side by side) from seeing each other's tables.
    """
    import sqlalchemy as sa
    from sqlalchemy.engine import make_url

    admin = PG_ADMIN_URL if kind == "postgresql" else MYSQL_ADMIN_URL
    env = "CCB_PG_URL" if kind == "postgresql" else "CCB_MYSQL_URL"
    if env not in os.environ:
        ensure_service("postgresql" if kind == "postgresql" else "mariadb")
    name = "ccb_" + uuid.uuid4().hex[:12]
    engine = sa.create_engine(admin, isolation_level="AUTOCOMMIT", pool_pre_ping=True)
    try:
        with engine.connect() as conn:
            conn.execute(sa.text(f"CREATE DATABASE {name}"))
    except sa.exc.OperationalError as exc:
        engine.dispose()
        raise ServiceUnavailable(f"cannot create a test database on {kind} ({admin}): {exc}") from exc
    try:
        yield make_url(admin).set(database=name).render_as_string(hide_password=False)
    finally:
        with engine.connect() as conn:
            if kind == "postgresql":
                conn.execute(sa.text(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = :d AND pid <> pg_backend_pid()"), {"d": name})
            conn.execute(sa.text(f"DROP DATABASE IF EXISTS {name}"))
        engine.dispose()
