"""Any value for any field: accepted and then working, or refused naming the field.

Issue 19, item 7: ``catchup_window=inf`` and ``max_run_time=1e300`` were accepted and broke beat
later (catch-up planning raised, for every schedule due with it); a task name of 256 characters
or with a NUL reached PostgreSQL and came back as a database outage. The rule checked here, for
the stored-schedule API (:meth:`StoredSchedules.add` / :meth:`~StoredSchedules.update`),
``beat_schedule`` entries and the ``cluster_beat_*`` settings: each value is either

* accepted, and then works: the row reads back as given, beat reads it into an entry that is
  not refused, its next occurrence computes, its catch-up plan over a day of downtime computes,
  its jitter delay computes; or
* refused with a :class:`ConfigError` whose message names the field (and the schedule),

never another exception (``OverflowError``, ``StoreUnavailable``, ...).

The hypothesis tests run on SQLite (bounded examples, well under the time budget); the column
widths are checked once more on PostgreSQL and MariaDB with the values at their edges.
"""
from __future__ import annotations

import math
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
from celery import Celery
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from celery_cluster_beat import ConfigError, cron, every
from celery_cluster_beat.beat.catchup import plan_catchup
from celery_cluster_beat.beat.jitter import jitter_delay
from celery_cluster_beat.config import CatchupPolicy, build_entries, load_settings
from celery_cluster_beat.config.values import MAX_SECONDS
from celery_cluster_beat.dynamic import StoredSchedules, entry_from_row

UTC = timezone.utc
FIELDS = ("task", "schedule", "args", "kwargs", "options", "overlap", "max_run_time", "jitter", "catchup",
          "catchup_window", "description", "owner", "enabled")

_specials = st.sampled_from([
    math.inf, -math.inf, math.nan, 1e300, -1e300, 1e30, MAX_SECONDS, MAX_SECONDS * 1.0001, 3.2e9, 1e10, 0.0, -0.0,
    -1, 0, 1, 10 ** 18, 10 ** 400, 10 ** 5000, 5e-324, 0.5, 86400,
])
_strings = st.one_of(
    st.text(max_size=40),
    st.text(alphabet=st.characters(codec="utf-8"), max_size=8),
    st.sampled_from(["", "x" * 255, "x" * 256, "é" * 255, "\U0001F600" * 255, "a\x00b", "a\nb", "\ud800",
                     "x" * 70_000, "every 60s", "* * * * *", "61 * * * *", "Europe/Paris", "latest", "skip",
                     " lead", "trail ", "t.record"]),
)
ANYTHING = st.one_of(
    _specials,
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(),
    _strings,
    st.none(),
    st.booleans(),
    st.lists(st.one_of(st.integers(), st.floats(), st.text(max_size=5)), max_size=3),
    st.dictionaries(st.one_of(st.text(max_size=5), st.integers()), st.one_of(st.integers(), st.floats(),
                                                                            st.text(max_size=5)), max_size=3),
    st.builds(timedelta, seconds=st.integers(min_value=-10, max_value=10 ** 6)),
    st.sampled_from([object(), b"bytes", every(60), cron("0 9 * * 1-5", tz="Europe/Paris"),
                     {"expires": 1e300}, {"priority": 300}, {"queue": 5}, {"headers": []}]),
)
NOW = datetime(2026, 6, 1, 12, 0, 7, tzinfo=UTC)


def _app(db_url: str) -> Celery:
    app = Celery("props", set_as_current=False)
    app.conf.update(cluster_beat_db_url=db_url, cluster_beat_redis_url="", cluster_beat_overlap="allow",
                    beat_schedule={})
    return app


def _works(entry: Any, settings_: Any) -> None:
    """What beat does with an entry, each step of which must compute."""
    assert not entry.refused, entry.refused
    nxt = entry.schedule.next_fire(NOW)
    assert nxt > NOW
    window = entry.catchup_window if entry.catchup_window is not None else settings_.catchup_window
    plan_catchup(entry.schedule, NOW - timedelta(days=1), NOW, policy=entry.catchup or CatchupPolicy.ALL,
                 window=window, max_count=settings_.catchup_max)
    jitter = entry.jitter if entry.jitter is not None else settings_.jitter
    jitter_delay(entry.name, nxt, jitter, entry.schedule.next_fire(nxt))
    if entry.max_run_time is not None:
        assert NOW + timedelta(seconds=entry.max_run_time) >= NOW  # computes


def _refused_naming(exc: ConfigError, name: str, field: str) -> None:
    message = str(exc)
    # (an option is named down to its key: "options.priority", "options.headers.task")
    assert f": {field}: " in message or f": {field}." in message or (field == "name" and "name:" in message), message
    assert field == "name" or repr(name) in message, message


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    path = tmp_path_factory.mktemp("props") / "claims.sqlite3"
    schedules = StoredSchedules(_app(f"sqlite:///{path}"))
    yield schedules
    schedules.close()


