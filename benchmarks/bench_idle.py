"""Idle: start-up cost, idle CPU and memory of one real ``celery beat`` with many idle entries.

    python benchmarks/bench_idle.py [--entries 20000] [--distinct 100] [--idle 30]
                                    [--schedulers ours-sqlite,ours-pg,plain-beat,redbeat]
                                    [--redis-db 13] [--quick] [--keep-logs]

The schedule has ``--entries`` entries whose cron expressions are drawn from
``--distinct`` different ones, all at hour H = (current UTC hour + 12) mod 24
(minutes 0-59, several day-of-week sets), so none falls due during the run.
Ours gets ``cron("m H * * dow")``, plain Celery beat and RedBeat
``crontab(minute=m, hour=H, day_of_week=dow)``. No worker runs. Schedulers
run one after another, never concurrently, on this machine.

Per scheduler it reports (psutil / /proc on the beat process):

* start-up CPU  - user+system CPU seconds of the beat process from exec until
                  its *first tick* has returned (time.process_time() written by
                  a beat_init hook in the generated app module): interpreter,
                  imports, the app module, the scheduler's set-up and first tick
* app import    - for reference, CPU of a bare ``python -c "import <app module>"``
                  (interpreter + Celery + building the beat_schedule dict): the
                  part of start-up that is the same whichever scheduler runs
* start-up wall - seconds from spawning the process to that first tick
* idle CPU      - CPU seconds used over ``--idle`` s, starting 1 s after the first tick
                  (summed from /proc/PID/task/*/schedstat: nanosecond resolution)
* RSS           - resident memory at the first tick and the peak (VmHWM) at the end

Ours uses its default Redis lease (the broker's Redis); claims in SQLite (a
file in the temp folder) or in a scratch PostgreSQL database. Plain beat is
``celery.beat:PersistentScheduler`` with a fresh shelve file; RedBeat keeps its
entries and lock in the same Redis DB, which (``--redis-db``) is FLUSHED at
start and at the end.

Targets for ours: start-up CPU at most 1/3 of plain beat's, idle CPU near zero
(at most 1% of one core), peak RSS at most 150 MiB. Exit status 1 when missed.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from common import log  # noqa: E402

SETTLE = 1.0
DOWS = ["*", "1-5", "0,6", "1", "2", "3", "4", "5", "6", "0", "1,3,5", "2,4"]
TARGET_STARTUP_FRACTION = 1 / 3
TARGET_IDLE_CORE = 0.01
TARGET_RSS = 150.0


@dataclass
class Result:
    label: str
    startup_cpu: Optional[float] = None
    startup_wall: Optional[float] = None
    import_cpu: Optional[float] = None
    idle_cpu: Optional[float] = None
    idle_seconds: Optional[float] = None
    rss_ready: Optional[float] = None
    peak_rss: Optional[float] = None
    load: Optional[float] = None
    notes: List[str] = field(default_factory=list)

    @property
    def idle_pct(self) -> Optional[float]:
        if self.idle_cpu is None or not self.idle_seconds:
            return None
        return 100.0 * self.idle_cpu / self.idle_seconds


def expressions(distinct: int, hour: int) -> List[tuple]:
    """(minute, hour, day_of_week) triples, all distinct."""
    out = []
    for k in range(distinct):
        dow = DOWS[(k // 60) % len(DOWS)]
        out.append((str(k % 60), str(hour), dow))
    if len(set(out)) != len(out):
        raise SystemExit(f"--distinct {distinct} is too large (at most {60 * len(DOWS)})")
    return out


def schedule_source(kind: str, entries: int, exprs: List[tuple]) -> str:
    if kind == "ours":
        sched = 'cron("%s %s * * %s" % X[i % len(X)])'
    else:
        sched = "crontab(minute=X[i % len(X)][0], hour=X[i % len(X)][1], day_of_week=X[i % len(X)][2])"
    return ('(lambda X: {"idle.%05d" % i: {"task": "t.record", "schedule": ' + sched + ', "args": (i,)} '
            f'for i in range({entries})}})({exprs!r})')


def import_cpu(app) -> Optional[float]:
    """CPU seconds of a bare interpreter that imports the app module (builds beat_schedule) and exits."""
    code = f"import time, {app.module} as m; m.app.conf.beat_schedule; print(time.process_time())"
    try:
        out = subprocess.run([sys.executable, "-c", code], cwd=app.directory, env=app.env(), capture_output=True,
                             text=True, timeout=120, check=True)
        return float(out.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, ValueError, IndexError) as exc:
        log(f"app import reference failed: {exc}")
        return None


def run_one(label: str, args, broker: str, exprs: List[tuple]) -> Result:
    scheduler, kind = common.SCHEDULERS[label]
    res = Result(label)
    with common.temp_dir(f"ccb-idle-{label}-") as tmp, common.claims_db(label, tmp) as db_url:
        app = common.write_app(tmp, broker=broker, kind=kind, db_url=db_url,
                               schedule_src=schedule_source(kind, args.entries, exprs), conf={"timezone": "UTC"})
        res.import_cpu = import_cpu(app)
        log(f"{label}: starting beat with {args.entries} idle entries")
        beat = common.start_beat(app, tmp, label, scheduler)
        try:
            cpu, wall = beat.wait_ready(timeout=args.startup_timeout)
            res.startup_cpu = cpu
            res.startup_wall = wall - beat.started_wall
            res.rss_ready = beat.rss_mib()
            time.sleep(SETTLE)
            c0, t0 = beat.cpu_precise(), time.monotonic()
            time.sleep(args.idle)
            c1, t1 = beat.cpu_precise(), time.monotonic()
            res.idle_cpu, res.idle_seconds = c1 - c0, t1 - t0
            res.load = common.load1()
            res.peak_rss = beat.peak_rss_mib()
            if not beat.proc.alive():
                res.notes.append(f"beat exited during the idle window ({beat.proc.popen.returncode})")
            text = beat.proc.log()
            sent = text.count("Sending due task") + text.count("occurrence(s) (")
            if sent:
                res.notes.append(f"{sent} send line(s) in the log: something fell due during the run")
        except RuntimeError as exc:
            res.notes.append(str(exc).splitlines()[0])
            log(str(exc))
        finally:
            beat.stop()
        common.keep_logs(tmp, args.keep_logs)
    import redis

    client = redis.Redis.from_url(broker)
    client.flushdb()
    client.close()
    log(f"{label}: start-up CPU {common.num(res.startup_cpu)}s, idle CPU {common.num(res.idle_cpu, '{:.3f}')}s, "
        f"peak RSS {common.num(res.peak_rss, '{:.0f}')} MiB")
    return res


def report(results: List[Result], args) -> bool:
    print(f"{args.entries} idle entries ({args.distinct} distinct cron expressions); idle window {args.idle:.0f}s")
    print()
    rows = [[r.label, common.num(r.startup_cpu), common.num(r.import_cpu),
             common.num(None if r.startup_cpu is None or r.import_cpu is None else r.startup_cpu - r.import_cpu),
             common.num(r.startup_wall), common.num(r.idle_cpu, "{:.4f}"), common.num(r.idle_pct, "{:.3f}"),
             common.num(r.rss_ready, "{:.0f}"), common.num(r.peak_rss, "{:.0f}"), common.num(r.load)] for r in results]
    print(common.table(["scheduler", "start-up CPU s", "app import CPU s", "beyond import s", "start-up wall s",
                        "idle CPU s", "idle %core", "RSS ready MiB", "peak RSS MiB", "load"], rows))
    print()
    print("start-up CPU: process CPU (user+sys) from exec until beat's first tick returned, read in-process;")
    print("app import CPU: a bare interpreter importing the same app module (the cost every scheduler shares);")
    print(f"idle CPU: over {args.idle:.0f}s starting {SETTLE:.0f}s after the first tick; peak RSS = VmHWM at the end;")
    print("load: 1-min load average at the end of the idle window (other work on the machine skews start-up CPU).")

    by = {r.label: r for r in results}
    ours = [o for o in ("ours-sqlite", "ours-pg") if o in by]
    others = [o for o in ("plain-beat", "redbeat") if o in by]
    if ours and others:
        print()
        print("Ratios (other / ours; > 1x is better for ours):")
        rows = []
        for a in ours:
            for b in others:
                ra, rb = by[a], by[b]
                beyond_a = None if ra.startup_cpu is None or ra.import_cpu is None else ra.startup_cpu - ra.import_cpu
                beyond_b = None if rb.startup_cpu is None or rb.import_cpu is None else rb.startup_cpu - rb.import_cpu
                rows.append([f"{b} / {a}", common.ratio(rb.startup_cpu, ra.startup_cpu),
                             common.ratio(beyond_b, beyond_a), common.ratio(rb.startup_wall, ra.startup_wall),
                             common.ratio(rb.idle_cpu, ra.idle_cpu), common.ratio(rb.peak_rss, ra.peak_rss, 2)])
        print(common.table(["pair", "start-up CPU", "beyond import", "start-up wall", "idle CPU", "peak RSS"], rows))

    ok = True
    plain = by.get("plain-beat")
    if ours:
        print()
    for a in ours:
        r = by[a]
        checks = []
        if plain is not None and plain.startup_cpu and r.startup_cpu is not None:
            good = r.startup_cpu <= plain.startup_cpu * TARGET_STARTUP_FRACTION
            checks.append((good, f"start-up CPU {r.startup_cpu:.2f}s <= 1/3 of plain beat's {plain.startup_cpu:.2f}s"))
        if r.idle_pct is not None:
            checks.append((r.idle_pct <= TARGET_IDLE_CORE * 100,
                           f"idle CPU {r.idle_pct:.2f}% of a core <= {TARGET_IDLE_CORE * 100:.0f}%"))
        if r.peak_rss is not None:
            checks.append((r.peak_rss <= TARGET_RSS, f"peak RSS {r.peak_rss:.0f} MiB <= {TARGET_RSS:.0f} MiB"))
        if not checks:
            checks.append((False, "not measured"))
        for good, text in checks:
            ok &= good
            print(f"target {a}: {text} -> {'MET' if good else 'MISSED'}")
    notes = [(r.label, n) for r in results for n in r.notes]
    if notes:
        print()
        for label, n in notes:
            print(f"note {label}: {n}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", type=int, default=None, help="idle entries (default 20000)")
    parser.add_argument("--distinct", type=int, default=100, help="distinct cron expressions (default 100)")
    parser.add_argument("--idle", type=float, default=None, help="idle window in seconds (default 30)")
    parser.add_argument("--startup-timeout", type=float, default=180.0,
                        help="give up on a scheduler whose first tick takes longer (default 180 s)")
    parser.add_argument("--quick", action="store_true", help="5,000 entries, 10 s idle window")
    common.add_common_args(parser, default_db=13)
    args = parser.parse_args()
    args.entries = args.entries or (5000 if args.quick else 20000)
    args.idle = args.idle or (10.0 if args.quick else 30.0)
    labels = common.selected(args.schedulers)
    common.install_signal_handlers()
    hour = (datetime.now(timezone.utc).hour + 12) % 24
    exprs = expressions(args.distinct, hour)

    common.print_header(
        f"celery-cluster-beat idle benchmark: {args.entries} idle entries",
        [f"schedulers: {', '.join(labels)} (one after another); broker: Redis DB {args.redis_db} (flushed); "
         f"no worker; every entry at {hour:02d}:mm UTC, {args.distinct} distinct expressions"])
    results = []
    with common.redis_db(args.redis_db) as broker:
        for label in labels:
            results.append(run_one(label, args, broker, exprs))
    ok = report(results, args)
    print(f"\nload at end: {common.load()} (1/5/15-min load average)")
    return 0 if ok else 1


if __name__ == "__main__":
    common.run_main(main)
