"""One-offs at scale: N ``at()`` schedules spread over a window, each should be sent once within a
second of its instant, with the scheduler's memory bounded by what is due soon.

    python benchmarks/bench_oneoff.py [--schedules 100000] [--spread 3600] [--lead 60]
                                      [--schedulers ours,django] [--sqlite] [--django-sqlite] [--redis-db 8]

The same N one-offs for each scheduler, one after another, each in a child process of its own
(so its memory is its own): the instants are ``start + i * spread / N`` (``start`` = ``--lead``
seconds after that child stored them), task ``t.record``, ``args=[i]``.

* ``ours``: stored with ``StoredSchedules(app).add_many()`` in batches of 10,000 (claims in a
  scratch PostgreSQL database, ``--sqlite`` for a SQLite file; no lease), then one real
  :class:`celery_cluster_beat.Scheduler` driven in the child as beat drives it (``tick()``, sleep
  what it returns). It holds only the one-offs due within its 120 s horizon.
* ``django``: django-celery-beat's clocked tasks (``ClockedSchedule`` + ``PeriodicTask(one_off=True)``,
  ``bulk_create`` in batches of 10,000, Django on a SQLite file), then its ``DatabaseScheduler``
  driven the same way. It loads every enabled task due within its sync interval into memory and
  re-reads them whenever one changes (a one-off is disabled after its run). Django runs on a
  scratch PostgreSQL database (``--django-sqlite``: a SQLite file, where django-celery-beat 2.9
  fails at start-up once more than about a thousand clocked tasks fall in its 5-minute window:
  ``OperationalError: Expression tree is too large (maximum depth 1000)``).

A thread in the child empties the broker's queue (Redis, database ``--redis-db``, FLUSHED at
start and end) every 20 ms, atomically, and records when each message arrived. Per scheduler:
seconds to store; sent, duplicates (by ``args``), never sent within ``--spread`` + 60 s;
lateness (arrival minus the instant) p50 / p99 / max and the share within 1 s; process CPU
seconds and peak RSS while scheduling (RSS sampled each second, after the storing); for ours
the most one-offs held in memory at once and the rows marked ended at the end. Ratios
django / ours. Targets for ours: every one-off sent exactly once, p99 lateness at most 1 s,
every row ended. Exit status 1 when ours misses one.
"""
from __future__ import annotations

import argparse
import base64
import contextlib
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Dict, List, Optional

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import redis  # noqa: E402

from common import log, num, print_header, ratio, redis_db, scratch_pg, table  # noqa: E402

UTC = timezone.utc
BATCH = 10_000
SCHEDULERS = ("ours", "django")


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class Drain(threading.Thread):
    """Empties the queue every 20 ms (LRANGE + DEL in one transaction) and notes each message's arrival."""

    def __init__(self, url: str, queue: str) -> None:
        super().__init__(daemon=True)
        self.client = redis.Redis.from_url(url)
        self.queue = queue
        self.stop = threading.Event()
        self.arrivals: List[tuple] = []  # (i, arrival epoch seconds)

    def run(self) -> None:
        while not self.stop.wait(0.02):
            self.take()
        self.take()

    def take(self) -> None:
        pipe = self.client.pipeline(transaction=True)
        pipe.lrange(self.queue, 0, -1)
        pipe.delete(self.queue)
        raw, _ = pipe.execute()
        now = time.time()
        for item in raw:
            msg = json.loads(item)
            body = json.loads(base64.b64decode(msg["body"]))
            self.arrivals.append((body[0][0], now))


def drive(sched, drain: Drain, end: float, holding=None) -> Dict[str, float]:
    """Beat's loop until *end* (epoch) or until every one-off arrived; CPU, peak RSS, most held."""
    cpu0, peak, held = time.process_time(), _rss_mib(), 0
    next_sample = time.monotonic() + 1
    want = drain.expected
    while time.time() < end and len(drain.arrivals) < want:
        wait = sched.tick()
        if time.monotonic() >= next_sample:
            peak = max(peak, _rss_mib())
            held = max(held, holding() if holding else 0)
            next_sample = time.monotonic() + 1
        time.sleep(max(0.0, min(wait, 0.05)))
    return {"cpu": time.process_time() - cpu0, "peak_rss": max(peak, _rss_mib()), "held": held}


