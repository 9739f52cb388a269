"""Chaos soak: three beat replicas under random faults; duplicates, losses, lateness.

    python benchmarks/chaos_soak.py [--minutes 10] [--seed N] [--quick] [--keep-logs]

Starts services of its own on free loopback ports in a temporary folder (so it may
kill and restart them and never touches the machine's services):

* a PostgreSQL cluster (``initdb`` / ``pg_ctl`` from ``/usr/lib/postgresql/*/bin``,
  run as the ``postgres`` user, trust auth) with a database ``soak`` for the claims;
* a Redis for the leader lease (the faults restart it);
* a second Redis as the Celery broker, never restarted; a drain thread ``BRPOP``s
  the app's queue continuously and records every message (its
  ``cluster_beat_schedule`` / ``cluster_beat_scheduled_at`` / ``id`` headers and the
  time it was received);
* per replica, a loopback TCP proxy in front of PostgreSQL whose link can be cut.

Then three ``celery -A <app> beat -S celery_cluster_beat.Scheduler -l info``
replicas (node ids r0, r1, r2; a restarted one becomes r1-1, r1-2, ...), all at the
package defaults (lease ttl 5 s, claim grace 10 s, catch-up ``latest``), schedule
3 x ``every(1)``, 500 x ``cron("* * * * *")`` and 4-8 hourly ``cron("M * * * *")``
(M chosen so that up to 8 of them fall inside the run, spread evenly; an hourly
entry has no claim history before its first occurrence, which a leaderless gap
may hit). Every 15-30 s (``--quick``:
10-20 s), one at a time, a fault drawn at random (seeded; all six kinds before any
repeats): SIGKILL a replica and restart it 2-5 s later; SIGSTOP one for 8-15 s
(longer than the lease ttl) then SIGCONT; SIGTERM one and restart it; restart the
lease Redis (SIGKILL, start again on the same port); restart PostgreSQL
(``pg_ctl stop -m fast``, start again 1-4 s later); cut one replica's database link
for 30 s (open connections reset; new ones reset at once, or held unanswered
until the cut ends - "blackhole"). Replica faults hit the current leader with
probability 0.6.

After the last fault: 30 s to settle (claim grace + a stale-claim sweep), the
replicas are stopped (SIGTERM), the queue is drained, and over the window
[start + 20 s warm-up, end of the last fault] it reports: the occurrences due
(``fires_between`` of each entry), those published (distinct (schedule,
scheduled_at) seen on the broker), same-id resends, different-id duplicates
(must be 0), the ones recorded ``missed`` / ``skipped`` / ``failed`` in
``cluster_beat_claims``, lost ones (due, never published, not recorded as such;
must be 0) and lateness (first receive - nominal instant). ``FAIL:`` lines flag
duplicates with different ids and losses; the exit status is 0 regardless (it
is a measuring tool). ``--keep-logs`` copies the beat, PostgreSQL and Redis logs
to ``./bench-logs/chaos-soak-<time>/``.

The replicas run a copy of ``celery_cluster_beat/`` taken at the start (the header
gives the git commit and whether the package's files differ from it), so edits made
to the working tree during a run never reach a restarted replica. A replica that
exits without being asked to is counted as a crash and restarted (after 1 s,
doubling up to 30 s while it keeps crashing).

The replicas share one claim database URL string although each reaches PostgreSQL
through its own proxy: the URL is ``postgresql+psycopg://postgres@/soak`` (no host,
no port) and each replica gets ``PGHOST=127.0.0.1 PGPORT=<its proxy>`` in its
environment (libpq reads them). Versions that named the lease after a hash of the
URL would otherwise have given each replica a lease of its own; the summary lists
the lease names found in the lease Redis at the end (one expected).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Dict, List, Optional, Tuple

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for _p in (str(HERE), str(REPO), str(REPO / "tests")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import redis  # noqa: E402

import common  # noqa: E402  (benchmarks/common.py: header, log, table, signal handling)
import procs  # noqa: E402  (tests/procs.py: app-module writer, process wrapper, throwaway Redis)
from celery_cluster_beat import cron, every  # noqa: E402

WARMUP = 20.0  # seconds after the replicas start before the measured window opens
SETTLE = 30.0  # seconds after the last fault: claim grace (10 s) + a stale-claim sweep, with margin
CUT_SECONDS = 30.0
HOURLY_INSIDE = 8  # hourly entries whose minute falls inside the run, at most
HOURLY_MIN = 4  # hourly entries in all, at least
LEADER_BIAS = 0.6  # probability that a replica fault targets the current leader
MIN_GAP = 3.0  # seconds between the end of a fault and the start of the next one, at least
REPLICAS = ("r0", "r1", "r2")
DB_URL = "postgresql+psycopg://postgres@/soak"  # host and port from PGHOST / PGPORT (the replica's proxy)

FAULTS = {
    "sigkill": "SIGKILL a replica, restart 2-5 s later",
    "sigstop": "SIGSTOP a replica 8-15 s, SIGCONT",
    "sigterm": "SIGTERM a replica, restart 1-3 s later",
    "redis-restart": "restart the lease Redis",
    "pg-restart": "restart PostgreSQL",
    "db-cut": f"cut a replica's database link {CUT_SECONDS:g} s",
}

TASKS = '''
@app.task(name="soak.noop")
def noop(*args, **kwargs):
    return None
'''

log = common.log


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def utc(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, timezone.utc)


def hms(ts: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts))


# --------------------------------------------------------------------------- the schedule
@dataclass(frozen=True)
class EntrySpec:
    name: str
    group: str
    ctor: str  # "every" or "cron"
    arg: object

    def source(self) -> str:
        return f"{{'task': 'soak.noop', 'schedule': {self.ctor}({self.arg!r})}}"

    def schedule(self):
        return every(self.arg) if self.ctor == "every" else cron(self.arg)


def build_entries(planned_start: float, planned_end: float, rng: random.Random) -> List[EntrySpec]:
    specs = [EntrySpec(f"sec{i}", "every(1)", "every", 1) for i in range(3)]
    specs += [EntrySpec(f"min{i:03d}", "cron * * * * *", "cron", "* * * * *") for i in range(500)]
    # Hourly: up to HOURLY_INSIDE at minute boundaries spread over the planned window (each one's
    # first occurrence ever, so a failover gap hitting it tests the "no claim history yet" path),
    # then random minutes up to HOURLY_MIN entries.
    first = math.floor(planned_start / 60) + 1
    inside = [(m * 60) for m in range(first, math.floor(planned_end / 60) + 1)]
    picks: List[int] = []
    count = min(len(inside), HOURLY_INSIDE)
    for i in range(count):
        minute = utc(inside[(2 * i + 1) * len(inside) // (2 * count)]).minute
        if minute not in picks:
            picks.append(minute)
    while len(picks) < HOURLY_MIN:
        minute = rng.randrange(60)
        if minute not in picks:
            picks.append(minute)
    specs += [EntrySpec(f"hour{m:02d}", "hourly M * * * *", "cron", f"{m} * * * *") for m in picks]
    return specs


def schedule_source(specs: List[EntrySpec]) -> str:
    return "{\n" + "".join(f"    {s.name!r}: {s.source()},\n" for s in specs) + "}"


# --------------------------------------------------------------------------- PostgreSQL
class PgCluster:
    """A throwaway PostgreSQL cluster run as the postgres user, on a port of its own."""

    def __init__(self, root: Path) -> None:
        bins = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"),
                      key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit() else 0)
        if not bins:
            raise SystemExit("no /usr/lib/postgresql/*/bin/pg_ctl: install the PostgreSQL server")
        if shutil.which("runuser") is None:
            raise SystemExit("runuser is not on PATH")
        self.bin = bins[-1].parent
        self.version = self.bin.parent.name
        self.root = root
        self.data = root / "data"
        self.logfile = root / "postgresql.log"
        self.port = free_port()
        root.mkdir()
        shutil.chown(root, "postgres", "postgres")
        self.restarts = 0

    def _run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        cmd = ["runuser", "-u", "postgres", "--", *args]
        with open(self.root / "pg_ctl.out", "ab") as out:
            res = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout,
                                 start_new_session=True, cwd=self.root)
        return res

    def init(self) -> None:
        res = self._run(str(self.bin / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres",
                        "-E", "UTF8", "--no-sync")
        if res.returncode:
            raise RuntimeError(f"initdb failed ({res.returncode}); see {self.root / 'pg_ctl.out'}:\n"
                               + (self.root / "pg_ctl.out").read_text(errors="replace")[-2000:])

    def start(self) -> None:
        opts = f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root}"
        res = self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.logfile), "-w",
                        "-t", "60", "-o", opts, "start", timeout=90)
        if res.returncode:
            raise RuntimeError(f"pg_ctl start failed ({res.returncode}); log tail:\n{self.log_tail()}")

    def stop(self, mode: str = "fast") -> int:
        return self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-w", "-t", "60", "-m", mode,
                         "stop", timeout=90).returncode

    def postmaster_pid(self) -> Optional[int]:
        try:
            return int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def create_database(self, name: str) -> None:
        import psycopg

        with psycopg.connect(host="127.0.0.1", port=self.port, user="postgres", dbname="postgres",
                             autocommit=True, connect_timeout=10) as conn:
            conn.execute(f"CREATE DATABASE {name}")

    def connect(self, dbname: str):
        import psycopg

        return psycopg.connect(host="127.0.0.1", port=self.port, user="postgres", dbname=dbname,
                               connect_timeout=10)

    def log_tail(self) -> str:
        try:
            return common.tail(self.logfile.read_text(errors="replace"), 15)
        except OSError:
            return "(no log)"

    def destroy(self) -> None:
        """Stop for good, whatever state it is in."""
        pid = self.postmaster_pid()
        if pid is None:
            return
        try:
            self.stop("immediate")
        except (subprocess.TimeoutExpired, OSError):
            pass
        if self.postmaster_pid() is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# --------------------------------------------------------------------------- the cuttable DB link
def _rst_close(sock: socket.socket) -> None:
    """Close with SO_LINGER 0: the peer gets a reset, not an orderly FIN."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


