"""Sustained load: 1,000 every-second entries for minutes, one real ``celery beat`` per scheduler.

    python benchmarks/bench_sustained.py [--minutes 5] [--entries 1000]
                                         [--schedulers ours-pg,plain-beat,redbeat]
                                         [--redis-db 14] [--quick] [--keep-logs]

Every entry fires every second: ``every(1)`` (from ``celery_cluster_beat``) for
ours, ``schedule=1.0`` for plain Celery beat and RedBeat, each entry with its own
``args=(i,)``. One beat process, a Redis broker, no worker: the messages pile up
in the app's queue and a drain thread in this process pops them continuously
(BRPOP, then RPOP batches of up to 1,000: oldest first, as kombu's consumer
does) and records for each message the wall time it was popped (its receive
time) and its identity, read from the message's headers. Schedulers run one
after another, never concurrently, on this machine.

The measuring window is [W0, W1): W0 = the first whole second at least 15 s
(the warm-up) after the process was spawned, W1 = W0 + ``--minutes``. Beat keeps
running 5 s after W1 so that late messages for occurrences inside the window
are still seen. Per scheduler it reports:

* due       - entries x window seconds (an every-second entry is due once in
              each second of the window)
* sent      - distinct occurrences received. Ours: distinct (cluster_beat_schedule,
              cluster_beat_scheduled_at) header pairs whose nominal instant is in
              the window. Plain beat / RedBeat send no nominal instant, so an
              occurrence is (entry, wall-clock second of receipt): the entry from
              the message's argsrepr header (its args), the second = floor(receive
              time), for messages received in the window. Two messages of one
              entry in one second count once (the second is an "extra")
* missed    - due - sent; for plain beat / RedBeat: how many fires short of one
              per entry per second they are
* msgs      - messages counted (ours: nominal instant in the window; others:
              received in the window); extra = msgs - sent (ours: duplicates)
* behind    - due - msgs: the messages still owed at the end of the window,
              also as seconds of schedule per entry (behind / entries)
* lateness  - receive time minus the nominal instant, of the first message of
              each occurrence: p50, p99, max. Ours: the nominal instant is the
              cluster_beat_scheduled_at header. Plain beat / RedBeat: the start of
              the wall-clock second the fire belongs to, i.e. the second it was
              received in, so their lateness is always below 1 s by construction
              and falling behind shows up as missed, not as lateness
* CPU       - beat's user+system CPU (psutil cpu_times) over the window, as % of
              one core
* RSS       - peak resident memory of beat (VmHWM at the end of the window)

Configurations: ours is ``celery_cluster_beat.Scheduler`` at its defaults with
claims in a scratch PostgreSQL database (``CCB_PG_URL``, dropped afterwards)
and the Redis lease on, in the broker's Redis (ttl 5 s); plain beat is
``celery.beat:PersistentScheduler`` with a fresh shelve file; RedBeat is
``redbeat.RedBeatScheduler`` with ``redbeat_redis_url`` = the broker's Redis, a
key prefix of its own, ``redbeat_lock_timeout=5`` and ``beat_max_loop_interval=1``
(its default lock of 5 x 300 s is meant for 5-minute loops; these are
bench_failover.py's "tuned" values). The Redis DB (``--redis-db``) is FLUSHED at
start, between schedulers and at the end. All beats log at INFO (plain beat and
RedBeat write one "Sending due task" line per message; that is part of their cost).

Targets for ours: nothing missed, p99 lateness at most 250 ms, CPU at most 60%
of one core. Exit status 1 when ours misses one. Each scheduler's run has a hard
time limit (SIGALRM); on it, Ctrl-C or an error, beat is killed, the queue and
keys flushed, the scratch database dropped and the temporary folder removed.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Dict, List, Optional, Tuple

sys.path.insert(0, str(Path(__file__).resolve().parent))

import redis  # noqa: E402

import common  # noqa: E402
from bench_burst import _entry_number  # noqa: E402  (argsrepr '(17,)' / '[17]' -> 17)
from common import log  # noqa: E402

WARMUP = 15.0  # seconds from spawning beat to the start of the measuring window
GRACE = 5.0  # beat keeps running this long after the window, for late messages of in-window occurrences
BATCH = 1000  # RPOP count per drained key
STARTUP_TIMEOUT = 60.0
STOP_AND_DRAIN = 90.0  # allowance in the hard limit for stopping beat, draining the rest, dropping the database
DEFAULT_SCHEDULERS = "ours-pg,plain-beat,redbeat"

TARGET_P99 = 0.250
TARGET_CPU_PCT = 60.0

#: Header fields read straight from the raw message (kombu's JSON envelope), without parsing all of it.
_RE_SCHEDULE = re.compile(rb'"cluster_beat_schedule"\s*:\s*"([^"]*)"')
_RE_AT = re.compile(rb'"cluster_beat_scheduled_at"\s*:\s*"([^"]*)"')
_RE_ARGSREPR = re.compile(rb'"argsrepr"\s*:\s*"([^"]*)"')


class RunTimeout(Exception):
    """One scheduler's run exceeded its hard time limit."""


