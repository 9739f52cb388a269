"""Operator surfaces at scale: ``/metrics`` and the status page of beat's HTTP server with 100,000 stored schedules.

    python benchmarks/bench_surfaces.py [--schedules 100000] [--dialects sqlite,postgresql] [--hammer 10] [--clients 3]

Ours only (plain beat and RedBeat serve neither). Everything runs in this process,
through the same calls beat makes (:func:`celery_cluster_beat.ops.http.start_beat_server`),
against a real claim store, and is read over real HTTP:

* ``/metrics``: the server's metrics are fed one ``occurrence_handled`` (sent, 50 ms late)
  for each of ``--schedules`` distinct stored schedules, as a leader sending each of them
  once would; then the size of the exposition and the time of one scrape. Then churn: those
  schedules are removed (beat tells the metrics, :meth:`ClusterBeatMetrics.schedule_gone`,
  where that exists) and as many new ones fire: the exposition must not grow.
* the status page: ``--schedules`` stored schedules are written in bulk into a scratch
  claim database per dialect (a SQLite file, a scratch PostgreSQL database dropped at the
  end), each with one claimed-and-sent occurrence, 1 % of them missed instead; then the time and
  size of the first page load, of a cached one, and of a filtered one (``?q=``), and
  ``--clients`` client processes loading the page as fast as they can for ``--hammer``
  seconds: pages served and this process's CPU meanwhile (the server's cost: the clients
  are other processes).

Prints one line a figure. Peak RSS is this process's (metrics and page together).
"""
from __future__ import annotations

import argparse
import contextlib
import http.client
import resource
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Iterator, List, Tuple

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from celery import Celery  # noqa: E402

from celery_cluster_beat import signals  # noqa: E402
from celery_cluster_beat.config import load_settings  # noqa: E402
from celery_cluster_beat.ops.http import start_beat_server  # noqa: E402
from celery_cluster_beat.schedules.occurrence import Occurrence  # noqa: E402
from celery_cluster_beat.store import ClaimStore  # noqa: E402

MB = 1e6

CLIENT = """
import http.client, sys, time
port, until, path = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
n = 0
conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
while time.time() < until:
    conn.request("GET", path)
    resp = conn.getresponse()
    resp.read()
    n += resp.status == 200
print(n)
"""


def log(msg: str) -> None:
    sys.stderr.write(f"[{time.strftime('%H:%M:%S')}] {msg}\n")
    sys.stderr.flush()


@contextlib.contextmanager
def scratch_db(dialect: str) -> Iterator[str]:
    """A scratch claim database: a SQLite file in a temporary folder, or a PostgreSQL database
    (bench_held_memory.scratch_pg), dropped afterwards."""
    if dialect == "sqlite":
        with tempfile.TemporaryDirectory(prefix="ccb-surfaces-") as tmp:
            yield f"sqlite:///{tmp}/claims.sqlite3"
        return
    from bench_held_memory import scratch_pg

    with scratch_pg() as url:
        yield url


