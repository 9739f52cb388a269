"""The command line tells the truth (issue 21, item 4 and the pause note of item 2).

* ``list`` says the rule in words with its zone (Celery's own ``celery.backend_cleanup`` too, never
  its crontab repr), shows the overlap policy, fits 120 columns by default and prints everything
  uncut with ``--wide``; an occurrence claimed (or skipped) ahead of its instant is the next fire,
  never the last outcome.
* ``pause NAME --note`` keeps who paused, when and why; ``list``, ``status`` and ``history`` show it.
* ``status`` tells a node that stopped cleanly (``stopped``) from one whose heartbeat lapsed
  (``gone``), neither shown as scheduling: with real beat processes, one SIGTERMed, one SIGKILLed.

In process through click's runner on SQLite where the output is the point; real ``celery beat``
processes where the behaviour is beat's.
"""
from __future__ import annotations

import json
import re
import signal
from datetime import datetime, timedelta, timezone

import pytest
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner, Result

from celery_cluster_beat import cron, every
from celery_cluster_beat.ops import report
from celery_cluster_beat.ops.cliviews import ELLIPSIS, LIST_WIDTH, render_list, table
from celery_cluster_beat.ops.cli import cluster_beat
from celery_cluster_beat.ops.records import NodeStatus
from celery_cluster_beat.schedules.occurrence import Occurrence
from celery_cluster_beat.store import ClaimStore
from procs import start_beat, wait_for, write_app

UTC = timezone.utc
LONG = "nightly-export-of-every-invoice-for-the-finance-team-in-three-regions"


def invoke(app: Celery, *args: str) -> Result:
    return CliRunner().invoke(cluster_beat, list(args), obj=CLIContext(app=app, no_color=True, workdir=None,
                                                                        quiet=False))


def ok(app: Celery, *args: str) -> str:
    r = invoke(app, *args)
    assert r.exit_code == 0 and r.exception is None, (args, r.output, r.exception)
    return r.output


def make_app(tmp_path) -> Celery:
    db_url = f"sqlite:///{tmp_path}/claims.sqlite3"
    ClaimStore(db_url, node_id="setup").open()  # prepared as beat prepares it
    app = Celery("truth", broker="memory://", set_as_current=False)
    app.conf.update(
        cluster_beat_db_url=db_url, cluster_beat_redis_url="", cluster_beat_claim_grace=2,
        result_backend=f"db+sqlite:///{tmp_path}/results.sqlite3",  # results expire: Celery adds backend_cleanup
        beat_schedule={
            LONG: {"task": "t.export", "schedule": cron("30 2 * * 1-5", tz="Europe/Paris"), "overlap": "replace"},
            "six-hourly": {"task": "t.sync", "schedule": every(timedelta(hours=6), baseline="02:30")},
            "tick": {"task": "t.tick", "schedule": every(10), "overlap": "buffer_one"},
        })
    return app


def table_lines(output: str, header: str) -> list:
    lines = output.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    end = next((i for i in range(start, len(lines)) if not lines[i].strip()), len(lines))
    return lines[start:end]


def test_list_says_each_rule_in_words_with_its_zone_and_policy_within_120_columns(tmp_path):
    app = make_app(tmp_path)
    out = ok(app, "list")
    rows = table_lines(out, "NAME")
    assert rows[0].split() == ["NAME", "STATE", "RULE", "NEXT", "LAST", "POLICY", "SOURCE"], rows[0]
    assert len(rows) == 5 and all(len(line) <= LIST_WIDTH for line in out.splitlines()), out
    by_name = {line.split()[0]: line for line in rows[1:]}
    cleanup = by_name["celery.backend_cleanup"]
    assert "At 04:00 (UTC)" in cleanup and "crontab(" not in out, out
    assert "every 6 hours from 02:30 (UTC)" in by_name["six-hourly"] and "21600" not in out
    # next fire relative to the database's clock: "in 4 s", or "now" when it is within half a second
    assert re.search(r"every 10 seconds +(in \d|now )", by_name["tick"]) and " buffer_one " in by_name["tick"]
    # The long name gives way (cut, marked), its rule still reads in words with its zone.
    (long_row,) = [line for line in rows if line.startswith(LONG[:16])]
    assert ELLIPSIS in long_row.split()[0] and "replace" in long_row, long_row
    assert "At 02:30, Monday through Friday" in long_row, long_row

    wide = ok(app, "list", "--wide")
    wide_rows = table_lines(wide, "NAME")
    assert ELLIPSIS not in wide and any(len(line) > LIST_WIDTH for line in wide_rows)
    (long_wide,) = [line for line in wide_rows if line.startswith(LONG + " ")]
    for exact in ("t.export", "30 2 * * 1-5", "Europe/Paris", "At 02:30, Monday through Friday (Europe/Paris)",
                  "replace", "0/0/0/0"):
        assert exact in long_wide, (exact, long_wide)
    assert "0 4 * * *" in next(line for line in wide_rows if line.startswith("celery.backend_cleanup"))

    listed = {s["name"]: s for s in json.loads(ok(app, "list", "--json"))}
    cleanup = listed["celery.backend_cleanup"]
    assert (cleanup["schedule"], cleanup["rule"], cleanup["zone"], cleanup["source"]) == (
        "0 4 * * *", "At 04:00 (UTC)", "UTC", "config")
    assert listed["six-hourly"]["schedule"] == "every 21600s from 02:30"  # the exact text form, as before
    assert listed["six-hourly"]["compact"] == "every 6h from 02:30"
    assert (listed[LONG]["overlap"], listed["tick"]["overlap"]) == ("replace", "buffer_one")
    assert listed["six-hourly"]["overlap"] == "skip"  # the default with a result backend
    assert {"state", "outcome", "paused_note", "paused_by", "paused_at", "counters"} <= set(cleanup)