# --------------------------------------------------------------------------- the broker drain
class Drain(threading.Thread):
    """Pops the app's queue (and kombu's priority sub-queues) continuously; one record per message.

    A record is (name, at, t): ours -> (cluster_beat_schedule, cluster_beat_scheduled_at, receive time);
    plain beat / RedBeat -> (argsrepr, None, receive time). Strings are interned: 300,000 records stay small.
    """

    def __init__(self, url: str, queue: str) -> None:
        super().__init__(daemon=True, name="drain")
        self.client = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=3)
        self.keys = [queue] + [f"{queue}\x06\x16{p}" for p in (3, 6, 9)]
        self.records: List[Tuple[str, Optional[str], float]] = []
        self.foreign = 0  # messages without an identity we can read
        self.errors = 0
        self.lock = threading.Lock()
        self.stopped = threading.Event()

    def _identity(self, raw: bytes) -> Tuple[Optional[str], Optional[str]]:
        m_name, m_at = _RE_SCHEDULE.search(raw), _RE_AT.search(raw)
        if m_name and m_at:
            return sys.intern(m_name.group(1).decode()), sys.intern(m_at.group(1).decode())
        m_args = _RE_ARGSREPR.search(raw)
        if m_args:
            return sys.intern(m_args.group(1).decode()), None
        try:  # unusual spacing: parse it all
            h = json.loads(raw)["headers"]
        except (ValueError, KeyError, TypeError):
            return None, None
        if h.get("cluster_beat_schedule") and h.get("cluster_beat_scheduled_at"):
            return sys.intern(h["cluster_beat_schedule"]), sys.intern(h["cluster_beat_scheduled_at"])
        return (sys.intern(str(h["argsrepr"])), None) if h.get("argsrepr") else (None, None)

    def _record(self, items: List[bytes], now: float) -> None:
        out = []
        foreign = 0
        for raw in items:
            name, at = self._identity(raw)
            if name is None:
                foreign += 1
            else:
                out.append((name, at, now))
        with self.lock:
            self.records.extend(out)
            self.foreign += foreign

    def _pop_batch(self) -> List[bytes]:
        pipe = self.client.pipeline(transaction=False)
        for key in self.keys:
            pipe.rpop(key, BATCH)
        out: List[bytes] = []
        for items in pipe.execute():
            if items:
                out.extend(items)
        return out

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                item = self.client.brpop(self.keys, timeout=1)
                if item is None:
                    continue
                first_t = time.time()
                more = self._pop_batch()
                more_t = time.time()
            except redis.RedisError:
                self.errors += 1
                self.stopped.wait(0.5)
                continue
            self._record([item[1]], first_t)
            if more:
                self._record(more, more_t)

    def stop(self) -> None:
        self.stopped.set()
        self.join(10)

    def finish(self, quiet: float = 1.0, limit: float = 30.0) -> None:
        """Stop the thread, then pop what is left until the lists stay empty for *quiet* s."""
        self.stop()
        deadline = time.monotonic() + limit
        empty_since = time.monotonic()
        try:
            while time.monotonic() < deadline and time.monotonic() - empty_since < quiet:
                items = self._pop_batch()
                if not items:
                    time.sleep(0.05)
                    continue
                empty_since = time.monotonic()
                self._record(items, time.time())
        except redis.RedisError:
            self.errors += 1
        finally:
            self.client.close()

    def count(self) -> int:
        with self.lock:
            return len(self.records)

    def snapshot(self) -> List[Tuple[str, Optional[str], float]]:
        with self.lock:
            return list(self.records)


