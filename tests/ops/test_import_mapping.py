"""What ``cluster-beat import`` makes of another scheduler's rules, without a database (issue 22, item 6).

* A Celery crontab becomes cron text only where it fires on exactly the same instants: each
  accepted case is checked against Celery's own crontab as this package already converts it in
  ``beat_schedule`` (``cron.from_crontab``, Celery's AND day rule), two years of fires each;
  both-day-fields crontabs that cron text cannot say (Friday the 13th) are refused naming why.
* django-celery-beat's clocked, ``one_off``, ``start_time`` and ``expires`` map to the agreed
  one-off / bounds API (``at(when)``, ``start_at``, ``end_at``, ``max_runs``): the spec dicts are
  checked here whatever this release has, and :mod:`bounds` refuses them with "needs one-off/bounds
  support" exactly while the API lacks them.
"""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from celery.schedules import crontab

from celery_cluster_beat.ops.importers import bounds
from celery_cluster_beat.ops.importers.bounds import OneOff
from celery_cluster_beat.ops.importers.djangobeat import plan_task
from celery_cluster_beat.ops.importers.mapping import Refused, crontab_rule, interval_rule, json_value, rule_words
from celery_cluster_beat.ops.importers.redbeat import plan_entry
from celery_cluster_beat.schedules.celery_types import cron

UTC = timezone.utc
NOW = datetime(2026, 12, 7, 12, 0, tzinfo=UTC)


def _fires(rule, count=60, start=datetime(2026, 1, 1, tzinfo=UTC)):
    out, t = [], start
    for _ in range(count):
        t = rule.next_fire(t)
        out.append(t)
    return out


@pytest.mark.parametrize("fields, text", [
    (dict(minute="*/15"), "*/15 * * * *"),
    (dict(minute="30", hour="8", day_of_week="mon-fri"), "30 8 * * mon-fri"),
    (dict(minute="0", hour="9", day_of_week="monday-fri"), "0 9 * * 1-5"),  # Celery's names, ours written out
    (dict(minute="0", hour="23-3/2"), "0 1,3,23 * * *"),  # Celery steps on through the wrap: 23, 1, 3
    (dict(minute="0", hour="9", day_of_month="1-7", day_of_week="1"), "0 9 * * 1#1"),  # the first Monday
    (dict(minute="0", hour="9", day_of_month="8-14,22-28", day_of_week="2,4"), "0 9 * * 2#2,2#4,4#2,4#4"),
    (dict(minute="0", hour="0", day_of_month="29-31", day_of_week="fri"), "0 0 * * 5#5"),
    (dict(minute="0", hour="6", day_of_month="1,15,31", day_of_week="fri"), "0 6 */30,15 * fri"),
    (dict(minute="0", hour="6", day_of_month="*/2", day_of_week="1"), "0 6 */2 * 1"),
    (dict(minute="0", hour="6", day_of_month="10", day_of_week="sun,sat"), "0 6 10 * */6"),
    (dict(minute="0", hour="6", day_of_month="13", day_of_week="0-6"), "0 6 13 * *"),  # a full day field is '*'
    (dict(minute=5, hour=4, month_of_year="jan,jul"), "5 4 * jan,jul *"),  # RedBeat keeps ints as ints
])
def test_a_crontab_becomes_cron_text_firing_on_exactly_celerys_instants(fields, text):
    rule, _ = crontab_rule(fields, "Europe/Paris")
    assert (rule.expr, rule.tz_name) == (text, "Europe/Paris")
    celery_rule = cron.from_crontab(crontab(**{k: str(v) for k, v in fields.items()}))  # Celery's AND, as in beat_schedule
    celery_rule.tz = rule.tz
    for start in (datetime(2026, 1, 1, tzinfo=UTC), datetime(2027, 2, 27, tzinfo=UTC)):
        assert _fires(rule, start=start) == _fires(cron(celery_rule.expr, _spec=celery_rule.spec, tz="Europe/Paris"),
                                                   start=start)


@pytest.mark.parametrize("fields, words", [
    (dict(day_of_month="13", day_of_week="5"), "both day fields are restricted"),  # Friday the 13th
    (dict(day_of_month="2-9", day_of_week="mon-fri"), "both day fields are restricted"),
    (dict(minute="5/15"), "Celery cannot read it"),
    (dict(day_of_week="7"), "Celery cannot read it"),
    (dict(day_of_month="30", month_of_year="2"), "never occurs"),
    (dict(minute="x" * 300), "longer than 256"),
    (dict(hour=None, minute=[1, 2]), "expected cron field text"),
])
def test_a_crontab_without_an_exact_cron_form_is_refused_saying_why(fields, words):
    with pytest.raises(Refused, match=words.replace("(", r"\(")):
        crontab_rule(fields, None)


def test_a_crontab_keeps_its_zone_and_an_unknown_zone_is_refused():
    rule, _ = crontab_rule(dict(minute="0", hour="9"), "America/New_York")
    assert rule.tz_name == "America/New_York"
    row = _task(crontab={"minute": "0", "hour": "9", "timezone": "Mars/Olympus"})
    planned = plan_task(row, _by_id(row), NOW)
    assert planned.spec is None and "Mars/Olympus" in planned.reason


