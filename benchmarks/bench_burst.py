"""Burst: N entries all due on the same minute, one real ``celery beat`` per scheduler.

    python benchmarks/bench_burst.py [--entries 5000] [--window 120] [--lead 40]
                                     [--schedulers ours-sqlite,ours-pg,plain-beat,redbeat]
                                     [--redis-db 12] [--quick] [--keep-logs]

Every entry fires at minute M of the hour (``cron("M * * * *")`` for ours,
``crontab(minute=M)`` for plain Celery beat and RedBeat), M being the first
minute boundary at least ``--lead`` seconds after the process is started, so
start-up is over before the burst. Each entry has its own ``args=(i,)``. No
worker runs: the benchmark polls LLEN of the app's queue on the Redis broker
every 50 ms, then reads every message (headers included) to count duplicates.
Schedulers run one after another, never concurrently, on this machine.

Per scheduler it reports:

* sent      - distinct entries queued within ``--window`` s after the minute
* dups      - messages beyond one per entry (ours: by the cluster_beat_schedule +
              cluster_beat_scheduled_at headers and by args; others: by args)
* first/last- seconds from the nominal minute to the poll that first saw the
              first / the final message (50 ms resolution)
* msgs/s    - sent / last, i.e. throughput counted from the moment they were due
* CPU       - CPU seconds the beat process used from the minute to the end of the burst
* ready     - seconds before the minute at which beat's first tick had returned

Ours runs with SQLite claims (the embedded default, file in the temp folder)
and with PostgreSQL claims (a scratch database), both with the default Redis
lease in the broker's Redis. Plain beat is ``celery.beat:PersistentScheduler``
(shelve file in the temp folder); RedBeat keeps its entries and lock in the
same Redis DB. That DB (``--redis-db``) is FLUSHED at start and at the end.

Targets for ours: all N sent exactly once, the last one within 2 s of the minute and
within 0.15x of RedBeat's time to its last message in the same run.
Exit status 1 when ours misses it.
"""
from __future__ import annotations

import argparse
import ast
import math
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

import redis  # noqa: E402

import common  # noqa: E402
from common import log  # noqa: E402

POLL = 0.05
SETTLE = 5.0  # once every entry is queued, keep watching this long for duplicates
TARGET_LAST = 2.0
TARGET_SHARE_OF_REDBEAT = 0.15  # ours' last message at most this share of RedBeat's, same run


@dataclass
class Result:
    label: str
    entries: int
    sent: int = 0
    messages: int = 0
    dups: int = 0
    unexpected: int = 0
    first: Optional[float] = None
    last: Optional[float] = None
    ready_before: Optional[float] = None
    cpu_burst: Optional[float] = None
    peak_rss: Optional[float] = None
    early: int = 0
    load: Optional[float] = None
    notes: List[str] = field(default_factory=list)

    @property
    def rate(self) -> Optional[float]:
        if not self.sent or self.last is None:
            return None
        return self.sent / max(self.last, POLL)

    @property
    def exactly_once(self) -> bool:
        return self.sent == self.entries and self.dups == 0 and self.unexpected == 0


def schedule_source(kind: str, entries: int, minute: int) -> str:
    sched = f'cron("{minute} * * * *")' if kind == "ours" else f"crontab(minute={minute})"
    return ('{"burst.%05d" % i: {"task": "t.record", "schedule": ' + sched + ', "args": (i,)} '
            f'for i in range({entries})}}')


def next_minute(lead: float) -> float:
    return math.ceil((time.time() + lead) / 60.0) * 60.0


def _entry_number(argsrepr) -> Optional[int]:
    """The entry's number from the message's argsrepr header: '(17,)' (Celery) or '[17]' (RedBeat)."""
    try:
        value = ast.literal_eval(argsrepr)
        return int(value[0])
    except (ValueError, SyntaxError, TypeError, IndexError):
        return None


