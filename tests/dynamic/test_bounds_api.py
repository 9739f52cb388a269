"""The stored-schedule API with one-offs and bounds, on each real database: at() stores as text
and reads back, start_at / end_at / max_runs are columns the record exposes, bad bounds are refused
naming the schedule, the field and the reason, a one-off in the past is refused (it would end at
once, unseen), add_many takes one-offs in bulk, and an update may end a schedule."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from celery import Celery

from celery_cluster_beat import ConfigError, at, every
from celery_cluster_beat.dynamic import StoredSchedules

UTC = timezone.utc


@pytest.fixture
def schedules(db_url):
    app = Celery("boundsapi", set_as_current=False)
    app.conf.update(cluster_beat_db_url=db_url, cluster_beat_redis_url="", timezone="Europe/Paris")
    api = StoredSchedules(app)
    yield api
    api.close()


def _soon(seconds: float = 3600) -> datetime:
    return datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=seconds)


def test_a_one_off_is_stored_as_its_instant_and_its_next_at_is_that_instant(schedules):
    when = _soon()
    s = schedules.add("once", "t.x", at(when))
    assert (s.schedule, s.zone, s.next_at, s.ended_at) == (f"at {when:%Y-%m-%dT%H:%M:%S}Z", None, when, None)
    wall = schedules.add("wall", "t.x", at(when.replace(tzinfo=None) + timedelta(days=1)))  # the app's zone
    assert wall.zone == "Europe/Paris" and wall.schedule.startswith("at ") and not wall.schedule.endswith("Z")


def test_bounds_are_columns_the_record_exposes(schedules):
    start, end = _soon(120).replace(second=0), _soon(7200)
    s = schedules.add("bounded", "t.x", every(60), start_at=start.isoformat(), end_at=end, max_runs=5)
    assert (s.start_at, s.end_at, s.max_runs) == (start, end, 5)
    assert s.next_at == start  # the first instant at or after start_at
    s = schedules.update("bounded", max_runs=None, end_at=None)
    assert (s.start_at, s.end_at, s.max_runs) == (start, None, None)


@pytest.mark.parametrize("kwargs, field, reason", [
    (dict(start_at="2030-01-01T00:00:00"), "start_at", "naive datetime"),
    (dict(end_at=datetime(2030, 1, 1)), "end_at", "naive datetime"),
    (dict(start_at="soon"), "start_at", "not an ISO-8601"),
    (dict(max_runs=0), "max_runs", "less than 1"),
    (dict(max_runs="3"), "max_runs", "expected a whole number"),
    (dict(start_at="2031-01-01T00:00:00Z", end_at="2030-01-01T00:00:00Z"), "end_at", "is before start_at"),
    (dict(end_at="2001-01-01T00:00:00Z"), "end_at", "has passed"),
])
def test_bad_bounds_name_the_schedule_the_field_and_the_reason(schedules, kwargs, field, reason):
    with pytest.raises(ConfigError) as info:
        schedules.add("bad", "t.x", every(60), **kwargs)
    assert str(info.value).startswith(f"stored schedule 'bad': {field}: ") and reason in str(info.value), info.value
    assert schedules.get("bad") is None


def test_a_one_off_in_the_past_is_refused_rather_than_ended_unseen(schedules):
    with pytest.raises(ConfigError, match=r"stored schedule 'late': schedule: no occurrence after now .* would "
                                          r"never fire"):
        schedules.add("late", "t.x", at("2001-01-01T00:00:00Z"))


def test_add_many_takes_one_offs_in_bulk(schedules):
    base = _soon()
    count = schedules.add_many({"name": f"o:{i}", "task": "t.x", "schedule": at(base + timedelta(seconds=i))}
                               for i in range(300))
    assert count == 300
    assert schedules.get("o:299").next_at == base + timedelta(seconds=299)


def test_an_update_that_leaves_no_occurrence_ends_the_schedule_and_a_later_one_revives_it(schedules):
    schedules.add("s", "t.x", every(60))
    ended = schedules.update("s", end_at=datetime.now(UTC) - timedelta(seconds=1))
    assert ended.next_at is None and ended.ended_at is not None
    again = schedules.update("s", end_at=None)
    assert again.next_at is not None and again.ended_at is None


def test_max_runs_past_year_9999_is_refused_naming_the_field_not_an_overflow(tmp_path):
    from celery import Celery
    from celery_cluster_beat import cron as _cron, every as _every
    from celery_cluster_beat.dynamic import StoredSchedules
    from celery_cluster_beat.errors import ConfigError
    app = Celery("ovf", set_as_current=False)
    app.conf.update(cluster_beat_db_url=f"sqlite:///{tmp_path}/c.db", cluster_beat_redis_url="")
    with StoredSchedules(app) as api:
        for rule in (_every(60), _cron("0 0 29 2 *")):
            with pytest.raises(ConfigError, match=r"'late': max_runs: .*9999"):
                api.add("late", "t.x", rule, start_at="9999-12-30T00:00:00Z", max_runs=10_000)
        with pytest.raises(ConfigError, match=r"'leap': max_runs: .*9999"):  # counted from the creation
            api.add("leap", "t.x", _cron("0 0 29 2 *"), max_runs=10_000)
        assert api.list() == []


def test_add_decides_a_one_off_by_the_databases_clock_inside_the_transaction(schedules, monkeypatch):
    """The host's clock an hour behind the database's: a one-off between the two is refused (it would
    be stored already ended, silently), by add and add_many alike; none is written."""
    import celery_cluster_beat.dynamic.api as api_module
    from celery_cluster_beat.schedules.instants import utcnow as real_utcnow
    monkeypatch.setattr(api_module, "utcnow", lambda: real_utcnow() - timedelta(hours=1))
    store = schedules._open()
    db_now = store.db_now()
    between = db_now - timedelta(minutes=10)  # future for the host, past for the database
    with pytest.raises(ConfigError, match=r"stored schedule 'skew': schedule: no occurrence after now"):
        schedules.add("skew", "t.x", at(between))
    with pytest.raises(ConfigError, match=r"stored schedule 'b': schedule: no occurrence after now"):
        schedules.add_many([{"name": "a", "task": "t.x", "schedule": at(db_now + timedelta(hours=1))},
                            {"name": "b", "task": "t.x", "schedule": at(between)}])
    assert schedules.list() == []


def test_the_boundary_of_add_is_the_transactions_own_now(schedules, monkeypatch):
    """At the database's now exactly: refused; one microsecond later: stored, not ended."""
    store = schedules._open()
    fixed = store.db_now().replace(microsecond=0) + timedelta(seconds=30)
    monkeypatch.setattr(type(store), "_now", lambda self, conn: fixed)
    with pytest.raises(ConfigError, match=r"'edge': schedule: no occurrence after now"):
        schedules.add("edge", "t.x", at(fixed))
    s = schedules.add("edge", "t.x", at(fixed + timedelta(microseconds=1)))
    assert s.next_at == fixed + timedelta(microseconds=1) and s.ended_at is None


def test_a_one_off_a_few_milliseconds_ahead_is_stored_pending_or_refused_never_ended(schedules):
    for i in range(5):
        when = schedules._open().db_now() + timedelta(milliseconds=2)
        try:
            s = schedules.add(f"ms:{i}", "t.x", at(when))
        except ConfigError as exc:
            assert "no occurrence after now" in str(exc)
            continue
        assert s.next_at == when and s.ended_at is None


def test_an_update_of_an_ended_schedule_keeps_when_it_ended_unless_it_revives_it(schedules):
    schedules.add("e", "t.x", every(60))
    first = schedules.update("e", end_at=datetime.now(UTC) - timedelta(seconds=1)).ended_at
    assert first is not None
    for change in (dict(description="still ended"), dict(enabled=False), dict(enabled=True)):
        again = schedules.update("e", **change)
        assert again.next_at is None and again.ended_at == first, change
    revived = schedules.update("e", end_at=None)
    assert revived.next_at is not None and revived.ended_at is None