def child_ours(args, broker: str) -> Dict:
    from celery import Celery

    from celery_cluster_beat import at
    from celery_cluster_beat.beat.scheduler import Scheduler
    from celery_cluster_beat.dynamic import StoredSchedules

    with contextlib.ExitStack() as stack:
        if args.sqlite:
            db_url = f"sqlite:///{stack.enter_context(tempfile.TemporaryDirectory())}/claims.sqlite3"
        else:
            db_url = stack.enter_context(scratch_pg())
        name = "ccb_once_" + uuid.uuid4().hex[:8]
        app = Celery(name, broker=broker, set_as_current=False)
        app.conf.update(task_default_queue="q_" + name, cluster_beat_db_url=db_url, cluster_beat_redis_url="",
                        cluster_beat_prune_interval=3600.0, beat_schedule={})
        api = StoredSchedules(app)
        t0 = time.monotonic()
        start = datetime.now(UTC) + timedelta(seconds=args.lead + args.schedules / 8000)  # room for storing
        step = args.spread / args.schedules
        instants = [start + timedelta(seconds=i * step) for i in range(args.schedules)]
        for lo in range(0, args.schedules, BATCH):
            api.add_many({"name": f"o-{i:06d}", "task": "t.record", "schedule": at(instants[i]), "args": [i]}
                         for i in range(lo, min(args.schedules, lo + BATCH)))
        stored = time.monotonic() - t0
        log(f"ours: stored {args.schedules} one-offs in {stored:.1f} s; first at {instants[0]:%H:%M:%S}")
        gc.collect()
        drain = Drain(broker, app.conf.task_default_queue)
        drain.expected = args.schedules
        drain.start()
        sched = Scheduler(app, lazy=False)
        try:
            stats = drive(sched, drain, instants[-1].timestamp() + 60, holding=lambda: len(sched.entries))
        finally:
            drain.stop.set()
            drain.join(5)
            sched.close()
        store = api.store
        ended = sum(1 for r in store.stored_list() if r.ended_at is not None)
        api.close()
        app.close()
    return dict(stats, stored=stored, arrivals=drain.arrivals, instants=[t.timestamp() for t in instants],
                ended=ended)


def child_django(args, broker: str) -> Dict:
    import django
    from django.conf import settings

    from sqlalchemy.engine import make_url

    stack = contextlib.ExitStack()
    if args.django_sqlite:
        database = {"ENGINE": "django.db.backends.sqlite3", "NAME": f"{tempfile.mkdtemp(prefix='bench-dcb-')}/db.sqlite3"}
    else:
        url = make_url(stack.enter_context(scratch_pg()))
        database = {"ENGINE": "django.db.backends.postgresql", "NAME": url.database, "USER": url.username,
                    "PASSWORD": url.password or "", "HOST": url.host, "PORT": url.port or 5432}
    settings.configure(INSTALLED_APPS=["django_celery_beat"], USE_TZ=True, TIME_ZONE="UTC",
                       DATABASES={"default": database},
                       DJANGO_CELERY_BEAT_TZ_AWARE=True, DEFAULT_AUTO_FIELD="django.db.models.AutoField")
    django.setup()
    from celery import Celery
    from django.core.management import call_command
    from django_celery_beat.models import ClockedSchedule, PeriodicTask
    from django_celery_beat.schedulers import DatabaseScheduler

    call_command("migrate", verbosity=0)
    name = "dcb_once_" + uuid.uuid4().hex[:8]
    app = Celery(name, broker=broker, set_as_current=False)
    app.conf.update(task_default_queue="q_" + name, timezone="UTC", beat_schedule={})
    t0 = time.monotonic()
    start = datetime.now(UTC) + timedelta(seconds=args.lead + args.schedules / 8000)
    step = args.spread / args.schedules
    instants = [start + timedelta(seconds=i * step) for i in range(args.schedules)]
    for lo in range(0, args.schedules, BATCH):
        part = range(lo, min(args.schedules, lo + BATCH))
        clocks = ClockedSchedule.objects.bulk_create([ClockedSchedule(clocked_time=instants[i]) for i in part])
        PeriodicTask.objects.bulk_create([PeriodicTask(name=f"o-{i:06d}", task="t.record", clocked=c, one_off=True,
                                                       args=json.dumps([i])) for i, c in zip(part, clocks)])
    stored = time.monotonic() - t0
    log(f"django: stored {args.schedules} clocked one-offs in {stored:.1f} s; first at {instants[0]:%H:%M:%S}")
    gc.collect()
    drain = Drain(broker, app.conf.task_default_queue)
    drain.expected = args.schedules
    drain.start()
    sched = DatabaseScheduler(app=app, lazy=False)
    try:
        stats = drive(sched, drain, instants[-1].timestamp() + 60, holding=lambda: len(sched._schedule or {}))
    finally:
        drain.stop.set()
        drain.join(5)
        with contextlib.suppress(Exception):
            sched.close()
        from django.db import connections

        connections.close_all()
        stack.close()
    app.close()
    return dict(stats, stored=stored, arrivals=drain.arrivals, instants=[t.timestamp() for t in instants],
                ended=None)


