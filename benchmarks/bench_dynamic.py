"""Dynamic: 100,000 schedules stored at run time, ours (StoredSchedules) next to RedBeat (RedBeatSchedulerEntry.save()).

    python benchmarks/bench_dynamic.py [--schedules 100000] [--idle 30] [--changes 5] [--sqlite]
                                       [--schedulers ours-pg,redbeat] [--redbeat-loop 1]
                                       [--redis-db 11] [--quick] [--keep-logs]

The workload is ``--schedules`` schedules made at run time (none in
``beat_schedule``), the same set for both: schedule i is daily at minute i mod 60
of an hour at least two hours away from the current UTC hour, on one of 12
day-of-week sets (up to 60 x 21 x 12 = 15,120 distinct cron expressions), task
``t.record``, ``args=[i]``; nothing falls due during the run. They are stored
before beat starts and that loading is not part of any figure (its time is
printed for reference):

* ours    - ``StoredSchedules(app).add_many(...)`` (batches of ``--batch``; ``add()`` in a loop
            when add_many is absent), cron text ``"m h * * dow"``; claims in a scratch
            PostgreSQL database (``--sqlite``: a SQLite file), the Redis lease on, in the
            broker's Redis (the defaults)
* RedBeat - ``RedBeatSchedulerEntry(name, "t.record", crontab(m, h, dow), args=[i], app=app).save()``
            in a loop (RedBeat's API has no bulk save), own key prefix, ``redbeat_lock_timeout=5``,
            ``beat_max_loop_interval=1`` (``--redbeat-loop``): at its defaults (300 s loop) RedBeat
            only looks for changed entries every 5 minutes

Then one real ``celery beat`` per scheduler (one after another, never at once,
no worker). Per scheduler (psutil / /proc on the beat process, as bench_idle.py):

* start-up CPU  - user+system CPU seconds of the beat process from exec until its
                  *first tick* returned (time.process_time() written by common.py's
                  beat_init hook): interpreter, imports, app module, scheduler set-up
                  (ours: store, lease, loading the stored schedules due within its
                  horizon) and the first tick. "beyond import" subtracts a bare
                  interpreter importing the same app module. "settle CPU" is the CPU
                  of the ``--settle`` s that follow, so work deferred past the first
                  tick is not hidden
* start-up wall - seconds from spawning the process to that first tick
* idle CPU      - CPU over ``--idle`` s after the settle, nothing due (schedstat, ns resolution)
* peak RSS      - VmHWM of the beat process at the end (after the changes)
* change        - ``--changes`` rounds, each on another stored schedule, with beat idle:
                  ours ``update(name, schedule=every(1))``; RedBeat re-saves the entry with
                  ``schedule(1)``. The script polls LLEN of the app's queue every 2 ms and
                  reads new messages until one of *that* schedule appears. Round k is made
                  (k + 0.5) / changes of the way into a wall-clock second, so the rounds
                  sample every phase of the whole-second grid and of RedBeat's tick.
                  raw = that message's first sight - the change call's return.
                  Ours: an every(1) fires on the next whole epoch second, so the earliest
                  possible message is at ideal = floor(return) + 1 s; effective = first
                  sight - ideal (what is beyond the schedule's own alignment; the target
                  applies to it); "applied" = the leader's first INFO line containing
                  "schedule change" after the return (log time, ms) - return; "skipped" =
                  whole seconds between ideal and the message's cluster_beat_scheduled_at
                  header (occurrences the change was too late for).
                  RedBeat: save() writes the entry's meta with HSETNX, so the entry keeps
                  its old last_run_at and is due at once; it fires at beat's next tick
                  (at most ``--redbeat-loop`` s later): its raw delay has no alignment
                  part, and raw is its figure.
                  Each change is reverted right after its first message (ours
                  ``update(name, schedule=<the cron>)``; RedBeat re-saves the crontab).
                  "fires after revert" = further messages of that schedule in the 2 s after
                  the revert call (ours: "revert applied" = its "schedule change" line -
                  the revert's return); then the queue is emptied and a message of that
                  schedule in the next 2 s is counted in "... after 2s" (should be 0)
* wakeups/s     - voluntary context switches of the beat process per second of the idle window
* PG CPU        - ours with PostgreSQL: CPU of the server backends serving beat's connections
                  over the idle window (matched by client port; RedBeat's Redis work is not
                  counted, that server is shared)

The Redis DB (``--redis-db``, default 11) is broker, lease and RedBeat store; it is
FLUSHED at start, between schedulers and at the end; the scratch PostgreSQL
database is dropped. Each scheduler's run has a hard time limit (SIGALRM).

Targets for ours: start-up CPU below RedBeat's, peak RSS at most 300 MiB, every
change visible within 1 s (effective, max over the rounds), idle CPU near zero
(at most 1% of one core). Exit status 1 when ours misses one.
"""
from __future__ import annotations