def get(port: int, path: str) -> Tuple[int, int, float]:
    """(status, body bytes, seconds) of one GET."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    started = time.perf_counter()
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        body = resp.read()
        return resp.status, len(body), time.perf_counter() - started
    finally:
        conn.close()


def server(db_url: str):
    app = Celery("surfaces", broker="memory://")
    app.conf.update(cluster_beat_db_url=db_url, cluster_beat_redis_url="", cluster_beat_http_port=0)
    settings = load_settings(app.conf, has_result_backend=lambda: False)
    sender = object()
    return start_beat_server(app, settings, sender=sender), sender


def feed(sender: object, names: List[str]) -> None:
    at = datetime.now(timezone.utc) - timedelta(seconds=0.05)
    for name in names:
        signals.occurrence_handled.send(sender=sender, outcome="sent", schedule=name, scheduled_at=at,
                                        task_id="t", reason=None)


def bench_metrics(n: int, db_url: str) -> None:
    ops, sender = server(db_url)
    try:
        port = ops.server.port
        first = [f"report:{i:06d}" for i in range(n)]
        started = time.perf_counter()
        feed(sender, first)
        log(f"fed {n} schedules in {time.perf_counter() - started:.1f} s")
        status, size, took = get(port, "/metrics")
        print(f"/metrics, {n:,} stored schedules fired: {size / MB:.3f} MB in {took:.2f} s (status {status})")
        gone = getattr(ops.metrics, "schedule_gone", None)
        if gone is not None:
            for name in first:
                gone(name)
        feed(sender, [f"churn:{i:06d}" for i in range(n)])
        time.sleep(1.1)  # past the exposition's cache
        status, size, took = get(port, "/metrics")
        print(f"/metrics after {n:,} removed and {n:,} new fired: {size / MB:.3f} MB in {took:.2f} s (status {status})")
    finally:
        ops.stop()


def fill(db_url: str, n: int) -> None:
    store = ClaimStore(db_url, node_id="bench-filler")
    store.open()
    try:
        started = time.perf_counter()
        rows = [dict(name=f"report:{i:06d}", task="t.report", schedule=f"{i % 60} {i % 24} * * *", zone="UTC",
                     args=f"[{i}]", kwargs="{}", options="{}", overlap=None, max_run_time=None, jitter=None,
                     catchup=None, catchup_window=None, description=f"report number {i}", owner=f"user{i % 100}",
                     enabled=True) for i in range(n)]
        now = store.db_now()
        store.stored_change([r["name"] for r in rows], lambda live, at: (rows, []),
                            lambda row, at: at + timedelta(seconds=60 + hash(row["name"]) % 86000))
        at = (now - timedelta(minutes=5)).replace(microsecond=0)
        occ = [Occurrence(r["name"], at) for r in rows]
        for i in range(0, n, 5000):
            part = occ[i:i + 5000]
            sent = [o for j, o in enumerate(part) if (i + j) % 100]
            missed = [o for j, o in enumerate(part) if not (i + j) % 100]
            store.claim(sent, term=1)
            store.mark_sent(sent)
            store.record(missed, status="missed", reason="no leader: bench", term=1)
        log(f"stored {n} schedules with one occurrence each in {time.perf_counter() - started:.1f} s")
    finally:
        store.close()


def bench_page(n: int, dialect: str, db_url: str, hammer: float, clients: int) -> None:
    fill(db_url, n)
    ops, _ = server(db_url)
    try:
        port = ops.server.port
        status, size, took = get(port, "/")
        print(f"page, {dialect}, {n:,} stored: first load {took:.2f} s, {size / MB:.3f} MB (status {status})")
        status, size, took = get(port, "/")
        print(f"page, {dialect}: cached load {took * 1000:.1f} ms")
        time.sleep(2.1)
        status, size, took = get(port, "/?q=report:0420")
        print(f"page, {dialect}: ?q=report:0420 {took:.2f} s, {size / MB:.3f} MB (status {status})")
        time.sleep(2.1)
        until = time.time() + hammer
        cpu = time.process_time()
        procs = [subprocess.Popen([sys.executable, "-c", CLIENT, str(port), str(until), "/"],
                                  stdout=subprocess.PIPE, text=True) for _ in range(clients)]
        served = sum(int(p.communicate(timeout=hammer + 600)[0] or 0) for p in procs)
        cpu = time.process_time() - cpu
        wall = hammer + max(0.0, time.time() - until)
        builds = getattr(ops.server, "page_builds", None)
        print(f"page, {dialect}: {clients} clients for {hammer:g} s: {served} pages served"
              f"{'' if builds is None else f' from {builds} builds in all'}, "
              f"server CPU {cpu:.2f} s ({100 * cpu / wall:.0f} % of a core)")
    finally:
        ops.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--schedules", type=int, default=100_000)
    parser.add_argument("--dialects", default="sqlite,postgresql")
    parser.add_argument("--hammer", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--skip-metrics", action="store_true")
    args = parser.parse_args()
    print(f"# python {' '.join(sys.argv)}")
    if not args.skip_metrics:
        with scratch_db("sqlite") as url:
            bench_metrics(args.schedules, url)
    for dialect in args.dialects.split(","):
        with scratch_db(dialect) as url:
            bench_page(args.schedules, dialect, url, args.hammer, args.clients)
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
