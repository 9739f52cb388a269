"""``celery -A app cluster-beat backfill``, as operators run it: against a real ``celery beat`` leader
and a real worker running a ``LedgerTask`` (each past occurrence of the range sent and run once,
with the backfill header; a second backfill sends nothing; the dry run lists what would be sent
and what not, writing nothing), and, without any beat, its validation (one line, exit 1) and a
request that waits for a leader."""
from __future__ import annotations

import time

from datetime import timedelta

import pytest

from celery_cluster_beat.schedules.occurrence import Occurrence
from celery_cluster_beat.store import ClaimStore
from cluster import claim_rows
from procs import start_worker, wait_for, write_app
from test_cli import TTL_GRACE, assert_one_line_error, cli, cli_json

TASKS = '''
from celery_cluster_beat import LedgerTask

@app.task(bind=True, base=LedgerTask, name="t.job")
def job(self):
    occ = self.occurrence
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "runs.txt"), "a") as f:
        f.write(f"{occ.scheduled_at.isoformat()} {occ.backfill}\\n")
'''


def _iso(at) -> str:
    return at.strftime("%Y-%m-%dT%H:%M:%S")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_backfill_is_sent_and_run_once_per_occurrence_by_a_real_leader_and_worker(
        tmp_path, redis_url, pg_url, cluster_factory):
    app = write_app(tmp_path, broker=redis_url, db_url=pg_url, redis_url=redis_url, conf=TTL_GRACE, tasks=TASKS,
                    schedule="{'minutely': {'task': 't.job', 'schedule': every(60)}}")
    cluster = cluster_factory(app)
    cluster.start(1)
    worker = start_worker(app, tmp_path, concurrency=2)
    ops = ClaimStore(pg_url, node_id="ops")
    ops.open()
    try:
        now = ops.db_now()
        start = now.replace(second=0, microsecond=0) - timedelta(minutes=30)
        end = start + timedelta(minutes=4)
        ops.record([Occurrence("minutely", start + timedelta(minutes=2))], status="missed", reason="catchup")

        first = cli_json(app, "backfill", "minutely", "--from", _iso(start), "--to", _iso(end))
        assert (first["state"], first["sent"], first["not_sent"]) == ("done", 5, {}), first

        def runs():
            return [r for r in claim_rows(pg_url, "minutely") if start <= r.scheduled_at <= end]

        wait_for(lambda: len([r for r in runs() if r.run_state == "succeeded"]) == 5, 90, interval=0.5,
                 what="five backfilled runs")
        assert {(r.status, r.reason) for r in runs()} == {("sent", "backfill")}
        ran = (tmp_path / "runs.txt").read_text().split("\n")
        in_range = {(start + timedelta(minutes=i)).isoformat() for i in range(5)}  # not the minute's own fires
        assert sorted(line for line in ran if line.split(" ")[0] in in_range) == sorted(
            f"{(start + timedelta(minutes=i)).isoformat()} True" for i in range(5))

        history = cli_json(app, "history", "minutely")
        assert len([r for r in history if r["backfill"] and r["reason"] == "backfill"]) == 5
        table = cli(app, "history", "minutely").stdout
        assert table.count(" backfill ") == 5, table

        again = cli(app, "backfill", "minutely", "--from", _iso(start), "--to", _iso(end))
        assert again.returncode == 0 and "0 sent; not sent: 5 already sent" in again.stdout, again.stdout

        wider = cli(app, "backfill", "minutely", "--from", _iso(start - timedelta(minutes=2)), "--to", _iso(end),
                    "--dry-run")
        assert wider.returncode == 0, wider.stderr
        assert "7 occurrence(s), 2 would be sent, 5 already sent; nothing written" in wider.stdout, wider.stdout
        assert wider.stdout.count("would send") == 2 and wider.stdout.count("already sent") == 6  # 5 + summary
        assert not [r for r in claim_rows(pg_url, "minutely") if r.scheduled_at < start]
        time.sleep(1.0)  # no further run of the range (the minute's own fires may add lines of other instants)
        assert len([line for line in (tmp_path / "runs.txt").read_text().split("\n")
                    if line.split(" ")[0] in in_range]) == 5
    finally:
        ops.close()
        worker.stop()