def count_messages(res: Result, app, kind: str, minute_epoch: float) -> None:
    msgs = app.queued_messages()
    res.messages = len(msgs)
    by_args: Dict[str, int] = {}
    by_occ: Dict[tuple, int] = {}
    want_at = datetime.fromtimestamp(minute_epoch, timezone.utc).replace(tzinfo=None).isoformat() + "Z"
    expected = set(range(res.entries))
    for m in msgs:
        h = m.get("headers", {})
        a = _entry_number(h.get("argsrepr"))
        by_args[a] = by_args.get(a, 0) + 1
        if a not in expected:
            res.unexpected += 1
        if kind == "ours":
            key = (h.get("cluster_beat_schedule"), h.get("cluster_beat_scheduled_at"))
            by_occ[key] = by_occ.get(key, 0) + 1
            if key[1] != want_at:
                res.unexpected += 1
    res.sent = len(set(by_args) & expected)
    res.dups = sum(n - 1 for n in by_args.values())
    if kind == "ours":
        occ_dups = sum(n - 1 for n in by_occ.values())
        if occ_dups != res.dups:
            res.notes.append(f"header duplicates {occ_dups} != args duplicates {res.dups}")
        res.dups = max(res.dups, occ_dups)


def run_one(label: str, args, broker: str, tmp_root: Path) -> Result:
    scheduler, kind = common.SCHEDULERS[label]
    res = Result(label, args.entries)
    with common.temp_dir(f"ccb-burst-{label}-") as tmp, common.claims_db(label, tmp) as db_url:
        minute_epoch = next_minute(args.lead)
        minute = datetime.fromtimestamp(minute_epoch, timezone.utc).minute
        app = common.write_app(tmp, broker=broker, kind=kind, db_url=db_url,
                               schedule_src=schedule_source(kind, args.entries, minute),
                               conf={"timezone": "UTC"})
        client = redis.Redis.from_url(broker)
        log(f"{label}: {args.entries} entries due at {time.strftime('%H:%M:%S', time.gmtime(minute_epoch))} UTC "
            f"(in {minute_epoch - time.time():.0f}s)")
        beat = common.start_beat(app, tmp, label, scheduler)
        try:
            try:
                beat.wait_ready(timeout=max(1.0, minute_epoch - time.time() - 2))
            except RuntimeError as exc:  # not ready 2 s before the minute: watch anyway, say so below
                log(str(exc))
                if not beat.proc.alive():
                    res.notes.append(str(exc).splitlines()[0])
            cpu_at_minute = None
            count = 0
            last_change = None
            deadline = minute_epoch + args.window
            while True:
                now = time.time()
                if now >= deadline or not beat.proc.alive():
                    break
                if cpu_at_minute is None and now >= minute_epoch:
                    cpu_at_minute = beat.cpu()
                    res.load = common.load1()
                n = client.llen(app.queue)
                t = time.time() - minute_epoch
                if n != count:
                    if t < 0:
                        res.early = n
                    if count == 0 and n:
                        res.first = t
                    count, last_change = n, t
                    res.last = t
                if count >= args.entries and last_change is not None and t - last_change >= SETTLE:
                    break
                time.sleep(POLL if now >= minute_epoch - 2 else 0.5)
            if cpu_at_minute is not None:
                # burst CPU: from the minute to the end of watching, minus the SETTLE tail (near-idle)
                res.cpu_burst = beat.cpu() - cpu_at_minute
            res.peak_rss = beat.peak_rss_mib()
            ready = beat.ready()
            if ready is None:
                res.notes.append("beat never finished its first tick")
            else:
                res.ready_before = minute_epoch - ready[1]
                if res.ready_before < 0:
                    res.notes.append(f"first tick returned {-res.ready_before:.1f}s AFTER the minute")
            if not beat.proc.alive():
                res.notes.append(f"beat exited early ({beat.proc.popen.returncode})")
        finally:
            beat.stop()
            client.close()
        count_messages(res, app, kind, minute_epoch)
        if res.early:
            res.notes.append(f"{res.early} message(s) queued BEFORE the minute")
        common.keep_logs(tmp, args.keep_logs)
        # empty the queue and scheduler keys before the next scheduler runs
        flush = redis.Redis.from_url(broker)
        flush.flushdb()
        flush.close()
    log(f"{label}: sent {res.sent}/{res.entries}, dups {res.dups}, last at {common.num(res.last)}s")
    return res