class _Pair:
    """One proxied connection: a thread per direction; the last one out closes both sockets."""

    def __init__(self, client: socket.socket, upstream: socket.socket, proxy: "LinkProxy") -> None:
        self.client, self.upstream, self.proxy = client, upstream, proxy
        self._lock = threading.Lock()
        self._done = 0
        self._killed = False

    def start(self) -> None:
        for src, dst in ((self.client, self.upstream), (self.upstream, self.client)):
            threading.Thread(target=self._pump, args=(src, dst), daemon=True,
                             name=f"proxy-{self.proxy.name}-pump").start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        self._wake()
        with self._lock:
            self._done += 1
            last = self._done == 2
        if last:
            for s in (self.client, self.upstream):
                if self._killed:
                    _rst_close(s)
                else:
                    try:
                        s.close()
                    except OSError:
                        pass
            self.proxy._forget(self)

    def _wake(self) -> None:
        for s in (self.client, self.upstream):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def kill(self) -> None:
        """Reset both ends (SO_LINGER 0) and wake both pumps."""
        self._killed = True
        for s in (self.client, self.upstream):
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
        self._wake()


class LinkProxy:
    """A loopback TCP proxy in front of PostgreSQL for one replica, with a cut switch."""

    def __init__(self, name: str, upstream_port: int) -> None:
        self.name = name
        self.upstream = ("127.0.0.1", upstream_port)
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(128)
        self.listener.settimeout(0.2)
        self.port = self.listener.getsockname()[1]
        self.stats: Counter = Counter()
        self._lock = threading.Lock()
        self._pairs: set = set()
        self._held: List[socket.socket] = []
        self._cut_until = 0.0
        self._mode = "reset"
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True, name=f"proxy-{name}")

    def start(self) -> "LinkProxy":
        self._thread.start()
        return self

    def cut(self, seconds: float, mode: str) -> int:
        """Reset every open connection; for *seconds*, reset new ones at once (``reset``) or hold
        them unanswered until the cut ends (``blackhole``). Returns the connections reset."""
        with self._lock:
            self._cut_until = time.monotonic() + seconds
            self._mode = mode
            pairs = list(self._pairs)
        for pair in pairs:
            pair.kill()
        self.stats["reset by cut"] += len(pairs)
        return len(pairs)

    def _forget(self, pair: _Pair) -> None:
        with self._lock:
            self._pairs.discard(pair)

    def _release_held(self) -> None:
        if self._held and time.monotonic() >= self._cut_until:
            for s in self._held:
                _rst_close(s)
            self._held.clear()

    def _serve(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self.listener.accept()
            except socket.timeout:
                self._release_held()
                continue
            except OSError:
                if self._stopped.is_set():
                    break
                time.sleep(0.05)
                continue
            client.settimeout(None)
            self.stats["accepted"] += 1
            with self._lock:
                cutting = time.monotonic() < self._cut_until
                mode = self._mode
            if cutting:
                if mode == "blackhole":
                    self._held.append(client)
                    self.stats["held (blackhole)"] += 1
                else:
                    _rst_close(client)
                    self.stats["refused (reset)"] += 1
                continue
            self._release_held()
            try:
                upstream = socket.create_connection(self.upstream, timeout=3)
                upstream.settimeout(None)
            except OSError:
                _rst_close(client)
                self.stats["upstream down"] += 1
                continue
            pair = _Pair(client, upstream, self)
            with self._lock:
                self._pairs.add(pair)
            pair.start()

    def close(self) -> None:
        self._stopped.set()
        try:
            self.listener.close()
        except OSError:
            pass
        self._thread.join(5)
        with self._lock:
            pairs = list(self._pairs)
        for pair in pairs:
            pair.kill()
        for s in self._held:
            _rst_close(s)
        self._held.clear()


# --------------------------------------------------------------------------- the broker drain
@dataclass(frozen=True)
class Received:
    schedule: str
    at: datetime
    task_id: str
    node: str
    t: float  # wall time the drain popped it


class Drain(threading.Thread):
    """BRPOPs the app's queue (and kombu's priority sub-queues) and records each message."""

    def __init__(self, url: str, queue: str) -> None:
        super().__init__(daemon=True, name="drain")
        self.client = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=3)
        self.keys = [queue] + [f"{queue}\x06\x16{p}" for p in (3, 6, 9)]
        self.records: List[Received] = []
        self.foreign = 0  # messages without our headers
        self.errors = 0
        self.lock = threading.Lock()
        self.stopped = threading.Event()

    def _record(self, raw: bytes, now: float) -> None:
        try:
            h = json.loads(raw)["headers"]
            name, at = h.get("cluster_beat_schedule"), h.get("cluster_beat_scheduled_at")
            if not name or not at:
                raise KeyError("no cluster_beat headers")
            rec = Received(name, datetime.fromisoformat(at.replace("Z", "+00:00")), h.get("id") or "",
                           h.get("cluster_beat_node") or "?", now)
        except (ValueError, KeyError, TypeError):
            with self.lock:
                self.foreign += 1
            return
        with self.lock:
            self.records.append(rec)

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                item = self.client.brpop(self.keys, timeout=1)
            except redis.RedisError:
                self.errors += 1
                self.stopped.wait(0.5)
                continue
            if item is not None:
                self._record(item[1], time.time())

    def finish(self, quiet: float = 2.0, limit: float = 60.0) -> None:
        """Stop the thread, then pop what is left until the lists stay empty for *quiet* s."""
        self.stopped.set()
        self.join(10)
        deadline = time.monotonic() + limit
        empty_since = time.monotonic()
        while time.monotonic() < deadline and time.monotonic() - empty_since < quiet:
            item = self.client.rpop(self.keys[0])
            for key in self.keys[1:]:
                if item is None:
                    item = self.client.rpop(key)
            if item is None:
                time.sleep(0.1)
                continue
            empty_since = time.monotonic()
            self._record(item, time.time())
        self.client.close()

    def latest(self) -> Optional[Received]:
        with self.lock:
            return self.records[-1] if self.records else None

    def snapshot(self) -> List[Received]:
        with self.lock:
            return list(self.records)


