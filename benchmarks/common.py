"""Shared helpers for the process benchmarks (bench_burst.py, bench_idle.py).

Each benchmark writes a Celery app module into a temporary folder with
``tests/procs.py``, starts one real ``celery beat`` process per scheduler (one
after another, never two at once) and measures it from outside (psutil, the
broker's Redis list) and from inside (a ``beat_init`` hook in the generated app
module that prints the process CPU time when the first tick returns).

Everything a run creates is removed at the end: the processes (SIGTERM, then
SIGKILL of their process group), the dedicated Redis database (FLUSHDB at start
and end), the scratch PostgreSQL database and the temporary folder.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import platform
import re
import shlex
import signal
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for _p in (str(REPO), str(REPO / "tests")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import psutil  # noqa: E402
import redis  # noqa: E402

import procs  # noqa: E402  (tests/procs.py: app-module writer and process wrapper)

#: The Redis server; any database number in the URL is replaced by ``--redis-db``
#: (CCB_BENCH_REDIS is shared with bench_failover.py, which takes a full URL).
REDIS_BASE = re.sub(r"/\d*$", "", os.environ.get("CCB_BENCH_REDIS", "redis://127.0.0.1:6379"))
PG_ADMIN_URL = os.environ.get("CCB_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")

#: label -> (scheduler class for ``celery beat -S``, kind)
SCHEDULERS: Dict[str, tuple] = {
    "ours-sqlite": ("celery_cluster_beat.Scheduler", "ours"),
    "ours-pg": ("celery_cluster_beat.Scheduler", "ours"),
    "plain-beat": ("celery.beat:PersistentScheduler", "plain"),
    "redbeat": ("redbeat.RedBeatScheduler", "redbeat"),
}

#: Appended to the generated app module: report when the scheduler is ready.
#: ``beat_init`` is sent by ``celery.beat.Service.start`` right after the
#: scheduler object was built (setup_schedule done); we wrap its ``tick`` so
#: the line is written when the *first tick* returns, then unwrap it.
#: ``time.process_time()`` is this process's user+system CPU since exec,
#: so it includes the interpreter, imports, the app module and the scheduler.
READY_HOOK = '''
import sys as _bench_sys, time as _bench_time
from celery.signals import beat_init as _bench_beat_init


@_bench_beat_init.connect(weak=False)
def _bench_mark_ready(sender=None, **kwargs):
    scheduler = sender.scheduler
    tick = scheduler.tick

    def first_tick(*a, **kw):
        interval = tick(*a, **kw)
        try:
            del scheduler.tick
        except AttributeError:
            pass
        _bench_sys.__stderr__.write("BENCH-READY cpu=%.4f wall=%.6f next=%r\\n"
                                    % (_bench_time.process_time(), _bench_time.time(), interval))
        _bench_sys.__stderr__.flush()
        return interval

    scheduler.tick = first_tick
'''

READY_RE = re.compile(r"BENCH-READY cpu=([0-9.]+) wall=([0-9.]+)")


# --------------------------------------------------------------------------- run-level plumbing
def install_signal_handlers() -> None:
    """SIGTERM/SIGHUP behave like Ctrl-C, so every ``finally`` (cleanup) runs."""

    def handler(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, handler)


def command_line() -> str:
    return " ".join(shlex.quote(a) for a in [Path(sys.executable).name] + sys.argv)


def versions() -> str:
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover
        return f"python {platform.python_version()}"

    def v(dist: str) -> str:
        try:
            return version(dist)
        except PackageNotFoundError:
            return "missing"

    dists = ("celery", "kombu", "celery-redbeat", "SQLAlchemy", "redis", "psycopg")
    return f"python {platform.python_version()}, " + ", ".join(f"{d} {v(d)}" for d in dists)


def machine() -> str:
    mem = psutil.virtual_memory().total / 2 ** 30
    return f"{platform.machine()}, {psutil.cpu_count()} CPUs, {mem:.0f} GiB RAM, {platform.system()} {platform.release()}"


def print_header(title: str, lines: Sequence[str] = ()) -> None:
    print(title)
    print("=" * len(title))
    print(f"command : {command_line()}")
    print(f"date    : {time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
    print(f"machine : {machine()}")
    print(f"versions: {versions()}")
    print(f"load    : {load()} (1/5/15-min load average at start; other work on the machine skews the figures)")
    for line in lines:
        print(line)
    print(flush=True)


def load() -> str:
    try:
        return "/".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "?"


def load1() -> Optional[float]:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def log(msg: str) -> None:
    """Progress lines go to stderr so stdout stays a clean report."""
    sys.stderr.write(f"[{time.strftime('%H:%M:%S')}] {msg}\n")
    sys.stderr.flush()


def add_common_args(parser: argparse.ArgumentParser, default_db: int) -> None:
    parser.add_argument("--redis-db", type=int, default=default_db,
                        help=f"Redis database used as broker/lease/RedBeat store; FLUSHED at start and end "
                             f"(default {default_db})")
    parser.add_argument("--schedulers", default=",".join(SCHEDULERS),
                        help=f"comma-separated subset of {','.join(SCHEDULERS)}")
    parser.add_argument("--keep-logs", action="store_true", help="copy the beat logs to ./bench-logs/")


def selected(arg: str) -> List[str]:
    names = [s.strip() for s in arg.split(",") if s.strip()]
    bad = [n for n in names if n not in SCHEDULERS]
    if bad:
        raise SystemExit(f"unknown scheduler(s) {bad}; choose from {', '.join(SCHEDULERS)}")
    return names


# --------------------------------------------------------------------------- services
@contextlib.contextmanager
def redis_db(db: int) -> Iterator[str]:
    """A Redis URL for database *db*, flushed before and after."""
    url = f"{REDIS_BASE}/{db}"
    client = redis.Redis.from_url(url, socket_connect_timeout=3)
    try:
        client.ping()
    except redis.RedisError as exc:
        raise SystemExit(f"Redis at {url} does not answer ({exc}); start redis-server first")
    client.flushdb()
    try:
        yield url
    finally:
        try:
            client.flushdb()
        finally:
            client.close()


@contextlib.contextmanager
def scratch_pg() -> Iterator[str]:
    """A fresh PostgreSQL database for the run, dropped afterwards."""
    import sqlalchemy as sa
    from sqlalchemy.engine import make_url

    name = "ccb_bench_" + uuid.uuid4().hex[:10]
    engine = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.execute(sa.text(f"CREATE DATABASE {name}"))
    except sa.exc.OperationalError as exc:
        engine.dispose()
        raise SystemExit(f"PostgreSQL at {make_url(PG_ADMIN_URL).render_as_string()} unavailable: {exc.orig}")
    try:
        yield make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    finally:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                 "WHERE datname = :d AND pid <> pg_backend_pid()"), {"d": name})
            conn.execute(sa.text(f"DROP DATABASE IF EXISTS {name}"))
        engine.dispose()


@contextlib.contextmanager
def claims_db(label: str, tmp: Path) -> Iterator[str]:
    """The claim database URL for ours (SQLite file in *tmp*, or a scratch PostgreSQL DB); '' for the others."""
    if label == "ours-pg":
        with scratch_pg() as url:
            yield url
    elif label == "ours-sqlite":
        yield f"sqlite:///{tmp}/celerybeat-cluster.sqlite3"
    else:
        yield ""


@contextlib.contextmanager
def temp_dir(prefix: str) -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        yield Path(tmp)


# --------------------------------------------------------------------------- one beat process
def write_app(tmp: Path, *, broker: str, kind: str, schedule_src: str, db_url: str = "",
              conf: Optional[Dict[str, object]] = None) -> "procs.App":
    """A generated app module for *kind* (ours / plain / redbeat).

    *schedule_src* is a Python expression evaluated in the module (``cron``,
    ``crontab`` and ``os`` are in scope). Ours keeps its default lease (the
    broker's Redis); RedBeat keeps its data and lock in the same Redis DB.
    """
    conf = dict(conf or {})
    if kind == "redbeat":
        conf.setdefault("redbeat_redis_url", broker)
    return procs.write_app(
        tmp,
        broker=broker,
        db_url=db_url or "sqlite:///" + str(tmp / "unused.sqlite3"),
        redis_url=None,  # ours: default, i.e. the lease lives in the broker's Redis
        schedule=schedule_src,
        conf=repr(conf),
        tasks=procs.DEFAULT_TASKS + READY_HOOK,
    )


@dataclass
class Beat:
    label: str
    proc: "procs.Proc"
    ps: psutil.Process
    started_wall: float

    def cpu(self) -> float:
        """User+system CPU seconds of the beat process (psutil; 10 ms clock-tick resolution)."""
        t = self.ps.cpu_times()
        return t.user + t.system

    def cpu_precise(self) -> float:
        """On-CPU seconds summed over the process's live threads from /proc/PID/task/*/schedstat
        (nanosecond resolution, Linux); falls back to :meth:`cpu`. Use for differences only."""
        try:
            total = 0
            for tid in os.listdir(f"/proc/{self.ps.pid}/task"):
                with open(f"/proc/{self.ps.pid}/task/{tid}/schedstat") as fh:
                    total += int(fh.read().split()[0])
            return total / 1e9
        except (OSError, ValueError, IndexError):
            return self.cpu()

    def rss_mib(self) -> float:
        return self.ps.memory_info().rss / 2 ** 20

    def peak_rss_mib(self) -> float:
        """VmHWM (the kernel's RSS high-water mark) of the beat process."""
        try:
            with open(f"/proc/{self.ps.pid}/status") as fh:
                for line in fh:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) / 1024
        except OSError:
            pass
        return self.rss_mib()

    def ready(self) -> Optional[tuple]:
        """(process CPU s, wall epoch) from the BENCH-READY line, once the first tick returned."""
        m = READY_RE.search(self.proc.log())
        return (float(m.group(1)), float(m.group(2))) if m else None

    def wait_ready(self, timeout: float) -> tuple:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = self.ready()
            if r:
                return r
            if not self.proc.alive():
                raise RuntimeError(f"{self.label}: beat exited with {self.proc.popen.returncode} before its first "
                                   f"tick; log tail:\n{tail(self.proc.log())}")
            time.sleep(0.05)
        raise RuntimeError(f"{self.label}: no first tick within {timeout:.0f}s; log tail:\n{tail(self.proc.log())}")

    def stop(self) -> None:
        self.proc.stop(timeout=15)


def tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.splitlines()[-lines:])


