"""``celery -A app cluster-beat ...`` run as operators run it: Celery's own command line, against
real PostgreSQL and Redis, with real ``celery beat`` replicas (and a real worker for ``history``)
where the behaviour involves beat. Most calls run the command line in the test's process
(:func:`cli`); a real subprocess (:func:`cli_process`) where what the shell sees is the point
(help, one line per problem and no traceback).

What the leader did is read where it matters: messages on the broker (the shared
:class:`~cluster.Watcher`) and claim rows. Waits are on conditions with generous bounds;
"applied within 1 s" gets slack for a loaded 2-core machine.
"""
from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest

from celery_cluster_beat.schedules.occurrence import Occurrence
from celery_cluster_beat.store import SCHEMA_VERSION, ClaimStore
from cluster import claim_rows, timeline
from procs import App, _free_port, start_worker, wait_for, write_app

UTC = timezone.utc
TTL_GRACE = "{'cluster_beat_lock_ttl': 2, 'cluster_beat_claim_grace': 2}"
#: The rule (the leader applies an action within 1 s) plus room for a loaded machine.
APPLIED_WITHIN = 1.0 + 1.5
COMMANDS = ("status", "list", "history", "run-now", "pause", "resume", "prune", "check", "backfill")


def cli_process(app: App, *args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    """``celery -A <app> cluster-beat ARGS`` as a real subprocess: what an operator's shell sees,
    logging and tracebacks included."""
    return subprocess.run([sys.executable, "-m", "celery", "-A", app.module, "cluster-beat", *args],
                          cwd=app.directory, env=app.env(), capture_output=True, text=True, timeout=timeout)


def cli(app: App, *args: str) -> subprocess.CompletedProcess:
    """The same command through Celery's own command line (its click group, our plugin found
    through the ``celery.commands`` entry point), run in this process: the same parsing, output
    and exit codes without a Python start-up per call (a second of CPU on a loaded machine, and
    the suite makes dozens). An exception that escapes the command (a traceback, in a real
    run) fails the test here; :func:`cli_process` covers what only a real process shows."""
    from celery.bin.celery import celery as celery_main
    from click.testing import CliRunner

    sys.path.insert(0, str(app.directory))
    try:
        try:
            runner = CliRunner(mix_stderr=False)  # click < 8.2 mixes stderr into stdout by default
        except TypeError:
            runner = CliRunner()  # click >= 8.2 keeps them apart and has no such argument
        result = runner.invoke(celery_main, ["-A", app.module, "cluster-beat", *args])
    finally:
        sys.path.remove(str(app.directory))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"cluster-beat {' '.join(args)} raised {result.exception!r}") from result.exception
    return subprocess.CompletedProcess(list(args), result.exit_code, result.stdout, result.stderr)


def cli_json(app: App, *args: str):
    r = cli(app, *args, "--json")
    assert r.returncode == 0, f"{args}: rc {r.returncode}\n{r.stdout}\n{r.stderr}"
    return json.loads(r.stdout)


def assert_one_line_error(r: subprocess.CompletedProcess, *fragments: str) -> str:
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr + r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for f in fragments:
        assert f in lines[0], (f, lines[0])
    return lines[0]


def at(text: str) -> datetime:
    return datetime.fromisoformat(text)


def the_app(monkeypatch, app: App):
    """The generated app module imported in this process (for the StoredSchedules API)."""
    monkeypatch.syspath_prepend(str(app.directory))
    return importlib.import_module(app.module).app


