"""Nothing an outsider sends or stores stops the schedule (issue 20, "Done when"), with a real beat.

The scenario of ``benchmarks/bench_hostile.py`` (its pieces are imported from there), small
enough for the suite: one real ``celery beat`` (PostgreSQL claims, the Redis lease and broker,
the HTTP server on) with an every-second config entry ``tick`` and 5,000 stored schedules, 4 %
of them hostile and written past the API's checks: names with terminal escapes, a newline, bidi
and zero-width characters; descriptions of 30,000 ``:``, escapes and markup, two of 1 MB (beat
cuts those when it reads them, and refuses names with control characters); options that would change which
task runs, its id, its serializer or its callbacks, on rows firing every 3 s. For 15 s three client
processes load the page (with hostile filters), ``/metrics`` and ``/healthz`` as fast as they are
answered, a probe loads ``/healthz`` every 0.25 s, and the CLI reads (``list``, ``status``,
``history``) run one after another through a PostgreSQL role that may only SELECT.

Then: ``tick`` has every instant of the window accounted for, sent or (a late pass on a loaded machine)
recorded missed, most of them sent, median lateness under a second (the strict targets are the
benchmark's, run alone);
every message on the broker carries the task and id beat gives it, is JSON and has no callbacks;
every hostile-option schedule that fell due is recorded ``failed`` with the reason (or ``missed`` by
a late pass's catch-up) and never sent;
every request answered (no 5xx but a filtered view's designed ``503 busy``, no dropped connection,
never long without an answer), every probe 200; every CLI read succeeded through the read-only role (a write through it is refused) and
printed no raw control character; no traceback in beat's log.
"""
from __future__ import annotations

import contextlib
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_hostile as scenario  # noqa: E402
from procs import _free_port, start_beat, wait_for  # noqa: E402
from test_cli import cli  # noqa: E402

#: 4 % hostile (the benchmark: 1 % of 100,000), so that about 120 rows with refused options fall due on
#: one instant: what one instant of the benchmark's 595 costs the loop shows on an idle machine too.
PLAN = scenario.Plan(schedules=5_000, hostile=0.04, fire_share=0.005, fire_rule="every 5s",
                     hostile_rule="every 3s", megabyte=2)
HAMMER_SECONDS = 15.0
CLIENTS = 3
#: Longest time a client may wait for any answer to a kind of request (a stall, not a slow page).
ANSWER_GAP = 5.0


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_an_every_second_schedule_keeps_time_while_hostile_rows_and_clients_hammer_every_surface(
        tmp_path, pg_url, redis_url, monkeypatch):
    since = datetime.now(timezone.utc).replace(microsecond=0)  # the rows' first instants follow their storing
    stored = scenario.store_rows(pg_url, PLAN)
    port = _free_port()
    app = scenario.write_app(tmp_path, broker=redis_url, db_url=pg_url, redis_url=redis_url, port=port)
    beat = start_beat(app, tmp_path, "hostile")
    try:
        wait_for(lambda: scenario.first_sent(pg_url, since), 60, interval=0.25, what="beat's first tick sent")
        with scenario.read_only_role(pg_url) as ro_url:
            monkeypatch.setenv(scenario.READ_URL_ENV, ro_url)  # after beat started: the CLI's only

            def read(args):
                r = cli(app, *args)
                return r.returncode, r.stdout, r.stderr

            # Each of the four reads at least once, past the window if need be: on a loaded machine one
            # `list` of the 5,000 rows (in this process) took 10 s, and fewer than four fitted in 15 s.
            ham = scenario.hammer(port, HAMMER_SECONDS, CLIENTS, read,
                                  [["list"], ["status"], ["history", stored.hostile_sent[0]],
                                   ["history", stored.unschedulable[0]]], cli_rounds=1)
            write = cli(app, "pause", "tick")
        last = datetime.fromtimestamp(int(ham.ended), timezone.utc)
        with contextlib.suppress(AssertionError):  # a late loop is measured below, not waited for here
            wait_for(lambda: any(r.status == "sent" for r in scenario.claims(pg_url, "tick", last)), 10,
                     interval=0.25, what="the instant after the window marked sent")
        lateness = scenario.tick_lateness(pg_url, ham.started, ham.ended)
        check = scenario.broker_check(app, pg_url, stored, since)
        log = beat.log()
    finally:
        beat.stop()

    assert check.messages > lateness.due and not check.forged, check.forged[:5]
    assert not set(check.by_schedule) & set(stored.refused_options + stored.unschedulable)
    assert check.refused_due == len(stored.refused_options) and not check.refused_problems, \
        (check.refused_due, check.refused_problems[:5])

    assert not ham.bad_answers(), ham.bad_answers()
    for kind, status in (("/", "200"), ("/?", "200"), ("/?", "400"), ("/metrics", "200"), ("/healthz", "200")):
        assert ham.answered(kind, status), (kind, status, ham.requests)
    gaps = {kind: round(s["gap_s"], 2) for kind, s in ham.requests.items()}
    assert max(gaps.values()) < ANSWER_GAP, gaps
    assert ham.probes >= HAMMER_SECONDS * 2 and not ham.probe_failures, ham.probe_failures[:5]

    assert ham.cli_runs >= 4 and not ham.cli_failures, ham.cli_failures[:3]
    assert ham.cli_raw_controls == 0
    assert write.returncode == 1 and write.stderr.startswith("error: "), (write.returncode, write.stderr)
    assert "Traceback" not in log and "cannot be scheduled" in log

    # Last, so that a miss here says every other check passed.
    figures = (f"due {lateness.due}, missed {[f'{t:%H:%M:%S}' for t in lateness.missed]}, lateness p50 "
               f"{lateness.pct(50):.3f} s p99 {lateness.pct(99):.3f} s max {lateness.pct(100):.3f} s, worst "
               f"{[(round(s, 3), f'{t:%H:%M:%S}') for s, t in lateness.late[:5]]}")
    # On a loaded machine (the suite's other workers, the matrix beside it) a pass can come late, and
    # the catch-up policy then records an instant missed: accounted for, not lost. The strict targets
    # (nothing missed, p99 <= 0.5 s) are the benchmark's, run alone; what the old code did here (the
    # loop held by refused rows) tests/beat/test_refused_rows.py counts in transactions.
    accounted = scenario.claims(pg_url, "tick", min(lateness.missed, default=None) or datetime.now(timezone.utc))
    missed_rows = {r.scheduled_at: r for r in accounted}
    unaccounted = [t for t in lateness.missed if t not in missed_rows or missed_rows[t].status != "missed"]
    assert lateness.due >= HAMMER_SECONDS - 2 and not unaccounted, figures
    assert lateness.sent >= 0.6 * lateness.due and lateness.pct(50) <= 1.0, figures
    assert check.by_schedule.get("tick", 0) >= lateness.sent  # and each went out