def test_an_interval_is_on_the_epoch_grid_with_a_note_and_under_a_second_is_refused():
    rule, notes = interval_rule(90, "django-celery-beat")
    assert rule_words(rule) == "every 90s" and "epoch grid" in notes[0]
    with pytest.raises(Refused, match="at most once a second"):
        interval_rule(0.5, "RedBeat")


def test_json_is_bounded_in_size_and_depth():
    with pytest.raises(Refused, match="nested deeper"):
        json_value("[" * 40 + "]" * 40, "args", list)
    with pytest.raises(Refused, match="nested too deep|not valid JSON"):
        json_value("[" * 30_000 + "]" * 30_000, "args", list)
    with pytest.raises(Refused, match="more than 65535"):
        json_value("[" + "1," * 40_000 + "1]", "args", list)
    with pytest.raises(Refused, match="expected a JSON list"):
        json_value('{"a": 1}', "args", list)


# ----------------------------------------------------------------------------- django-celery-beat rows


def _task(**fields):
    row = {"id": 1, "name": "job", "task": "t.record", "args": "[1]", "kwargs": "{}", "enabled": True,
           "one_off": False, "total_run_count": 0, "headers": "{}", "description": ""}
    for kind in ("interval", "crontab", "clocked", "solar"):
        if kind in fields:
            row[f"{kind}_id"] = 7
            row[f"_{kind}"] = fields.pop(kind)
    row.update(fields)
    return row


def _by_id(row):
    return {kind: ({7: row[f"_{kind}"]} if f"_{kind}" in row else {})
            for kind in ("interval", "crontab", "clocked", "solar")}


LATER = NOW + timedelta(days=30)


def test_clocked_becomes_a_one_off_at_its_time():
    row = _task(clocked={"clocked_time": LATER.replace(tzinfo=None)}, one_off=True)  # naive: UTC, as Django stores
    spec = plan_task(row, _by_id(row), NOW).spec
    assert spec["schedule"] == OneOff(LATER) and "max_runs" not in spec
    assert bounds.uses_bounds(spec)


def test_one_off_with_an_interval_or_crontab_runs_once():
    for kind, value in (("interval", {"every": 1, "period": "hours"}), ("crontab", {"minute": "0", "hour": "9"})):
        row = _task(one_off=True, **{kind: value})
        assert plan_task(row, _by_id(row), NOW).spec["max_runs"] == 1


def test_start_time_and_expires_become_start_at_and_end_at():
    start, end = NOW + timedelta(days=1), NOW + timedelta(days=9)
    row = _task(interval={"every": 5, "period": "minutes"}, start_time=start, expires=end)
    planned = plan_task(row, _by_id(row), NOW)
    assert (planned.spec["start_at"], planned.spec["end_at"]) == (start, end)
    assert "expires" not in planned.spec["options"]  # the end bounds the schedule; noted, not sent per message
    assert any("no longer expire" in n for n in planned.notes)
    row = _task(interval={"every": 5, "period": "minutes"}, start_time=NOW - timedelta(days=1))
    planned = plan_task(row, _by_id(row), NOW)  # a start that has passed is no bound: importable without the API
    assert "start_at" not in planned.spec and not bounds.uses_bounds(planned.spec)


def test_spent_expired_and_past_one_offs():
    row = _task(interval={"every": 1, "period": "hours"}, one_off=True, total_run_count=1)
    assert plan_task(row, _by_id(row), NOW).skipped
    row = _task(interval={"every": 1, "period": "hours"}, one_off=True, enabled=False)  # disabled after its run
    assert plan_task(row, _by_id(row), NOW).skipped
    row = _task(interval={"every": 1, "period": "hours"}, expires=NOW - timedelta(seconds=1))
    assert plan_task(row, _by_id(row), NOW).skipped
    row = _task(clocked={"clocked_time": NOW - timedelta(hours=1)}, one_off=True)
    planned = plan_task(row, _by_id(row), NOW)
    assert not planned.skipped and "has passed and it never ran" in planned.reason


def test_options_are_those_django_celery_beat_sends():
    row = _task(interval={"every": 10, "period": "seconds"}, queue="reports", routing_key="r.k", priority=3,
                expire_seconds=60, headers='{"x-team": "a"}', exchange="")
    assert plan_task(row, _by_id(row), NOW).spec["options"] == {
        "queue": "reports", "routing_key": "r.k", "priority": 3, "expires": 60,
        "headers": {"x-team": "a", "periodic_task_name": "job"}}