def start_beat(app: "procs.App", tmp: Path, label: str, scheduler: str) -> Beat:
    args = [sys.executable, "-m", "celery", "-A", app.module, "beat", "-S", scheduler, "-l", "info",
            "--pidfile=", "-s", str(tmp / f"celerybeat-schedule-{label}")]
    started = time.time()
    proc = procs.Proc(args, cwd=app.directory, env=app.env(), log=tmp / f"beat-{label}.log")
    return Beat(label, proc, psutil.Process(proc.pid), started)


def keep_logs(tmp: Path, enabled: bool) -> None:
    if not enabled:
        return
    dest = Path.cwd() / "bench-logs"
    dest.mkdir(exist_ok=True)
    for f in tmp.glob("beat-*.log"):
        (dest / f.name).write_bytes(f.read_bytes())
    log(f"beat logs copied to {dest}")


# --------------------------------------------------------------------------- output
def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def fmt(r):
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))

    out = [fmt(cells[0]), "  ".join("-" * w for w in widths)]
    out += [fmt(r) for r in cells[1:]]
    return "\n".join(out)


def ratio(a: Optional[float], b: Optional[float], digits: int = 1) -> str:
    """a/b as 'x.yx', or '-' when undefined."""
    if a is None or b is None or b == 0:
        return "-"
    return f"{a / b:.{digits}f}x"