# --------------------------------------------------------------------------- replicas
class Replica:
    def __init__(self, name: str, app: "procs.App", logdir: Path, proxy: LinkProxy) -> None:
        self.name = name
        self.app = app
        self.logdir = logdir
        self.proxy = proxy
        self.incarnation = -1
        self.proc: Optional[procs.Proc] = None
        self.expect_down = False
        self.history: List[str] = []  # node ids of every incarnation
        self.exits: List[Tuple[str, Optional[int], str]] = []  # (node, rc, cause)
        self.restart_at: Optional[float] = None  # monotonic time of a pending restart after a crash
        self.backoff = 1.0  # seconds before restarting a crashed replica (doubles up to 30 s)
        self.started = 0.0

    @property
    def node(self) -> str:
        return self.name if self.incarnation <= 0 else f"{self.name}-{self.incarnation}"

    def start(self) -> None:
        self.incarnation += 1
        env = {"CCB_SOAK_NODE": self.node, "PGHOST": "127.0.0.1", "PGPORT": str(self.proxy.port)}
        self.proc = procs.start_beat(self.app, self.logdir, self.node, env=env)
        self.history.append(self.node)
        self.expect_down = False
        self.restart_at = None
        self.started = time.monotonic()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive()

    def signal(self, sig: int) -> None:
        if self.proc is not None:
            self.proc.signal(sig)

    def wait_exit(self, timeout: float) -> Optional[int]:
        assert self.proc is not None
        try:
            return self.proc.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def reap(self, cause: str) -> None:
        """Record the exit of the current incarnation and close its log."""
        if self.proc is None:
            return
        rc = self.proc.stop(timeout=5)
        self.exits.append((self.node, rc, cause))


