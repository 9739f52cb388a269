"""How fast is ``cron(...).next_fire``, next to croniter, and how fast is building schedules?

    python benchmarks/bench_schedules.py [--seconds 1.0]

For each expression and zone it measures, for about ``--seconds`` each:

* ours: ``cron(expr, tz).next_fire(t)`` walking forward (t = the previous result);
* croniter: ``croniter(expr, t_local).get_next(datetime)`` walking forward the same way
  (one iterator, as croniter is normally used);

and prints calls per second and the ratio ours / croniter (> 1 means we are faster).
Then it times building 20,000 ``cron`` schedules from 100 distinct expressions.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import datetime, timezone
from zoneinfo import ZoneInfo

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from croniter import croniter  # noqa: E402

from celery_cluster_beat import cron  # noqa: E402

EXPRESSIONS = [
    "*/5 * * * *",
    "0 * * * *",
    "30 2 * * *",
    "0 9 * * 1-5",
    "15,45 8-18 * * *",
    "0 0 1 * *",
]
ZONES = ["UTC", "America/New_York"]
START = datetime(2026, 1, 1, tzinfo=timezone.utc)


def _rate(step, seconds: float) -> float:
    """Calls of `step()` per second, measured for about `seconds` (batches of 50)."""
    calls = 0
    began = time.perf_counter()
    deadline = began + seconds
    while True:
        for _ in range(50):
            step()
        calls += 50
        now = time.perf_counter()
        if now >= deadline:
            return calls / (now - began)


def bench_ours(expr: str, tz: str, seconds: float) -> float:
    schedule = cron(expr, tz=tz)
    state = [START]

    def step():
        # Walk forward, wrapping after a century so monthly schedules stay in realistic years.
        state[0] = schedule.next_fire(state[0]) if state[0].year < 2126 else START

    return _rate(step, seconds)


def bench_croniter(expr: str, tz: str, seconds: float) -> float:
    it = croniter(expr, START.astimezone(ZoneInfo(tz)))

    def step():
        it.get_next(datetime)

    return _rate(step, seconds)


def _distinct_expressions(n: int) -> list[str]:
    """n distinct, valid, everyday-looking expressions (deterministic)."""
    templates = [
        "{m} {h} * * *",
        "*/{s} * * * *",
        "{m} {h}-{h2} * * 1-5",
        "0,{m} */{s2} {d} * *",
        "{m} {h} * {mo} {w}",
    ]
    out: list[str] = []
    i = 0
    while len(out) < n:
        t = templates[i % len(templates)]
        expr = t.format(m=(i * 7) % 60, h=(i * 5) % 16, h2=(i * 5) % 16 + 8, s=i % 29 + 1,
                        s2=i % 11 + 1, d=i % 28 + 1, mo=i % 12 + 1, w=i % 7)
        if expr not in out:
            out.append(expr)
        i += 1
    return out


def bench_build(seconds_hint: float) -> tuple[int, float]:
    exprs = _distinct_expressions(100)
    zones = ["UTC", "America/New_York", "Europe/London", "Asia/Tokyo"]
    count = 20_000
    began = time.perf_counter()
    for i in range(count):
        cron(exprs[i % 100], tz=zones[i % 4])
    return count, time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1.0, help="time per measurement (default 1.0)")
    args = parser.parse_args()

    header = f"{'expression':<20} {'tz':<18} {'ours calls/s':>14} {'croniter calls/s':>17} {'ours/croniter':>14}"
    print("next_fire, walking forward from 2026-01-01T00:00Z")
    print(header)
    print("-" * len(header))
    ratios = []
    for tz in ZONES:
        for expr in EXPRESSIONS:
            ours = bench_ours(expr, tz, args.seconds)
            theirs = bench_croniter(expr, tz, args.seconds)
            ratios.append(ours / theirs)
            print(f"{expr:<20} {tz:<18} {ours:>14,.0f} {theirs:>17,.0f} {ours / theirs:>13.2f}x")
    geo = 1.0
    for r in ratios:
        geo *= r
    geo **= 1 / len(ratios)
    print("-" * len(header))
    print(f"{'geometric mean':<39} {'':>14} {'':>17} {geo:>13.2f}x")
    print()
    count, took = bench_build(args.seconds)
    print(f"build {count:,} cron schedules from 100 distinct expressions (4 zones): "
          f"{took:.3f} s ({count / took:,.0f} per second)")


if __name__ == "__main__":
    main()