def report(results: List[Result], args) -> bool:
    rows = []
    for r in results:
        rows.append([
            r.label, f"{r.sent}/{r.entries}", r.messages, r.dups,
            common.num(r.first), common.num(r.last), common.num(r.rate, "{:.0f}"),
            common.num(r.cpu_burst), common.num(r.peak_rss, "{:.0f}"), common.num(r.ready_before, "{:.1f}"),
            "yes" if r.exactly_once else "NO", common.num(r.load),
        ])
    print(f"Burst of {args.entries} entries due on one minute; window {args.window:.0f}s after the minute")
    print()
    print(common.table(
        ["scheduler", "sent", "msgs", "dups", "first s", "last s", "msgs/s", "CPU s", "RSS MiB", "ready s",
         "exactly once", "load"], rows))
    print()
    print("first/last s: from the nominal minute to the LLEN poll (every 50 ms) that saw the first/final message;")
    print("msgs/s = sent / last s; CPU s = beat process CPU from the minute to the end of watching (incl. the")
    print(f"{SETTLE:.0f}s watched for duplicates after the last message); RSS = peak (VmHWM); ready s = how long before")
    print("the minute beat's first tick had returned; load = 1-min load average at the minute (2 CPUs here means")
    print("anything above ~1 is other work competing with beat).")

    by = {r.label: r for r in results}
    others = [o for o in ("plain-beat", "redbeat") if o in by]
    ours = [o for o in ("ours-sqlite", "ours-pg") if o in by]
    if ours and others:
        print()
        print("Ratios (ours vs the others; > 1x is better for ours):")
        rows = []
        for a in ours:
            for b in others:
                ra, rb = by[a], by[b]
                rows.append([f"{a} vs {b}", common.ratio(ra.sent, rb.sent, 2), common.ratio(rb.last, ra.last),
                             common.ratio(ra.rate, rb.rate), common.ratio(rb.cpu_burst, ra.cpu_burst)])
        print(common.table(["pair", "sent ratio", "last-msg speed-up", "msgs/s ratio", "CPU saving"], rows))

    ok = True
    if ours:
        print()
        for a in ours:
            r = by[a]
            good = r.exactly_once and r.last is not None and r.last <= TARGET_LAST
            ok &= good
            print(f"target {a}: all {r.entries} sent exactly once, last within {TARGET_LAST:.0f}s of the minute -> "
                  f"{'MET' if good else 'MISSED'} (sent {r.sent}, dups {r.dups}, last {common.num(r.last)}s)")
            rb = by.get("redbeat")
            if rb is not None and rb.last is not None and r.last is not None and rb.sent == rb.entries:
                share = r.last / rb.last
                ok &= share <= TARGET_SHARE_OF_REDBEAT
                print(f"target {a}: last message within {TARGET_SHARE_OF_REDBEAT:g}x RedBeat's in this run -> "
                      f"{'MET' if share <= TARGET_SHARE_OF_REDBEAT else 'MISSED'} ({share:.3f}x: "
                      f"{common.num(r.last)}s vs {common.num(rb.last)}s)")
    notes = [(r.label, n) for r in results for n in r.notes]
    if notes:
        print()
        for label, n in notes:
            print(f"note {label}: {n}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", type=int, default=None, help="entries due on the minute (default 5000)")
    parser.add_argument("--window", type=float, default=None, help="seconds watched after the minute (default 120)")
    parser.add_argument("--lead", type=float, default=None,
                        help="minimum seconds between starting beat and the minute (default 40)")
    parser.add_argument("--quick", action="store_true", help="1,000 entries, 60 s window, 30 s lead")
    common.add_common_args(parser, default_db=12)
    args = parser.parse_args()
    args.entries = args.entries or (1000 if args.quick else 5000)
    args.window = args.window or (60.0 if args.quick else 120.0)
    args.lead = args.lead or (30.0 if args.quick else 40.0)
    labels = common.selected(args.schedulers)
    common.install_signal_handlers()

    common.print_header(
        f"celery-cluster-beat burst benchmark: {args.entries} entries due on the same minute",
        [f"schedulers: {', '.join(labels)} (one after another); broker: Redis DB {args.redis_db} (flushed); "
         f"no worker"])
    results = []
    with common.redis_db(args.redis_db) as broker, common.temp_dir("ccb-burst-") as tmp_root:
        for label in labels:
            results.append(run_one(label, args, broker, tmp_root))
    ok = report(results, args)
    print(f"\nload at end: {common.load()} (1/5/15-min load average)")
    return 0 if ok else 1


if __name__ == "__main__":
    common.run_main(main)