@dataclass
class Crash:
    offset: float
    node: str
    rc: Optional[int]
    line: str  # the last CRITICAL line of its log, else the last line
    tail: str


@dataclass
class Fault:
    n: int
    kind: str
    start: float
    end: float = 0.0
    target: str = ""
    detail: str = ""


class Soak:
    def __init__(self, args: argparse.Namespace, tmp: Path, stack: ExitStack) -> None:
        self.args = args
        self.tmp = tmp
        self.stack = stack
        self.rng = random.Random(args.seed)
        self.faults: List[Fault] = []
        self.crashes: List[Crash] = []
        self.replicas: Dict[str, Replica] = {}
        self.t0 = 0.0
        self.bag: List[str] = []

    # ---------------------------------------------------------------- set-up
    def setup(self) -> None:
        tmp = self.tmp
        log("initdb + start PostgreSQL")
        self.pg = PgCluster(tmp / "pg")
        self.stack.callback(self.pg.destroy)
        self.pg.init()
        self.pg.start()
        self.pg.create_database("soak")
        log(f"PostgreSQL {self.pg.version} on 127.0.0.1:{self.pg.port}")

        redis_dir = tmp / "redis"
        redis_dir.mkdir()
        self.lease_redis = procs.ThrowawayRedis(redis_dir)
        self.stack.callback(self.lease_redis.kill)
        self.lease_redis.start()
        self.broker = procs.ThrowawayRedis(redis_dir)
        self.stack.callback(self.broker.kill)
        self.broker.start()
        log(f"lease Redis on :{self.lease_redis.port}, broker Redis on :{self.broker.port}")
        self.lease_client = redis.Redis.from_url(self.lease_redis.url, socket_timeout=1, socket_connect_timeout=1)
        self.stack.callback(self.lease_client.close)

        self.proxies = {name: LinkProxy(name, self.pg.port).start() for name in REPLICAS}
        for proxy in self.proxies.values():
            self.stack.callback(proxy.close)

        planned_start = time.time() + 3
        self.planned_end = planned_start + self.args.minutes * 60
        self.specs = build_entries(planned_start + WARMUP, self.planned_end, self.rng)
        appdir = tmp / "app"
        appdir.mkdir()
        # Every incarnation runs the package as it was at the start, even if the working tree changes
        # during the run: the app folder comes first on the replicas' PYTHONPATH (tests/procs.py).
        shutil.copytree(REPO / "celery_cluster_beat", appdir / "celery_cluster_beat",
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        self.app = procs.write_app(
            appdir, broker=self.broker.url, db_url=DB_URL, redis_url=self.lease_redis.url,
            schedule=schedule_source(self.specs),
            conf="{'cluster_beat_node_id': os.environ['CCB_SOAK_NODE']}", tasks=TASKS)
        self.logdir = tmp / "logs"
        self.logdir.mkdir()

        self.drain = Drain(self.broker.url, self.app.queue)
        self.drain.start()
        self.stack.callback(self.drain.stopped.set)

        for name in REPLICAS:
            self.replicas[name] = Replica(name, self.app, self.logdir, self.proxies[name])
        self.stack.callback(self.stop_replicas, 5.0)
        self.t0 = time.time()
        for r in self.replicas.values():
            r.start()
        log(f"3 replicas started (pids {', '.join(str(r.proc.pid) for r in self.replicas.values())})")
        deadline = time.monotonic() + 60
        while self.drain.latest() is None:
            self.check_replicas()
            if time.monotonic() > deadline:
                tails = "\n".join(f"--- {r.node}\n{common.tail(r.proc.log(), 20)}" for r in self.replicas.values())
                raise RuntimeError(f"no message on the broker within 60 s of the start; log tails:\n{tails}")
            time.sleep(0.2)
        log(f"first message after {time.time() - self.t0:.1f} s (node {self.drain.latest().node})")

    # ---------------------------------------------------------------- helpers
    def offset(self, ts: Optional[float] = None) -> str:
        return f"+{(ts if ts is not None else time.time()) - self.t0:6.1f}s"

    def check_replicas(self) -> None:
        """A replica that exited without a fault asking for it is a crash: record it, restart it
        after a back-off (1 s, doubling up to 30 s while it keeps crashing within a minute)."""
        now = time.monotonic()
        for r in self.replicas.values():
            if r.restart_at is not None:
                if now >= r.restart_at:
                    r.start()
                    log(f"{self.offset()} restarted as {r.node}")
                continue
            if r.proc is not None and not r.expect_down and not r.alive():
                rc = r.proc.popen.returncode
                text = r.proc.log()
                crit = [ln for ln in text.splitlines() if "CRITICAL/" in ln]
                last = (crit or [ln for ln in text.splitlines() if ln.strip()] or ["(empty log)"])[-1]
                self.crashes.append(Crash(time.time() - self.t0, r.node, rc, last.strip(), common.tail(text, 15)))
                if now - r.started > 60:
                    r.backoff = 1.0
                log(f"{self.offset()} UNEXPECTED EXIT of {r.node} (rc {rc}): {last.strip()[:200]}; "
                    f"restart in {r.backoff:g} s")
                r.reap("crash")
                r.restart_at = now + r.backoff
                r.backoff = min(30.0, r.backoff * 2)

    def pause(self, seconds: float) -> None:
        end = time.monotonic() + max(0.0, seconds)
        while True:
            self.check_replicas()
            left = end - time.monotonic()
            if left <= 0:
                return
            time.sleep(min(0.25, left))

    def leader(self) -> Optional[str]:
        """Node id holding the lease (from the lease Redis), else the sender of the latest message."""
        try:
            for key in self.lease_client.scan_iter(match="cluster_beat:*:lease"):
                value = self.lease_client.get(key)
                if value:
                    return value.decode().split(":", 2)[2]
        except (redis.RedisError, IndexError, UnicodeDecodeError):
            pass
        latest = self.drain.latest()
        if latest is not None and time.time() - latest.t < 2.5:
            return latest.node
        return None

    def pick_replica(self) -> Tuple[Replica, str]:
        leader = self.leader()
        up = [r for r in self.replicas.values() if r.restart_at is None] or list(self.replicas.values())
        by_node = {r.node: r for r in up}
        if leader in by_node and self.rng.random() < LEADER_BIAS:
            return by_node[leader], "leader"
        r = self.rng.choice(up)
        return r, ("leader" if r.node == leader else "standby")

    def next_kind(self) -> str:
        if not self.bag:
            self.bag = list(FAULTS)
            self.rng.shuffle(self.bag)
        return self.bag.pop()

    # ---------------------------------------------------------------- faults
    def inject(self, fault: Fault) -> None:
        rng = self.rng
        kind = fault.kind
        if kind in ("sigkill", "sigstop", "sigterm", "db-cut"):
            r, role = self.pick_replica()
            fault.target = f"{r.node} ({role})"
        if kind == "sigkill":
            delay = rng.uniform(2, 5)
            r.expect_down = True
            r.signal(signal.SIGKILL)
            r.wait_exit(10)
            r.reap("SIGKILL")
            self.pause(delay)
            r.start()
            fault.detail = f"restarted as {r.node} after {delay:.1f} s"
        elif kind == "sigstop":
            hold = rng.uniform(8, 15)
            r.signal(signal.SIGSTOP)
            self.pause(hold)
            r.signal(signal.SIGCONT)
            fault.detail = f"stopped {hold:.1f} s"
        elif kind == "sigterm":
            delay = rng.uniform(1, 3)
            r.expect_down = True
            t = time.monotonic()
            r.signal(signal.SIGTERM)
            rc = r.wait_exit(20)
            took = time.monotonic() - t
            if rc is None:
                fault.detail = "did NOT exit within 20 s of SIGTERM (killed); "
                log(f"{self.offset()} {r.node} still running 20 s after SIGTERM; log tail:\n"
                    f"{common.tail(r.proc.log(), 10)}")
            else:
                fault.detail = f"exited rc {rc} in {took:.1f} s; "
            r.reap("SIGTERM")
            self.pause(delay)
            r.start()
            fault.detail += f"restarted as {r.node} after {delay:.1f} s"
        elif kind == "redis-restart":
            delay = rng.uniform(1, 3)
            self.lease_redis.kill()
            self.pause(delay)
            self.lease_redis.start()
            fault.target = f"lease Redis :{self.lease_redis.port}"
            fault.detail = f"down {delay:.1f} s (data lost: no persistence)"
        elif kind == "pg-restart":
            delay = rng.uniform(1, 4)
            t = time.monotonic()
            rc = self.pg.stop("fast")
            stop_took = time.monotonic() - t
            self.pause(delay)
            self.pg.start()
            self.pg.restarts += 1
            fault.target = f"PostgreSQL :{self.pg.port}"
            fault.detail = f"stop -m fast rc {rc} in {stop_took:.1f} s, down {delay:.1f} s more"
        elif kind == "db-cut":
            mode = rng.choice(("reset", "blackhole"))
            n = r.proxy.cut(CUT_SECONDS, mode)
            self.pause(CUT_SECONDS)
            fault.target = f"{fault.target} link"
            fate = "reset" if mode == "reset" else "held"
            fault.detail = f"{mode}: {n} open connection(s) reset, new ones {fate} for {CUT_SECONDS:g} s"

    def run_faults(self) -> None:
        lo, hi = self.args.interval
        run_end = self.t0 + self.args.minutes * 60
        next_start = self.t0 + WARMUP + self.rng.uniform(lo, hi) / 2
        n = 0
        while next_start < run_end:
            self.pause(next_start - time.time())
            n += 1
            fault = Fault(n, self.next_kind(), time.time())
            log(f"{self.offset(fault.start)} fault {n}: {fault.kind} ...")
            self.inject(fault)
            fault.end = time.time()
            self.faults.append(fault)
            log(f"{self.offset(fault.end)} fault {n}: {fault.kind} {fault.target}: {fault.detail} "
                f"[{fault.end - fault.start:.1f} s]")
            next_start = max(fault.start + self.rng.uniform(lo, hi), fault.end + MIN_GAP)
        self.faults_end = max(time.time(), run_end)

    def stop_replicas(self, timeout: float = 15.0) -> Dict[str, Optional[int]]:
        rcs: Dict[str, Optional[int]] = {}

        def stop(r: Replica) -> None:
            if r.proc is None or r.proc._log.closed:
                return
            r.expect_down = True
            t = time.monotonic()
            rcs[r.node] = r.proc.stop(timeout=timeout)
            r.exits.append((r.node, rcs[r.node], f"final SIGTERM ({time.monotonic() - t:.1f} s)"))

        threads = [threading.Thread(target=stop, args=(r,)) for r in self.replicas.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return rcs

    # ---------------------------------------------------------------- the run
    def run(self) -> dict:
        self.setup()
        self.run_faults()
        log(f"{self.offset()} faults over ({len(self.faults)}); settling {SETTLE:g} s")
        self.pause(SETTLE)
        log(f"{self.offset()} stopping the replicas")
        final = self.stop_replicas(timeout=15.0)
        self.drain.finish()
        log(f"{self.offset()} drained: {len(self.drain.records)} messages")
        return final


# --------------------------------------------------------------------------- analysis
def pct(values: List[float], p: float) -> Optional[float]:
    if not values:
        return None
    s = sorted(values)
    k = max(0, min(len(s) - 1, math.ceil(p / 100 * len(s)) - 1))
    return s[k]


def table(headers, rows, left=(0,)) -> str:
    """common.table, with a choice of left-aligned (text) columns."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def fmt(r):
        return "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()

    return "\n".join([fmt(cells[0]), "  ".join("-" * w for w in widths)] + [fmt(r) for r in cells[1:]])


def fault_near(faults: List[Fault], ts: float) -> List[Fault]:
    """The faults in progress at *ts* (from 1 s before a fault starts to 10 s after it ends)."""
    return [f for f in faults if f.start - 1 <= ts <= f.end + 10]


def sec(v: Optional[float]) -> str:
    return "-" if v is None else f"{v:.2f}"


def scan_logs(logdir: Path) -> Tuple[Dict[str, Counter], Counter]:
    """Per log file: ERROR / CRITICAL / WARNING / Traceback line counts; and distinct error messages."""
    per_file: Dict[str, Counter] = {}
    messages: Counter = Counter()
    for path in sorted(logdir.glob("beat-*.log")):
        c: Counter = Counter()
        for line in path.read_text(errors="replace").splitlines():
            for level in ("CRITICAL", "ERROR", "WARNING"):
                if f": {level}/" in line:
                    c[level] += 1
                    if level != "WARNING":
                        text = line.split("] ", 1)[-1]
                        messages[f"{level}: {text[:220]}"] += 1
                    break
            if line.startswith("Traceback"):
                c["Traceback"] += 1
        per_file[path.stem[len("beat-"):]] = c
    return per_file, messages


def normalise(msg: str) -> str:
    """Fold numbers, ids and timestamps so alike messages count together."""
    import re

    msg = re.sub(r"\d{4}-\d\d-\d\d[T ][\d:.+Z]+", "<time>", msg)
    msg = re.sub(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", "<uuid>", msg)
    msg = re.sub(r"\b\d+(\.\d+)?\b", "N", msg)
    return msg


def lease_names(soak: Soak) -> List[str]:
    """The ``{name}`` parts of the cluster_beat:* keys in the lease Redis (one cluster: one name)."""
    try:
        keys = [k.decode() for k in soak.lease_client.scan_iter(match="cluster_beat:*", count=1000)]
    except redis.RedisError as exc:
        return [f"(lease Redis unreadable: {exc})"]
    return sorted({k.split("{", 1)[1].rsplit("}", 1)[0] for k in keys if "{" in k and "}" in k})


def report(soak: Soak, final_rcs: Dict[str, Optional[int]], wall_started: float) -> None:
    args = soak.args
    t0 = soak.t0
    ws, we = t0 + WARMUP, soak.faults_end
    ws_dt, we_dt = utc(ws), utc(we)
    specs = soak.specs
    groups = ["every(1)", "cron * * * * *", "hourly M * * * *"]
    group_of = {s.name: s.group for s in specs}
    entries_per_group = Counter(s.group for s in specs)

    due: Dict[Tuple[str, datetime], str] = {}
    for s in specs:
        for at in s.schedule().fires_between(ws_dt, we_dt):
            due[(s.name, at)] = s.group

    records = soak.drain.snapshot()
    by_occ: Dict[Tuple[str, datetime], List[Received]] = defaultdict(list)
    for rec in records:
        by_occ[(rec.schedule, rec.at)].append(rec)

    # Claim rows of the window (read straight from PostgreSQL, not through a proxy).
    claims: Dict[Tuple[str, datetime], tuple] = {}
    counters = Counter()
    claim_error = ""
    try:
        with soak.pg.connect("soak") as conn:
            rows = conn.execute(
                "SELECT schedule, scheduled_at, status, reason, node, attempts FROM cluster_beat_claims "
                "WHERE scheduled_at > %s AND scheduled_at <= %s",
                (ws_dt.replace(tzinfo=None), we_dt.replace(tzinfo=None))).fetchall()
            for name, at, status, reason, node, attempts in rows:
                claims[(name, at.replace(tzinfo=timezone.utc))] = (status, reason, node, attempts)
            for row in conn.execute("SELECT sum(sent), sum(skipped), sum(missed), sum(failed), sum(claim_lost), "
                                    "sum(resent) FROM cluster_beat_schedules").fetchall():
                counters.update(dict(zip(("sent", "skipped", "missed", "failed", "claim_lost", "resent"),
                                         (int(v or 0) for v in row))))
    except Exception as exc:  # noqa: BLE001  (report it; the broker-side figures still stand)
        claim_error = f"{type(exc).__name__}: {exc}"

    stats = {g: Counter() for g in groups + ["total"]}
    late: Dict[str, List[float]] = {g: [] for g in groups + ["total"]}
    lost_list: List[Tuple[str, datetime, str]] = []
    missed_reasons: Counter = Counter()
    missed_by_fault: Counter = Counter()
    inconsistent: Counter = Counter()
    latest: List[Tuple[float, str, datetime, str]] = []
    first_sender: Counter = Counter()
    for key, group in due.items():
        rows = (group, "total")
        msgs = by_occ.get(key, [])
        claim = claims.get(key)
        status = claim[0] if claim else None
        for g in rows:
            stats[g]["due"] += 1
        if msgs:
            ids = Counter(m.task_id for m in msgs)
            first = min(msgs, key=lambda m: m.t)
            lateness = first.t - key[1].timestamp()
            first_sender[first.node] += 1
            latest.append((lateness, key[0], key[1], first.node))
            for g in rows:
                stats[g]["published"] += 1
                stats[g]["same-id resends"] += sum(n - 1 for n in ids.values())
                if len(ids) > 1:
                    stats[g]["different-id dups"] += 1
                late[g].append(lateness)
            if status != "sent":
                inconsistent[f"published, claim row {status or 'absent'}"] += 1
        elif status in ("missed", "skipped", "failed"):
            for g in rows:
                stats[g][status] += 1
            if status == "missed":
                missed_reasons[claim[1] or "(no reason)"] += 1
                near = fault_near(soak.faults, key[1].timestamp())
                missed_by_fault[near[0].kind if near else "no fault in progress"] += 1
        else:
            for g in rows:
                stats[g]["lost"] += 1
            lost_list.append((key[0], key[1], f"claim row {status} by {claim[2]} attempts {claim[3]}"
                              if claim else "no claim row"))
    # Messages for in-window instants that no entry has (off-grid or unknown schedule).
    unexpected = sum(1 for (name, at) in by_occ if ws_dt < at <= we_dt and (name, at) not in due)

    fault_counts = Counter(f.kind for f in soak.faults)
    leader_hits = Counter(f.kind for f in soak.faults if "(leader)" in f.target)

    print()
    print("Chaos soak summary")
    print("------------------")
    print(f"replicas started {hms(t0)}; window [{ws_dt:%H:%M:%S}Z, {we_dt:%H:%M:%S}Z] UTC = "
          f"[+{WARMUP:g} s, +{we - t0:.0f} s] ({(we - ws) / 60:.1f} min); settle {SETTLE:g} s; "
          f"total run {time.time() - wall_started:.0f} s")
    print()
    print(f"Faults injected: {len(soak.faults)}")
    on_replica = ("sigkill", "sigstop", "sigterm", "db-cut")
    rows = [(k, FAULTS[k], fault_counts.get(k, 0), leader_hits.get(k, 0) if k in on_replica else "-") for k in FAULTS]
    print(table(["kind", "what", "count", "on the leader"], rows, left=(0, 1)))
    print()
    print("Fault timeline (offsets from the replicas' start):")
    print(table(["#", "start", "end", "kind", "target", "detail"],
                [(f.n, f"+{f.start - t0:.1f}", f"+{f.end - t0:.1f}", f.kind, f.target, f.detail)
                 for f in soak.faults], left=(3, 4, 5)))
    print()
    print("Occurrences in the window (due = fires_between of each entry; lateness = first receive - nominal, s):")
    headers = ["group", "entries", "due", "published", "missed", "skipped", "failed", "LOST",
               "same-id resends", "diff-id dups", "p50 late", "p99 late", "max late"]
    trows = []
    for g in groups + ["total"]:
        st = stats[g]
        trows.append((g, entries_per_group.get(g, len(specs)) if g != "total" else len(specs), st["due"],
                      st["published"], st["missed"], st["skipped"], st["failed"], st["lost"],
                      st["same-id resends"], st["different-id dups"], sec(pct(late[g], 50)), sec(pct(late[g], 99)),
                      sec(max(late[g]) if late[g] else None)))
    print(table(headers, trows))
    if stats["hourly M * * * *"]["due"] == 0:
        print("note: no hourly occurrence fell inside the window")
    print()
    print(f"messages on the broker: {len(records)} with our headers ({soak.drain.foreign} without); "
          f"occurrences published in total (in and out of the window): {len(by_occ)}; "
          f"in-window messages for instants no entry has: {unexpected}")
    if missed_reasons:
        print("recorded missed, by reason: " + "; ".join(f"{r!r}: {n}" for r, n in missed_reasons.most_common())
              + "; by fault in progress: " + ", ".join(f"{k} {n}" for k, n in missed_by_fault.most_common()))
    if inconsistent:
        print("claim rows disagreeing with the broker: " + "; ".join(f"{k}: {n}" for k, n in inconsistent.items()))
    if claim_error:
        print(f"could not read cluster_beat_claims: {claim_error}")
    else:
        print("cluster_beat_schedules counters (whole run, all entries): "
              + ", ".join(f"{k} {counters.get(k, 0)}" for k in ("sent", "skipped", "missed", "failed", "claim_lost",
                                                                  "resent")))
    print("first sends per node: " + ", ".join(f"{n} {c}" for n, c in sorted(first_sender.items())))
    if latest:
        print("latest occurrences (lateness s, schedule, nominal, first sender; fault in progress):")
        for lateness, name, at, node in sorted(latest, reverse=True)[:6]:
            ts = at.timestamp()
            nf = ", ".join(f"#{f.n} {f.kind} {f.target}" for f in fault_near(soak.faults, ts)) or "none"
            print(f"  {lateness:7.2f}  {name:8} {at:%H:%M:%S}Z  {node:6}  {nf}")
    if lost_list:
        print(f"LOST occurrences ({len(lost_list)}), first 15:")
        for name, at, why in sorted(lost_list, key=lambda x: x[1])[:15]:
            ts = at.timestamp()
            nf = ", ".join(f"#{f.n} {f.kind} {f.target}" for f in fault_near(soak.faults, ts)) or "no fault in progress"
            print(f"  {name:8} {at:%H:%M:%S}Z  {why}; {nf}")
    print()
    print("Replicas: incarnations " + "; ".join(f"{r.name}: {', '.join(r.history)}" for r in soak.replicas.values()))
    print("final SIGTERM exit codes: " + ", ".join(f"{n} {rc}" for n, rc in sorted(final_rcs.items())))
    print(f"unexpected exits (crashes): {len(soak.crashes)}")
    shown = set()
    for c in soak.crashes:
        print(f"  +{c.offset:.1f}s {c.node} rc {c.rc}: {c.line[:240]}")
        if c.line not in shown:  # the log tail once per distinct cause
            shown.add(c.line)
            print("    " + c.tail.replace("\n", "\n    "))
    per_file, messages = scan_logs(soak.logdir)
    print("beat logs, lines per level: " + "; ".join(
        f"{n} E{c['ERROR']}/C{c['CRITICAL']}/W{c['WARNING']}/TB{c['Traceback']}" for n, c in per_file.items()))
    folded = Counter()
    for m, n in messages.items():
        folded[normalise(m)] += n
    if folded:
        print("most frequent ERROR/CRITICAL messages (numbers folded):")
        for m, n in folded.most_common(8):
            print(f"  {n:5} x {m}")
    proxy_stats = "; ".join(f"{n}: " + ", ".join(f"{k} {v}" for k, v in sorted(p.stats.items()))
                            for n, p in soak.proxies.items())
    print(f"DB link proxies: {proxy_stats}")
    print(f"drain errors: {soak.drain.errors}; PostgreSQL restarts: {soak.pg.restarts}; "
          f"lease names in the lease Redis at the end: {lease_names(soak) or 'none'}")
    print()
    total = stats["total"]
    fails = []
    if total["different-id dups"]:
        fails.append(f"FAIL: {total['different-id dups']} occurrence(s) published with more than one task id")
    if total["lost"]:
        fails.append(f"FAIL: {total['lost']} occurrence(s) lost (due, never published, not recorded "
                     f"missed/skipped/failed)")
    if soak.crashes:
        fails.append(f"FAIL: {len(soak.crashes)} replica(s) exited without being asked to")
    for line in fails:
        print(line)
    if not fails:
        print("OK: no different-id duplicates, nothing lost, no crash")


# --------------------------------------------------------------------------- main
def package_version() -> str:
    """git commit of the working tree and how many files differ from it."""
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()

    try:
        sha = git("rev-parse", "--short", "HEAD")
        dirty = [ln for ln in git("status", "--porcelain", "--", "celery_cluster_beat").splitlines() if ln.strip()]
    except (OSError, subprocess.SubprocessError):
        return "celery_cluster_beat (git unavailable)"
    state = f"{len(dirty)} file(s) of celery_cluster_beat/ modified or new" if dirty else "clean"
    return f"git {sha or '?'}, {state}"


def keep_logs(soak: Soak, tmp: Path) -> None:
    dest = Path.cwd() / "bench-logs" / f"chaos-soak-{time.strftime('%Y%m%d-%H%M%S')}"
    dest.mkdir(parents=True, exist_ok=True)
    for f in list((tmp / "logs").glob("*.log")) + list((tmp / "redis").glob("*.log")):
        shutil.copy(f, dest / f.name)
    for name in ("postgresql.log", "pg_ctl.out"):
        if (tmp / "pg" / name).exists():
            shutil.copy(tmp / "pg" / name, dest / name)
    log(f"logs copied to {dest}")


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="minutes of fault injection (default 10)")
    parser.add_argument("--seed", type=int, default=None, help="seed of the fault sequence (default: random, printed)")
    parser.add_argument("--quick", action="store_true", help="2 minutes, a fault every 10-20 s (overrides --minutes)")
    parser.add_argument("--keep-logs", action="store_true",
                        help="copy the beat/PostgreSQL/Redis logs to ./bench-logs/chaos-soak-<time>/")
    args = parser.parse_args(argv)
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1, 10 ** 6)
    if args.quick:
        args.minutes, args.interval = 2.0, (10.0, 20.0)
    else:
        args.interval = (15.0, 30.0)
    if args.minutes * 60 < WARMUP + 30:
        raise SystemExit("--minutes too short: at least 1")
    if os.geteuid() != 0:
        raise SystemExit("run as root: PostgreSQL is started as the postgres user through runuser")

    limit = args.minutes * 60 + WARMUP + CUT_SECONDS + SETTLE + 240  # hard bound on the whole run
    common.print_header("Chaos soak: 3 beat replicas under random faults", [
        f"seed    : {args.seed} (--seed {args.seed} replays the same fault sequence; timings differ)",
        f"run     : {args.minutes:g} min of faults, one every {args.interval[0]:g}-{args.interval[1]:g} s after a "
        f"{WARMUP:g} s warm-up; settle {SETTLE:g} s; hard limit {limit / 60:.1f} min",
        "services: own PostgreSQL (claims, via a cuttable proxy per replica), own lease Redis, own broker Redis "
        "(never restarted), all on free 127.0.0.1 ports",
        "beat    : celery_cluster_beat.Scheduler at its defaults (lease ttl 5 s, claim grace 10 s, catch-up latest)",
        f"entries : 3 x every(1), 500 x cron('* * * * *'), {HOURLY_MIN}-{HOURLY_INSIDE} x cron('M * * * *') "
        f"(minutes inside the run)",
        f"package : {package_version()}; the replicas run a copy taken at the start",
    ])

    def on_alarm(signum, frame):
        raise TimeoutError(f"run time limit of {limit:.0f} s reached")

    common.install_signal_handlers()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started with SIGINT ignored (a `&` job)
    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(int(limit))
    wall_started = time.time()
    tmp = Path(tempfile.mkdtemp(prefix="ccb-soak-"))
    os.chmod(tmp, 0o711)  # the postgres user must reach its data directory inside
    soak: Optional[Soak] = None
    try:
        with ExitStack() as stack:
            soak = Soak(args, tmp, stack)
            final = soak.run()
            hourly = [s.arg for s in soak.specs if s.group.startswith("hourly")]
            log(f"hourly entries: {', '.join(str(h) for h in hourly)}")
            report(soak, final, wall_started)
            if args.keep_logs:
                keep_logs(soak, tmp)
    except (KeyboardInterrupt, TimeoutError) as exc:
        log(f"interrupted ({str(exc) or 'Ctrl-C'}); cleaning up")
        if soak is not None and args.keep_logs:
            keep_logs(soak, tmp)
        return 0
    except Exception:
        if soak is not None and args.keep_logs:
            keep_logs(soak, tmp)
        raise
    finally:
        signal.alarm(0)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
