"""Real ``celery beat`` / ``celery worker`` processes for the behaviour tests.

A test writes a small Celery app module into its temporary folder
(:func:`write_app`), starts processes from it, and reads what reached the
broker: the messages themselves (with their headers) from the Redis list of
the test's own queue, so "sent exactly once" is checked where it matters.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Callable, Dict, List, Optional

import redis

REPO = Path(__file__).resolve().parent.parent

APP_TEMPLATE = '''
import os, time
from celery import Celery
from celery_cluster_beat import cron, every
from celery.schedules import crontab, schedule
from datetime import timedelta

app = Celery({name!r}, broker={broker!r}, backend={backend!r})
app.conf.update(
    task_default_queue={queue!r},
    broker_connection_retry_on_startup=True,
    cluster_beat_db_url={db_url!r},
    cluster_beat_redis_url={redis_url!r},
    beat_schedule={schedule},
)
app.conf.update({conf})

{tasks}
'''

DEFAULT_TASKS = '''
@app.task(bind=True, name="t.record")
def record(self, *args, **kwargs):
    return self.request.get("cluster_beat_scheduled_at")
'''


class App:
    """A generated app module plus the handles a test needs to inspect its traffic."""

    def __init__(self, directory: Path, module: str, queue: str, broker: str, redis_url: Optional[str]):
        self.directory = directory
        self.module = module
        self.queue = queue
        self.broker = broker
        self.redis_url = redis_url

    def env(self, **extra: str) -> Dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(self.directory), str(REPO), env.get("PYTHONPATH", "")])
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.update(extra)
        return env

    def queued_messages(self) -> List[dict]:
        """Messages waiting in the test's queue on a Redis broker (nobody consumes them)."""
        client = redis.Redis.from_url(self.broker)
        try:
            raw = client.lrange(self.queue, 0, -1)
        finally:
            client.close()
        return [json.loads(item) for item in reversed(raw)]  # LPUSH: oldest at the end

    def sent_occurrences(self) -> List[tuple]:
        """(schedule, scheduled_at, node, task_id) of each queued message, from its headers."""
        out = []
        for msg in self.queued_messages():
            h = msg["headers"]
            out.append((h.get("cluster_beat_schedule"), h.get("cluster_beat_scheduled_at"),
                        h.get("cluster_beat_node"), h.get("id")))
        return out


def write_app(
    directory: Path,
    *,
    broker: str,
    db_url: str,
    schedule: str,
    redis_url: Optional[str] = "",
    backend: Optional[str] = None,
    conf: str = "{}",
    tasks: str = DEFAULT_TASKS,
) -> App:
    """Write a Celery app module into *directory*; *schedule* and *conf* are Python source."""
    module = "ccbapp_" + uuid.uuid4().hex[:8]
    queue = "q_" + module
    source = APP_TEMPLATE.format(
        name=module, broker=broker, backend=backend, queue=queue, db_url=db_url, redis_url=redis_url,
        schedule=textwrap.dedent(schedule).strip(), conf=textwrap.dedent(conf).strip(), tasks=textwrap.dedent(tasks),
    )
    (directory / f"{module}.py").write_text(source)
    return App(directory, module, queue, broker, redis_url)


class Proc:
    """One child process with its log in a file; always killed at the end of the test."""

    def __init__(self, args: List[str], *, cwd: Path, env: Dict[str, str], log: Path):
        self.args = args
        self.log_path = log
        self._log = open(log, "wb")
        self.popen = subprocess.Popen(args, cwd=cwd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                      start_new_session=True)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def signal(self, sig: int) -> None:
        if self.popen.poll() is None:
            os.kill(self.popen.pid, sig)

    def stop(self, timeout: float = 10.0) -> Optional[int]:
        """SIGTERM, then SIGKILL (the whole process group) if it does not exit in time."""
        if self.popen.poll() is None:
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        if self.popen.poll() is None:
            try:
                os.killpg(self.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.popen.wait(5)
        self._log.close()
        return self.popen.returncode

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")


def start_beat(app: App, tmp: Path, label: str, *extra: str, env: Optional[Dict[str, str]] = None) -> Proc:
    args = [sys.executable, "-m", "celery", "-A", app.module, "beat", "-S", "celery_cluster_beat.Scheduler",
            "-l", "info", "--pidfile=", "-s", str(tmp / f"unused-{label}"), *extra]
    return Proc(args, cwd=app.directory, env=app.env(**(env or {})), log=tmp / f"beat-{label}.log")


def start_worker(app: App, tmp: Path, label: str = "worker", *extra: str, concurrency: int = 4) -> Proc:
    args = [sys.executable, "-m", "celery", "-A", app.module, "worker", "-Q", app.queue, "-l", "info",
            "-c", str(concurrency), "--pidfile=", "-n", f"{label}-{uuid.uuid4().hex[:6]}@%h",
            "--without-gossip", "--without-mingle", *extra]
    return Proc(args, cwd=app.directory, env=app.env(), log=tmp / f"{label}.log")


def wait_for(predicate: Callable[[], bool], timeout: float, interval: float = 0.1, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def wait_for_log(proc: Proc, text: str, timeout: float) -> None:
    wait_for(lambda: text in proc.log(), timeout, what=f"{text!r} in {proc.log_path.name}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PortTaken(RuntimeError):
    """The server exited at start: on a port of the OS's choosing, someone else bound it first."""


class ThrowawayRedis:
    """A redis-server without persistence on a port of its own: the test may kill and restart it."""

    def __init__(self, workdir: Path) -> None:
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server is not on PATH: install Redis to run these tests")
        self.port = _free_port()
        self.workdir = workdir
        self.proc: Optional[subprocess.Popen] = None
        self.started_once = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start (or restart, on the same port) the server. A free port picked by the OS may be taken
        by another process before redis-server binds it (parallel workers, suites side by side):
        the first start then moves to another port."""
        for attempt in range(5):
            try:
                return self._start()
            except PortTaken:
                if self.started_once or attempt == 4:
                    raise
                self.port = _free_port()

    def _start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir), "--logfile", str(self.workdir / f"redis-{self.port}.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        client = redis.Redis(port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5)
        proc = self.proc

        def up() -> bool:
            if proc.poll() is not None:
                raise PortTaken(f"redis-server exited ({proc.returncode}) on port {self.port}")
            try:
                # Ours answering, not another server that holds the port (ours then exits).
                return client.info("server")["process_id"] == proc.pid
            except redis.RedisError:
                return False

        try:
            wait_for(up, 10, interval=0.02, what=f"redis-server on port {self.port}")
        finally:
            client.close()
        self.started_once = True

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None