# --------------------------------------------------------------------------- one scheduler
@dataclass
class Result:
    label: str
    kind: str
    entries: int
    seconds: int = 0
    window: Optional[Tuple[int, int]] = None  # (W0, W1) epoch seconds
    sent: int = 0
    messages: int = 0
    unexpected: int = 0  # messages of no known entry
    foreign: int = 0
    lateness: List[float] = field(default_factory=list)  # seconds, first message of each occurrence
    cpu_s: Optional[float] = None
    cpu_wall: Optional[float] = None
    peak_rss: Optional[float] = None
    load: Optional[float] = None
    per_entry: List[int] = field(default_factory=list)  # occurrences sent per entry in the window
    claims: Dict[str, int] = field(default_factory=dict)  # ours: claim-table status(reason) counts in the window
    spread: Optional[Tuple[float, float]] = None  # ours: medians over the seconds of (earliest, latest) lateness
    completed: bool = False
    notes: List[str] = field(default_factory=list)

    @property
    def due(self) -> int:
        return self.entries * self.seconds

    @property
    def missed(self) -> Optional[int]:
        return self.due - self.sent if self.completed else None

    @property
    def extra(self) -> int:
        return self.messages - self.sent

    @property
    def behind(self) -> Optional[int]:
        return self.due - self.messages if self.completed else None

    @property
    def cpu_pct(self) -> Optional[float]:
        if self.cpu_s is None or not self.cpu_wall:
            return None
        return 100.0 * self.cpu_s / self.cpu_wall

    def lat(self, p: float) -> Optional[float]:
        return pct(self.lateness, p)

    @property
    def lat_max(self) -> Optional[float]:
        return max(self.lateness) if self.lateness else None


def pct(values: List[float], p: float) -> Optional[float]:
    """Nearest-rank percentile (as chaos_soak.py)."""
    if not values:
        return None
    s = sorted(values)
    k = max(0, min(len(s) - 1, math.ceil(p / 100 * len(s)) - 1))
    return s[k]


def schedule_source(kind: str, entries: int) -> str:
    sched = "every(1)" if kind == "ours" else "1.0"
    return ('{"sust.%05d" % i: {"task": "t.record", "schedule": ' + sched + ', "args": (i,)} '
            f'for i in range({entries})}}')


def beat_conf(kind: str, broker: str, prefix: str) -> Dict[str, object]:
    conf: Dict[str, object] = {"timezone": "UTC"}
    if kind == "redbeat":
        conf.update(redbeat_redis_url=broker, redbeat_key_prefix=prefix, redbeat_lock_timeout=5,
                    beat_max_loop_interval=1)
    return conf


def _epoch(at: str, cache: Dict[str, Optional[float]]) -> Optional[float]:
    try:
        return cache[at]
    except KeyError:
        try:
            value = datetime.fromisoformat(at.replace("Z", "+00:00")).timestamp()
        except ValueError:
            value = None
        cache[at] = value
        return value