def columns_aligned(text: str, header: str) -> None:
    """Each column of a table starts at the same offset in every row as in its header."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    head = lines[start]
    rows = []
    for line in lines[start + 1:]:
        if not line.strip():
            break
        rows.append(line)
    assert rows, text
    offsets = [m.start() for m in re.finditer(r"\S+(?: \S+)*", head)]
    for row in rows:
        for off in offsets[1:]:
            assert row[off - 2:off] == "  " and row[off] != " ", f"column at {off} misaligned:\n{head}\n{row}"


# ----------------------------------------------------------------------------- the command itself


def test_it_is_a_subcommand_of_celery_beside_beat_and_worker(tmp_path):
    app = write_app(tmp_path, broker="memory://", db_url=f"sqlite:///{tmp_path}/c.sqlite3", schedule="{}")
    top = subprocess.run([sys.executable, "-m", "celery", "-A", app.module, "--help"], cwd=app.directory,
                         env=app.env(), capture_output=True, text=True, timeout=60)
    assert top.returncode == 0 and "cluster-beat" in top.stdout and "beat" in top.stdout
    r = cli_process(app, "--help")
    assert r.returncode == 0, r.stderr
    for command in COMMANDS:
        assert f"  {command}" in r.stdout, r.stdout
    for read in ("status", "list", "history", "check"):
        assert "--json" in cli(app, read, "--help").stdout


# ----------------------------------------------------------------------------- reads of a running cluster


@pytest.mark.slow
@pytest.mark.timeout(300)  # process-heavy: room on a loaded 2-core machine
def test_status_and_list_show_a_running_cluster(tmp_path, redis_url, pg_url, cluster_factory, monkeypatch):
    from celery_cluster_beat import cron
    from celery_cluster_beat.dynamic import StoredSchedules

    app = write_app(tmp_path, broker=redis_url, db_url=pg_url, redis_url=redis_url, conf=TTL_GRACE,
                    schedule="{'tick': {'task': 't.record', 'schedule': every(1)},"
                             " 'yearly': {'task': 't.record', 'schedule': cron('0 0 1 1 *')}}")
    cluster = cluster_factory(app)
    cluster.start(2)
    leader = cluster.steady_leader()
    with StoredSchedules(the_app(monkeypatch, app)) as api:
        api.add("report:1", "t.record", cron("0 9 * * 1-5", tz="Europe/Paris"), owner="alice")

    st = cli_json(app, "status")
    assert st["leader"] == leader and st["lease"]["holder"] == leader, (st, cluster.logs())
    assert st["term"] >= 1 and st["store_term"] >= 1
    assert 0 < st["lease"]["expires_in"] <= 2.0
    assert st["lease"]["key"] == f"cluster_beat:{{{app.module}}}:lease"
    nodes = {n["node"]: n for n in st["nodes"]}
    pids = {p.pid for p in cluster.procs}
    assert {int(n.rsplit(":", 1)[1]) for n in nodes} == pids, nodes
    assert nodes[leader]["state"] == "leader" and nodes[leader]["scheduling"] is True
    (standby,) = [n for n in nodes.values() if n["node"] != leader]
    assert standby["state"] == "up" and standby["scheduling"] is False
    for n in nodes.values():
        assert n["heartbeat_age"] < 10 and abs(n["clock_offset"]) < 1.0
    assert st["schema_version"] == SCHEMA_VERSION and st["db_url"].startswith("postgresql")
    assert (st["schedules"], st["config_schedules"], st["stored_schedules"]) == (3, 2, 1)
    assert st["unsent"] == 0 and st["paused"] == [] and st["cluster_name"] == app.module

    human = cli(app, "status")
    assert human.returncode == 0, human.stderr
    assert re.search(rf"^leader +{re.escape(leader)} \(term \d+\)$", human.stdout, re.M), human.stdout
    columns_aligned(human.stdout, "NODE")
    assert re.search(r"^schedules +3 \(2 config, 1 stored\), 0 paused$", human.stdout, re.M), human.stdout

    listed = {s["name"]: s for s in cli_json(app, "list")}
    assert list(listed) == ["tick", "yearly", "report:1"]
    tick = listed["tick"]
    assert (tick["source"], tick["task"], tick["schedule"], tick["paused"], tick["enabled"]) == (
        "config", "t.record", "every 1s", False, True)
    assert tick["counters"]["sent"] >= 3 and tick["last_status"] == "sent" and tick["outcome"] == "sent"
    last, nxt = at(tick["last_occurrence"]), at(tick["next_fire"])
    assert timedelta(0) < nxt - last <= timedelta(seconds=3), tick
    yearly = listed["yearly"]
    assert (yearly["schedule"], yearly["zone"], yearly["last_occurrence"]) == ("0 0 1 1 *", "UTC", None)
    assert at(yearly["next_fire"]).strftime("%m-%d %H:%M") == "01-01 00:00"
    report = listed["report:1"]
    assert (report["source"], report["schedule"], report["zone"], report["owner"]) == (
        "stored", "0 9 * * 1-5", "Europe/Paris", "alice")
    assert at(report["next_fire"]).astimezone(ZoneInfo("Europe/Paris")).strftime("%H:%M") == "09:00"
    human = cli(app, "list")
    assert human.returncode == 0, human.stderr
    columns_aligned(human.stdout, "NAME")
    assert "report:1" in human.stdout and "stored" in human.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)  # process-heavy: room on a loaded 2-core machine
def test_history_shows_sent_started_finished_and_errors_from_a_real_worker(tmp_path, redis_url, pg_url,
                                                                            cluster_factory):
    tasks = '''
    from celery_cluster_beat import LedgerTask

    @app.task(bind=True, base=LedgerTask, name="t.job")
    def job(self):
        time.sleep(0.3)
        return "ok"

    @app.task(bind=True, base=LedgerTask, name="t.boom")
    def boom(self):
        raise ValueError("kaput")
    '''
    app = write_app(tmp_path, broker=redis_url, db_url=pg_url, redis_url=redis_url, conf=TTL_GRACE, tasks=tasks,
                    schedule="{'job': {'task': 't.job', 'schedule': every(2)},"
                             " 'boom': {'task': 't.boom', 'schedule': every(2)}}")
    cluster = cluster_factory(app)
    cluster.start(1)
    worker = start_worker(app, tmp_path, concurrency=2)
    try:
        wait_for(lambda: any(r.finished_at for r in claim_rows(pg_url, "job"))
                 and any(r.run_state == "failed" for r in claim_rows(pg_url, "boom")), 90, interval=0.5,
                 what="a finished run of job and a failed one of boom")
    except AssertionError:
        raise AssertionError(cluster.logs() + worker.log()[-3000:])
    finally:
        worker.stop()
    beat_node = next(r.node for r in claim_rows(pg_url, "job"))
    assert int(beat_node.rsplit(":", 1)[1]) == cluster.procs[0].pid

    rows = cli_json(app, "history", "job")
    instants = [at(r["scheduled_at"]) for r in rows]
    assert instants == sorted(instants, reverse=True) and rows
    done = [r for r in rows if r["run_state"] == "succeeded"]
    assert done, rows
    r = done[0]
    assert (r["status"], r["node"], r["manual"], r["error"]) == ("sent", beat_node, False, None)
    sent, started, finished = at(r["sent_at"]), at(r["started_at"]), at(r["finished_at"])
    assert at(r["scheduled_at"]) <= sent + timedelta(seconds=1) and started <= finished
    assert 0.25 <= r["runtime"] < 5 and r["worker"]
    assert len(cli_json(app, "history", "job", "--limit", "1")) == 1

    failed = [r for r in cli_json(app, "history", "boom") if r["run_state"] == "failed"]
    assert failed and failed[0]["error"].startswith("ValueError: kaput"), failed
    human = cli(app, "history", "boom")
    assert human.returncode == 0, human.stderr
    columns_aligned(human.stdout, "SCHEDULED")
    assert "ValueError: kaput" in human.stdout and "failed" in human.stdout


# ----------------------------------------------------------------------------- actions


@pytest.mark.slow
@pytest.mark.timeout(300)  # process-heavy: room on a loaded 2-core machine
def test_run_now_pressed_twice_at_once_gives_one_manual_run(tmp_path, redis_url, pg_url, cluster_factory):
    app = write_app(tmp_path, broker=redis_url, db_url=pg_url, redis_url=redis_url, conf=TTL_GRACE,
                    schedule="{'tick': {'task': 't.record', 'schedule': every(1)},"
                             " 'yearly': {'task': 't.record', 'schedule': cron('0 0 1 1 *')}}")
    with ClaimStore(pg_url, node_id="test-setup"):  # the tables, so the two presses below race on the request only
        pass
    ok = cli(app, "check")  # a read: it needs them (it never creates them)
    assert ok.returncode == 0 and ok.stderr == "", ok.stderr
    assert [line.split()[:2] for line in ok.stdout.splitlines()] == [
        ["ok", "versions:"], ["ok", "settings:"], ["ok", "beat_schedule:"], ["ok", "claim"], ["ok", "redis:"],
        ["ok", "messages:"], ["ok", "broker:"]], ok.stdout

    # Two operators at once (no beat yet, so neither press can have been handled before the other).
    args = [sys.executable, "-m", "celery", "-A", app.module, "cluster-beat", "run-now", "yearly", "--json"]
    presses = [subprocess.Popen(args, cwd=app.directory, env=app.env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=90) for p in presses]
    assert [p.returncode for p in presses] == [0, 0], outs
    answers = [json.loads(out) for out, _ in outs]
    assert answers[0]["request"] == answers[1]["request"]
    assert sorted(a["joined"] for a in answers) == [False, True]

    cluster = cluster_factory(app)
    cluster.start(2)
    cluster.steady_leader()
    first = cluster.watcher.wait_for(lambda m: m.schedule == "yearly", 30, "the manual run of yearly")
    assert first.at == at(answers[0]["scheduled_at"])
    time.sleep(3)
    yearly = [m for m in cluster.watcher.messages() if m.schedule == "yearly"]
    assert len(yearly) == 1, timeline(yearly)
    (row,) = cli_json(app, "history", "yearly")
    assert (row["manual"], row["status"], row["reason"], row["task_id"]) == (True, "sent", "manual", first.task_id)

    # Pressed while a leader runs: sent within the rule, as an occurrence of its own.
    again = cli_json(app, "run-now", "yearly")
    pressed = time.time()
    assert again["joined"] is False and again["request"] != answers[0]["request"]
    try:
        second = cluster.watcher.wait_for(lambda m: m.schedule == "yearly" and m.task_id != first.task_id, 30,
                                          "the second manual run")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{cluster.logs()}") from None
    assert second.seen - pressed <= APPLIED_WITHIN, (second.seen - pressed, cluster.logs())
    assert second.at == at(again["scheduled_at"])
    rows = cli_json(app, "history", "yearly")
    assert [r["manual"] for r in rows] == [True, True] and rows[0]["task_id"] == second.task_id
    human = cli(app, "history", "yearly")
    assert human.stdout.count("manual") == 2, human.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)  # process-heavy: room on a loaded 2-core machine
def test_pause_and_resume_config_and_stored_schedules_across_a_restart(tmp_path, redis_url, pg_url,
                                                                       cluster_factory, monkeypatch):
    from celery_cluster_beat import every
    from celery_cluster_beat.dynamic import StoredSchedules

    app = write_app(tmp_path, broker=redis_url, db_url=pg_url, redis_url=redis_url, conf=TTL_GRACE,
                    schedule="{'tick': {'task': 't.record', 'schedule': every(1)},"
                             " 'other': {'task': 't.record', 'schedule': every(1)}}")
    with StoredSchedules(the_app(monkeypatch, app)) as api:
        api.add("st", "t.record", every(1))
    cluster = cluster_factory(app)
    cluster.start(2)
    cluster.steady_leader()
    watcher = cluster.watcher
    watcher.wait_for(lambda m: m.schedule == "st", 30, "the stored schedule firing")

    for name in ("tick", "st"):
        r = cli(app, "pause", name)
        assert r.returncode == 0 and "paused" in r.stdout, r.stderr
    paused_at = time.time()
    assert "paused already" in cli(app, "pause", "tick").stdout
    listed = {s["name"]: s for s in cli_json(app, "list")}
    assert (listed["tick"]["paused"], listed["tick"]["source"], listed["tick"]["next_fire"]) == (True, "config", None)
    assert (listed["st"]["paused"], listed["st"]["source"]) == (True, "stored")
    assert listed["other"]["paused"] is False and listed["tick"]["paused_by"]
    assert re.search(r"^tick +paused +every second +- ", cli(app, "list").stdout, re.M)
    assert cli_json(app, "status")["paused"] == ["st", "tick"]

    def last_seen(name: str) -> float:
        return max((m.seen for m in watcher.messages() if m.schedule == name), default=0.0)

    # Applied within the rule: nothing of either after that, while `other` keeps going.
    time.sleep(APPLIED_WITHIN + 2)
    for name in ("tick", "st"):
        assert last_seen(name) <= paused_at + APPLIED_WITHIN, (name, last_seen(name) - paused_at, cluster.logs())

    # A restart of every replica (a failover included) keeps them paused.
    for p in cluster.procs:
        p.stop()
    restarted = time.time()
    cluster.start(2)
    watcher.wait_for(lambda m: m.schedule == "other" and m.seen > restarted, 60, "`other` after the restart")
    time.sleep(4)
    assert last_seen("tick") <= paused_at + APPLIED_WITHIN and last_seen("st") <= paused_at + APPLIED_WITHIN

    r = cli(app, "resume", "tick")
    resumed = time.time()
    assert r.returncode == 0 and "resumed" in r.stdout, r.stderr
    back = watcher.wait_for(lambda m: m.schedule == "tick" and m.seen > resumed, 30, "tick after resume")
    assert back.seen - resumed <= APPLIED_WITHIN, (back.seen - resumed, cluster.logs())
    # Resumed from now: the paused time is not caught up, and nothing was recorded while paused.
    assert back.at.timestamp() >= resumed - 2.0, back
    gap = [r.scheduled_at for r in claim_rows(pg_url, "tick")
           if paused_at + APPLIED_WITHIN < r.scheduled_at.timestamp() < resumed - 2.0]
    assert gap == [], gap
    time.sleep(2)
    assert last_seen("st") <= paused_at + APPLIED_WITHIN  # still paused
    listed = {s["name"]: s for s in cli_json(app, "list")}
    assert listed["tick"]["paused"] is False and listed["tick"]["next_fire"] and listed["st"]["paused"] is True
    assert cli(app, "resume", "st").returncode == 0
    watcher.wait_for(lambda m: m.schedule == "st" and m.seen > resumed + 2, 30, "st after resume")


# ----------------------------------------------------------------------------- housekeeping and checks


@pytest.mark.slow
@pytest.mark.timeout(300)  # process-heavy: room on a loaded 2-core machine
def test_prune_deletes_finished_rows_older_than_asked(tmp_path, redis_url, pg_url):
    app = write_app(tmp_path, broker=redis_url, db_url=pg_url, redis_url=redis_url, schedule="{}")
    store = ClaimStore(pg_url, node_id="test-writer")
    store.open()
    try:
        now = store.db_now().replace(microsecond=0)
        store.record([Occurrence("old", now - timedelta(days=10)), Occurrence("old", now - timedelta(hours=2))],
                     status="missed", reason="test")
        store.claim([Occurrence("old", now - timedelta(days=11))])  # still claimed: never pruned
        assert cli_json(app, "prune", "--older-than", "7d")["deleted"] == 1
        assert [r.scheduled_at for r in store.claims("old")] == [now - timedelta(days=11), now - timedelta(hours=2)]
        r = cli(app, "prune", "--older-than", "1h30m")
        assert r.returncode == 0 and "deleted 1 claim row(s)" in r.stdout, r.stdout + r.stderr
        assert [r.status for r in store.claims("old")] == ["claimed"]
        assert cli_json(app, "prune")["older_than"] == 7 * 86400.0  # default: cluster_beat_claim_retention
    finally:
        store.close()
    for bad in ("7x", "0s", "-3d", "d"):
        assert_one_line_error(cli(app, "prune", "--older-than", bad), "duration")


@pytest.mark.slow
def test_check_gives_one_line_per_problem_and_exit_1(tmp_path, redis_url):
    dead_db = f"postgresql+psycopg://postgres:s3cret@127.0.0.1:{_free_port()}/nowhere"
    dead_redis = f"redis://:pw@127.0.0.1:{_free_port()}/0"
    app = write_app(tmp_path, broker=redis_url, db_url=dead_db, redis_url=dead_redis,
                    schedule="{'bad': {'task': 't.record', 'schedule': '61 * * * *'},"
                             " 'fine': {'task': 't.record', 'schedule': every(5)}}")
    r = cli_process(app, "check")
    assert r.returncode == 1 and "Traceback" not in r.stdout + r.stderr, r.stderr
    problems = r.stderr.strip().splitlines()
    assert [p.split()[1] for p in problems] == ["beat_schedule:", "claim", "redis:"], problems
    assert "'bad': schedule: cron '61 * * * *': minute value 61 is out of range 0-59" in problems[0]
    assert "s3cret" not in r.stderr and "pw@" not in r.stderr
    assert [line.split()[1] for line in r.stdout.splitlines()] == ["versions:", "settings:", "broker:"], r.stdout
    j = cli(app, "check", "--json")
    assert j.returncode == 1
    doc = json.loads(j.stdout)
    assert doc["ok"] is False and [c["check"] for c in doc["checks"] if not c["ok"]] == [
        "beat_schedule", "claim store", "redis"]


@pytest.mark.slow
@pytest.mark.timeout(300)  # process-heavy: room on a loaded 2-core machine
def test_bad_input_is_one_line_and_exit_1(tmp_path, redis_url, pg_url):
    app = write_app(tmp_path, broker=redis_url, db_url=pg_url, redis_url=redis_url,
                    schedule="{'tick': {'task': 't.record', 'schedule': every(60)}}")
    with ClaimStore(pg_url, node_id="test-setup"):  # the tables: no cluster-beat command creates them
        pass
    assert_one_line_error(cli_process(app, "pause", "no-such"), "no schedule is named 'no-such'")
    for command in ("history", "resume", "run-now"):
        assert_one_line_error(cli(app, command, "no-such"), "no schedule is named 'no-such'")
    assert_one_line_error(cli(app, "history", "tick", "--limit", "0"), "limit")
    assert cli_json(app, "history", "tick") == []
    dead = write_app(tmp_path, broker=redis_url, redis_url=redis_url, schedule="{}",
                     db_url=f"postgresql+psycopg://postgres:s3cret@127.0.0.1:{_free_port()}/nowhere")
    for run, command in ((cli_process, ["status"]), (cli, ["list"]), (cli, ["history", "tick"]),
                         (cli, ["pause", "tick"]), (cli, ["prune"])):
        line = assert_one_line_error(run(dead, *command), "claim store", "Connection refused")
        assert "s3cret" not in line
