"""Start-up that says one thing clearly, in real ``celery beat`` and ``celery worker -B`` processes.

* A configuration error (bad setting, bad ``beat_schedule`` entry, an unsupported
  schedule type, a stored schedule named like an entry, a missing database driver)
  prints one ERROR message listing every problem and exits with status 1, without a
  traceback, whether beat runs alone or embedded in a worker.
* A claim database or Redis that does not answer at start-up is retried with
  back-off and logged once per outage: beat stays up and starts sending when it answers.
* ``-l debug`` lists each schedule with its next fire when the node starts scheduling.
"""
from __future__ import annotations

import importlib.util
import re
import select
import socket
import sys
import threading
import time
from pathlib import Path
from typing import List
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis
from celery import Celery
from sqlalchemy.engine import make_url

from celery_cluster_beat import every
from celery_cluster_beat.dynamic import StoredSchedules

from procs import App, Proc, ThrowawayRedis, start_worker, wait_for, wait_for_log, write_app

BROKER_DB = 7  # the Redis database of the process tests' brokers; every app has its own queue

#: A Celery solar schedule. Building one needs the ``ephem`` package (Celery's ``solar`` extra);
#: without it the object is made without its constructor: what is refused is the type.
SOLAR_PRELUDE = '''
from celery.schedules import solar
try:
    SOLAR = solar("sunset", 51.5, -0.1)
except Exception:
    SOLAR = solar.__new__(solar)
    SOLAR.event, SOLAR.lat, SOLAR.lon = "sunset", 51.5, -0.1
'''

BAD_ENTRIES = """{
    'bad-cron': {'task': 't.record', 'schedule': '61 * * * *'},
    'unknown-key': {'task': 't.record', 'schedule': every(60), 'colour': 'blue'},
    'sunset': {'task': 't.record', 'schedule': SOLAR},
    'good': {'task': 't.record', 'schedule': every(60)},
}"""

BAD_ENTRY_PROBLEMS = [
    "beat_schedule entry 'bad-cron': schedule: cron '61 * * * *': minute value 61 is out of range 0-59",
    "beat_schedule entry 'unknown-key': colour: unknown key",
    "beat_schedule entry 'sunset': schedule: ",
]

#: Most lines a refused start-up may print (beat's banner is 14; a worker's about 25).
MAX_LINES = 40


# --------------------------------------------------------------------------- helpers


@pytest.fixture
def broker(redis_url) -> str:
    parts = urlsplit(redis_url)
    return urlunsplit(parts._replace(path=f"/{BROKER_DB}"))


@pytest.fixture
def apps():
    """The test's apps; their queues are deleted at the end (nobody consumes them)."""
    made: List[App] = []
    yield made
    for app in made:
        client = redis.Redis.from_url(app.broker)
        try:
            client.delete(app.queue)
        finally:
            client.close()


@pytest.fixture
def procs():
    started: List[Proc] = []
    yield started
    for proc in started:
        proc.stop()


def _with_prelude(app: App, prelude: str) -> None:
    path = app.directory / f"{app.module}.py"
    path.write_text(path.read_text().replace("app = Celery(", prelude + "\napp = Celery(", 1))


def _beat(app: App, tmp: Path, label: str, procs: list, *, level: str = "info") -> Proc:
    args = [sys.executable, "-m", "celery", "-A", app.module, "beat", "-S", "celery_cluster_beat.Scheduler",
            "-l", level, "--pidfile=", "-s", str(tmp / f"unused-{label}")]
    proc = Proc(args, cwd=app.directory, env=app.env(), log=tmp / f"beat-{label}.log")
    procs.append(proc)
    return proc