def analyse(res: Result, records: List[Tuple[str, Optional[str], float]]) -> None:
    w0, w1 = res.window
    first: Dict[tuple, float] = {}
    counts: Counter = Counter()
    per_entry: Counter = Counter()
    if res.kind == "ours":
        names = {"sust.%05d" % i for i in range(res.entries)}
        cache: Dict[str, Optional[float]] = {}
        for name, at, t in records:
            if at is None:
                res.unexpected += 1
                continue
            nominal = _epoch(at, cache)
            if nominal is None or name not in names:
                res.unexpected += 1
                continue
            if not w0 <= nominal < w1:
                continue
            key = (name, nominal)
            counts[key] += 1
            if key not in first or t < first[key]:
                first[key] = t
        res.lateness = [t - key[1] for key, t in first.items()]
        lo: Dict[float, float] = {}
        hi: Dict[float, float] = {}
        for (_name, nominal), t in first.items():
            late = t - nominal
            lo[nominal] = min(lo.get(nominal, late), late)
            hi[nominal] = max(hi.get(nominal, late), late)
        if lo:
            res.spread = (pct(list(lo.values()), 50), pct(list(hi.values()), 50))
    else:
        number: Dict[str, Optional[int]] = {}
        for argsrepr, _at, t in records:
            if argsrepr not in number:
                n = _entry_number(argsrepr)
                number[argsrepr] = n if n is not None and 0 <= n < res.entries else None
            n = number[argsrepr]
            if n is None:
                res.unexpected += 1
                continue
            if not w0 <= t < w1:
                continue
            key = (n, math.floor(t))
            counts[key] += 1
            if key not in first or t < first[key]:
                first[key] = t
        res.lateness = [t - key[1] for key, t in first.items()]
    res.sent = len(counts)
    res.messages = sum(counts.values())
    for key in counts:
        per_entry[key[0]] += 1
    res.per_entry = [per_entry.get(k, 0) for k in (
        ["sust.%05d" % i for i in range(res.entries)] if res.kind == "ours" else range(res.entries))]


def claim_counts(db_url: str, w0: int, w1: int) -> Dict[str, int]:
    """Ours: status (and reason, when not 'sent') of the claim rows whose instant is in the window."""
    import sqlalchemy as sa

    from celery_cluster_beat.store.schema import claims_table as c

    engine = sa.create_engine(db_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.select(c.c.status, c.c.reason, sa.func.count())
                .where(c.c.scheduled_at >= datetime.fromtimestamp(w0, timezone.utc),
                       c.c.scheduled_at < datetime.fromtimestamp(w1, timezone.utc))
                .group_by(c.c.status, c.c.reason)).all()
    finally:
        engine.dispose()
    out: Dict[str, int] = {}
    for status, reason, n in rows:
        key = status if status == "sent" or not reason else f"{status} ({reason[:60]})"
        out[key] = out.get(key, 0) + n
    return out


def scan_log(path: Path) -> Tuple[int, int, List[str]]:
    """(ERROR lines, WARNING lines, up to 3 distinct first ERROR/CRITICAL/Traceback lines) of a beat log."""
    errors = warnings = 0
    samples: List[str] = []
    try:
        with open(path, errors="replace") as fh:
            for line in fh:
                if "ERROR" in line or "CRITICAL" in line or line.startswith("Traceback"):
                    errors += 1
                    text = line.strip()[:160]
                    if len(samples) < 3 and text not in samples:
                        samples.append(text)
                elif "WARNING" in line:
                    warnings += 1
    except OSError:
        pass
    return errors, warnings, samples


def sleep_until(epoch: float, beat: common.Beat) -> bool:
    """Sleep until wall time *epoch*; False when beat exited meanwhile."""
    while True:
        left = epoch - time.time()
        if left <= 0:
            return True
        if not beat.proc.alive():
            return False
        time.sleep(min(left, 0.5))