import argparse
import json
import math
import signal
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))

import redis  # noqa: E402

import common  # noqa: E402
from bench_burst import _entry_number  # noqa: E402  (argsrepr '(17,)' / '[17]' -> 17)
from bench_idle import DOWS, import_cpu  # noqa: E402
from bench_sustained import scan_log, stop_beat  # noqa: E402
from common import log  # noqa: E402

TASK = "t.record"
NAME = "dyn.%06d"
POLL = 0.002  # LLEN poll while waiting for the changed schedule's first message
REVERT_SETTLE = 2.0  # after a revert: wait, empty the queue ...
REVERT_WATCH = 2.0  # ... then count that schedule's messages for this long
LOAD_PROGRESS = 10  # log loading progress this many times
DEFAULT_SCHEDULERS = "ours-pg,redbeat"
ALLOWED = ("ours-pg", "ours-sqlite", "redbeat")

TARGET_RSS = 300.0
TARGET_CHANGE = 1.0
TARGET_IDLE_CORE = 0.01


class RunTimeout(Exception):
    """One scheduler's run exceeded its hard time limit."""


@dataclass
class Change:
    name: str
    t1: float  # epoch when the change call returned
    call: float  # seconds the change call took
    t_revert: float = 0.0  # epoch when the revert call started
    raw: Optional[float] = None  # first sight of its message - call return
    ideal_wait: float = 0.0  # ours: floor(return) + 1 - return
    effective: Optional[float] = None  # ours: first sight - ideal
    nominal_late: Optional[float] = None  # ours: first sight - cluster_beat_scheduled_at
    skipped: Optional[int] = None  # ours: whole seconds between ideal and the header's instant
    applied: Optional[float] = None  # ours: "schedule change" log line - call return
    t_reverted: float = 0.0  # epoch when the revert call returned
    revert_applied: Optional[float] = None  # ours: the next "schedule change" line - revert return
    fired_during_revert: int = 0  # messages of this schedule after its first, within REVERT_SETTLE s of the revert
    after_revert: int = 0  # messages of this schedule REVERT_SETTLE s after its revert
    others: int = 0  # messages of other schedules seen while waiting


@dataclass
class Result:
    label: str
    kind: str
    schedules: int
    load_s: Optional[float] = None
    load_how: str = ""
    startup_cpu: Optional[float] = None
    startup_wall: Optional[float] = None
    import_cpu: Optional[float] = None
    settle_cpu: Optional[float] = None
    idle_cpu: Optional[float] = None
    idle_seconds: Optional[float] = None
    idle_msgs: int = 0
    idle_db_cpu: Optional[float] = None  # ours with PostgreSQL: CPU of the server backends serving beat, idle window
    idle_wakeups: Optional[float] = None  # voluntary context switches of the beat process per second, idle window
    batch_times: List[float] = field(default_factory=list)
    rss_ready: Optional[float] = None
    peak_rss: Optional[float] = None
    load: Optional[float] = None
    changes: List[Change] = field(default_factory=list)
    change_lines: int = 0
    notes: List[str] = field(default_factory=list)

    @property
    def beyond_import(self) -> Optional[float]:
        if self.startup_cpu is None or self.import_cpu is None:
            return None
        return self.startup_cpu - self.import_cpu

    @property
    def idle_pct(self) -> Optional[float]:
        if self.idle_cpu is None or not self.idle_seconds:
            return None
        return 100.0 * self.idle_cpu / self.idle_seconds

    def stat(self, attr: str, fn: Callable) -> Optional[float]:
        values = [getattr(c, attr) for c in self.changes if getattr(c, attr) is not None]
        return fn(values) if values else None

    @property
    def seen(self) -> int:
        return sum(1 for c in self.changes if c.raw is not None)

    @property
    def change_figure(self) -> str:
        """The attribute a change is judged by: ours effective, RedBeat raw."""
        return "effective" if self.kind == "ours" else "raw"