def _exit_status(proc: Proc, timeout: float) -> int:
    try:
        return proc.popen.wait(timeout)
    except Exception:
        raise AssertionError(f"still running after {timeout:.0f}s:\n{proc.log()[-3000:]}") from None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _assert_one_clean_message(out: str, *, expected: List[str], max_lines: int = MAX_LINES) -> str:
    """One ERROR record (the configuration error) holding every *expected* problem, no traceback,
    no CRITICAL line, and a short output. Returns the message (its record's lines)."""
    assert "Traceback" not in out, out
    assert "CRITICAL" not in out, out
    errors = [i for i, line in enumerate(out.splitlines()) if "ERROR/" in line]
    assert len(errors) == 1, f"expected one ERROR record:\n{out}"
    lines = out.splitlines()
    first = errors[0]
    message = [lines[first]] + [line for line in lines[first + 1:first + 1 + len(expected)] if line.startswith("  - ")]
    text = "\n".join(message)
    assert "cluster-beat: configuration error" in lines[first], out
    for problem in expected:
        assert problem in text, f"{problem!r} missing from the message:\n{text}\n--- whole output:\n{out}"
    assert len(lines) < max_lines, f"{len(lines)} lines of output:\n{out}"
    return text


class PortForwarder:
    """Forwards connections to a fixed local port (chosen by the test before anything listens on
    it) to *target*: the claim database becomes reachable on a URL that was refused until now."""

    def __init__(self, port: int, target: tuple) -> None:
        self.target = target
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", port))
        self._listener.listen(32)
        self._closed = False
        self._socks: List[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                ready, _, _ = select.select([self._listener], [], [], 0.2)
                if not ready:
                    continue
                client, _ = self._listener.accept()
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                continue
            self._socks += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        try:
            while not self._closed:
                ready, _, _ = select.select([a, b], [], [], 0.2)
                for sock in ready:
                    data = sock.recv(65536)
                    if not data:
                        return
                    (b if sock is a else a).sendall(data)
        except (OSError, ValueError):
            return
        finally:
            for sock in (a, b):
                try:
                    sock.close()
                except OSError:
                    pass

    def close(self) -> None:
        self._closed = True
        for sock in [self._listener] + self._socks:
            try:
                sock.close()
            except OSError:
                pass
        self._thread.join(5)


# --------------------------------------------------------------------------- configuration errors


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_bad_entries_stop_celery_beat_with_one_message_and_status_1(tmp_path, broker, apps, procs):
    """A bad cron string, an unknown key and Celery's solar schedule in one app: ``celery beat``
    exits with status 1 after one ERROR message listing all three; no traceback, few lines, and
    no claim database was created."""
    db = tmp_path / "claims.sqlite3"
    app = write_app(tmp_path, broker=broker, db_url=f"sqlite:///{db}", schedule=BAD_ENTRIES)
    _with_prelude(app, SOLAR_PRELUDE)
    beat = _beat(app, tmp_path, "bad", procs)
    assert _exit_status(beat, 60) == 1, beat.log()
    out = beat.log()
    message = _assert_one_clean_message(out, expected=BAD_ENTRY_PROBLEMS)
    assert "3 problems in the celery-cluster-beat configuration" in message
    assert "solar" in message and "'good'" not in message
    assert not db.exists()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bad_entries_stop_a_worker_with_embedded_beat_with_one_message_and_status_1(tmp_path, broker, apps, procs):
    """The same app under ``celery worker -B``: the embedded beat logs the one message and the
    worker stops (warm shutdown) with exit status 1 instead of running on without a scheduler."""
    db = tmp_path / "claims.sqlite3"
    app = write_app(tmp_path, broker=broker, db_url=f"sqlite:///{db}", schedule=BAD_ENTRIES)
    _with_prelude(app, SOLAR_PRELUDE)
    worker = start_worker(app, tmp_path, "worker", "-B", "--scheduler", "celery_cluster_beat.Scheduler",
                          "-s", str(tmp_path / "unused-worker"), concurrency=1)
    procs.append(worker)
    assert _exit_status(worker, 90) == 1, worker.log()
    out = worker.log()
    message = _assert_one_clean_message(out, expected=BAD_ENTRY_PROBLEMS, max_lines=60)
    assert "3 problems in the celery-cluster-beat configuration" in message
    assert "the worker with it (exit status 1)" in message
    assert not db.exists()


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_bad_settings_stop_celery_beat_before_it_starts_with_one_message(tmp_path, broker, apps, procs):
    """Bad ``cluster_beat_*`` settings are found by the banner's scheduler, before Celery sets
    logging up: still one ERROR message listing every problem, status 1, no traceback."""
    app = write_app(tmp_path, broker=broker, db_url=f"sqlite:///{tmp_path}/claims.sqlite3",
                    schedule="{'tick': {'task': 't.record', 'schedule': every(60)}}",
                    conf="{'cluster_beat_lock_ttl': 'x', 'cluster_beat_catchup': 'sometimes'}")
    beat = _beat(app, tmp_path, "badsetting", procs)
    assert _exit_status(beat, 60) == 1, beat.log()
    out = beat.log()
    message = _assert_one_clean_message(out, expected=[
        "setting cluster_beat_lock_ttl: expected a number of seconds, got 'x'",
        "setting cluster_beat_catchup: ",
    ])
    assert "2 problems in the celery-cluster-beat configuration" in message
    assert "beat: Starting" not in out


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_stored_schedule_named_like_an_entry_stops_celery_beat_with_status_1(tmp_path, broker, apps, procs):
    """A stored schedule 'report' exists; an app whose ``beat_schedule`` has an entry 'report'
    is refused: one message naming both and the way out, status 1, no traceback."""
    db_url = f"sqlite:///{tmp_path}/claims.sqlite3"
    owner_app = Celery("ccb_clash", broker="memory://")
    owner_app.conf.update(cluster_beat_db_url=db_url, cluster_beat_redis_url="")
    api = StoredSchedules(owner_app)
    try:
        api.add("report", "t.record", every(60), owner="alice")
    finally:
        api.close()
    app = write_app(tmp_path, broker=broker, db_url=db_url,
                    schedule="{'report': {'task': 't.record', 'schedule': every(1)}}")
    apps.append(app)
    beat = _beat(app, tmp_path, "clash", procs)
    assert _exit_status(beat, 60) == 1, beat.log()
    _assert_one_clean_message(beat.log(), expected=[
        "beat_schedule entry 'report' and the stored schedule 'report' of 'alice' share a name",
    ])
    assert app.queued_messages() == []


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_missing_database_driver_names_the_url_form_to_use(tmp_path, broker, apps, procs):
    """``mysql://`` means SQLAlchemy's default MySQL driver (mysqlclient), not installed here:
    one message naming the URL form to use and the extra to install, status 1, no traceback
    (not a retry loop: no retry can install a driver)."""
    assert importlib.util.find_spec("MySQLdb") is None, "this test needs a driver that is absent"
    app = write_app(tmp_path, broker=broker, db_url="mysql://root@127.0.0.1:3306/test",
                    schedule="{'tick': {'task': 't.record', 'schedule': every(60)}}")
    beat = _beat(app, tmp_path, "driver", procs)
    assert _exit_status(beat, 60) == 1, beat.log()
    _assert_one_clean_message(beat.log(), expected=[
        "setting cluster_beat_db_url: mysql://root@127.0.0.1:3306/test: its driver module 'MySQLdb' is not installed",
        "use the URL form mysql+pymysql:// (mysql+pymysql://root@127.0.0.1:3306/test)",
        "pip install 'celery-cluster-beat[mysql]'",
    ])


# --------------------------------------------------------------------------- outages at start-up


def _closed_port_url(pg_url: str) -> tuple:
    """*pg_url* moved to a local port nothing listens on (yet), and that port."""
    port = _free_port()
    return make_url(pg_url).set(host="127.0.0.1", port=port).render_as_string(hide_password=False), port


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_an_unreachable_claim_database_at_start_is_retried_and_logged_once(tmp_path, broker, apps, procs, pg_url):
    """The claim database's port refuses connections when beat starts: beat stays up, logs the
    outage once (not once per retry) and sends nothing; once the port leads to PostgreSQL it
    finishes its start-up, says so, and sends ``every(1)``."""
    url, port = _closed_port_url(pg_url)
    real = make_url(pg_url)
    app = write_app(tmp_path, broker=broker, db_url=url,
                    schedule="{'tick': {'task': 't.record', 'schedule': every(1)}}")
    apps.append(app)
    beat = _beat(app, tmp_path, "nodb", procs, level="debug")  # debug: each retry is seen
    outage = "the claim store is unreachable at start-up"
    wait_for_log(beat, outage, 60)
    # A retry (about 1 s after the first try) met the outage again: logged at debug level only.
    wait_for_log(beat, "cluster-beat: the claim store still unreachable", 30)
    out = beat.log()
    assert beat.alive(), out
    assert out.count(outage) == 1, out
    assert "retrying with back-off" in out
    assert app.queued_messages() == []
    forwarder = PortForwarder(port, (real.host or "127.0.0.1", real.port or 5432))
    try:
        wait_for(lambda: len(app.queued_messages()) >= 2, 60, what="two messages once the database answers")
        out = beat.log()
        assert beat.alive(), out
    finally:
        beat.stop()  # before its database link goes
        forwarder.close()
    assert out.count(outage) == 1, out
    assert "the claim store answers after" in out, out
    assert "Traceback" not in out, out


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_clash_found_once_the_database_answers_still_exits_with_status_1(tmp_path, broker, apps, procs, pg_url):
    """The database was unreachable at start-up; when it answers it holds a stored schedule named
    like an entry: the same one message and exit status 1 as at start-up (found inside beat's loop)."""
    owner_app = Celery("ccb_clash_late", broker="memory://")
    owner_app.conf.update(cluster_beat_db_url=pg_url, cluster_beat_redis_url="")
    api = StoredSchedules(owner_app)
    try:
        api.add("report", "t.record", every(60), owner="bob")
    finally:
        api.close()
    url, port = _closed_port_url(pg_url)
    real = make_url(pg_url)
    app = write_app(tmp_path, broker=broker, db_url=url,
                    schedule="{'report': {'task': 't.record', 'schedule': every(1)}}")
    apps.append(app)
    beat = _beat(app, tmp_path, "lateclash", procs)
    wait_for_log(beat, "the claim store is unreachable at start-up", 60)
    forwarder = PortForwarder(port, (real.host or "127.0.0.1", real.port or 5432))
    try:
        assert _exit_status(beat, 60) == 1, beat.log()
    finally:
        forwarder.close()
    out = beat.log()
    _assert_one_clean_message(out, expected=[
        "beat_schedule entry 'report' and the stored schedule 'report' of 'bob' share a name",
    ])
    assert app.queued_messages() == []


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_an_unreachable_redis_at_start_is_retried_and_logged_once(tmp_path, broker, apps, procs):
    """The lease's Redis does not run when beat starts: beat stays up, logs the outage once and
    sends nothing (no lease, no leader); once a redis-server runs on that port the node takes
    the lease and sends ``every(1)``."""
    lease_redis = ThrowawayRedis(tmp_path)  # its port is chosen; the server is not started yet
    try:
        app = write_app(tmp_path, broker=broker, db_url=f"sqlite:///{tmp_path}/claims.sqlite3",
                        redis_url=lease_redis.url,
                        schedule="{'tick': {'task': 't.record', 'schedule': every(1)}}")
        apps.append(app)
        beat = _beat(app, tmp_path, "noredis", procs, level="debug")  # debug: each retry is seen
        outage = "Redis unavailable while trying to check which claim store the lease serves"
        wait_for_log(beat, outage, 60)
        # The lease retries every 0.1 s, doubling to 2 s: two retries met the outage again.
        wait_for(lambda: beat.log().count("Redis still unavailable") >= 2, 30, what="two retries of Redis")
        out = beat.log()
        assert beat.alive(), out
        assert out.count("Redis unavailable") == 1, out
        assert app.queued_messages() == []
        lease_redis.start()
        wait_for(lambda: len(app.queued_messages()) >= 2, 60, what="two messages once Redis answers")
        out = beat.log()
        assert beat.alive(), out
        beat.stop()  # before its Redis goes
        assert out.count("Redis unavailable") == 1, out
        assert "Redis reachable again after" in out, out
        assert "is now the leader" in out, out
        assert "Traceback" not in out, out
    finally:
        lease_redis.kill()


# --------------------------------------------------------------------------- -l debug


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_debug_level_lists_each_schedule_with_its_next_fire(tmp_path, broker, apps, procs):
    """``-l debug``: when the node starts scheduling, one line per schedule with its next fire
    (a disabled entry says so); ``-l info`` prints none of it."""
    schedule = """{
        'every-minute': {'task': 't.record', 'schedule': every(60)},
        'nightly': {'task': 't.record', 'schedule': cron('30 2 * * *', tz='Europe/London')},
        'idle': {'task': 't.record', 'schedule': every(60), 'enabled': False},
    }"""
    app = write_app(tmp_path, broker=broker, db_url=f"sqlite:///{tmp_path}/claims.sqlite3", schedule=schedule)
    apps.append(app)
    quiet = write_app(tmp_path, broker=broker, db_url=f"sqlite:///{tmp_path}/claims2.sqlite3", schedule=schedule)
    apps.append(quiet)
    beat = _beat(app, tmp_path, "debug", procs, level="debug")
    info = _beat(quiet, tmp_path, "info", procs)  # side by side: the two start-ups overlap
    wait_for_log(beat, "schedule 'nightly'", 60)
    wait_for_log(beat, "schedule 'idle'", 10)
    wait_for_log(beat, "beat: Ticking with max interval", 10)  # Celery's line, once the scheduler is built
    out = beat.log()
    assert "schedules 3 beat_schedule entries (next fires in UTC)" in out, out
    lines = {name: [line for line in out.splitlines() if f"cluster-beat: schedule '{name}':" in line][0]
             for name in ("every-minute", "nightly", "idle")}
    assert re.search(r"t\.record <every 60s>, next fire \d{4}-\d\d-\d\dT\d\d:\d\d:00\+00:00$",
                     lines["every-minute"]), lines
    assert re.search(r"t\.record <cron '30 2 \* \* \*' tz=Europe/London>, next fire \d{4}-\d\d-\d\dT0[12]:30:00\+00:00$",
                     lines["nightly"]), lines
    assert lines["idle"].endswith("next fire disabled"), lines
    assert all("DEBUG/MainProcess" in line for line in lines.values()), lines

    wait_for_log(info, "cluster-beat: node", 60)
    time.sleep(1.0)
    assert "cluster-beat: schedule '" not in info.log()


# --------------------------------------------------------------------------- a beat thread


@pytest.mark.timeout(60)
def test_a_beat_thread_with_bad_entries_asks_its_worker_to_stop_with_status_1(tmp_path, caplog, capfd):
    """``EmbeddedService(thread=True)`` (Celery's threaded beat): the thread logs the one message
    and ends quietly (Python's own thread excepthook prints nothing for its SystemExit); the
    worker's stop flag holds exit status 1 and the service counts as stopped, so the worker's
    shutdown does not wait for it. (In-process: no worker runs here.)"""
    from celery.beat import EmbeddedService
    from celery.worker import state

    app = Celery("ccb_thread", broker="memory://")
    app.conf.update(cluster_beat_db_url=f"sqlite:///{tmp_path}/claims.sqlite3", cluster_beat_redis_url="",
                    beat_schedule={"bad-cron": {"task": "t.record", "schedule": "61 * * * *"},
                                   "unknown-key": {"task": "t.record", "schedule": every(60), "colour": "blue"}})
    service = EmbeddedService(app, thread=True, scheduler_cls="celery_cluster_beat.Scheduler",
                              schedule_filename=str(tmp_path / "unused"))
    before, hook = state.should_stop, threading.excepthook
    threading.excepthook = threading.__excepthook__  # Python's, not pytest's (which reports SystemExit too)
    try:
        with caplog.at_level("ERROR", logger="celery_cluster_beat"):
            service.start()
            service.join(30)
        threading.excepthook = hook
        assert not service.is_alive()
        assert state.should_stop == 1
        assert service.service._is_stopped.is_set()
    finally:
        state.should_stop, threading.excepthook = before, hook
    assert "Traceback" not in capfd.readouterr().err
    errors = [r for r in caplog.records if r.levelname == "ERROR" and r.name == "celery_cluster_beat"]
    assert len(errors) == 1, caplog.text
    message = errors[0].getMessage()
    assert "configuration error, the embedded beat stops, and the worker with it (exit status 1)" in message
    assert "2 problems in the celery-cluster-beat configuration" in message
    assert not (tmp_path / "claims.sqlite3").exists()
