"""Time ClaimStore.claim() + mark_sent() of a 5,000-occurrence burst per dialect.

A burst like this happens when many schedules fire on the same minute (or a
replica catches up after downtime); beat must get through it well within a
tick. Target: under ~300 ms for claim + mark_sent of 5,000 rows per dialect.

    python benchmarks/bench_store.py [--rows 5000] [--schedules 500] [--rounds 5]
                                     [--dialects sqlite,postgresql,mysql]

PostgreSQL and MariaDB/MySQL are reached at the same admin URLs the tests use
(CCB_PG_URL / CCB_MYSQL_URL, defaults to the local servers); a scratch
database is created for the run and dropped afterwards.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from contextlib import contextmanager
from datetime import datetime, timedelta, timezone
from typing import Iterator

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir))

import sqlalchemy as sa  # noqa: E402
from sqlalchemy.engine import make_url  # noqa: E402

from celery_cluster_beat.schedules.occurrence import Occurrence  # noqa: E402
from celery_cluster_beat.store import ClaimStore  # noqa: E402

ADMIN_URLS = {
    "postgresql": os.environ.get("CCB_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"),
    "mysql": os.environ.get("CCB_MYSQL_URL", "mysql+pymysql://root@127.0.0.1:3306/test"),
}


@contextmanager
def scratch_database(kind: str) -> Iterator[str]:
    if kind == "sqlite":
        with tempfile.TemporaryDirectory(prefix="ccb-bench-") as tmp:
            yield f"sqlite:///{tmp}/claims.sqlite3"
        return
    admin = ADMIN_URLS[kind]
    name = "ccb_bench_" + uuid.uuid4().hex[:10]
    engine = sa.create_engine(admin, isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE {name}"))
    try:
        yield make_url(admin).set(database=name).render_as_string(hide_password=False)
    finally:
        with engine.connect() as conn:
            if kind == "postgresql":
                conn.execute(
                    sa.text(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                        "WHERE datname = :d AND pid <> pg_backend_pid()"
                    ),
                    {"d": name},
                )
            conn.execute(sa.text(f"DROP DATABASE IF EXISTS {name}"))
        engine.dispose()


def burst(round_no: int, rows: int, schedules: int) -> list[Occurrence]:
    base = datetime(2030, 1, 1, tzinfo=timezone.utc) + timedelta(days=round_no)
    per = max(1, rows // schedules)
    return [Occurrence(f"bench.schedule.{i % schedules:05d}", base + timedelta(minutes=i // schedules)) for i in range(per * schedules)][:rows]


def bench(kind: str, rows: int, schedules: int, rounds: int) -> dict[str, float]:
    with scratch_database(kind) as url:
        store = ClaimStore(url, node_id="bench")
        store.open()
        try:
            store.mark_sent(store.claim(burst(-1, 50, 10)))  # warm up pool and statement cache
            claim_ms, sent_ms, lost_ms = [], [], []
            for r in range(rounds):
                occs = burst(r, rows, schedules)
                t0 = time.perf_counter()
                won = store.claim(occs)
                t1 = time.perf_counter()
                marked = store.mark_sent(won)
                t2 = time.perf_counter()
                again = store.claim(occs)  # what every losing replica pays
                t3 = time.perf_counter()
                assert len(won) == len(occs) == marked, (len(won), len(occs), marked)
                assert again == []
                claim_ms.append((t1 - t0) * 1000)
                sent_ms.append((t2 - t1) * 1000)
                lost_ms.append((t3 - t2) * 1000)
        finally:
            store.close()
    claim = statistics.median(claim_ms)
    sent = statistics.median(sent_ms)
    return {
        "claim": claim,
        "mark_sent": sent,
        "total": claim + sent,
        "best_total": min(c + s for c, s in zip(claim_ms, sent_ms)),
        "lost": statistics.median(lost_ms),
        "rows_s": rows / ((claim + sent) / 1000),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=5000)
    parser.add_argument("--schedules", type=int, default=500, help="distinct schedule names in the burst")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dialects", default="sqlite,postgresql,mysql")
    args = parser.parse_args()

    print(
        f"claim() + mark_sent() of a {args.rows}-occurrence burst over {args.schedules} schedules, "
        f"median of {args.rounds} rounds (ms)"
    )
    header = f"{'dialect':<11} {'claim':>8} {'mark_sent':>10} {'total':>8} {'best':>8} {'rows/s':>9} {'lost claim':>11}"
    print(header)
    print("-" * len(header))
    slow = False
    for kind in args.dialects.split(","):
        try:
            r = bench(kind, args.rows, args.schedules, args.rounds)
        except sa.exc.OperationalError as exc:
            print(f"{kind:<11} unavailable: {exc.orig}")
            continue
        slow |= r["total"] > 300
        print(
            f"{kind:<11} {r['claim']:8.1f} {r['mark_sent']:10.1f} {r['total']:8.1f} {r['best_total']:8.1f} "
            f"{r['rows_s']:9.0f} {r['lost']:11.1f}"
        )
    print("\n'lost claim': a second claim() of the same burst (every row already taken).")
    return 1 if slow else 0


if __name__ == "__main__":
    sys.exit(main())
