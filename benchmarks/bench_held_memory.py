"""Held memory: what the leader keeps after 100,000 stored schedules each fired once and went back to SQL.

    python benchmarks/bench_held_memory.py [--schedules 100000] [--rounds 1] [--sqlite] [--redis-db 10]

``--schedules`` stored schedules (``StoredSchedules.add_many``, task ``t.record``,
``args=[i]``) share one ``every(n)`` whose first fire is 30-90 s after the start and
whose next one is past the leader's horizon (120 s), so each fires once, at the same
instant, and is then handed back to SQL. One real :class:`Scheduler` runs in this
process (no lease, claims in a scratch PostgreSQL database or, ``--sqlite``, a SQLite
file; broker: the Redis database ``--redis-db``, FLUSHED at start and end, whose queue a
thread keeps emptying). Printed:

* RSS (VmRSS, after ``gc.collect()`` and glibc's ``malloc_trim(0)``, so memory the burst
  freed is not counted) and Python's allocated blocks (``sys.getallocatedblocks()``) once
  the scheduler holds the schedules (entries, queue) and its send path is warm (a config
  entry ``warm`` fired every second for 5 s), and after each round's fire and hand-back;
* at that point, the stored schedules held, and the message templates and overlap-guard
  last runs kept of them (the ``warm`` entry's own left out): all should be 0.

Target: nothing kept, and no more Python blocks allocated after the hand-back than while
holding them (the template and guard state of a schedule leave with it; kept, they were
about 1.6 KiB a schedule, 160 MiB for 100,000). Exit status 1 when the target is missed.
RSS is printed for reference only: it stays above its level while holding although fewer
objects are live (the burst's peak leaves pymalloc arenas partly used, and not all memory
is Python's). ``--rounds 2`` waits for the second fire of every schedule, n s after the
first, once the window has loaded them again.

Takes about 2-4 minutes for 100,000 (most of it storing them and waiting for the instant),
and n s (250 s or more) more a further round. Measured on a loaded 2-core machine with
12,000 schedules (SQLite), 2 rounds: live blocks -210,000 after each round (all 0 kept),
RSS +38 MiB after round 1 and +50 MiB after round 2. With the template and guard state
kept as before: live blocks +500,000 after round 1, RSS +60 MiB, 12,000 of each kept.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import os
import platform
import signal
import sys
import tempfile
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Iterator

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import redis  # noqa: E402
import sqlalchemy as sa  # noqa: E402
from celery import Celery  # noqa: E402
from sqlalchemy.engine import make_url  # noqa: E402

from celery_cluster_beat import every  # noqa: E402
from celery_cluster_beat.beat.scheduler import Scheduler  # noqa: E402
from celery_cluster_beat.dynamic import StoredSchedules  # noqa: E402

REDIS_BASE = os.environ.get("CCB_BENCH_REDIS", "redis://127.0.0.1:6379").rstrip("/0123456789")
PG_ADMIN_URL = os.environ.get("CCB_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")

MIB = 2 ** 20
#: Hard limit of one run (seconds), plus 300 s a round.
LIMIT = 900


def log(msg: str) -> None:
    sys.stderr.write(f"[{time.strftime('%H:%M:%S')}] {msg}\n")
    sys.stderr.flush()


@contextlib.contextmanager
def redis_db(db: int) -> Iterator[str]:
    """The broker's URL (database *db*, flushed before and after)."""
    url = f"{REDIS_BASE}/{db}"
    client = redis.Redis.from_url(url, socket_connect_timeout=3)
    client.flushdb()
    try:
        yield url
    finally:
        client.flushdb()
        client.close()


@contextlib.contextmanager
def scratch_pg() -> Iterator[str]:
    """A fresh PostgreSQL database, dropped afterwards."""
    name = "ccb_bench_" + uuid.uuid4().hex[:10]
    engine = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE {name}"))
    try:
        yield make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    finally:
        with engine.connect() as conn:
            conn.execute(sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                 "WHERE datname = :d AND pid <> pg_backend_pid()"), {"d": name})
            conn.execute(sa.text(f"DROP DATABASE IF EXISTS {name}"))
        engine.dispose()


