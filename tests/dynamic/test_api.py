"""The stored-schedule API on each real database: what it stores, what it refuses (naming the
schedule, the field and the reason), and the change counter every change bumps."""
from __future__ import annotations

import threading
from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest
from celery import Celery

from celery_cluster_beat import ConfigError, cron, every
from celery_cluster_beat.dynamic import StoredSchedules
from celery_cluster_beat.errors import UnknownSchedule

UTC = timezone.utc


@pytest.fixture
def schedules(db_url):
    app = Celery("apitest", set_as_current=False)
    app.conf.cluster_beat_db_url = db_url
    app.conf.cluster_beat_redis_url = ""  # no lease: no notice to send
    app.conf.beat_schedule = {"nightly": {"task": "jobs.nightly", "schedule": cron("0 3 * * *")}}
    api = StoredSchedules(app)
    yield api
    api.close()


def test_add_stores_the_definition_as_text_and_json_and_reads_it_back(schedules):
    s = schedules.add("report:1", "reports.run", cron("0 9 * * 1-5", tz="Europe/Paris"), args=(1, "a"),
                      kwargs={"fmt": "csv"}, options={"queue": "reports"}, overlap="allow", max_run_time=60,
                      owner="alice", description="weekday report")
    assert (s.schedule, s.zone, s.args, s.kwargs, s.options) == ("0 9 * * 1-5", "Europe/Paris", [1, "a"],
                                                                {"fmt": "csv"}, {"queue": "reports"})
    assert (s.overlap, s.max_run_time, s.owner, s.enabled, s.description) == ("allow", 60, "alice", True,
                                                                            "weekday report")
    assert s.next_at is not None and s.next_at.astimezone(UTC) > datetime.now(UTC) - timedelta(seconds=5)
    assert [x.name for x in schedules.list(owner="alice")] == ["report:1"]
    assert schedules.list(owner="bob") == []


@pytest.mark.parametrize("kwargs, field, reason", [
    (dict(schedule="61 * * * *"), "schedule", "out of range"),
    (dict(schedule=0.5), "schedule", "1 second minimum"),
    (dict(args=[object()]), "args", "not JSON-serialisable"),
    (dict(kwargs={1: "x"}), "kwargs", "does not survive JSON"),
    (dict(args="abc"), "args", "expected a list"),
    (dict(overlap="maybe"), "overlap", "expected one of"),
    (dict(max_run_time=-1), "max_run_time", "positive"),
    (dict(task=""), "task", "expected a task name"),
    # Range and column checks (issue 19, item 7): refused with the field, never a database error.
    (dict(catchup_window=float("inf")), "catchup_window", "finite"),
    (dict(max_run_time=1e300), "max_run_time", "at most"),
    (dict(jitter=10 ** 400), "jitter", "at most"),
    (dict(catchup_window=float("nan")), "catchup_window", "expected a number of seconds"),
    (dict(task="t" * 256), "task", "longer than 255 characters"),
    (dict(task="t.\x00x"), "task", "control character"),
    (dict(owner="al\x00ice"), "owner", "control character"),
    (dict(description="a\x00b"), "description", "control character"),
    (dict(args=["x" * 70_000]), "args", "more than the 65535"),
    (dict(schedule=1e300), "schedule", "cannot be read as a schedule"),
    (dict(schedule=3.2e9), "schedule", "longer than"),
    (dict(options={"expires": 1e300}), "options.expires", "must be at most"),
])
def test_bad_input_names_the_schedule_the_field_and_the_reason_and_stores_nothing(schedules, kwargs, field, reason):
    spec = dict(task="t.x", schedule=every(60))
    spec.update(kwargs)
    with pytest.raises(ConfigError) as info:
        schedules.add("bad", spec.pop("task"), spec.pop("schedule"), **spec)
    message = str(info.value)
    assert message.startswith(f"stored schedule 'bad': {field}: ") and reason in message
    assert schedules.get("bad") is None


def test_config_and_stored_schedules_share_one_namespace(schedules):
    with pytest.raises(ConfigError, match="stored schedule 'nightly': name: the Celery config's beat_schedule "
                                          "has an entry 'nightly'"):
        schedules.add("nightly", "t.x", every(60))
    schedules.add("once", "t.x", every(60))
    with pytest.raises(ConfigError, match="exists already"):
        schedules.add("once", "t.y", every(30))
    assert schedules.get("once").task == "t.x"


def test_every_change_bumps_the_counter_and_marks_its_row_with_it(schedules):
    store = schedules.store
    schedules.add("a", "t.x", every(60))
    v1 = store.stored_version()
    schedules.update("a", schedule=every(30))
    v2 = store.stored_version()
    schedules.disable("a")
    v3 = store.stored_version()
    assert v1 < v2 < v3
    assert [(r.name, r.version) for r in store.stored_changes(v1)] == [("a", v3)]
    assert store.stored_changes(v3) == []


def test_update_changes_only_the_given_fields_and_restarts_from_the_change_time(schedules):
    schedules.add("a", "t.x", cron("0 0 1 1 *"), args=[1], owner="alice")  # next: next New Year
    changed = schedules.update("a", schedule=every(60))
    assert (changed.task, changed.args, changed.owner, changed.schedule) == ("t.x", [1], "alice", "every 60s")
    assert changed.next_at - changed.changed_at <= timedelta(seconds=60)
    with pytest.raises(UnknownSchedule):
        schedules.update("nope", task="t.y")
    with pytest.raises(ConfigError, match="stored schedule 'a': colour: unknown field"):
        schedules.update("a", colour="red")


