"""Hostile input and scale on every surface at once: does an every-second schedule stay on time?

    python benchmarks/bench_hostile.py [--schedules 100000] [--seconds 120] [--clients 4] [--hostile 0.01]
                                       [--refused-rule CRON] [--redis-db 9] [--keep-logs]

Ours only: plain Celery beat and RedBeat have no status page, no ``/metrics`` per schedule,
no operator command line and no stored schedules, so there is nothing of theirs to compare.

One real ``celery beat -S celery_cluster_beat.Scheduler`` process: claims in a scratch
PostgreSQL database (dropped at the end), the Redis lease and broker in Redis database
``--redis-db`` (FLUSHED at start and end), ``cluster_beat_http_port`` set, one config entry
``tick`` = ``every(1)``. Before it starts, ``--schedules`` stored schedules are written in
batches through the claim store's own change (what ``StoredSchedules`` writes once it has
checked a definition, so the hostile share is written *past* the API's checks):

* 99 % ordinary reports: yearly crons (never due during the run), 0.5 % of all firing every
  minute (``--fire-rule``);
* 1 % hostile (``--hostile``), firing every 10 s (``--hostile-rule``): names with terminal
  escapes, a newline drawing a fake row, a bell (control characters: beat refuses to schedule
  those), bidi overrides and zero-width joiners (scheduled); descriptions of 30,000 ``:``,
  ``a:b@`` repeated, escapes and markup, and ``--megabyte`` of them 1 MB long (beat cuts those
  when it reads them: shown, never a reason to refuse the schedule); options with reserved headers (``task``, ``id``, ``lang``,
  our own ``cluster_beat_*``), ``serializer: pickle``, ``content_type``, ``link``,
  ``link_error``, ``task_id``, ``shadow``, ``reply_to`` (a quarter with none, so they are sent).

Then for ``--seconds``: ``--clients`` client processes load ``/``, ``/?q=`` with hostile
filters (SQL wildcards and quotes, markup, escapes, bidi, 255 and 256 characters, bad limits),
``/metrics`` and ``/healthz`` over keep-alive connections as fast as they are answered (a
filtered view the page cannot build now is answered ``503`` with ``Retry-After``, by design:
one view is built at a time, at most one every 2 s; the default view is never turned away); this
process polls ``/healthz`` on a fresh connection every 0.25 s (a liveness probe) and runs
``celery cluster-beat list``, ``status`` and ``history <hostile name>`` as real processes, one
after another, through a PostgreSQL role that may only SELECT (created in the scratch database).

Measured: from the claim rows of ``tick`` whose instant falls in the hammering window, the
lateness (``sent_at`` by the database's clock minus the instant) p50 / p99 / max and the
instants missed (no ``sent`` row); requests answered per kind and status, the worst latency of
each; CLI runs and their times; beat's CPU over the window and its RSS (now and peak). Checked:
every message on the broker carries the ``task`` and ``id`` headers beat gives it (the
schedule's task; the id of its claim row) and is JSON, with no callbacks; no hostile-option
schedule reached the broker and each that fell due is recorded ``failed`` with the reason; every
CLI read succeeded through the SELECT-only role (which a write, ``pause``, then proves cannot
write) and printed no raw control character. Targets: p99 lateness at most 0.5 s, nothing
missed, and every check above. Exit status 1 when one is missed. About 3 minutes for 100,000.

``--refused-rule "0 0 1 1 *"`` keeps the rows with refused options from falling due, to measure
everything else without their cost to the loop (their check then misses by construction).

``tests/ops/test_hostile_surfaces.py`` runs the same scenario, small, in the suite; it imports
the pieces from here.
"""
from __future__ import annotations