def stop_beat(beat: common.Beat) -> None:
    """SIGTERM, then SIGKILL of its process group (common.Beat.stop); SIGKILL at once if interrupted meanwhile."""
    try:
        beat.stop()
    except BaseException:
        try:
            os.killpg(beat.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        raise


def run_one(label: str, args, broker: str) -> Result:
    scheduler, kind = common.SCHEDULERS[label]
    res = Result(label, kind, args.entries, seconds=args.seconds)
    limit = int(STARTUP_TIMEOUT + WARMUP + 1 + args.seconds + GRACE + STOP_AND_DRAIN)

    def on_alarm(signum, frame):
        raise RunTimeout(f"{label}: hard time limit of {limit} s reached")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(limit)
    try:
        with common.temp_dir(f"ccb-sustained-{label}-") as tmp, common.claims_db(label, tmp) as db_url:
            prefix = f"ccb-sustained-{label}:"
            app = common.write_app(tmp, broker=broker, kind=kind, db_url=db_url,
                                   schedule_src=schedule_source(kind, args.entries),
                                   conf=beat_conf(kind, broker, prefix))
            drain = Drain(broker, app.queue)
            drain.start()
            try:
                log(f"{label}: starting beat with {args.entries} every-second entries; window {args.seconds}s "
                    f"after a {WARMUP:.0f}s warm-up (hard limit {limit}s)")
                beat = common.start_beat(app, tmp, label, scheduler)
                try:
                    try:
                        ready = beat.wait_ready(timeout=STARTUP_TIMEOUT)
                    except RuntimeError as exc:
                        res.notes.append(str(exc).splitlines()[0])
                        log(str(exc))
                        ready = None
                    if ready is not None:
                        w0 = math.ceil(beat.started_wall + WARMUP)
                        if ready[1] > w0 - 2:  # slow start: keep 2 s between the first tick and the window
                            w0 = math.ceil(ready[1] + 2)
                            res.notes.append(f"first tick {ready[1] - beat.started_wall:.1f}s after spawn; "
                                             f"window starts {w0 - beat.started_wall:.1f}s after spawn")
                        w1 = w0 + args.seconds
                        res.window = (w0, w1)
                        if sleep_until(w0, beat):
                            c0, t0 = beat.cpu(), time.time()
                            last_progress = time.monotonic()
                            while time.time() < w1 and beat.proc.alive():
                                time.sleep(min(1.0, max(0.0, w1 - time.time())))
                                if time.monotonic() - last_progress >= 60 and w1 - time.time() > 1:
                                    last_progress = time.monotonic()
                                    log(f"{label}: {w1 - time.time():.0f}s of the window left; "
                                        f"{drain.count()} messages so far")
                            if beat.proc.alive():
                                c1, t1 = beat.cpu(), time.time()
                                res.cpu_s, res.cpu_wall = c1 - c0, t1 - t0
                                res.peak_rss = beat.peak_rss_mib()
                                res.load = common.load1()
                                res.completed = True
                                sleep_until(w1 + GRACE, beat)
                        if not beat.proc.alive():
                            res.notes.append(f"beat exited during the run ({beat.proc.popen.returncode})")
                finally:
                    signal.alarm(0)  # the clean-up below is bounded by its own timeouts
                    stop_beat(beat)
            finally:
                signal.alarm(0)
                drain.finish()
            res.foreign = drain.foreign
            if drain.errors:
                res.notes.append(f"drain: {drain.errors} Redis error(s)")
            if res.window is not None:
                analyse(res, drain.snapshot())
                if kind == "ours" and db_url:
                    try:
                        res.claims = claim_counts(db_url, *res.window)
                    except Exception as exc:  # a diagnostic only
                        res.notes.append(f"claim table not read: {exc}")
            errors, warnings, samples = scan_log(tmp / f"beat-{label}.log")
            if errors or warnings:
                res.notes.append(f"beat log: {errors} ERROR/Traceback line(s), {warnings} WARNING line(s)")
                res.notes.extend(f"  {s}" for s in samples)
            common.keep_logs(tmp, args.keep_logs)
            flush = redis.Redis.from_url(broker)  # the queue and the scheduler's keys, before the next one
            flush.flushdb()
            flush.close()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    log(f"{label}: sent {res.sent}/{res.due}, msgs {res.messages}, p99 lateness "
        f"{common.num(ms(res.lat(99)), '{:.0f}')} ms, CPU {common.num(res.cpu_pct, '{:.1f}')}% of a core")
    return res


# --------------------------------------------------------------------------- report
def ms(seconds: Optional[float]) -> Optional[float]:
    return None if seconds is None else seconds * 1000.0


def report(results: List[Result], args) -> bool:
    print(f"{args.entries} entries x every 1 s; window {args.seconds}s after a {WARMUP:.0f}s warm-up; "
          f"due = {args.entries} x {args.seconds} = {args.entries * args.seconds}")
    print()
    rows = []
    for r in results:
        behind = r.behind
        rows.append([
            r.label, r.due, r.sent, common.num(r.missed, "{}"),
            common.num(None if r.missed is None or not r.due else 100.0 * r.missed / r.due, "{:.1f}"),
            r.messages, r.extra, common.num(behind, "{}"),
            common.num(None if behind is None else behind / r.entries, "{:.1f}"),
            common.num(ms(r.lat(50)), "{:.0f}"), common.num(ms(r.lat(99)), "{:.0f}"),
            common.num(ms(r.lat_max), "{:.0f}"), common.num(r.cpu_pct, "{:.1f}"),
            common.num(r.peak_rss, "{:.0f}"), common.num(r.load),
        ])
    print(common.table(["scheduler", "due", "sent", "missed", "missed %", "msgs", "extra", "behind",
                        "behind s", "p50 ms", "p99 ms", "max ms", "CPU %core", "peak RSS MiB", "load"], rows))
    print()
    print("sent: distinct occurrences received - ours by (cluster_beat_schedule, cluster_beat_scheduled_at) with the")
    print("nominal instant in the window; plain beat / RedBeat by (entry from argsrepr, wall-clock second of receipt)")
    print("for messages received in the window. missed = due - sent; msgs = messages counted; extra = msgs - sent")
    print("(ours: duplicates; others: a 2nd fire of an entry within one second); behind = due - msgs, the messages")
    print("still owed at the end (behind s = behind / entries, seconds of schedule per entry).")
    print("Lateness = first receive - nominal instant. Ours: the instant in the cluster_beat_scheduled_at header.")
    print("Plain beat / RedBeat carry none: the nominal instant is the start of the wall-clock second the message")
    print("was received in, so their lateness is < 1000 ms by construction (it is the phase of their fires within")
    print("the second) and falling behind shows as missed, not as lateness. CPU: beat's user+system CPU (psutil)")
    print("over the window / window length; peak RSS = VmHWM; load = 1-min load average at the end of the window.")

    by = {r.label: r for r in results}
    ours = [o for o in ("ours-pg", "ours-sqlite") if o in by]
    others = [o for o in ("plain-beat", "redbeat") if o in by]
    if ours and others:
        print()
        print("Ratios (other / ours; > 1x is better for ours):")
        rows = []
        for a in ours:
            for b in others:
                ra, rb = by[a], by[b]
                rows.append([f"{b} / {a}", common.ratio(rb.lat(99), ra.lat(99)), common.ratio(rb.cpu_pct, ra.cpu_pct),
                             common.ratio(rb.missed, ra.missed) if ra.missed else
                             ("-" if rb.missed is None else f"{rb.missed} vs 0")])
        print(common.table(["pair", "p99 lateness", "CPU", "missed"], rows))
    if others:
        print()
        print("How far behind (window of %ds, %d entries):" % (args.seconds, args.entries))
        for b in others:
            r = by[b]
            if not r.completed:
                print(f"  {b}: run did not complete")
                continue
            low = min(r.per_entry) if r.per_entry else 0
            print(f"  {b}: missed {r.missed} of {r.due} ({100.0 * r.missed / r.due:.1f}%); still behind "
                  f"{r.behind} messages at the end ({r.behind / r.entries:.1f} s of schedule per entry); "
                  f"per entry {low}-{max(r.per_entry) if r.per_entry else 0} of {r.seconds} seconds fired")
        for a in ours:
            r = by[a]
            if r.completed:
                print(f"  {a}: missed {r.missed}; behind {r.behind}")

    ok = True
    if ours:
        print()
    for a in ours:
        r = by[a]
        checks = []
        checks.append((r.completed and r.missed == 0, f"nothing missed (missed {common.num(r.missed, '{}')})"))
        p99 = r.lat(99)
        checks.append((p99 is not None and p99 <= TARGET_P99,
                       f"p99 lateness {common.num(ms(p99), '{:.0f}')} ms <= {TARGET_P99 * 1000:.0f} ms"))
        checks.append((r.cpu_pct is not None and r.cpu_pct <= TARGET_CPU_PCT,
                       f"CPU {common.num(r.cpu_pct, '{:.1f}')}% of one core <= {TARGET_CPU_PCT:.0f}%"))
        for good, text in checks:
            ok &= good
            print(f"target {a}: {text} -> {'MET' if good else 'NOT MET'}")

    notes = []
    for r in results:
        if r.claims:
            notes.append((r.label, "claim rows in the window: " + ", ".join(
                f"{k} {v}" for k, v in sorted(r.claims.items(), key=lambda kv: -kv[1]))))
        if r.spread:
            notes.append((r.label, f"per second, the earliest of its {r.entries} occurrences arrived "
                                   f"{r.spread[0] * 1000:.0f} ms and the latest {r.spread[1] * 1000:.0f} ms after "
                                   f"the instant (medians over the seconds)"))
        if r.per_entry and r.label in ours:
            notes.append((r.label, f"occurrences sent per entry: {min(r.per_entry)}-{max(r.per_entry)} "
                                   f"of {r.seconds}"))
        if r.unexpected:
            notes.append((r.label, f"{r.unexpected} message(s) with no known entry / instant"))
        if r.foreign:
            notes.append((r.label, f"{r.foreign} message(s) without a readable identity"))
        notes.extend((r.label, n) for n in r.notes)
    if notes:
        print()
        for label, n in notes:
            print(f"note {label}: {n}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=None, help="length of the measuring window (default 5)")
    parser.add_argument("--entries", type=int, default=None, help="every-second entries (default 1000)")
    parser.add_argument("--quick", action="store_true", help="1-minute window, 200 entries")
    common.add_common_args(parser, default_db=14)
    parser.set_defaults(schedulers=DEFAULT_SCHEDULERS)
    args = parser.parse_args()
    args.minutes = args.minutes or (1.0 if args.quick else 5.0)
    args.entries = args.entries or (200 if args.quick else 1000)
    args.seconds = max(1, int(round(args.minutes * 60)))
    labels = common.selected(args.schedulers)
    common.install_signal_handlers()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started with SIGINT ignored (a `&` job)

    per_run = STARTUP_TIMEOUT + WARMUP + 1 + args.seconds + GRACE + STOP_AND_DRAIN
    expected = len(labels) * (WARMUP + args.seconds + GRACE + 10)
    configs = {
        "ours-pg": "celery_cluster_beat.Scheduler defaults, every(1); claims in a scratch PostgreSQL database; "
                   "lease on (broker's Redis, ttl 5 s)",
        "ours-sqlite": "celery_cluster_beat.Scheduler defaults, every(1); claims in a SQLite file; "
                       "lease on (broker's Redis, ttl 5 s)",
        "plain-beat": "celery.beat:PersistentScheduler, schedule=1.0, fresh shelve file",
        "redbeat": "redbeat.RedBeatScheduler, schedule=1.0, redbeat_lock_timeout=5, beat_max_loop_interval=1, "
                   "own key prefix",
    }
    common.print_header(
        f"celery-cluster-beat sustained benchmark: {args.entries} entries every second for {args.seconds}s",
        [f"schedulers : {', '.join(labels)} (one after another); broker: Redis DB {args.redis_db} (flushed); "
         f"no worker, the queue drained by this process"]
        + [f"{label:<11}: {configs[label]}" for label in labels]
        + [f"run        : warm-up {WARMUP:.0f}s, window {args.seconds}s, grace {GRACE:.0f}s per scheduler; about "
           f"{expected / 60:.0f} min in all; hard limit {per_run:.0f}s per scheduler"])
    results: List[Result] = []
    status = 0
    try:
        with common.redis_db(args.redis_db) as broker:
            for label in labels:
                results.append(run_one(label, args, broker))
    except RunTimeout as exc:
        log(f"{exc}; processes, Redis DB, database and temp files cleaned up")
        print(f"ABORTED: {exc}\n")
        status = 1
    if results:
        ok = report(results, args)
        status = status or (0 if ok else 1)
    print(f"\nload at end: {common.load()} (1/5/15-min load average)")
    return status


if __name__ == "__main__":
    common.run_main(main)