def num(value: Optional[float], fmt: str = "{:.2f}") -> str:
    return "-" if value is None else fmt.format(value)


# --------------------------------------------------------------------------- additions for bench_dynamic.py
def import_app(app: "procs.App"):
    """The Celery app of a generated module, imported into *this* process (to store schedules at run time
    through the same configuration the beat process reads). The module's folder is put on sys.path."""
    import importlib

    if str(app.directory) not in sys.path:
        sys.path.insert(0, str(app.directory))
    return importlib.import_module(app.module).app


#: Celery's default log line prefix: ``[2026-12-01 08:36:32,123: INFO/MainProcess] message``.
LOG_TIME_RE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}): ")


def log_times(text: str, needle: str) -> List[float]:
    """Epoch seconds (millisecond resolution, local time as Celery writes it) of the log lines containing
    *needle* (case-insensitive), in log order."""
    from datetime import datetime

    out = []
    low = needle.lower()
    for line in text.splitlines():
        if low not in line.lower():
            continue
        m = LOG_TIME_RE.match(line)
        if m:
            out.append(datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp() + int(m.group(2)) / 1000.0)
    return out


def pg_backend_pids(db_url: str, client_pid: int) -> List[int]:
    """PIDs of the PostgreSQL server processes serving the connections of process *client_pid* to *db_url*'s
    database (matched by the client's local TCP ports); [] when not PostgreSQL or not readable."""
    import sqlalchemy as sa
    from sqlalchemy.engine import make_url

    url = make_url(db_url)
    if not url.drivername.startswith("postgresql"):
        return []
    try:
        ports = {c.laddr.port for c in psutil.Process(client_pid).net_connections(kind="tcp") if c.laddr}
    except (psutil.Error, AttributeError):
        return []
    engine = sa.create_engine(PG_ADMIN_URL)
    try:
        with engine.connect() as conn:
            rows = conn.execute(sa.text("SELECT pid, client_port FROM pg_stat_activity WHERE datname = :d"),
                                {"d": url.database}).all()
    except sa.exc.SQLAlchemyError:
        return []
    finally:
        engine.dispose()
    return [pid for pid, port in rows if port in ports]


def processes_cpu(pids: Sequence[int]) -> Dict[int, float]:
    """User+system CPU seconds of each readable process in *pids* (psutil; 10 ms clock-tick resolution)."""
    out = {}
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            out[pid] = t.user + t.system
        except psutil.Error:
            pass
    return out


def run_main(main) -> None:
    """Run a benchmark's ``main()`` and exit with its status; Ctrl-C / SIGTERM (turned into
    KeyboardInterrupt) exits 130 once the with-blocks have cleaned up."""
    try:
        sys.exit(main())
    except KeyboardInterrupt as exc:
        sys.stderr.write(f"interrupted ({exc or 'Ctrl-C'}); processes, Redis DB and temp files cleaned up\n")
        sys.exit(130)