def summarise(result: Dict) -> Dict:
    instants = result["instants"]
    first: Dict[int, float] = {}
    dup = 0
    for i, t in result["arrivals"]:
        if i in first:
            dup += 1
        else:
            first[i] = t
    late = sorted(first[i] - instants[i] for i in first)

    def pct(p: float) -> Optional[float]:
        return late[min(len(late) - 1, int(p * len(late)))] if late else None

    return {"stored": result["stored"], "sent": len(first), "dup": dup, "never": len(instants) - len(first),
            "p50": pct(0.5), "p99": pct(0.99), "max": late[-1] if late else None,
            "within1": sum(1 for x in late if x <= 1.0) / len(instants), "cpu": result["cpu"],
            "peak_rss": result["peak_rss"], "held": result["held"], "ended": result["ended"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedules", type=int, default=100_000)
    parser.add_argument("--spread", type=float, default=3600.0, help="seconds the instants are spread over")
    parser.add_argument("--lead", type=float, default=60.0, help="seconds from the end of storing to the first")
    parser.add_argument("--schedulers", default=",".join(SCHEDULERS))
    parser.add_argument("--sqlite", action="store_true", help="ours with a SQLite claim database")
    parser.add_argument("--django-sqlite", action="store_true", help="Django on a SQLite file, not PostgreSQL")
    parser.add_argument("--redis-db", type=int, default=8, help="the broker's Redis database; FLUSHED")
    parser.add_argument("--child", choices=SCHEDULERS, help=argparse.SUPPRESS)
    parser.add_argument("--broker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        result = (child_ours if args.child == "ours" else child_django)(args, args.broker)
        result["maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        Path(args.out).write_text(json.dumps(result))
        return 0
    names = [s for s in args.schedulers.split(",") if s]
    from importlib.metadata import PackageNotFoundError, version

    def v(dist: str) -> str:
        try:
            return version(dist)
        except PackageNotFoundError:
            return "missing"

    print_header("One-offs: at() at scale", [
        f"setup   : {args.schedules} one-offs, instants spread evenly over {args.spread:.0f} s from {args.lead:.0f} s "
        f"after storing; ours: claims in {'SQLite' if args.sqlite else 'PostgreSQL'}, no lease; django-celery-beat: "
        f"clocked one_off tasks (django-celery-beat {v('django-celery-beat')}, Django {v('Django')}), Django on "
        f"{'SQLite' if args.django_sqlite else 'PostgreSQL'}; each scheduler driven in its own process, one after another"])
    results: Dict[str, Dict] = {}
    with redis_db(args.redis_db) as broker:
        for name in names:
            out = Path(tempfile.mkstemp(prefix="bench-oneoff-", suffix=".json")[1])
            limit = args.spread + args.lead + args.schedules / 500 + 300
            cmd = [sys.executable, __file__, "--child", name, "--broker", broker, "--out", str(out),
                   "--schedules", str(args.schedules), "--spread", str(args.spread), "--lead", str(args.lead)]
            cmd += ["--sqlite"] if args.sqlite else []
            cmd += ["--django-sqlite"] if args.django_sqlite else []
            log(f"{name}: running (at most {limit:.0f} s) ...")
            try:
                subprocess.run(cmd, check=True, timeout=limit)
                results[name] = summarise(json.loads(out.read_text()))
                log(f"{name}: {results[name]}")
            except (subprocess.SubprocessError, ValueError) as exc:
                log(f"{name}: failed ({exc})")
            finally:
                out.unlink(missing_ok=True)
            redis.Redis.from_url(broker).flushdb()
    rows = []
    for name, r in results.items():
        rows.append((name, num(r["stored"], "{:.1f}"), r["sent"], r["dup"], r["never"], num(r["p50"], "{:.3f}"),
                     num(r["p99"], "{:.3f}"), num(r["max"], "{:.3f}"), f"{100 * r['within1']:.2f}%",
                     num(r["cpu"], "{:.1f}"), num(r["peak_rss"], "{:.0f}"), r["held"],
                     "-" if r["ended"] is None else r["ended"]))
    print(table(["scheduler", "store s", "sent", "dup", "never sent", "late p50 s", "p99 s", "max s", "within 1 s",
                 "CPU s", "peak RSS MiB", "most held", "rows ended"], rows))
    ours, other = results.get("ours"), results.get("django")
    if ours and other:
        print()
        print(f"django / ours: p99 lateness {ratio(other['p99'], ours['p99'])}, CPU {ratio(other['cpu'], ours['cpu'])}, "
              f"peak RSS {ratio(other['peak_rss'], ours['peak_rss'])}, entries held {ratio(other['held'], ours['held'])}")
    if not ours:
        return 1
    ok = (ours["sent"] == args.schedules and ours["dup"] == 0 and ours["p99"] is not None and ours["p99"] <= 1.0
          and ours["ended"] == args.schedules)
    print(f"\ntargets (ours): all sent once, p99 <= 1 s, every row ended: {'met' if ok else 'MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