def _add_and_check(api: StoredSchedules, name: Any, field: str, value: Any, blame: str = "") -> bool:
    """Add a schedule with *value* as *field*; True when accepted (and checked working)."""
    spec = dict(task="t.record", schedule=every(60))
    spec[field] = value
    try:
        stored = api.add(name, spec.pop("task"), spec.pop("schedule"), **spec)
    except ConfigError as exc:
        _refused_naming(exc, name, blame or field)
        assert api.get(name) is None if isinstance(name, str) else True
        return False
    try:
        row = api.store.stored_get([name])[0]
        _works(entry_from_row(row, app=api.app), api.settings)
        if field in ("task", "owner", "description", "max_run_time", "jitter", "catchup_window"):
            got = getattr(stored, field)
            assert got == value or (field == "description" and value is None and got == ""), (field, got, value)
        assert stored.next_at > stored.changed_at if stored.enabled else stored.next_at is None
    finally:
        api.remove(name)
    return True


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(field=st.sampled_from(FIELDS), value=ANYTHING)
def test_add_accepts_and_works_or_refuses_naming_the_field(api, field, value):
    _add_and_check(api, "prop", field, value)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=ANYTHING)
def test_any_name_is_accepted_and_works_or_refused_as_the_name(api, name):
    _add_and_check(api, name, "task", "t.record", blame="name")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(field=st.sampled_from(FIELDS + ("tz",)), value=ANYTHING)
def test_update_accepts_and_works_or_refuses_naming_the_field_and_keeps_the_row(api, field, value):
    before = api.add("upd", "t.record", cron("0 9 * * *", tz="Europe/Paris"), max_run_time=60)
    try:
        try:
            api.update("upd", **{field: value})
        except ConfigError as exc:
            _refused_naming(exc, "upd", field)
            after = api.get("upd")
            assert (after.version, after.task, after.schedule, after.zone) == (before.version, before.task,
                                                                              before.schedule, before.zone)
            return
        row = api.store.stored_get(["upd"])[0]
        _works(entry_from_row(row, app=api.app), api.settings)
    finally:
        api.remove("upd")


@settings(max_examples=90, deadline=None)
@given(field=st.sampled_from(FIELDS), value=ANYTHING)
def test_a_beat_schedule_entry_is_built_and_works_or_refused_naming_the_field(field, value):
    app = _app("sqlite://")
    conf = load_settings(app.conf, has_result_backend=lambda: False)
    spec = {"task": "t.record", "schedule": every(60), field: value}
    try:
        entries = build_entries({"entry": spec}, app=app)
    except ConfigError as exc:
        _refused_naming(exc, "entry", field)
        return
    _works(entries["entry"], conf)


SETTINGS = ("cluster_beat_lock_ttl", "cluster_beat_catchup_window", "cluster_beat_catchup_max",
            "cluster_beat_max_run_time", "cluster_beat_jitter", "cluster_beat_claim_retention",
            "cluster_beat_prune_interval", "cluster_beat_claim_grace", "cluster_beat_node_id",
            "cluster_beat_cluster_name", "cluster_beat_http_port", "beat_cron_starting_deadline")


@settings(max_examples=100, deadline=None)
@given(setting=st.sampled_from(SETTINGS), value=ANYTHING)
def test_a_setting_is_accepted_and_usable_or_refused_naming_it(setting, value):
    app = _app("sqlite://")
    app.conf[setting] = value
    try:
        conf = load_settings(app.conf, has_result_backend=lambda: False)
    except ConfigError as exc:
        assert f"setting {setting}: " in str(exc), str(exc)
        return
    for name in ("lock_ttl", "catchup_window", "max_run_time", "jitter", "claim_retention", "prune_interval",
                 "claim_grace"):
        seconds = getattr(conf, name)
        if seconds is not None:
            assert NOW - timedelta(seconds=seconds) <= NOW + timedelta(seconds=seconds)  # computes, both ways
    plan_catchup(every(60), NOW - timedelta(days=1), NOW, policy=CatchupPolicy.ALL, window=conf.catchup_window,
                 max_count=conf.catchup_max)


# ------------------------------------------------------------------ the columns, on each server

EDGES = [
    ("task", "t" * 255, True), ("task", "t" * 256, False), ("task", "é" * 255, True), ("task", "t\x00", False),
    ("owner", "\U0001F600" * 255, True), ("owner", "o" * 256, False), ("owner", "o\x00", False),
    ("description", "d" * 65_535, True), ("description", "é" * 40_000, False), ("description", "a\x00", False),
    ("args", ["a" * 65_000], True), ("args", ["a" * 65_600], False),
    ("max_run_time", MAX_SECONDS, True), ("max_run_time", 1e300, False), ("catchup_window", math.inf, False),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("server", ["postgresql", "mysql"])
def test_the_column_edges_are_accepted_and_read_back_or_refused_never_a_database_error(server, request):
    db_url = request.getfixturevalue("pg_url" if server == "postgresql" else "mysql_url")
    with StoredSchedules(_app(db_url)) as api:
        for field, value, ok in EDGES:
            assert _add_and_check(api, "edge", field, value) is ok, (field, ok)
            assert api.get("edge") is None, field
        for name, ok in (("n" * 255, True), ("\U0001F600" * 255, True), ("n" * 256, False), ("a\x00b", False),
                         ("a\tb", False)):
            try:
                api.add(name, "t.record", every(60))
            except ConfigError as exc:
                assert not ok and "name:" in str(exc)
            else:
                assert ok and api.get(name).name == name
                api.remove(name)