def test_a_table_gives_way_widest_column_first_and_never_below_its_floor():
    rows = [("a" * 60, "b" * 50, "fixed-cell")]
    out = table(["A", "B", "C"], rows, width=80, flexible={0: 10, 1: 10}).splitlines()
    assert all(len(line) <= 80 for line in out), out
    a, b, c = out[1].split("  ")
    assert a.endswith(ELLIPSIS) and b.endswith(ELLIPSIS) and c == "fixed-cell"
    assert abs(len(a) - len(b)) <= 1  # the cut is spread: the widest gave way first
    tight = table(["A", "B"], [("x" * 40, "y" * 40)], width=10, flexible={0: 12, 1: 12}).splitlines()
    assert [len(part) for part in tight[1].split("  ")] == [12, 12]  # floors hold: longer than asked, readable


def test_the_last_outcome_is_never_an_occurrence_ahead_of_its_instant(tmp_path):
    """The leader claims (and the overlap guard skips) occurrences a moment before their instant:
    such a row is the next fire. ``list`` shows the occurrence that happened last."""
    app = make_app(tmp_path)
    store = ClaimStore(app.conf.cluster_beat_db_url, node_id="beat-1")
    store.open()
    try:
        now = store.db_now().replace(microsecond=0)
        past, ahead = now - timedelta(seconds=10), now + timedelta(seconds=40)
        store.claim([Occurrence("tick", past)], term=1)
        store.mark_sent([Occurrence("tick", past)])
        # Skipped ahead by the guard (buffer_one's predecessor still running): final, but not yet due.
        store.record([Occurrence("tick", ahead)], status="skipped", reason="overlap: previous run in flight", term=1)
        store.claim([Occurrence("six-hourly", ahead)], term=1)  # claimed ahead, nothing before it
        listed = {s.name: s for s in report.schedule_list(app, store=store)}
        tick = listed["tick"]
        assert (tick.last_occurrence, tick.last_status, tick.outcome) == (past, "sent", "sent")
        six = listed["six-hourly"]
        assert (six.last_occurrence, six.last_status, six.outcome) == (None, None, None)
        text = render_list(list(listed.values()), now)
    finally:
        store.close()
    (row,) = [line for line in text.splitlines() if line.startswith("tick ")]
    assert re.search(r"  sent 10 s ago  ", row), row
    (row,) = [line for line in text.splitlines() if line.startswith("six-hourly ")]
    assert "claimed" not in row and "skipped" not in text, text


def test_pause_with_a_note_is_shown_by_list_status_and_history_and_cleared_on_resume(tmp_path):
    app = make_app(tmp_path)
    r = invoke(app, "pause", "tick", "--note", "evil\x1b[2J")
    assert r.exit_code == 1 and "control character" in r.output and "Traceback" not in r.output, r.output
    assert json.loads(ok(app, "status", "--json"))["paused"] == []  # refused before anything was written

    assert "paused 'tick'" in ok(app, "pause", "tick", "--note", "deploying v2 (ticket #42)")
    listed = {s["name"]: s for s in json.loads(ok(app, "list", "--json"))}
    tick = listed["tick"]
    assert (tick["paused"], tick["state"], tick["paused_note"]) == (True, "paused", "deploying v2 (ticket #42)")
    assert tick["paused_by"] and "@" in tick["paused_by"] and tick["paused_at"]
    by = tick["paused_by"]

    out = ok(app, "list")
    assert re.search(r"^tick +paused +every 10 seconds +- ", out, re.M), out
    paused = table_lines(out, "PAUSED")
    assert paused[0].split() == ["PAUSED", "BY", "SINCE", "NOTE"]
    assert re.match(rf"tick +{re.escape(by)} +(now|[\d.]+ (ms|s) ago) +deploying v2 \(ticket #42\)$", paused[1]), paused

    status = ok(app, "status")
    assert re.search(r"^schedules +4 \(4 config, 0 stored\), 1 paused: tick$", status, re.M), status
    assert re.search(rf"^tick +{re.escape(by)} +\S.* +deploying v2 \(ticket #42\)$", status, re.M), status
    details = json.loads(ok(app, "status", "--json"))["paused_details"]
    assert [(d["name"], d["paused_by"], d["paused_note"]) for d in details] == [
        ("tick", by, "deploying v2 (ticket #42)")]

    history = ok(app, "history", "tick")
    assert history.splitlines()[0].startswith(f"tick is paused by {by} since ") and \
        history.splitlines()[0].endswith(": deploying v2 (ticket #42)"), history
    assert json.loads(ok(app, "history", "tick", "--json")) == []  # JSON keeps its shape: the occurrences

    assert "its note is now: rolled back, waiting" in ok(app, "pause", "tick", "--note", "rolled back, waiting")
    assert "resumed 'tick'" in ok(app, "resume", "tick")
    tick = {s["name"]: s for s in json.loads(ok(app, "list", "--json"))}["tick"]
    assert (tick["paused"], tick["paused_note"], tick["paused_by"]) == (False, None, None)
    out = ok(app, "list")
    assert "PAUSED" not in out and "deploying" not in ok(app, "status") and "paused" not in ok(app, "history", "tick")


