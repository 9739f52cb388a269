"""``beat_schedule`` entries: each problem names the entry, the field and the reason; all are
reported together; policies become enums. Pure: nothing is opened."""
from __future__ import annotations

from datetime import timedelta

import pytest
from celery.schedules import crontab

from celery_cluster_beat import cron, every
from celery_cluster_beat.config import CatchupPolicy, OverlapPolicy, build_entries
from celery_cluster_beat.errors import ConfigError


def test_a_valid_entry_keeps_celery_keys_and_ours():
    entries = build_entries({
        "report": {"task": "t.report", "schedule": "0 6 * * 1-5", "args": [1], "kwargs": {"a": 2},
                   "options": {"queue": "reports", "priority": 3}, "overlap": "buffer_one", "catchup": "all",
                   "catchup_window": 3600, "max_run_time": 120, "jitter": 0, "description": "weekday report"},
    })
    e = entries["report"]
    assert e.task == "t.report" and e.schedule == cron("0 6 * * 1-5")
    assert e.args == (1,) and e.kwargs == {"a": 2} and e.options == {"queue": "reports", "priority": 3}
    assert e.overlap is OverlapPolicy.BUFFER_ONE and e.catchup is CatchupPolicy.ALL
    assert (e.catchup_window, e.max_run_time, e.jitter, e.enabled) == (3600, 120, 0, True)


def test_celery_schedule_types_are_converted():
    entries = build_entries({
        "a": {"task": "t", "schedule": crontab(minute="*/5")},
        "b": {"task": "t", "schedule": timedelta(seconds=30)},
        "c": {"task": "t", "schedule": 10},
    })
    assert entries["b"].schedule == every(30) and entries["c"].schedule == every(10)
    assert entries["a"].schedule.next_fire is not None


@pytest.mark.parametrize("spec, field, reason", [
    ({"schedule": 10}, "task", "expected a task name"),
    ({"task": "t"}, "schedule", "missing"),
    ({"task": "t", "schedule": "61 * * * *"}, "schedule", "minute"),
    ({"task": "t", "schedule": {"every": 5}}, "schedule", "not supported"),
    ({"task": "t", "schedule": 10, "args": "x"}, "args", "expected a list or tuple"),
    ({"task": "t", "schedule": 10, "kwargs": [1]}, "kwargs", "expected a dict"),
    ({"task": "t", "schedule": 10, "options": {"priority": 300}}, "options.priority", "integer 0-255"),
    ({"task": "t", "schedule": 10, "overlap": "sometimes"}, "overlap", "expected one of skip, allow"),
    ({"task": "t", "schedule": 10, "catchup": "most"}, "catchup", "expected one of latest, all, none"),
    ({"task": "t", "schedule": 10, "max_run_time": 0}, "max_run_time", "must be positive"),
    ({"task": "t", "schedule": 10, "jitter": -1}, "jitter", "must be zero or positive"),
    ({"task": "t", "schedule": 10, "catchup_window": "1h"}, "catchup_window", "expected a number of seconds"),
    ({"task": "t", "schedule": 10, "enabled": "yes"}, "enabled", "expected True or False"),
    ({"task": "t", "schedule": 10, "colour": "red"}, "colour", "unknown key"),
    # Range and column checks (issue 19, item 7): what beat or the claim table cannot hold is refused here.
    ({"task": "t", "schedule": 10, "catchup_window": float("inf")}, "catchup_window", "finite"),
    ({"task": "t", "schedule": 10, "max_run_time": 1e300}, "max_run_time", "at most 3153600000 s"),
    ({"task": "t", "schedule": 10, "jitter": 10 ** 5000}, "jitter", "at most"),
    ({"task": "t", "schedule": 10, "catchup_window": float("nan")}, "catchup_window", "expected a number"),
    ({"task": "t" * 256, "schedule": 10}, "task", "longer than 255 characters"),
    ({"task": "t.\x00", "schedule": 10}, "task", "control character"),
    ({"task": "t", "schedule": 1e300}, "schedule", "cannot be read as a schedule (OverflowError"),
    ({"task": "t", "schedule": timedelta(days=40000)}, "schedule", "interval longer than"),
    ({"task": "t", "schedule": 10, "kwargs": {1: "x"}}, "kwargs", "keyword names must be strings"),
    ({"task": "t", "schedule": 10, "options": {"expires": 1e300}}, "options.expires", "must be at most"),
    ({"task": "t", "schedule": 10, "description": "a\x00"}, "description", "control character"),
])
def test_a_bad_field_is_named_with_its_entry_and_reason(spec, field, reason):
    with pytest.raises(ConfigError) as info:
        build_entries({"job": spec})
    (problem,) = info.value.problems
    assert problem.startswith(f"beat_schedule entry 'job': {field}: "), problem
    assert reason in problem, problem


def test_every_problem_of_every_entry_is_reported_at_once():
    with pytest.raises(ConfigError) as info:
        build_entries({"a": {"task": "t"}, "b": {"schedule": 5, "jitter": -1}, "c": {"task": "t", "schedule": 1}})
    assert len(info.value.problems) == 3
    assert {p.split(":")[0] for p in info.value.problems} == {"beat_schedule entry 'a'", "beat_schedule entry 'b'"}


def test_a_name_longer_than_the_claim_column_is_refused():
    with pytest.raises(ConfigError, match="name: longer than 255"):
        build_entries({"x" * 256: {"task": "t", "schedule": 10}})


@pytest.mark.parametrize("name", ["a\x00b", "tab\there", "\ud800"])
def test_a_name_the_claim_column_cannot_hold_as_is_is_refused(name):
    with pytest.raises(ConfigError, match="name: contains a (control character|lone surrogate)"):
        build_entries({name: {"task": "t", "schedule": 10}})


def test_no_beat_schedule_is_no_entries_and_a_non_dict_is_an_error():
    assert build_entries(None) == {}
    with pytest.raises(ConfigError, match="expected a dict of entries"):
        build_entries([("a", {})])
