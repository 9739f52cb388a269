"""What beat says when it starts (issue 21, item 7 and item 5's start-up half).

* One WARNING names each entry the default overlap policy leaves unguarded (README: Overlapping
  runs), also when that default is ``allow`` for every entry because the app has no result
  backend: it used to say nothing then, so the promise held only for ``ignore_result`` tasks.
  An entry with a policy of its own, a global ``cluster_beat_overlap``, or a ledger task is not named.
* The start-up line counts in words that agree: ``1 entry``, ``2 entries``, ``0 stored schedules``.
* A ``cluster_beat_*`` key no release reads is one WARNING line naming the setting meant: a
  misspelt setting used to be ignored silently, its default in force. Beat still starts (a
  config written for a newer release must not stop an older beat); ``check`` fails on it.

Real Schedulers in this process, each with a SQLite claim file of its own, no lease.
"""
from __future__ import annotations

import logging
import uuid

import pytest
from celery import Celery

from celery_cluster_beat import every
from celery_cluster_beat.beat.guard import UNGUARDED_NAMED, OverlapGuard
from celery_cluster_beat.beat.scheduler import Scheduler
from celery_cluster_beat.config import Entry, OverlapPolicy, load_settings
from celery_cluster_beat.config.celeryconf import has_result_backend
from celery_cluster_beat.worker import LedgerTask


def make_app(backend=None, **conf) -> Celery:
    app = Celery(f"warn_{uuid.uuid4().hex[:8]}", backend=backend, set_as_current=False)
    app.conf.update(conf)

    @app.task(shared=False, name="t.plain")
    def plain():
        pass

    @app.task(shared=False, name="t.quiet", ignore_result=True)
    def quiet():
        pass

    @app.task(shared=False, name="t.ledger", base=LedgerTask)
    def ledger():
        pass

    return app


def warnings_of(app: Celery, entries, caplog) -> list:
    settings = load_settings(app.conf, has_result_backend=lambda: has_result_backend(app))
    guard = OverlapGuard(app, settings, ledger=lambda keys: {})
    caplog.clear()
    with caplog.at_level("WARNING", logger="celery_cluster_beat.guard"):
        guard.warn_about_configuration(entries)
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def entry(name: str, task: str, overlap=None) -> Entry:
    return Entry(name=name, task=task, schedule=every(60), overlap=overlap and OverlapPolicy(overlap))


def test_without_a_result_backend_one_warning_names_each_unguarded_entry(caplog):
    entries = [entry("report", "t.plain"), entry("cleanup", "t.quiet"), entry("export", "t.ledger"),
               entry("ping", "t.plain", "allow")]
    lines = warnings_of(make_app(None), entries, caplog)
    assert lines == [
        "cluster-beat: overlap guard off for cleanup, report: the app has no result backend, so nothing says when "
        "a run ends and runs may overlap. Use base=celery_cluster_beat.LedgerTask for the task to guard it (or "
        "configure result_backend), or set overlap='allow' on the entry (or cluster_beat_overlap='allow') to "
        "silence this."]
    # said as allowed: a global policy silences it
    assert warnings_of(make_app(None, cluster_beat_overlap="allow"), entries, caplog) == []


def test_with_a_result_backend_the_warning_names_the_tasks_that_ignore_their_results(caplog):
    app = make_app("redis://127.0.0.1:6379/0", task_track_started=True)
    lines = warnings_of(app, [entry("report", "t.plain"), entry("cleanup", "t.quiet"), entry("export", "t.ledger")],
                        caplog)
    assert len(lines) == 1 and lines[0].startswith("cluster-beat: overlap guard off for cleanup: the task ignores "
                                                   "its results"), lines


def test_many_unguarded_entries_are_named_up_to_a_bound_and_counted(caplog):
    entries = [entry(f"job-{i:03d}", "t.plain") for i in range(UNGUARDED_NAMED + 7)]
    (line,) = warnings_of(make_app(None), entries, caplog)
    named = line.split("overlap guard off for ", 1)[1].split(":", 1)[0]
    assert named == ", ".join(f"job-{i:03d}" for i in range(UNGUARDED_NAMED)) + " and 7 more"


@pytest.mark.parametrize("schedule, words", [
    ({"one": {"task": "t.plain", "schedule": every(60)}}, "1 entry, 0 stored schedules"),
    ({"one": {"task": "t.plain", "schedule": every(60)}, "two": {"task": "t.plain", "schedule": every(60)}},
     "2 entries, 0 stored schedules"),
])
def test_the_start_up_line_counts_in_words_that_agree(tmp_path, caplog, schedule, words):
    app = make_app(None, cluster_beat_db_url=f"sqlite:///{tmp_path}/claims.sqlite3", cluster_beat_redis_url="",
                   cluster_beat_node_id="n1", beat_schedule=schedule)
    with caplog.at_level("INFO", logger="celery_cluster_beat"):
        sched = Scheduler(app, lazy=False)
    try:
        started = [r.getMessage() for r in caplog.records if r.getMessage().startswith("cluster-beat: node n1,")]
        assert len(started) == 1 and started[0].startswith(f"cluster-beat: node n1, {words}, claims in "), started
    finally:
        sched.close()


def test_a_misspelt_setting_is_one_start_up_warning_and_beat_still_starts(tmp_path, caplog):
    app = make_app(None, cluster_beat_db_url=f"sqlite:///{tmp_path}/claims.sqlite3", cluster_beat_redis_url="",
                   cluster_beat_lock_tll=30, cluster_beat_claim_grase=5,
                   beat_schedule={"one": {"task": "t.plain", "schedule": every(60), "overlap": "allow"}})
    with caplog.at_level("WARNING", logger="celery_cluster_beat"):
        sched = Scheduler(app, lazy=False)
    try:
        lines = [r.getMessage() for r in caplog.records if "so it is ignored" in r.getMessage()]
        assert lines == [
            "cluster-beat: setting cluster_beat_claim_grase: not a setting celery-cluster-beat reads, so it is "
            "ignored; did you mean cluster_beat_claim_grace?; setting cluster_beat_lock_tll: not a setting "
            "celery-cluster-beat reads, so it is ignored; did you mean cluster_beat_lock_ttl?"], lines
        assert sched.settings.lock_ttl == 5.0  # the default, as the warning says
    finally:
        sched.close()