def test_node_states():
    now = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    hb = now - timedelta(seconds=1)

    def state(heartbeat, stopped, leader=None):
        return report.node_status("n1", heartbeat, stopped, (now - heartbeat).total_seconds(), leader=leader,
                                  grace=5)

    assert state(hb, None) is NodeStatus.UP
    assert state(hb, None, leader="n1") is NodeStatus.LEADER
    assert state(now - timedelta(seconds=30), None) is NodeStatus.GONE
    assert state(hb, hb) is NodeStatus.STOPPED and state(hb, now) is NodeStatus.STOPPED
    assert state(now - timedelta(minutes=30), now - timedelta(minutes=30)) is NodeStatus.STOPPED  # stopped, not gone
    assert state(hb, hb - timedelta(seconds=1)) is NodeStatus.UP  # heard from after its stop: running again


@pytest.mark.slow
@pytest.mark.timeout(300)  # real beat processes: room on a loaded 2-core machine
def test_status_tells_a_node_stopped_by_sigterm_from_one_whose_heartbeat_lapsed(tmp_path, redis_url):
    db_url = f"sqlite:///{tmp_path}/claims.sqlite3"
    app = write_app(tmp_path, broker=redis_url, db_url=db_url, redis_url="",
                    conf="{'cluster_beat_claim_grace': 2}",
                    schedule="{'minutely': {'task': 't.record', 'schedule': every(60)}}")
    beats = {label: start_beat(app, tmp_path, label) for label in ("termed", "killed")}
    try:
        celery_app = _import(app)

        def nodes():
            r = invoke(celery_app, "status", "--json")  # exit 3 (or 1) while the first beat prepares the file
            return {n["node"]: n for n in json.loads(r.output)["nodes"]} if r.exit_code == 0 else {}

        node_of = {label: f":{proc.pid}" for label, proc in beats.items()}

        def both_scheduling():
            seen = nodes()
            return all(any(k.endswith(node_of[label]) and n["scheduling"] and n["state"] in ("up", "leader")
                           for k, n in seen.items()) for label in beats)

        wait_for(both_scheduling, 120, interval=0.5, what="both beats heartbeating, scheduling")
        beats["termed"].signal(signal.SIGTERM)
        assert beats["termed"].popen.wait(60) is not None
        beats["killed"].signal(signal.SIGKILL)
        beats["killed"].popen.wait(30)

        def settled():
            seen = {label: n for label in beats for k, n in nodes().items() if k.endswith(node_of[label])}
            return seen if seen.get("termed", {}).get("state") == "stopped" and \
                seen.get("killed", {}).get("state") == "gone" else None

        wait_for(lambda: settled() is not None, 60, interval=0.5, what="stopped and gone")
        seen = settled()
        assert seen["termed"]["stopped_at"] and seen["termed"]["scheduling"] is False, seen
        assert seen["killed"]["stopped_at"] is None and seen["killed"]["scheduling"] is False, seen
        assert seen["killed"]["heartbeat_age"] > 2, seen
        human = ok(celery_app, "status")
        rows = {line.split()[0]: line.split() for line in table_lines(human, "NODE")[1:]}
        (termed,) = [r for k, r in rows.items() if k.endswith(node_of["termed"])]
        (killed,) = [r for k, r in rows.items() if k.endswith(node_of["killed"])]
        assert termed[1:3] == ["stopped", "-"] and killed[1:3] == ["gone", "-"], human
        assert re.search(r" ago ", " ".join(termed)) and "stopped: shut down cleanly" in human, human
    finally:
        logs = {label: p.log()[-3000:] for label, p in beats.items()}
        for p in beats.values():
            p.stop()
    assert "Traceback" not in logs["termed"], logs["termed"]


def _import(app):
    import importlib
    import sys

    sys.path.insert(0, str(app.directory))
    try:
        return importlib.import_module(app.module).app
    finally:
        sys.path.remove(str(app.directory))