import argparse
import base64
import contextlib
import http.client
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import unicodedata
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for _p in (str(REPO), str(REPO / "tests"), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import redis  # noqa: E402
import sqlalchemy as sa  # noqa: E402
from sqlalchemy.engine import make_url  # noqa: E402

import procs  # noqa: E402  (tests/procs.py: app-module writer, process wrapper)
from celery_cluster_beat.schedules.text import parse_schedule_text  # noqa: E402
from celery_cluster_beat.store import ClaimStore  # noqa: E402

UTC = timezone.utc
#: The app module reads its claim database from here when set: the CLI reads get the SELECT-only role.
READ_URL_ENV = "CCB_HOSTILE_READ_URL"
TASK = "t.record"
TARGET_P99 = 0.5

#: Appended to a name (every third hostile row): beat refuses to schedule such a name; the CLI escapes it.
HOSTILE_NAME_TAILS = ("\x1b[2J\x1b[31m", "\nfake-row  t.record  every 1s  config  enabled", "\u202e",
                      "\u200d", "\r\x07")
HOSTILE_DESCRIPTIONS = (":" * 30_000, "a:b@" * 7_500, "\x1b[2J\x1b]0;owned\x07 <script>alert(1)</script>\u202e",
                        "xss:user:alice@example.com")
_LINK = {"task": "t.other", "args": [1], "kwargs": {}, "options": {}, "subtask_type": None, "immutable": False}
#: Options no stored schedule may set (config/options.py): each row with one is recorded failed, never sent.
HOSTILE_OPTIONS: Tuple[Dict[str, Any], ...] = (
    {"headers": {"task": "t.other", "id": "forged-id"}},
    {"serializer": "pickle"},
    {"link": _LINK},
    {"link_error": _LINK},
    {"headers": {"cluster_beat_schedule": "tick", "cluster_beat_scheduled_at": "2099-01-01T00:00:00+00:00"}},
    {"task_id": "forged-id"},
    {"shadow": "t.other"},
    {"reply_to": "elsewhere"},
    {"content_type": "application/x-python-serialize"},
    {"headers": {"lang": "rb", "root_id": "x", "parent_id": "y", "eta": "2099-01-01T00:00:00"}},
)
#: What the clients ask for: the page, hostile filters and limits (200 or 400), metrics, health.
CLIENT_PATHS = ("/", "/metrics", "/?q=hostile", "/healthz", "/?q=%25", "/?q=_", "/?q=%27%20OR%201%3D1%20--",
                "/?q=%3Cscript%3Ealert(1)%3C%2Fscript%3E", "/?q=%E2%80%AE", "/?q=" + "a" * 255,
                "/?q=" + "a" * 256, "/?q=%1B%5B2J", "/?limit=500", "/?limit=500&q=report", "/?limit=-1",
                "/?limit=99999999999999999999", "/?q=report:00042", "/?q=hostile:00000", "/?q=" + "%3A" * 255,
                "/?q=%00", "/?q=" + "%F0%9F%92%A5" * 100)

CLIENT = r"""
import http.client, json, sys, time
port, until, paths = int(sys.argv[1]), float(sys.argv[2]), json.loads(sys.argv[3])
stats = {}
conn = None
i = 0
begun = time.time()
while time.time() < until:
    path = paths[i % len(paths)]
    i += 1
    kind = "/?" if path.startswith("/?") else path
    s = stats.setdefault(kind, {"status": {}, "errors": 0, "max_s": 0.0, "max_bytes": 0, "n": 0, "gap_s": 0.0,
                                "last": begun})
    started = time.perf_counter()
    try:
        if conn is None:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        conn.request("GET", path)
        resp = conn.getresponse()
        body = resp.read()
        code = str(resp.status) + ("-busy" if resp.status == 503 and resp.getheader("Retry-After") else "")
        s["max_bytes"] = max(s["max_bytes"], len(body))
        if resp.getheader("Connection", "").lower() == "close":
            conn.close(); conn = None
    except Exception as exc:
        code = None
        s["errors"] += 1
        s.setdefault("error", repr(exc)[:200])
        if conn is not None:
            conn.close()
        conn = None
        time.sleep(0.05)
    took = time.perf_counter() - started
    s["n"] += 1
    s["max_s"] = max(s["max_s"], took)
    if code is not None and not code.startswith("5"):
        s["gap_s"] = max(s["gap_s"], time.time() - s["last"])
        s["last"] = time.time()
    if code is not None:
        s["status"][code] = s["status"].get(code, 0) + 1
for s in stats.values():
    s["gap_s"] = max(s["gap_s"], time.time() - s.pop("last"))
print(json.dumps(stats))
"""


def log(msg: str) -> None:
    sys.stderr.write(f"[{time.strftime('%H:%M:%S')}] {msg}\n")
    sys.stderr.flush()


# --------------------------------------------------------------------------- the stored schedules
@dataclass
class Plan:
    """The scenario's size and rules (the suite runs a small one)."""

    schedules: int = 100_000
    hostile: float = 0.01  # share of the schedules that is hostile
    fire_share: float = 0.005  # share of all schedules that are ordinary and fire on *fire_rule*
    fire_rule: str = "* * * * *"
    hostile_rule: str = "every 10s"
    refused_rule: Optional[str] = None  # the rows with refused options (None: hostile_rule)
    megabyte: int = 5  # hostile descriptions 1 MB long


@dataclass
class Stored:
    """What was written: hostile names by kind."""

    rows: int = 0
    #: Rows beat refuses to schedule: a control character in the name, a description over 65,535 characters.
    unschedulable: List[str] = field(default_factory=list)
    refused_options: List[str] = field(default_factory=list)  # schedulable, with options no stored row may set
    hostile_sent: List[str] = field(default_factory=list)  # schedulable, hostile description, no options
    megabyte: List[str] = field(default_factory=list)


def _row(name: str, schedule: str, zone: Optional[str], description: str, options: Dict[str, Any],
         owner: str, args: str) -> Dict[str, Any]:
    return dict(name=name, task=TASK, schedule=schedule, zone=zone, args=args, kwargs="{}",
                options=json.dumps(options), overlap=None, max_run_time=None, jitter=None, catchup=None,
                catchup_window=None, description=description, owner=owner, enabled=True)


def _zone(rule: str) -> Optional[str]:
    return None if rule.startswith("every") else "UTC"


def plan_rows(plan: Plan, now: datetime) -> Tuple[List[Dict[str, Any]], Stored]:
    """The rows to store: ordinary reports first, then the hostile share."""
    hostile = max(1, round(plan.schedules * plan.hostile))
    ordinary = plan.schedules - hostile
    every_nth = max(1, round(1 / plan.fire_share)) if plan.fire_share else 0
    rows: List[Dict[str, Any]] = []
    stored = Stored()
    for i in range(ordinary):
        if every_nth and i % every_nth == 0:
            rule = plan.fire_rule
        else:  # yearly, never in the current month: nothing of them falls due during the run
            month = 1 + i % 12
            month = month % 12 + 1 if month == now.month else month
            rule = f"{i % 60} {i % 24} {1 + i % 28} {month} *"
        rows.append(_row(f"report:{i:06d}", rule, _zone(rule), f"report number {i}", {}, f"user{i % 100}",
                         f"[{i}]"))
    for i in range(hostile):
        name = f"hostile:{i:05d}"
        if i % 3 == 2:
            name += HOSTILE_NAME_TAILS[(i // 3) % len(HOSTILE_NAME_TAILS)]
        options = HOSTILE_OPTIONS[i % len(HOSTILE_OPTIONS)] if i % 4 != 3 else {}
        description = HOSTILE_DESCRIPTIONS[i % len(HOSTILE_DESCRIPTIONS)]
        if i % 3 != 2 and len(stored.megabyte) < plan.megabyte:
            description = ":" * 1_000_000
            stored.megabyte.append(name)
        if any(unicodedata.category(ch) == "Cc" for ch in name):
            stored.unschedulable.append(name)  # beat refuses a control character in a name (1 MB of text it cuts)
        elif options:
            stored.refused_options.append(name)  # bidi and zero-width characters in a name are scheduled
        else:
            stored.hostile_sent.append(name)
        owner = "mallory\x1b[0m" if i % 2 else "mallory"
        rule = plan.refused_rule if plan.refused_rule and stored.refused_options[-1:] == [name] else plan.hostile_rule
        rows.append(_row(name, rule, _zone(rule), description, options, owner, "[]"))
    stored.rows = len(rows)
    return rows, stored


def store_rows(db_url: str, plan: Plan, batch: int = 10_000) -> Stored:
    """Write the plan's rows through the claim store's change (one transaction a batch)."""
    store = ClaimStore(db_url, node_id="bench-hostile-filler")
    store.open()
    try:
        rows, stored = plan_rows(plan, store.db_now())

        def next_fire(row: Dict[str, Any], now: datetime) -> Optional[datetime]:
            return parse_schedule_text(row["schedule"], row["zone"]).next_fire(now)

        for start in range(0, len(rows), batch):
            part = rows[start:start + batch]
            store.stored_change([r["name"] for r in part], lambda live, at, part=part: (part, []), next_fire)
        return stored
    finally:
        store.close()


# --------------------------------------------------------------------------- services and the beat
@contextlib.contextmanager
def read_only_role(admin_url: str) -> Iterator[str]:
    """A PostgreSQL login role that may SELECT the database's tables (as they are now) and nothing else."""
    url = make_url(admin_url)
    role = f"ccb_ro_{uuid.uuid4().hex[:10]}"
    engine = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql(f"CREATE ROLE {role} LOGIN")
            conn.exec_driver_sql(f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {role}")
        yield url.set(username=role, password=None).render_as_string(hide_password=False)
    finally:
        with engine.connect() as conn:
            conn.exec_driver_sql("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %(r)s",
                                 {"r": role})
            conn.exec_driver_sql(f"DROP OWNED BY {role}")
            conn.exec_driver_sql(f"DROP ROLE {role}")
        engine.dispose()


def write_app(tmp: Path, *, broker: str, db_url: str, redis_url: str, port: int) -> "procs.App":
    """The app: ``tick`` every second, the HTTP server on *port*; the CLI's claim database from the environment."""
    conf = (f"{{'cluster_beat_http_port': {port}, "
            f"'cluster_beat_db_url': os.environ.get({READ_URL_ENV!r}) or {db_url!r}}}")
    return procs.write_app(tmp, broker=broker, db_url=db_url, redis_url=redis_url,
                           schedule="{'tick': {'task': 't.record', 'schedule': every(1)}}", conf=conf)


def get(port: int, path: str, timeout: float = 10.0) -> Tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def first_sent(db_url: str, since: datetime) -> bool:
    return any(r.status == "sent" for r in claims(db_url, "tick", since))


def claims(db_url: str, schedule: Optional[str], since: datetime):
    store = ClaimStore(db_url, node_id="bench-hostile-reader")
    store.open()
    try:
        return store.claims(schedule, since)
    finally:
        store.close()


class ProcStat:
    """CPU seconds and RSS of one process, from /proc (Linux)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.tick = os.sysconf("SC_CLK_TCK")

    def cpu(self) -> float:
        with open(f"/proc/{self.pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / self.tick

    def mib(self, key: str) -> float:
        with open(f"/proc/{self.pid}/status") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 1024
        return float("nan")


# --------------------------------------------------------------------------- hammering
@dataclass
class Hammered:
    started: float = 0.0
    ended: float = 0.0
    #: kind -> statuses, errors, slowest answer, largest body, longest time without an answer (gap_s)
    requests: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    probes: int = 0
    probe_failures: List[str] = field(default_factory=list)
    probe_max_s: float = 0.0
    cli_runs: int = 0
    cli_failures: List[str] = field(default_factory=list)
    cli_raw_controls: int = 0  # raw control / format characters in what the CLI printed
    cli_times: Dict[str, List[float]] = field(default_factory=dict)

    def answered(self, kind: str, status: str) -> int:
        return self.requests.get(kind, {}).get("status", {}).get(status, 0)

    def bad_answers(self) -> List[str]:
        """Request kinds with errors or 5xx answers (but a filtered view's ``503 busy``, Retry-After given:
        one view is built at a time, and the default view is never turned away)."""
        out = []
        for kind, s in sorted(self.requests.items()):
            worse = {k: v for k, v in s["status"].items()
                     if k.startswith("5") and not (kind == "/?" and k == "503-busy")}
            if s["errors"] or worse:
                out.append(f"{kind}: {s['errors']} errors {s.get('error', '')} {worse}")
        return out


def raw_controls(text: str) -> int:
    """Characters a terminal acts on (control but newline, format, line separators) in *text*."""
    return sum(1 for ch in text if ch != "\n" and unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp"))


def hammer(port: int, seconds: float, clients: int, cli: Callable[[Sequence[str]], Tuple[int, str, str]],
           cli_commands: Sequence[Sequence[str]], cli_rounds: int = 0) -> Hammered:
    """*clients* client processes, a liveness probe thread, and CLI reads (here, one after another) for *seconds*.

    With *cli_rounds*, the CLI reads go on past the window until each of *cli_commands* ran that many
    times: a loaded machine may fit fewer in (one ``list`` of 5,000 rows can take 10 s there)."""
    out = Hammered(started=time.time())
    until = out.started + seconds
    procs_ = [subprocess.Popen([sys.executable, "-c", CLIENT, str(port), str(until), json.dumps(CLIENT_PATHS)],
                               stdout=subprocess.PIPE, text=True) for _ in range(clients)]
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set() and time.time() < until:
            started = time.perf_counter()
            try:
                status, body = get(port, "/healthz", timeout=10)
                if status != 200:
                    out.probe_failures.append(f"{time.time() - out.started:.1f}s: {status} {body[:80]!r}")
            except OSError as exc:
                out.probe_failures.append(f"{time.time() - out.started:.1f}s: {exc!r}")
            out.probe_max_s = max(out.probe_max_s, time.perf_counter() - started)
            out.probes += 1
            stop.wait(0.25)

    prober = threading.Thread(target=probe, name="healthz-probe", daemon=True)
    prober.start()
    try:
        i = 0
        while time.time() < until or i < cli_rounds * len(cli_commands):
            args = list(cli_commands[i % len(cli_commands)])
            i += 1
            started = time.perf_counter()
            rc, stdout, stderr = cli(args)
            out.cli_times.setdefault(args[0], []).append(time.perf_counter() - started)
            out.cli_runs += 1
            out.cli_raw_controls += raw_controls(stdout) + raw_controls(stderr)
            if rc != 0:
                out.cli_failures.append(f"{' '.join(map(repr, args))}: rc {rc}: {stderr.strip()[:300]}")
        for p in procs_:
            stats = json.loads(p.communicate(timeout=seconds + 120)[0] or "{}")
            for kind, s in stats.items():
                mine = out.requests.setdefault(kind, {"status": {}, "errors": 0, "max_s": 0.0, "max_bytes": 0,
                                                      "n": 0, "gap_s": 0.0})
                for code, n in s["status"].items():
                    mine["status"][code] = mine["status"].get(code, 0) + n
                mine["errors"] += s["errors"]
                if "error" in s:
                    mine.setdefault("error", s["error"])
                mine["n"] += s["n"]
                mine["max_s"] = max(mine["max_s"], s["max_s"])
                mine["max_bytes"] = max(mine["max_bytes"], s["max_bytes"])
                mine["gap_s"] = max(mine["gap_s"], s["gap_s"])
    finally:
        stop.set()
        prober.join(15)
        for p in procs_:
            if p.poll() is None:
                p.kill()
                p.wait(5)
    out.ended = time.time()
    return out


# --------------------------------------------------------------------------- what happened
@dataclass
class Lateness:
    due: int
    sent: int
    missed: List[datetime]
    late: List[Tuple[float, datetime]]  # (seconds, instant), sent ones, worst first

    def pct(self, p: float) -> float:
        values = sorted(s for s, _ in self.late)
        if not values:
            return float("nan")
        return values[min(len(values) - 1, max(0, round(p / 100 * len(values) + 0.5) - 1))]


def tick_lateness(db_url: str, start: float, end: float) -> Lateness:
    """The every-second entry over the whole seconds in [start, end): sent ones' lateness, and missed instants."""
    first = datetime.fromtimestamp(int(start) + 1, UTC)
    last = datetime.fromtimestamp(int(end), UTC)
    due = [first + timedelta(seconds=s) for s in range(int((last - first).total_seconds()))]
    rows = {r.scheduled_at: r for r in claims(db_url, "tick", first) if r.scheduled_at < last}
    late = sorted((((r.sent_at - at).total_seconds(), at) for at, r in rows.items()
                   if r.status == "sent" and r.sent_at is not None), reverse=True)
    missed = [at for at in due if at not in rows or rows[at].status != "sent"]
    return Lateness(len(due), len(late), missed, late)


@dataclass
class BrokerCheck:
    messages: int = 0
    by_schedule: Dict[str, int] = field(default_factory=dict)
    forged: List[str] = field(default_factory=list)
    refused_failed: int = 0  # hostile-option schedules with failed rows (and a reason)
    refused_due: int = 0  # hostile-option schedules that fell due (have any row)
    refused_problems: List[str] = field(default_factory=list)


def broker_check(app: "procs.App", db_url: str, stored: Stored, since: datetime,
                 keys: Optional[Sequence[str]] = None) -> BrokerCheck:
    """Every message on the broker (the app's queue, or every list of *keys*) against its claim row."""
    out = BrokerCheck()
    refused = set(stored.refused_options)
    client = redis.Redis.from_url(app.broker)
    try:
        raw: List[bytes] = []
        for key in keys or [app.queue]:
            raw.extend(client.lrange(key, 0, -1))
    finally:
        client.close()
    # Read after the messages: an occurrence's row is written (claimed) before it is published.
    rows = {(r.schedule, r.scheduled_at): r for r in claims(db_url, None, since)}
    for item in raw:
        try:
            msg = json.loads(item)
            h = msg["headers"]
        except (ValueError, KeyError, TypeError):
            out.forged.append(f"not a Celery message: {item[:100]!r}")
            continue
        name, at_text = h.get("cluster_beat_schedule"), h.get("cluster_beat_scheduled_at")
        out.messages += 1
        out.by_schedule[name] = out.by_schedule.get(name, 0) + 1
        problems = []
        if name in refused or name in stored.unschedulable:
            problems.append("a hostile-option or unschedulable schedule was sent")
        if h.get("task") != TASK:
            problems.append(f"task {h.get('task')!r}")
        if msg.get("content-type") != "application/json":
            problems.append(f"content-type {msg.get('content-type')!r}")
        try:
            at = datetime.fromisoformat(at_text.replace("Z", "+00:00")).astimezone(UTC)
            row = rows.get((name, at))
        except (AttributeError, ValueError):
            row = None
        if row is None or h.get("id") != row.task_id:
            problems.append(f"id {h.get('id')!r}, claim row {None if row is None else row.task_id!r}")
        if msg.get("properties", {}).get("correlation_id") != h.get("id"):
            problems.append("correlation_id differs from the id")
        try:
            body = json.loads(base64.b64decode(msg["body"]))
            embed = body[2]
            if embed.get("callbacks") or embed.get("errbacks") or embed.get("chain"):
                problems.append(f"callbacks {embed}")
        except (KeyError, ValueError, TypeError, IndexError) as exc:
            problems.append(f"body not JSON ({exc.__class__.__name__})")
        if problems:
            out.forged.append(f"{name!r} {at_text}: {'; '.join(problems)}")
    def ended(r: Any) -> bool:  # failed with the reason, or missed by the catch-up policy of a late pass
        return (r.status == "failed" and bool(r.reason) and "options" in r.reason) or \
            (r.status == "missed" and r.reason == "catchup")

    # A refused row's occurrence is claimed, then marked failed in the next transaction: a read
    # between the two sees it claimed. Such rows are read again for up to 10 s (a loaded machine);
    # one still claimed then, or sent, is a problem.
    deadline = time.monotonic() + 10
    while True:
        in_flight = [k for k, r in rows.items() if k[0] in refused and r.status == "claimed"]
        if not in_flight or time.monotonic() > deadline:
            break
        time.sleep(0.5)
        again = {(r.schedule, r.scheduled_at): r for r in claims(db_url, None, since) if r.schedule in refused}
        rows.update({k: again[k] for k in in_flight if k in again})
    per: Dict[str, List[Any]] = {}
    for (name, _), row in rows.items():
        if name in refused:
            per.setdefault(name, []).append(row)
    out.refused_due = len(per)

    for name, rs in sorted(per.items()):
        if all(ended(r) for r in rs) and any(r.status == "failed" for r in rs):
            out.refused_failed += 1
        else:
            bad = next((r for r in rs if not ended(r)), rs[0])
            out.refused_problems.append(f"{name}: {bad.status} {(bad.reason or '')[:120]!r}")
    return out


def log_counts(text: str) -> Dict[str, int]:
    return {"ERROR": text.count("ERROR/"), "WARNING": text.count("WARNING/"), "Traceback": text.count("Traceback"),
            "cannot be scheduled": text.count("cannot be scheduled")}


# --------------------------------------------------------------------------- the benchmark
def fmt_ms(s: float) -> str:
    return f"{s * 1000:.0f} ms"


def report(plan: Plan, stored: Stored, lat: Lateness, ham: Hammered, check: BrokerCheck, beat: Dict[str, float],
           write_refused: bool, logs: Dict[str, int]) -> List[str]:
    """Print the figures; the targets missed (empty: all met)."""
    window = ham.ended - ham.started
    print(f"stored schedules: {stored.rows:,} ({len(stored.refused_options)} with refused options, "
          f"{len(stored.unschedulable)} with control/format characters in the name, {len(stored.hostile_sent)} "
          f"hostile descriptions only, {len(stored.megabyte)} with a 1 MB description); ordinary ones firing on "
          f"{plan.fire_rule!r}: {round(plan.schedules * plan.fire_share)}; hostile ones on {plan.hostile_rule!r}"
          + (f", those with refused options on {plan.refused_rule!r}" if plan.refused_rule else ""))
    print(f"\ntick (every 1 s) over {window:.0f} s of hammering: due {lat.due}, sent {lat.sent}, missed "
          f"{len(lat.missed)}; lateness p50 {fmt_ms(lat.pct(50))}, p99 {fmt_ms(lat.pct(99))}, "
          f"max {fmt_ms(lat.pct(100))}")
    print("  worst: " + ", ".join(f"{at:%H:%M:%S} {fmt_ms(s)}" for s, at in lat.late[:5]))
    if lat.missed:
        print("  missed: " + ", ".join(f"{at:%H:%M:%S}" for at in lat.missed[:20]))
    print("\nrequests (all clients):")
    for kind, s in sorted(ham.requests.items()):
        statuses = ", ".join(f"{n:,} x {code}" for code, n in sorted(s["status"].items()))
        print(f"  {kind:9} {s['n']:>7,}  {statuses}; errors {s['errors']}; slowest {s['max_s']:.2f} s; "
              f"largest {s['max_bytes'] / 1e6:.3f} MB")
    print(f"  liveness probe /healthz every 0.25 s: {ham.probes} probes, {len(ham.probe_failures)} not 200, "
          f"slowest {ham.probe_max_s:.2f} s")
    cli_times = "; ".join(f"{k} x{len(v)} median {statistics.median(v):.1f} s, max {max(v):.1f} s"
                          for k, v in sorted(ham.cli_times.items()))
    print(f"CLI runs (real processes, SELECT-only role): {ham.cli_runs} ({cli_times}); failed "
          f"{len(ham.cli_failures)}; raw control characters printed {ham.cli_raw_controls}; a write (pause) "
          f"through the role {'refused' if write_refused else 'NOT REFUSED'}")
    print(f"beat: CPU {beat['cpu']:.1f} s over the window ({100 * beat['cpu'] / window:.0f} % of a core), "
          f"RSS {beat['rss']:.0f} MiB now, peak {beat['peak']:.0f} MiB; log: "
          + ", ".join(f"{k} {v}" for k, v in logs.items()))
    print(f"\nbroker: {check.messages:,} messages, of {len(check.by_schedule):,} schedules (tick "
          f"{check.by_schedule.get('tick', 0)}); forged task/id/serializer/callbacks: {len(check.forged)}")
    for line in check.forged[:10]:
        print(f"  FORGED {line}")
    print(f"hostile-option schedules: {check.refused_due} fell due, {check.refused_failed} recorded only "
          f"failed with the reason, none sent" if not check.refused_problems else
          f"hostile-option schedules: {len(check.refused_problems)} not recorded failed")
    for line in check.refused_problems[:10]:
        print(f"  {line}")
    missed_targets = []
    if not lat.pct(99) <= TARGET_P99:
        missed_targets.append(f"p99 lateness {fmt_ms(lat.pct(99))} > {fmt_ms(TARGET_P99)}")
    if lat.missed or lat.due == 0:
        missed_targets.append(f"{len(lat.missed)} of {lat.due} tick instants missed")
    if check.forged:
        missed_targets.append(f"{len(check.forged)} messages with a forged task/id/serializer")
    if check.refused_problems or not check.refused_due:
        missed_targets.append("hostile-option schedules not (all) recorded failed")
    if ham.cli_failures or ham.cli_raw_controls or not write_refused:
        missed_targets.append("CLI reads: " + "; ".join(ham.cli_failures[:3]))
    if ham.bad_answers() or ham.probe_failures or not ham.answered("/", "200"):
        missed_targets.append("HTTP: " + "; ".join(ham.bad_answers() + ham.probe_failures[:3]))
    return missed_targets


def run(args: argparse.Namespace) -> int:
    from bench_held_memory import redis_db  # the broker's Redis database, flushed before and after
    from bench_surfaces import scratch_db  # a scratch PostgreSQL database, dropped at the end

    plan = Plan(schedules=args.schedules, hostile=args.hostile, fire_rule=args.fire_rule,
                hostile_rule=args.hostile_rule, refused_rule=args.refused_rule, megabyte=args.megabyte)
    with redis_db(args.redis_db) as broker, scratch_db("postgresql") as db_url, \
            tempfile.TemporaryDirectory(prefix="ccb-hostile-") as tmp_name:
        tmp = Path(tmp_name)
        started = time.perf_counter()
        since = datetime.now(UTC).replace(microsecond=0)  # the rows' first instants follow their storing
        stored = store_rows(db_url, plan)
        log(f"stored {stored.rows:,} schedules in {time.perf_counter() - started:.1f} s")
        port = procs._free_port()
        app = write_app(tmp, broker=broker, db_url=db_url, redis_url=broker, port=port)
        beat = procs.start_beat(app, tmp, "hostile")
        try:
            procs.wait_for(lambda: first_sent(db_url, since), 120, interval=0.5, what="the first tick sent")
            stat = ProcStat(beat.pid)
            log("beat sends; hammering")
            with read_only_role(db_url) as ro_url:
                env = app.env(**{READ_URL_ENV: ro_url})

                def cli(cli_args: Sequence[str]) -> Tuple[int, str, str]:
                    r = subprocess.run([sys.executable, "-m", "celery", "-A", app.module, "cluster-beat",
                                        *cli_args], cwd=app.directory, env=env, capture_output=True, text=True,
                                       timeout=600)
                    return r.returncode, r.stdout, r.stderr

                cpu = stat.cpu()
                ham = hammer(port, args.seconds, args.clients, cli,
                             [["list"], ["status"], ["history", stored.hostile_sent[0]],
                              ["history", stored.unschedulable[0]]])
                cpu = stat.cpu() - cpu
                figures = {"cpu": cpu, "rss": stat.mib("VmRSS"), "peak": stat.mib("VmHWM")}
                write_refused = cli(["pause", "tick"])[0] != 0
            time.sleep(2.5)  # the window's last instants are marked sent
            lat = tick_lateness(db_url, ham.started, ham.ended)
            client = redis.Redis.from_url(broker)
            lists = [k.decode() for k in client.scan_iter(count=1000) if client.type(k) == b"list"]
            client.close()
            check = broker_check(app, db_url, stored, since, keys=lists)
            logs = log_counts(beat.log())
        finally:
            rc = beat.stop(timeout=15)
            log(f"beat exited with {rc}")
            if args.keep_logs:
                (Path.cwd() / "bench-logs").mkdir(exist_ok=True)
                (Path.cwd() / "bench-logs" / "beat-hostile.log").write_text(beat.log())
        missed = report(plan, stored, lat, ham, check, figures, write_refused, logs)
    print()
    for line in missed:
        print(f"TARGET MISSED: {line}")
    print("all targets met" if not missed else f"{len(missed)} target(s) missed")
    return 1 if missed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--schedules", type=int, default=100_000)
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--hostile", type=float, default=0.01)
    parser.add_argument("--fire-rule", default="* * * * *")
    parser.add_argument("--hostile-rule", default="every 10s")
    parser.add_argument("--refused-rule", default=None,
                        help="rule of the rows with refused options (default: --hostile-rule); a yearly cron "
                             "keeps them from falling due, to measure the rest without them")
    parser.add_argument("--megabyte", type=int, default=5)
    parser.add_argument("--redis-db", type=int, default=9, help="broker and lease database; FLUSHED at start and end")
    parser.add_argument("--keep-logs", action="store_true", help="copy beat's log to ./bench-logs/")
    args = parser.parse_args()
    title = "Hostile input on every surface: an every-second schedule while the page, /metrics and the CLI are hammered"
    print(title)
    print("=" * len(title))
    print(f"command : python {' '.join(sys.argv)}")
    print(f"date    : {time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
    print(f"machine : {platform.machine()}, {os.cpu_count()} CPUs, {platform.system()} {platform.release()}, "
          f"python {platform.python_version()}")
    print(f"load    : {'/'.join(f'{x:.2f}' for x in os.getloadavg())} (1/5/15-min load average at start)\n",
          flush=True)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