def test_validation_dry_run_and_a_request_waiting_for_a_leader(tmp_path):
    db = f"sqlite:///{tmp_path}/c.sqlite3"
    app = write_app(tmp_path, broker="memory://", db_url=db, tasks=TASKS,
                    schedule="{'minutely': {'task': 't.job', 'schedule': every(60)}}")
    store = ClaimStore(db, node_id="setup")
    store.open()  # prepared as a beat would
    try:
        now = store.db_now()
        past = now.replace(second=0, microsecond=0) - timedelta(hours=1)
        args = ("backfill", "minutely", "--from", _iso(past))
        assert_one_line_error(cli(app, *args, "--to", _iso(now + timedelta(hours=1))), "is in the future")
        assert_one_line_error(cli(app, "backfill", "minutely", "--from", "yesterday", "--to", _iso(past)),
                              "--from: not an ISO 8601 instant")
        assert_one_line_error(cli(app, *args, "--to", _iso(past - timedelta(minutes=1))), "is after --to")
        assert_one_line_error(cli(app, *args, "--to", _iso(past), "--limit", "10001"), "--limit must be from 1 to 10000")
        assert_one_line_error(cli(app, *args, "--to", _iso(past + timedelta(minutes=30)), "--limit", "10"),
                              "holds more than 10 occurrences")
        assert_one_line_error(cli(app, "backfill", "nobody", "--from", _iso(past), "--to", _iso(past)), "nobody")
        old = past - timedelta(days=8)  # beyond the default claim retention (7 days): its rows may be pruned
        for dry in ((), ("--dry-run",)):
            assert_one_line_error(cli(app, "backfill", "minutely", "--from", _iso(old), "--to",
                                      _iso(old + timedelta(minutes=5)), *dry), "older than cluster_beat_claim_retention")

        dry = cli_json(app, *args, "--to", _iso(past + timedelta(minutes=2)), "--dry-run")
        assert (dry["would_send"], [o["send"] for o in dry["occurrences"]]) == (3, [True] * 3)
        assert store.pending_backfills() == [] and store.claims("minutely") == []  # nothing written

        pending = cli(app, *args, "--to", _iso(past + timedelta(minutes=2)), "--no-wait")
        assert pending.returncode == 0 and "no leader has served it yet" in pending.stdout, pending.stdout
        (request,) = store.pending_backfills()
        assert (request.schedule, request.from_at, request.max_count) == ("minutely", past, 1000)
    finally:
        store.close()


def test_the_dry_run_warns_when_it_would_send_occurrences_the_overlap_guard_skipped(tmp_path):
    db = f"sqlite:///{tmp_path}/c.sqlite3"
    app = write_app(tmp_path, broker="memory://", db_url=db, tasks=TASKS,
                    schedule="{'minutely': {'task': 't.job', 'schedule': every(60), 'overlap': 'skip'}}")
    store = ClaimStore(db, node_id="setup")
    store.open()
    try:
        start = store.db_now().replace(second=0, microsecond=0) - timedelta(minutes=30)
        store.record([Occurrence("minutely", start + timedelta(minutes=1))], status="skipped", reason="overlap")
        store.record([Occurrence("minutely", start + timedelta(minutes=2))], status="missed", reason="catchup")
        args = ("backfill", "minutely", "--from", _iso(start), "--to", _iso(start + timedelta(minutes=3)), "--dry-run")
        dry = cli(app, *args)
        assert dry.returncode == 0, dry.stderr
        assert "warning: 1 of the occurrences to send were skipped by the overlap guard" in dry.stdout, dry.stdout
        assert cli_json(app, *args)["warnings"] == [
            "1 of the occurrences to send were skipped by the overlap guard (overlap=skip: a run was still in "
            "flight); a backfill sends them without the guard, so their runs may overlap"]
    finally:
        store.close()