def test_solar_and_broken_rows_are_refused_by_name():
    row = _task(solar={"event": "sunrise", "latitude": "51.5", "longitude": "0.1"})
    planned = plan_task(row, _by_id(row), NOW)
    assert "solar" in planned.what and "solar schedules are not supported" in planned.reason
    row = _task(interval={"every": 1, "period": "fortnights"})
    assert "not a count of" in plan_task(row, _by_id(row), NOW).reason
    row = _task()
    assert "no schedule" in plan_task(row, _by_id(row), NOW).reason
    row = _task(interval={"every": 1, "period": "hours"}, crontab={"minute": "0"})
    assert "more than one schedule" in plan_task(row, _by_id(row), NOW).reason
    row = _task(interval={"every": 1, "period": "hours"})
    assert "not in the database" in plan_task(row, {"interval": {}}, NOW).reason


def test_a_one_off_spec_becomes_at_and_unset_bounds_are_left_out():
    from celery_cluster_beat import at

    spec = {"task": "t", "schedule": OneOff(LATER), "end_at": LATER}
    api = bounds.to_api(spec)
    assert api["schedule"] == at(LATER) and api["end_at"] == LATER
    assert api["schedule"].next_fire(LATER - timedelta(seconds=1)) == LATER
    assert api["schedule"].next_fire(LATER) is None
    assert bounds.to_api({"task": "t", "schedule": "x", "start_at": None}) == {"task": "t", "schedule": "x"}


# ----------------------------------------------------------------------------- RedBeat definitions


def test_redbeat_definitions():
    def planned(schedule, **more):
        import json

        text = json.dumps({"name": "n", "task": "t.record", "schedule": schedule, "args": [1], "kwargs": {},
                           "options": {"queue": "q"}, "enabled": True, **more}).encode()
        return plan_entry(b"rb:n", "rb:", text, len(text), set())

    p = planned({"__type__": "interval", "every": 45.0, "relative": False})
    assert str(p.spec["schedule"]) == "<every 45s>" and p.spec["options"] == {"queue": "q"}
    p = planned({"__type__": "crontab", "minute": "0", "hour": "9", "day_of_week": "*", "day_of_month": "*",
                 "month_of_year": "*"})
    assert p.spec["schedule"].expr == "0 9 * * *" and p.spec["schedule"].tz_name is None  # the app's zone
    assert "rrule" in planned({"__type__": "rrule", "freq": 5}).reason
    assert "not one RedBeat writes" in planned({"__type__": "solar"}).reason
    assert "not valid JSON" in plan_entry(b"rb:x", "rb:", b"{", 1, set()).reason
    assert "more than" in plan_entry(b"rb:x", "rb:", None, 10 ** 7, set()).reason
    assert plan_entry(b"rb:n", "rb:", b'{"schedule": {}}', 16, {"n"}).skipped


def test_the_day_check_that_guards_every_accepted_form_can_fail():
    from celery_cluster_beat.ops.importers.mapping import _same_days
    from celery_cluster_beat.schedules.cronexpr import parse_cron

    assert not _same_days(parse_cron("0 0 13 * 5"), frozenset({13}), frozenset({5}))  # Vixie's OR: not Celery's AND
    assert not _same_days(parse_cron("0 0 * * 1#5"), frozenset(range(22, 32)), frozenset({1}))  # 22-31 is not a #k
    assert _same_days(parse_cron("0 0 * * 1#1"), frozenset(range(1, 8)), frozenset({1}))


def _field(lo, hi):
    from hypothesis import strategies as st

    return st.one_of(st.just("*"), st.sets(st.integers(lo, hi), min_size=1, max_size=8).map(
        lambda s: ",".join(map(str, sorted(s)))), st.tuples(st.integers(lo, hi), st.integers(lo, hi)).map(
        lambda t: f"{min(t)}-{max(t)}"), st.integers(2, 9).map(lambda n: f"*/{n}"))


def test_any_crontab_is_refused_or_imported_with_celerys_very_days_and_times():
    """Arbitrary Celery crontabs: the import either refuses one or stores a rule with Celery's minutes,
    hours, months and days (compared with Celery's own AND rule on every kind of month)."""
    from hypothesis import given, settings

    from celery_cluster_beat.ops.importers.mapping import _day_matches, _month_kinds
    import calendar
    from datetime import date

    @settings(max_examples=150, deadline=None)
    @given(minute=_field(0, 59), hour=_field(0, 23), dom=_field(1, 31), dow=_field(0, 6))
    def check(minute, hour, dom, dow):
        fields = dict(minute=minute, hour=hour, day_of_month=dom, day_of_week=dow)
        try:
            rule, _ = crontab_rule(fields, "UTC")
        except Refused as exc:
            assert "both day fields" in str(exc) or "never occurs" in str(exc), exc
            return
        celery_rule = cron.from_crontab(crontab(**fields))
        ours, theirs = rule.spec, celery_rule.spec
        assert (ours.minutes, ours.hours, ours.months, ours.wildcard) == (
            theirs.minutes, theirs.hours, theirs.months, theirs.wildcard)
        for year, month in _month_kinds():
            for number in range(1, calendar.monthrange(year, month)[1] + 1):
                day = date(year, month, number)
                assert _day_matches(ours, day) == _day_matches(theirs, day), (fields, rule.expr, day)

    check()