def test_update_keeps_the_zone_unless_tz_is_given(schedules):
    """The README's example (issue 19, item 8): a new rule without a zone of its own is read in the
    schedule's zone, not stored in UTC; ``tz`` changes the zone, alone or with a new rule."""
    schedules.add("report:42", "reports.run", cron("0 9 * * 1-5", tz="Europe/Paris"))
    changed = schedules.update("report:42", schedule="30 8 * * 1-5")
    assert (changed.schedule, changed.zone) == ("30 8 * * 1-5", "Europe/Paris")
    paris = changed.next_at.astimezone(ZoneInfo("Europe/Paris"))
    assert (paris.hour, paris.minute) == (8, 30) and paris.isoweekday() <= 5
    assert schedules.update("report:42", owner="bob").zone == "Europe/Paris"  # other fields: the zone stays
    moved = schedules.update("report:42", tz="America/New_York")
    assert (moved.schedule, moved.zone) == ("30 8 * * 1-5", "America/New_York")
    assert moved.next_at.astimezone(ZoneInfo("America/New_York")).hour == 8
    both = schedules.update("report:42", schedule=cron("0 7 * * *", tz="Asia/Tokyo"))  # a rule with its own zone
    assert both.zone == "Asia/Tokyo"
    both = schedules.update("report:42", schedule="0 6 * * *", tz="Europe/London")
    assert (both.schedule, both.zone) == ("0 6 * * *", "Europe/London")
    with pytest.raises(ConfigError, match="stored schedule 'report:42': tz: unknown time zone"):
        schedules.update("report:42", tz="Nowhere/Zone")
    assert schedules.get("report:42").zone == "Europe/London"


def test_disable_clears_the_next_occurrence_and_enable_starts_from_now(schedules):
    schedules.add("a", "t.x", every(3600))
    assert schedules.disable("a").next_at is None
    enabled = schedules.enable("a")
    assert enabled.enabled and enabled.changed_at < enabled.next_at <= enabled.changed_at + timedelta(hours=1)


def test_remove_leaves_a_tombstone_the_leader_can_see_and_the_name_can_be_reused(schedules):
    schedules.add("a", "t.x", every(60))
    before = schedules.store.stored_version()
    assert schedules.remove("a") is True
    assert schedules.remove("a") is False
    assert schedules.get("a") is None
    [tomb] = schedules.store.stored_changes(before)
    assert tomb.deleted and not tomb.enabled and tomb.next_at is None
    again = schedules.add("a", "t.y", every(30))
    assert again.task == "t.y" and again.created_at >= tomb.changed_at


def test_add_many_is_one_change(schedules):
    before = schedules.store.stored_version()
    assert schedules.add_many({"name": f"n{i}", "task": "t.x", "schedule": every(3600)} for i in range(600)) == 600
    assert schedules.store.stored_version() == before + 1
    assert schedules.store.stored_count() == 600


def test_concurrent_changes_get_distinct_versions_in_commit_order(schedules, db_url):
    """Eight threads change schedules at once: every change gets its own version, and reading
    'changed since N' after all commits misses none of them."""
    for i in range(8):
        schedules.add(f"c{i}", "t.x", every(60))
    start = schedules.store.stored_version()
    errors = []

    def worker(i: int) -> None:
        try:
            for k in range(5):
                schedules.update(f"c{i}", args=[k])
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert schedules.store.stored_version() == start + 40
    rows = schedules.store.stored_changes(start)
    assert sorted(r.name for r in rows) == [f"c{i}" for i in range(8)]
    assert all(r.args == "[4]" for r in rows)


def test_an_explicit_guard_on_runs_nothing_can_observe_is_refused_unless_the_task_uses_the_ledger(schedules):
    """No result backend: a stored 'skip' on a plain task could never see a run end (it would
    block each fire for max_run_time), so it is refused like the same beat_schedule entry; a
    LedgerTask's runs are read from the ledger, so there it is accepted."""
    from celery_cluster_beat import LedgerTask

    with pytest.raises(ConfigError, match=r"stored schedule 'plain': overlap: 'skip' cannot see when a run ends "
                                          r"\(the app has no result backend\); use base=celery_cluster_beat.LedgerTask"):
        schedules.add("plain", "jobs.plain", every(60), overlap="skip")

    @schedules.app.task(name="jobs.ledgered", base=LedgerTask)
    def ledgered():  # pragma: no cover - never run here
        return None

    assert schedules.add("ledgered", "jobs.ledgered", every(60), overlap="skip").overlap == "skip"


def test_validate_checks_a_spec_as_add_many_does_and_writes_nothing(schedules):
    schedules.validate({"name": "v:1", "task": "reports.run", "schedule": "0 9 * * *", "args": [1]})
    for spec, words in (({"name": "v:2", "task": "t", "schedule": "61 * * * *"}, "out of range"),
                        ({"name": "nightly", "task": "t", "schedule": "0 9 * * *"}, "beat_schedule"),
                        ({"name": "v:3", "task": "t", "schedule": "0 9 * * *", "options": {"exchange": "x"}},
                         "options.exchange")):
        with pytest.raises(ConfigError, match=words):
            schedules.validate(spec)
        with pytest.raises(ConfigError, match=words):
            schedules.add_many([spec])
    assert schedules.list() == []
