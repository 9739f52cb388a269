"""Real services for the tests: Redis, PostgreSQL, MariaDB, RabbitMQ.

Each is looked for at its usual local address (or the URL in an environment
variable). When it does not answer, we try the command that starts it on our CI
machines; when that fails too the test *fails* with a message saying what to
start. Nothing is skipped silently.
"""
from __future__ import annotations

import fcntl
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from contextlib import contextmanager
from typing import Iterator

REDIS_URL = os.environ.get("CCB_REDIS_URL", "redis://127.0.0.1:6379/0")
PG_ADMIN_URL = os.environ.get("CCB_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
MYSQL_ADMIN_URL = os.environ.get("CCB_MYSQL_URL", "mysql+pymysql://root@127.0.0.1:3306/test")
RABBITMQ_URL = os.environ.get("CCB_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672//")

_START = {
    "redis": "redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save '' "
    "--appendonly no --dir /var/lib/redis --logfile /var/log/redis/ci.log",
    "postgresql": "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start",
    "mariadb": "start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd",
    "rabbitmq": "rabbitmq-server -detached",
}
_PORTS = {"redis": 6379, "postgresql": 5432, "mariadb": 3306, "rabbitmq": 5672}


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
    # One starter per machine: parallel workers (and suites side by side) wait for it.
    with open(os.path.join(tempfile.gettempdir(), f"ccb-start-{kind}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not _port_open(port):
            _start(kind, port, timeout)


def _start(kind: str, port: int, timeout: float) -> None:
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


# ----------------------------------------------------------------------------- RabbitMQ

#: RabbitMQ opens its port a while before it accepts logins (boot steps, then the vhosts):
#: a started broker is only ready once an AMQP handshake succeeds.
RABBITMQ_BOOT_TIMEOUT = 90.0


def _amqp_handshake(url: str) -> None:
    """Open and close one AMQP connection to *url* (raises what py-amqp raises)."""
    import amqp
    from kombu import Connection

    info = Connection(url)
    conn = amqp.Connection(host=f"{info.hostname or '127.0.0.1'}:{info.port or 5672}", userid=info.userid,
                           password=info.password, virtual_host=info.virtual_host or "/", connect_timeout=2)
    try:
        conn.connect()
    finally:
        try:
            conn.close()
        except Exception:  # it never opened
            conn.collect()


def _masked(url: str) -> str:
    from kombu.utils.url import maybe_sanitize_url

    return maybe_sanitize_url(url)


def rabbitmq_url(timeout: float = RABBITMQ_BOOT_TIMEOUT) -> str:
    """The broker URL of a RabbitMQ that accepts an AMQP login, started here when it is down.

    Waits for the port and then for a handshake, both within *timeout*: a broker that is
    still booting refuses logins for a few seconds after its port opens.
    """
    import amqp

    if "CCB_RABBITMQ_URL" not in os.environ:
        ensure_service("rabbitmq", timeout=timeout)
    deadline = time.monotonic() + timeout
    while True:
        try:
            _amqp_handshake(RABBITMQ_URL)
            return RABBITMQ_URL
        except (OSError, amqp.exceptions.AMQPError) as exc:  # refused, reset, timeout, access refused while booting
            if time.monotonic() >= deadline:
                raise ServiceUnavailable(
                    f"RabbitMQ at {_masked(RABBITMQ_URL)} does not complete an AMQP handshake within "
                    f"{timeout:.0f}s: {exc!r}; start it (`rabbitmq-server -detached`) or set CCB_RABBITMQ_URL"
                ) from exc
            time.sleep(0.5)


def _rabbitmqctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["rabbitmqctl", "-q", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, timeout=60)


@contextmanager
def fresh_vhost(base_url: str) -> Iterator[str]:
    """A virtual host of the test's own on the RabbitMQ at *base_url*; yields its broker URL.

    Queues, exchanges (Celery's ``celery_delayed_*`` ones included) and messages of one
    test are then invisible to every other test, and deleting the vhost removes them all.
    Needs ``rabbitmqctl`` with access to the node (the broker's own host, as root or the
    rabbitmq user); without it, the test fails saying so (tests also use queue names of
    their own, but a vhost is what cleans up).
    """
    from urllib.parse import urlsplit, urlunsplit

    from kombu import Connection

    if shutil.which("rabbitmqctl") is None:
        raise ServiceUnavailable("rabbitmqctl is not installed here: it creates a vhost per test on RabbitMQ "
                                 "(install rabbitmq-server, or run these tests on the broker's host)")
    user = Connection(base_url).userid or "guest"
    name = "ccbtest_" + uuid.uuid4().hex[:12]
    made = _rabbitmqctl("add_vhost", name)
    if made.returncode != 0:
        raise ServiceUnavailable(f"`rabbitmqctl add_vhost {name}` failed: {made.stdout.strip()[-500:]}")
    try:
        granted = _rabbitmqctl("set_permissions", "-p", name, user, ".*", ".*", ".*")
        if granted.returncode != 0:
            raise ServiceUnavailable(f"`rabbitmqctl set_permissions -p {name} {user}` failed: "
                                     f"{granted.stdout.strip()[-500:]}")
        parts = urlsplit(base_url)
        yield urlunsplit((parts.scheme, parts.netloc, "/" + name, parts.query, ""))
    finally:
        _rabbitmqctl("delete_vhost", name)