def trimmed_rss() -> int:
    """RSS after glibc returned the free heap to the system (what is live, not what the burst left free)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: RSS as it is
        pass
    return rss()


def rss() -> int:
    gc.collect()
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def step_first_in(lo: float, hi: float) -> int:
    """n (over 240 s) such that every(n), on the epoch grid, first fires *lo* to *hi* s from now."""
    while True:
        now = time.time()
        for n in range(250, 4000):
            if lo <= n - now % n <= hi:
                return n
        time.sleep(0.5)


def drain(url: str, queue: str, stop: threading.Event) -> None:
    client = redis.Redis.from_url(url)
    try:
        while not stop.wait(0.5):
            client.delete(queue)
    finally:
        client.close()


def run(args, broker: str, db_url: str) -> int:
    name = "ccb_mem_" + uuid.uuid4().hex[:8]
    app = Celery(name, broker=broker, set_as_current=False)
    app.conf.update(task_default_queue="q_" + name, cluster_beat_db_url=db_url, cluster_beat_redis_url="",
                    cluster_beat_prune_interval=3600.0,
                    beat_schedule={"warm": {"task": "t.record", "schedule": every(1)}})
    api = StoredSchedules(app)
    n = step_first_in(30, 90)
    log(f"storing {args.schedules} schedules every({n}) ...")
    t0 = time.monotonic()
    for start in range(0, args.schedules, 10_000):
        api.add_many([{"name": f"s-{i:06d}", "task": "t.record", "schedule": every(n), "args": [i]}
                      for i in range(start, min(args.schedules, start + 10_000))])
    stored_s = time.monotonic() - t0
    first = every(n).next_fire(api.store.db_now())
    if (first - api.store.db_now()).total_seconds() < 15:
        log("storing took too long for the first fire; run again (or with fewer schedules)")
        return 1
    stop = threading.Event()
    drainer = threading.Thread(target=drain, args=(broker, app.conf.task_default_queue, stop), daemon=True)
    drainer.start()
    sched = Scheduler(app, lazy=False)
    rounds = []
    try:
        # Warm up the send path (Celery's producer, kombu, the template machinery) with the
        # config's every-second entry, so the figures are what the schedules themselves cost.
        warm_until = time.monotonic() + 5
        while time.monotonic() < warm_until:
            time.sleep(min(sched.tick(), 0.2))
        holding, blocks_holding = trimmed_rss(), sys.getallocatedblocks()
        held_at_start = len(sched.entries) - 1
        publisher = sched._pipeline.publisher
        for k in range(1, args.rounds + 1):
            at = first + timedelta(seconds=n * (k - 1))
            log(f"round {k}: waiting for the fire at {at.isoformat()} and the hand-back ...")
            deadline = time.monotonic() + (at - api.store.db_now()).total_seconds() + 120
            while time.monotonic() < deadline:
                wait = sched.tick()
                if len(sched.entries) == 1 and publisher.stamped >= args.schedules * k:
                    break
                time.sleep(min(wait, 0.2))
            for _ in range(5):  # a few more ticks, as a running leader makes
                time.sleep(0.2)
                sched.tick()
            raw = rss()
            rounds.append((k, raw, trimmed_rss(), sys.getallocatedblocks(), len(sched.entries) - 1,
                           publisher.templates.kept() - 1, sched._guard.kept_runs() - 1))  # less 'warm'
        sent = publisher.stamped + publisher.celery_path
    finally:
        stop.set()
        sched.close()
        api.close()
        app.close()
    print(f"schedules      : {args.schedules} (stored in {stored_s:.1f} s), every({n}), {args.rounds} round(s)")
    print(f"sent           : {sent} ({publisher.stamped} from templates; the 'warm' entry's included)")
    print(f"holding, warm  : RSS {holding / MIB:.1f} MiB, {blocks_holding} Python blocks allocated "
          f"({held_at_start} held)")
    ok = sent >= args.schedules * args.rounds
    for k, raw, after, blocks, held, templates, runs in rounds:
        growth = (after - holding) / MIB
        print(f"after round {k}  : RSS {after / MIB:.1f} MiB ({growth:+.1f} MiB; {raw / MIB:.1f} before "
              f"malloc_trim), {blocks} blocks ({blocks - blocks_holding:+d}); kept: {held} schedules, "
              f"{templates} templates, {runs} guard last runs")
        ok = ok and held == templates == runs == 0 and blocks <= blocks_holding
    print(f"target (nothing kept, no more Python blocks allocated than while holding them): "
          f"{'met' if ok else 'MISSED'}")
    return 0 if ok else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--schedules", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=1,
                        help="fires of each schedule to wait for (each n s after the previous, n >= 250)")
    parser.add_argument("--sqlite", action="store_true", help="claims in a SQLite file instead of PostgreSQL")
    parser.add_argument("--redis-db", type=int, default=10, help="broker database; FLUSHED at start and end")
    args = parser.parse_args()
    print("Held memory after stored schedules fired and went back to SQL")
    print(f"command : {' '.join(sys.argv)}")
    print(f"date    : {time.strftime('%Y-%m-%d %H:%M:%S %Z')}; python {platform.python_version()}; "
          f"load {'/'.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    signal.signal(signal.SIGALRM, lambda *a: (_ for _ in ()).throw(KeyboardInterrupt("time limit")))
    signal.alarm(LIMIT + 300 * args.rounds)
    with redis_db(args.redis_db) as broker, tempfile.TemporaryDirectory(prefix="ccb-mem-") as tmp:
        if args.sqlite:
            return run(args, broker, f"sqlite:///{tmp}/claims.sqlite3")
        with scratch_pg() as db_url:
            return run(args, broker, db_url)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt as exc:
        sys.stderr.write(f"interrupted ({exc}); Redis database and scratch database cleaned up\n")
        sys.exit(130)