# --------------------------------------------------------------------------- workload
def hours_away(now_hour: int) -> List[int]:
    """UTC hours at least two hours from the current one, either way: nothing of them falls due in a run."""
    return [h for h in range(24) if (h - now_hour) % 24 in range(2, 23)]


def workload(n: int, hours: List[int]) -> List[Tuple[str, int, int, str]]:
    """(name, minute, hour, day-of-week set) of the n schedules."""
    out = []
    per_dow = 60 * len(hours)
    for i in range(n):
        out.append((NAME % i, i % 60, hours[(i // 60) % len(hours)], DOWS[(i // per_dow) % len(DOWS)]))
    return out


def cron_text(minute: int, hour: int, dow: str) -> str:
    return f"{minute} {hour} * * {dow}"


def _progress(label: str, done: int, total: int, t0: float) -> None:
    log(f"{label}: stored {done}/{total} ({time.monotonic() - t0:.0f}s)")


class OursStore:
    """Ours: the application's side, StoredSchedules on the same configuration as the beat process."""

    def __init__(self, app, label: str) -> None:
        from celery_cluster_beat.dynamic import StoredSchedules

        self.label = label
        self.api = StoredSchedules(app)
        self.batch_times: List[float] = []

    def load(self, work, batch: int) -> str:
        t0 = time.monotonic()
        step = max(1, len(work) // LOAD_PROGRESS)
        if hasattr(self.api, "add_many"):
            for start in range(0, len(work), batch):
                chunk = work[start:start + batch]
                tb = time.monotonic()
                self.api.add_many([{"name": name, "task": TASK, "schedule": cron_text(m, h, dow),
                                    "args": [start + k]} for k, (name, m, h, dow) in enumerate(chunk)])
                self.batch_times.append(time.monotonic() - tb)
                _progress(self.label, min(start + batch, len(work)), len(work), t0)
            return f"add_many, batches of {batch}"
        for i, (name, m, h, dow) in enumerate(work):
            self.api.add(name, TASK, cron_text(m, h, dow), args=[i])
            if (i + 1) % step == 0:
                _progress(self.label, i + 1, len(work), t0)
        return "add() in a loop (no add_many)"

    def change(self, i: int, spec) -> float:
        """Make schedule *i* fire every second; returns the ideal first instant (epoch s) once the call returned."""
        from celery_cluster_beat import every

        self.api.update(spec[0], schedule=every(1))
        return math.floor(time.time()) + 1.0

    def revert(self, i: int, spec) -> None:
        self.api.update(spec[0], schedule=cron_text(*spec[1:]))

    def close(self) -> None:
        close = getattr(self.api, "close", None)
        if callable(close):
            close()


class RedBeatStore:
    """RedBeat: RedBeatSchedulerEntry(...).save(), the API RedBeat documents for run-time schedules."""

    def __init__(self, app, label: str) -> None:
        from redbeat import RedBeatSchedulerEntry

        self.label = label
        self.app = app
        self.Entry = RedBeatSchedulerEntry
        self.batch_times: List[float] = []

    def _entry(self, i: int, spec, sched):
        return self.Entry(spec[0], TASK, sched, args=[i], app=self.app)

    @staticmethod
    def _crontab(spec):
        from celery.schedules import crontab

        return crontab(minute=spec[1], hour=spec[2], day_of_week=spec[3])

    def load(self, work, batch: int) -> str:
        t0 = time.monotonic()
        step = max(1, len(work) // LOAD_PROGRESS)
        for i, spec in enumerate(work):
            self._entry(i, spec, self._crontab(spec)).save()
            if (i + 1) % step == 0:
                _progress(self.label, i + 1, len(work), t0)
        return "RedBeatSchedulerEntry(...).save() in a loop"

    def change(self, i: int, spec) -> float:
        from celery.schedules import schedule

        self._entry(i, spec, schedule(1)).save()
        return time.time()  # raw is RedBeat's figure; see the module docstring

    def revert(self, i: int, spec) -> None:
        self._entry(i, spec, self._crontab(spec)).save()

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------- one scheduler
def identity(kind: str, raw: bytes) -> Tuple[Optional[str], Optional[str]]:
    """(schedule name, nominal instant or None) of a queued message."""
    try:
        h = json.loads(raw)["headers"]
    except (ValueError, KeyError, TypeError):
        return None, None
    if kind == "ours" and h.get("cluster_beat_schedule"):
        return h["cluster_beat_schedule"], h.get("cluster_beat_scheduled_at")
    n = _entry_number(h.get("argsrepr"))
    return (NAME % n if n is not None else None), None


def _epoch(at: Optional[str]) -> Optional[float]:
    try:
        return datetime.fromisoformat(at.replace("Z", "+00:00")).replace(tzinfo=timezone.utc).timestamp()
    except (AttributeError, ValueError):
        return None


def wait_for_message(client, queue: str, kind: str, name: str, timeout: float, beat) -> Tuple[
        Optional[float], Optional[str], int]:
    """Poll until a message of *name* is queued: (epoch of first sight, its nominal instant, other messages)."""
    seen = 0
    others = 0
    deadline = time.time() + timeout
    while time.time() < deadline and beat.proc.alive():
        n = client.llen(queue)
        if n > seen:
            now = time.time()
            new = client.lrange(queue, 0, n - seen - 1)  # LPUSH: the newest are at the head
            seen = n
            for raw in new:
                got, at = identity(kind, raw)
                if got == name:
                    return now, at, others
                others += 1
        time.sleep(POLL)
    return None, None, others


def count_of(client, queue: str, kind: str, name: str) -> int:
    return sum(1 for raw in client.lrange(queue, 0, -1) if identity(kind, raw)[0] == name)


def run_changes(res: Result, store, work, client, queue: str, beat, args) -> None:
    picks = [(k + 1) * len(work) // (args.changes + 1) for k in range(args.changes)]
    for k, i in enumerate(picks):
        spec = work[i]
        client.delete(queue)
        # Round k changes at (k + 0.5) / changes into a second, so the rounds sample every phase of the
        # schedule's whole-second grid and of RedBeat's tick instead of the one the previous round left.
        phase = (k + 0.5) / len(picks)
        now = time.time()
        time.sleep((phase - (now - math.floor(now))) % 1.0)
        t0 = time.time()
        ideal = store.change(i, spec)
        t1 = time.time()
        ch = Change(spec[0], t1, call=t1 - t0)
        t_seen, at, ch.others = wait_for_message(client, queue, res.kind, spec[0], args.change_timeout, beat)
        if t_seen is not None:
            ch.raw = t_seen - t1
            if res.kind == "ours":
                ch.ideal_wait = ideal - t1
                ch.effective = t_seen - ideal
                nominal = _epoch(at)
                if nominal is not None:
                    ch.nominal_late = t_seen - nominal
                    ch.skipped = int(round(nominal - ideal))
        ch.t_revert = time.time()
        store.revert(i, spec)
        ch.t_reverted = time.time()
        res.changes.append(ch)
        time.sleep(REVERT_SETTLE)
        # The revert was made within milliseconds of the first message and the next every-second fire is
        # a second later: any further message of the schedule was sent after the revert call.
        ch.fired_during_revert = max(0, count_of(client, queue, res.kind, spec[0]) - (ch.raw is not None))
        client.delete(queue)
        time.sleep(REVERT_WATCH)
        ch.after_revert = count_of(client, queue, res.kind, spec[0])
        log(f"{res.label}: change {spec[0]}: call {ch.call * 1000:.0f} ms, raw "
            f"{common.num(None if ch.raw is None else ch.raw * 1000, '{:.0f}')} ms"
            + (f", effective {common.num(None if ch.effective is None else ch.effective * 1000, '{:.0f}')} ms"
               if res.kind == "ours" else "")
            + (f", {ch.fired_during_revert} more message(s) after the revert call" if ch.fired_during_revert else "")
            + (f", {ch.after_revert} message(s) {REVERT_SETTLE:.0f}s after the revert" if ch.after_revert else ""))
        if not beat.proc.alive():
            break
    if res.kind == "ours":
        times = common.log_times(beat.proc.log(), "schedule change")
        res.change_lines = len(times)
        for ch in res.changes:
            # the first line after the change returned and before its revert (log times are truncated to ms)
            later = [t for t in times if ch.t1 - 0.0015 <= t <= ch.t_revert + 0.0015]
            if later:
                ch.applied = later[0] - ch.t1
            later = [t for t in times if t >= ch.t_reverted - 0.0015]
            if later:
                ch.revert_applied = later[0] - ch.t_reverted


def run_one(label: str, args, broker: str, work) -> Result:
    scheduler, kind = common.SCHEDULERS[label]
    res = Result(label, kind, len(work))
    limit = int(args.load_timeout + args.startup_timeout + args.settle + args.idle
                + args.changes * (args.change_timeout + REVERT_SETTLE + REVERT_WATCH + 5) + 120)

    def on_alarm(signum, frame):
        raise RunTimeout(f"{label}: hard time limit of {limit} s reached")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(limit)
    store = None
    try:
        with common.temp_dir(f"ccb-dynamic-{label}-") as tmp, common.claims_db(label, tmp) as db_url:
            conf = {"timezone": "UTC"}
            if kind == "redbeat":
                conf.update(redbeat_key_prefix=f"ccb-dynamic-{label}:", redbeat_lock_timeout=5,
                            beat_max_loop_interval=args.redbeat_loop)
            app = common.write_app(tmp, broker=broker, kind=kind, db_url=db_url, schedule_src="{}", conf=conf)
            res.import_cpu = import_cpu(app)
            client = redis.Redis.from_url(broker, socket_timeout=10)
            try:
                celery_app = common.import_app(app)
                store = (OursStore if kind == "ours" else RedBeatStore)(celery_app, label)
                log(f"{label}: storing {len(work)} schedules (hard limit {limit}s for this scheduler)")
                t0 = time.monotonic()
                res.load_how = store.load(work, args.batch)
                res.load_s = time.monotonic() - t0
                res.batch_times = list(store.batch_times)
                log(f"{label}: stored in {res.load_s:.1f}s; starting beat")
                beat = common.start_beat(app, tmp, label, scheduler)
                try:
                    measure(res, beat, store, work, client, app.queue, args, db_url)
                finally:
                    signal.alarm(0)  # the clean-up below is bounded by its own timeouts
                    stop_beat(beat)
            except RunTimeout as exc:
                res.notes.append(str(exc))
                log(str(exc))
            except Exception as exc:  # an API that fails: report it, clean up, go on with the next scheduler
                res.notes.append(f"failed: {exc!r}")
                log(f"{label}: failed:\n{traceback.format_exc()}")
            finally:
                signal.alarm(0)
                if store is not None:
                    try:
                        store.close()
                    except Exception as exc:  # clean-up only
                        log(f"{label}: closing the store: {exc!r}")
                client.flushdb()
                client.close()
            errors, warnings, samples = scan_log(tmp / f"beat-{label}.log")
            if errors or warnings:
                res.notes.append(f"beat log: {errors} ERROR/Traceback line(s), {warnings} WARNING line(s)")
                res.notes.extend(f"  {s}" for s in samples)
            common.keep_logs(tmp, args.keep_logs)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    med = res.stat(res.change_figure, statistics.median)
    log(f"{label}: start-up CPU {common.num(res.startup_cpu)}s, idle {common.num(res.idle_pct, '{:.3f}')}% core, "
        f"peak RSS {common.num(res.peak_rss, '{:.0f}')} MiB, change {res.change_figure} median "
        f"{common.num(None if med is None else med * 1000, '{:.0f}')} ms")
    return res


def measure(res: Result, beat, store, work, client, queue: str, args, db_url: str) -> None:
    try:
        cpu, wall = beat.wait_ready(timeout=args.startup_timeout)
    except RuntimeError as exc:
        res.notes.append(str(exc).splitlines()[0])
        log(str(exc))
        return
    res.startup_cpu, res.startup_wall = cpu, wall - beat.started_wall
    res.rss_ready = beat.rss_mib()
    c0 = beat.cpu_precise()
    time.sleep(args.settle)
    c1, t1 = beat.cpu_precise(), time.monotonic()
    v1 = beat.ps.num_ctx_switches().voluntary
    db0 = common.processes_cpu(common.pg_backend_pids(db_url, beat.ps.pid)) if res.kind == "ours" else {}
    res.settle_cpu = c1 - c0
    log(f"{res.label}: first tick after {res.startup_wall:.1f}s ({cpu:.2f}s CPU); idle window {args.idle:.0f}s")
    time.sleep(args.idle)
    c2, t2 = beat.cpu_precise(), time.monotonic()
    v2 = beat.ps.num_ctx_switches().voluntary
    if db0:
        db1 = common.processes_cpu(common.pg_backend_pids(db_url, beat.ps.pid))
        res.idle_db_cpu = sum(v - db0.get(pid, 0.0) for pid, v in db1.items())
    res.idle_cpu, res.idle_seconds = c2 - c1, t2 - t1
    res.idle_wakeups = (v2 - v1) / (t2 - t1)
    res.load = common.load1()
    res.idle_msgs = client.llen(queue)
    if res.idle_msgs:
        res.notes.append(f"{res.idle_msgs} message(s) queued before the changes: something fell due")
    if not beat.proc.alive():
        res.notes.append(f"beat exited during the idle window ({beat.proc.popen.returncode})")
        return
    run_changes(res, store, work, client, queue, beat, args)
    res.peak_rss = beat.peak_rss_mib()
    if not beat.proc.alive():
        res.notes.append(f"beat exited during the changes ({beat.proc.popen.returncode})")


# --------------------------------------------------------------------------- report
def ms(seconds: Optional[float]) -> str:
    return common.num(None if seconds is None else seconds * 1000.0, "{:.0f}")


def report(results: List[Result], args) -> bool:
    print(f"{args.schedules} stored schedules (daily cron, nothing due during the run); settle {args.settle:.0f}s; "
          f"idle window {args.idle:.0f}s; {args.changes} change(s)")
    print()
    rows = []
    for r in results:
        rows.append([r.label, common.num(r.load_s, "{:.1f}"), common.num(r.startup_cpu), common.num(r.beyond_import),
                     common.num(r.startup_wall), common.num(r.settle_cpu, "{:.3f}"),
                     common.num(r.idle_cpu, "{:.4f}"), common.num(r.idle_pct, "{:.3f}"),
                     common.num(r.idle_db_cpu, "{:.2f}"), common.num(r.idle_wakeups, "{:.1f}"),
                     common.num(r.rss_ready, "{:.0f}"),
                     common.num(r.peak_rss, "{:.0f}"), common.num(r.load)])
    print(common.table(["scheduler", "store s", "start-up CPU s", "beyond import s", "start-up wall s",
                        "settle CPU s", "idle CPU s", "idle %core", "PG CPU s", "wakeups/s", "RSS ready MiB",
                        "peak RSS MiB", "load"], rows))
    print()
    rows = []
    for r in results:
        ours = r.kind == "ours"
        rows.append([r.label, f"{r.seen}/{len(r.changes)}", ms(r.stat("call", statistics.median)),
                     ms(r.stat("raw", statistics.median)), ms(r.stat("raw", max)),
                     ms(r.stat("effective", statistics.median)) if ours else "n/a",
                     ms(r.stat("effective", max)) if ours else "n/a",
                     ms(r.stat("applied", statistics.median)) if ours else "n/a",
                     ms(r.stat("applied", max)) if ours else "n/a",
                     ms(r.stat("revert_applied", max)) if ours else "n/a",
                     ms(r.stat("nominal_late", statistics.median)) if ours else "n/a",
                     common.num(r.stat("skipped", sum), "{}") if ours else "n/a",
                     sum(c.fired_during_revert for c in r.changes), sum(c.after_revert for c in r.changes)])
    print(common.table(["changes", "seen", "call ms", "raw p50 ms", "raw max ms", "effective p50 ms",
                        "effective max ms", "applied p50 ms", "applied max ms", "revert applied max ms",
                        "late vs header ms", "skipped s", "fires after revert", f"... after {REVERT_SETTLE:.0f}s"],
                       rows))
    print()
    for line in (
        "store s: storing the schedules before beat starts (not part of any figure). start-up CPU: process CPU",
        "(user+sys) from exec until beat's first tick returned, read in-process; beyond import: minus a bare",
        f"interpreter importing the same app module; settle CPU: the {args.settle:.0f}s after the first tick; idle: "
        f"the {args.idle:.0f}s after that;",
        "PG CPU s: ours with PostgreSQL, CPU of the server backends serving beat's connections over the idle window",
        "(psutil, 10 ms ticks; RedBeat's Redis work is not counted: its server is shared); wakeups/s: voluntary",
        "context switches of the beat process per second of the idle window; peak RSS = VmHWM at the end (after the",
        "changes); load = 1-min load average at the end of the idle window.",
        "changes: call = the change call's duration; raw = first sight of the changed schedule's message (LLEN polled",
        f"every {POLL * 1000:.0f} ms) - the call's return. Ours: effective = raw minus the wait for the next whole "
        "second (every(1)",
        "fires on the epoch grid); applied = the leader's 'schedule change' log line - return (revert applied: the",
        "same for the revert); late vs header = first sight - cluster_beat_scheduled_at; skipped = seconds of",
        "every(1) the change came too late for; fires after revert = further messages of the changed schedule (the",
        f"revert follows its first message within ms) in the {REVERT_SETTLE:.0f}s after the revert; ... after "
        f"{REVERT_SETTLE:.0f}s: in the {REVERT_WATCH:.0f}s after",
        "that (should be 0). RedBeat: the re-saved entry keeps its old last_run_at (save() writes meta with HSETNX),",
        f"so it is due at once and fires on beat's next tick (loop {args.redbeat_loop:g} s): raw has no alignment "
        "part and is its figure.",
    ):
        print(line)

    by = {r.label: r for r in results}
    ours = [o for o in ("ours-pg", "ours-sqlite") if o in by]
    rb = by.get("redbeat")
    if ours and rb is not None:
        print()
        print("Ratios (RedBeat / ours; > 1x is better for ours):")
        rows = []
        for a in ours:
            r = by[a]
            rows.append([f"redbeat / {a}", common.ratio(rb.startup_cpu, r.startup_cpu, 2),
                         common.ratio(rb.beyond_import, r.beyond_import, 2),
                         common.ratio(rb.startup_wall, r.startup_wall, 2), common.ratio(rb.peak_rss, r.peak_rss, 2),
                         common.ratio(rb.stat("raw", statistics.median), r.stat("raw", statistics.median), 2),
                         common.ratio(rb.stat("raw", statistics.median), r.stat("effective", statistics.median), 2),
                         common.ratio(rb.idle_cpu, r.idle_cpu, 2)])
        print(common.table(["pair", "start-up CPU", "beyond import", "start-up wall", "peak RSS",
                            "change raw p50", "RedBeat raw / ours effective p50", "idle CPU"], rows))

    ok = True
    if ours:
        print()
    for a in ours:
        r = by[a]
        checks = []
        if rb is not None and rb.startup_cpu is not None and r.startup_cpu is not None:
            checks.append((r.startup_cpu < rb.startup_cpu,
                           f"start-up CPU {r.startup_cpu:.2f}s below RedBeat's {rb.startup_cpu:.2f}s"))
        else:
            checks.append((False, "start-up CPU below RedBeat's: not measured"))
        checks.append((r.peak_rss is not None and r.peak_rss <= TARGET_RSS,
                       f"peak RSS {common.num(r.peak_rss, '{:.0f}')} MiB <= {TARGET_RSS:.0f} MiB"))
        worst = r.stat("effective", max)
        checks.append((bool(r.changes) and r.seen == len(r.changes) and worst is not None and worst <= TARGET_CHANGE,
                       f"every change visible within {TARGET_CHANGE:.0f} s ({r.seen}/{len(r.changes)} seen, "
                       f"effective max {ms(worst)} ms)"))
        checks.append((r.idle_pct is not None and r.idle_pct <= TARGET_IDLE_CORE * 100,
                       f"idle CPU {common.num(r.idle_pct, '{:.3f}')}% of a core <= {TARGET_IDLE_CORE * 100:.0f}%"))
        for good, text in checks:
            ok &= good
            print(f"target {a}: {text} -> {'MET' if good else 'MISSED'}")

    notes = []
    for r in results:
        notes.append((r.label, f"stored with {r.load_how}" if r.load_how else "not stored"))
        if r.batch_times:
            notes.append((r.label, "add_many seconds per batch: " + ", ".join(f"{t:.1f}" for t in r.batch_times)))
        if r.kind == "ours" and r.changes and r.change_lines < 2 * len(r.changes):
            notes.append((r.label, f"{r.change_lines} 'schedule change' log line(s) for {2 * len(r.changes)} "
                                   f"changes (change + revert each)"))
        unseen = [c.name for c in r.changes if c.raw is None]
        if unseen:
            notes.append((r.label, f"no message within {args.change_timeout:.0f}s of the change: {', '.join(unseen)}"))
        others = sum(c.others for c in r.changes)
        if others:
            notes.append((r.label, f"{others} message(s) of other schedules while waiting for a changed one"))
        notes.extend((r.label, n) for n in r.notes)
    if notes:
        print()
        for label, n in notes:
            print(f"note {label}: {n}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedules", type=int, default=None, help="stored schedules (default 100000)")
    parser.add_argument("--idle", type=float, default=None, help="idle window in seconds (default 30)")
    parser.add_argument("--changes", type=int, default=None, help="change rounds per scheduler (default 5)")
    parser.add_argument("--settle", type=float, default=5.0,
                        help="seconds between the first tick and the idle window (default 5)")
    parser.add_argument("--sqlite", action="store_true", help="ours with SQLite claims instead of PostgreSQL")
    parser.add_argument("--batch", type=int, default=10000, help="schedules per add_many call (default 10000)")
    parser.add_argument("--redbeat-loop", type=float, default=1.0,
                        help="RedBeat's beat_max_loop_interval in seconds (default 1; Celery's default is 300)")
    parser.add_argument("--change-timeout", type=float, default=15.0,
                        help="give up on a change whose message does not come within this (default 15 s)")
    parser.add_argument("--startup-timeout", type=float, default=300.0,
                        help="give up on a beat whose first tick takes longer (default 300 s)")
    parser.add_argument("--load-timeout", type=float, default=900.0,
                        help="allowance for storing the schedules in the hard time limit (default 900 s)")
    parser.add_argument("--quick", action="store_true", help="10,000 schedules, 10 s idle window, 3 changes")
    common.add_common_args(parser, default_db=11)
    parser.set_defaults(schedulers=DEFAULT_SCHEDULERS)
    args = parser.parse_args()
    args.schedules = args.schedules or (10000 if args.quick else 100000)
    args.idle = args.idle or (10.0 if args.quick else 30.0)
    args.changes = args.changes if args.changes is not None else (3 if args.quick else 5)
    labels = common.selected(args.schedulers)
    if args.sqlite:
        labels = ["ours-sqlite" if n == "ours-pg" else n for n in labels]
    bad = [n for n in labels if n not in ALLOWED]
    if bad:
        raise SystemExit(f"{', '.join(bad)}: no run-time schedules; choose from {', '.join(ALLOWED)}")
    common.install_signal_handlers()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started with SIGINT ignored (a `&` job)

    now_hour = datetime.now(timezone.utc).hour
    hours = hours_away(now_hour)
    work = workload(args.schedules, hours)
    distinct = len({spec[1:] for spec in work})
    common.print_header(
        f"celery-cluster-beat dynamic benchmark: {args.schedules} schedules stored at run time",
        [f"schedulers: {', '.join(labels)} (one after another); broker, lease and RedBeat store: Redis DB "
         f"{args.redis_db} (flushed); no worker",
         f"schedules: daily cron, {distinct} distinct (minute x hours {hours[0]:02d}..{hours[-1]:02d} UTC except "
         f"{now_hour:02d} +-1 x {len(DOWS)} day-of-week sets), args=[i]",
         "ours: StoredSchedules.add_many, claims in " + ("a SQLite file" if "ours-sqlite" in labels else
                                                          "a scratch PostgreSQL database")
         + ", Redis lease on (broker's Redis); RedBeat: RedBeatSchedulerEntry.save(), redbeat_lock_timeout=5, "
           f"beat_max_loop_interval={args.redbeat_loop:g}"])
    results = []
    with common.redis_db(args.redis_db) as broker:
        for label in labels:
            results.append(run_one(label, args, broker, work))
    ok = report(results, args)
    print(f"\nload at end: {common.load()} (1/5/15-min load average)")
    return 0 if ok else 1


if __name__ == "__main__":
    common.run_main(main)
